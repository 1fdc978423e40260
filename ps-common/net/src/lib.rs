//! Both ends of every transport between the processes, and their security:
//! - `client`: a worker's (or a shard's) client of one shard over gRPC, the data connection
//!   and the shared-memory boards, with retries and errors in words;
//! - `wire`: tensors as bytes on gRPC (f32, bf16 with error feedback), chunking and checks;
//! - `copied`: the host bytes the data path copies, counted where it copies;
//! - `exact`: the exact-sum mode's fixed point and its encoding as f32 digits;
//! - `datalink`: the plain-TCP tensor data connection's framing (hello, frames, pieces);
//! - `shm`: the shared-memory boards of a host;
//! - `dma`: plane memory a device reads and writes directly (registration, in-place slots);
//! - `sink`: where a pull writes its values, piece by piece, publishing how far it got;
//! - `source`: where a shard reads a push's values, in place, whatever plane carried them;
//! - `gate`: a step's pulls and its forward pass sharing the weights, layer by layer;
//! - `peer`: a worker's shards: registration, recovery from a lost shard, pulls of every shard;
//! - `session`: register, pull, push, leave, without a training loop (the Python worker's);
//! - `auth`: the shared token and TLS on gRPC (interceptors, endpoints);
//! - `neterr`: connection errors in words;
//! - `throttle`: the rate limit of repeated warnings.
//!
//! The credentials themselves are read by `ps_config::credential`; the messages and the error
//! table are `ps_proto`'s. Without the `grpc` feature only `wire`, `shm`, `dma`, `sink`,
//! `gate`, `copied` and `throttle` are here (no tonic, no tokio): the shard core's part.

#[cfg(feature = "grpc")]
pub mod auth;
#[cfg(feature = "grpc")]
pub mod client;
pub mod copied;
#[cfg(feature = "grpc")]
pub mod datalink;
pub mod dma;
pub mod exact;
pub mod gate;
#[cfg(feature = "grpc")]
pub mod neterr;
#[cfg(feature = "grpc")]
pub mod peer;
#[cfg(feature = "grpc")]
pub mod session;
pub mod shm;
pub mod sink;
pub mod source;
pub mod throttle;
pub mod wire;
