//! Compiles `proto/ps.proto` and TensorFlow's event protos (`proto/tensorflow/`, trimmed, for
//! the shards' TensorBoard files) with protox (pure Rust), so `cargo build` is the only build
//! step. `ps-common/proto` is a link to the repository's `proto/`, so the files are inside the
//! crate and go with it into a source distribution (the Python package's sdist).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/proto");
    let protos = [
        format!("{proto_dir}/ps.proto"),
        format!("{proto_dir}/tensorflow/core/util/event.proto"),
        format!("{proto_dir}/tensorflow/core/framework/summary.proto"),
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(&protos, [proto_dir])?;
    // the services only with the `grpc` feature: the messages alone need no tonic, nor its
    // code generator
    #[cfg(feature = "grpc")]
    tonic_prost_build::configure().bytes(".").compile_fds(fds)?;
    #[cfg(not(feature = "grpc"))]
    prost_build::Config::new().bytes(["."]).compile_fds(fds)?;
    Ok(())
}
