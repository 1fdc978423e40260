//! The wire contract of the parameter server, in one place: the code generated from
//! `proto/ps.proto` (`pb`) and TensorFlow's event protos (`tensorflow`), the protocol version,
//! every `x-ps-*` metadata key (`keys`), and the typed errors with their one gRPC status table
//! (`error`: `PsError` and `PsError::code`). Nothing here opens a connection (that is
//! `ps-net`) or knows the config (`ps-config`). The `grpc` feature adds the services and the
//! status table's `tonic` side; without it (the shard core) the crate has no tonic in it.

pub mod error;

pub use error::{PsError, PsResult};

/// Sent on registration; a worker and a shard of different protocol versions refuse each other.
/// Bumped whenever a message's meaning changes: 1, the first; 2, rank leases (`Lease` on
/// every push, pull and data hello), generations on pushes and pulls, the `PSDATA02` data
/// hello, and the buffers and clipping calls.
pub const PROTOCOL_VERSION: u32 = 2;

/// The generated gRPC code for `proto/ps.proto`.
#[allow(clippy::all, clippy::too_many_lines, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/ps.v1.rs"));
}

/// TensorFlow's `Event`, `Summary` and `SessionLog`, generated from its own `event.proto` and
/// `summary.proto` (`proto/tensorflow/`, trimmed to what the shards write, field numbers as
/// upstream), for the TensorBoard event files (`ps_server::tensorboard`).
pub mod tensorflow {
    #![allow(missing_docs, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/tensorflow.rs"));
}

/// The gRPC metadata keys of the protocol, each defined here only.
pub mod keys {
    /// The run id on every request (`ps_config::runid`): a shard refuses another run's.
    pub const RUN_ID: &str = "x-ps-run-id";
    /// The shard credential (`[server] shard_token_file`) on the shards' step reports and
    /// recovery calls to each other; workers do not have it.
    pub const SHARD_TOKEN_KEY: &str = "x-ps-shard-token";
    /// Metadata key of a push or pull whose values move on the data connection of this rank.
    pub const DATA_RANK_KEY: &str = "x-ps-data-rank";
    /// Metadata key of a registration whose worker pushes values as `[cluster] wire` says
    /// (`"bf16"`); absent: `"f32"`. The shard refuses a worker whose wire differs from its own.
    pub const WIRE_KEY: &str = "x-ps-wire";
}

#[cfg(feature = "grpc")]
pub use tonic;
