//! Request sequences to the peer service over a DRAM medium (`umbp_peer::fuzzing::peer_requests`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = umbp_peer::fuzzing::peer_requests(data);
});
