//! Compiles `proto/ps.proto` with protox (pure Rust), so `cargo build` is the only build step.
//! `ps-common/proto` is a link to the repository's `proto/`, so the file is inside the crate
//! and goes with it into a source distribution (the Python package's sdist).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/proto");
    let proto = format!("{proto_dir}/ps.proto");
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([&proto], [proto_dir])?;
    tonic_prost_build::configure().bytes(".").compile_fds(fds)?;
    Ok(())
}
