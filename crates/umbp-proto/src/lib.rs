//! The gRPC protocols of umbp-rs, generated from `proto/*.proto` (package `umbp.v1`).
//!
//! # Owns
//! The wire messages and the tonic client and server stubs of `UMBPMaster` and `UMBPPeer`. Field
//! numbers are stable and documented in the `.proto` files; removed fields are `reserved`.
//!
//! # Never
//! Contains logic. Conversions between these messages and `umbp-core` types live with the code that
//! speaks the protocol (the master and the peer), so this crate stays a pure schema.

/// Package `umbp.v1`: every message, enum and service stub.
#[expect(
    missing_docs,
    clippy::allow_attributes,
    reason = "generated code: docs come from the .proto comments only where they exist, and prost emits #[allow]"
)]
pub mod v1 {
    tonic::include_proto!("umbp.v1");
}
