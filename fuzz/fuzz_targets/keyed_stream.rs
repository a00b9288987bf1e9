//! One connection's whole stream to a node's data server with its own keyed handler over a DRAM
//! medium (`umbp_peer::fuzzing::keyed_stream`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = umbp_peer::fuzzing::keyed_stream(data);
});
