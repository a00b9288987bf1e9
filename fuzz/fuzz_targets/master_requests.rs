//! Request sequences to a fresh master (`umbp_master::fuzzing::requests`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = umbp_master::fuzzing::requests(data);
});
