//! The gRPC protocols of umbp-rs, generated from `proto/*.proto` (package `umbp.v1`).
//!
//! # Owns
//! - The wire messages and the tonic client and server stubs of `UMBPMaster` and `UMBPPeer`. Field
//!   numbers are stable and documented in the `.proto` files; removed fields are `reserved`.
//! - What every speaker of the protocols shares, written once: the cluster token on gRPC
//!   ([`token`]: the metadata key, the server's check, the client's injector), every conversion
//!   between the messages and `umbp-core` values (`From` / `TryFrom` and the enum functions in
//!   [`convert`], one [`WireError`] for what cannot be read) and the struct-of-arrays codec of
//!   `BatchResolveKeys` ([`resolve`]).
//!
//! # Never
//! Opens a connection, serves, or decides anything: the master and the peer do, on top of it.
//!
//! ```
//! use umbp_core::TierType;
//! use umbp_proto::convert::{tier_from_wire, tier_to_wire};
//! use umbp_proto::v1;
//!
//! assert_eq!(tier_to_wire(TierType::Ssd), v1::TierType::TierSsd as i32);
//! assert_eq!(tier_from_wire(42), TierType::Unknown); // a newer peer's tier is ignored, not an error
//! ```

pub mod convert;
#[doc(hidden)]
pub mod fuzzing;
pub mod resolve;
pub mod token;

pub use convert::WireError;
pub use token::TOKEN_METADATA;

/// Package `umbp.v1`: every message, enum and service stub.
#[expect(
    missing_docs,
    clippy::allow_attributes,
    reason = "generated code: docs come from the .proto comments only where they exist, and prost emits #[allow]"
)]
pub mod v1 {
    tonic::include_proto!("umbp.v1");
}
