//! Compiles the protos with protox (pure Rust: no protoc needed) and generates tonic code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/tandem/v1/tandem.proto", "proto/tandem/node/v1/node.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
