//! The SSD record header decoder and record verifier (`umbp_ssd::fuzzing::record`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    umbp_ssd::fuzzing::record(data);
});
