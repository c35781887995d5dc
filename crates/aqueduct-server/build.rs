//! Generates the admin API's gRPC code from `proto/aqueduct/admin/v1/admin.proto` with a
//! vendored `protoc` (nothing to install), plus the descriptor set served by reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let proto_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let file = proto_dir.join("aqueduct/admin/v1/admin.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("admin_descriptor.bin"))
        .compile_protos(&[file], &[proto_dir])?;
    Ok(())
}
