//! Generates the gRPC code from `proto/*.proto` with protox (a pure-Rust protobuf compiler), so the
//! build needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/umbp_common.proto", "proto/umbp_master.proto", "proto/umbp_peer.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
