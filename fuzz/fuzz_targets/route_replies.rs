//! The master client's routing-reply decoders (`umbp_peer::fuzzing::route_replies`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    umbp_peer::fuzzing::route_replies(data);
});
