//! Every TCP data-plane and shared-memory frame decoder (`umbp_transfer::fuzzing::frames`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    umbp_transfer::fuzzing::frames(data);
});
