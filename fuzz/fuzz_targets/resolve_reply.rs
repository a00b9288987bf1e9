//! The columnar `BatchResolveKeys` reply decoder (`umbp_proto::fuzzing::resolve`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    umbp_proto::fuzzing::resolve(data);
});
