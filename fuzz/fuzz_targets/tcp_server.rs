//! One connection's whole stream to a live data server (`umbp_transfer::fuzzing::server_stream`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = umbp_transfer::fuzzing::server_stream(data);
});
