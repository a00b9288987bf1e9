//! SSD restart recovery over one segment file (`umbp_ssd::fuzzing::recovery`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = umbp_ssd::fuzzing::recovery(data);
});
