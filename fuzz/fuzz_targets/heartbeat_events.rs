//! Heartbeat event bundles as the master converts them (`umbp_proto::fuzzing::events`).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    umbp_proto::fuzzing::events(data);
});
