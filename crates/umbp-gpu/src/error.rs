//! Errors of the GPU shim.

/// Why a GPU runtime call failed or no runtime could be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No library of the requested runtime could be opened (no driver or runtime installed).
    #[error("no {runtime} library found (tried {tried:?}): {reason}")]
    NotFound {
        /// The runtime looked for.
        runtime: &'static str,
        /// The library names tried, in order.
        tried: Vec<&'static str>,
        /// The last loader error.
        reason: String,
    },
    /// The library opened but lacks a function we need (a runtime too old).
    #[error("{library} has no symbol {symbol}: {reason}")]
    MissingSymbol {
        /// The library.
        library: &'static str,
        /// The symbol.
        symbol: &'static str,
        /// The loader's message.
        reason: String,
    },
    /// A runtime call returned an error code.
    #[error("{runtime}: {call} failed with code {code}: {message}")]
    Call {
        /// The runtime (`"cuda"`, `"hip"`, `"fake"`, …).
        runtime: &'static str,
        /// The function that failed.
        call: &'static str,
        /// The runtime's error code.
        code: i32,
        /// The runtime's error string for `code`.
        message: String,
    },
    /// A device ordinal the machine does not have.
    #[error("device {device} does not exist ({count} devices)")]
    InvalidDevice {
        /// The ordinal asked for.
        device: u32,
        /// Devices present.
        count: u32,
    },
    /// The runtime failed to load earlier in this process (the first failure, kept as text: a
    /// runtime is loaded once per process).
    #[error("{0}")]
    Unavailable(String),
    /// A stream handed to a runtime instance that did not create it.
    #[error("a stream of runtime instance {stream_owner} was handed to runtime instance {runtime}")]
    ForeignStream {
        /// The instance that created the stream.
        stream_owner: u64,
        /// The instance it was handed to.
        runtime: u64,
    },
    /// The calling thread has no current device and the call needs one (run it under a
    /// `DeviceGuard`).
    #[error("{call}: the calling thread has no current device")]
    NoCurrentDevice {
        /// The call that needed a device.
        call: &'static str,
    },
    /// A request the shim refuses before calling the runtime (a zero-byte allocation, a size past
    /// the address space).
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl GpuError {
    /// Whether the error says the device is out of memory (the caller may free memory and retry).
    pub fn is_out_of_memory(&self) -> bool {
        // cudaErrorMemoryAllocation = 2, CUDA_ERROR_OUT_OF_MEMORY = 2, hipErrorOutOfMemory = 2.
        matches!(self, Self::Call { code: 2, .. })
    }
}
