//! The kinds a config names by string (`transport = "auto"`, `kind = "adamw"`, ...), as enums
//! that serde reads directly: an unknown name is refused while the file is read, with the
//! key, the value and the names it accepts.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// An enum read from one string key: `[section] key = "name"`. An unknown name is refused
/// as `[section] key = "x": expected ...`; with `$say_variant` (the two kinds serde read
/// before, whose message tools and tests match) as `... "x": unknown variant `x`, expected ...`.
macro_rules! kind_enum {
    (
        $(#[$m:meta])* $name:ident, $key:literal, $help:literal, $say_variant:literal,
        { $( $(#[$vm:meta])* $var:ident = $s:literal ),+ $(,)? }
    ) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name { $( $(#[$vm])* $var ),+ }

        impl $name {
            /// The name in the config file.
            pub fn name(self) -> &'static str {
                match self { $( Self::$var => $s ),+ }
            }

            /// The kind a config file calls `s`.
            pub fn from_name(s: &str) -> Option<Self> {
                match s { $( $s => Some(Self::$var), )+ _ => None }
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Self::from_name(&s).ok_or_else(|| {
                    D::Error::custom(if $say_variant {
                        format!("{} = {s:?}: unknown variant `{s}`, expected {}", $key, $help)
                    } else {
                        format!("{} = {s:?}: expected {}", $key, $help)
                    })
                })
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }
    };
}

kind_enum!(
    /// How a worker reduces the per-sample losses of its slice (`[train] loss_reduction`).
    LossReduction, "[train] loss_reduction", "\"mean\" or \"sum\"", true, {
        /// `g_r = (1/b_r) Σ ∇ℓ_i`
        Mean = "mean",
        /// `g_r = Σ ∇ℓ_i`
        Sum = "sum",
    }
);

kind_enum!(
    /// How a shard combines the workers' gradients (`[train] aggregation`).
    Aggregation, "[train] aggregation", "\"sum\", \"mean\" or \"weighted\"", true, {
        /// `G = Σ_r g_r`
        Sum = "sum",
        /// `G = (1/W) Σ_r g_r`
        Mean = "mean",
        /// `G = Σ_r b_r g_r / Σ_r b_r`
        Weighted = "weighted",
    }
);

kind_enum!(
    /// How tensors travel between workers and shards (`[cluster] transport`).
    Transport, "[cluster] transport",
    "\"auto\" (shared memory between processes on one host, gRPC otherwise) or \"grpc\"", false, {
        /// Tensors through shared memory (`/dev/shm`) when worker and shard share a host,
        /// verified at registration; through gRPC otherwise. Control messages always go
        /// through gRPC.
        Auto = "auto",
        /// Every tensor through gRPC.
        Grpc = "grpc",
    }
);

kind_enum!(
    /// How pushed gradient values travel over the network (`[cluster] wire`): shared-memory
    /// pushes and every pull stay f32 whatever it says.
    #[derive(Default)]
    Wire, "[cluster] wire",
    "\"f32\" (exact) or \"bf16\" (gradients pushed over the network as bfloat16 with error feedback on the worker: half the push bytes, no longer exactly one process)", false, {
        /// Little-endian f32, 4 bytes a value: the run equals one process.
        #[default]
        F32 = "f32",
        /// Little-endian bfloat16, 2 bytes a value, rounded to nearest even; each worker
        /// carries the rounding error into its next push (`ps_net::wire::Bf16Encoder`).
        Bf16 = "bf16",
    }
);

impl Wire {
    /// Bytes one value takes on the wire.
    pub fn value_bytes(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::Bf16 => 2,
        }
    }
}

kind_enum!(
    /// What a shard does when a step's barrier times out (`[server] barrier_policy`).
    BarrierPolicy, "[server] barrier_policy",
    "\"fail\" (stop the run when a step times out) or \"continue\" (go on without the ranks that did not push)", false, {
        /// Fail the run loudly (exit 1; waiting workers are told why).
        Fail = "fail",
        /// Apply the step with the ranks that pushed and stop waiting for the others until
        /// they register or push again (elastic membership; the run no longer equals one
        /// process).
        Continue = "continue",
    }
);

kind_enum!(
    /// The optimizer family (`[optimizer] kind`).
    OptimizerKind, "[optimizer] kind", "\"sgd\", \"adam\" or \"adamw\"", false, {
        /// SGD with optional (Nesterov) momentum.
        Sgd = "sgd",
        /// Adam, weight decay added to the gradient.
        Adam = "adam",
        /// Adam with decoupled weight decay.
        AdamW = "adamw",
    }
);

kind_enum!(
    /// The learning-rate decay (`[schedule] kind`).
    ScheduleKind, "[schedule] kind", "\"constant\", \"step\" or \"cosine\"", false, {
        /// The base lr throughout.
        Constant = "constant",
        /// Times `gamma` every `step_size` steps.
        Step = "step",
        /// Cosine from the base lr to `min_lr` over the run.
        Cosine = "cosine",
    }
);

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transport::Auto => "auto (shared memory on one host, else gRPC)",
            Transport::Grpc => "gRPC",
        })
    }
}

impl fmt::Display for LossReduction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for Aggregation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
