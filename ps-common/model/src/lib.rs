//! The model as the shards and workers see it: its description as named tensors flattened
//! into one `f32` vector and the split of that vector into shard ranges (`layout`, with the
//! built-in MLP and CNN), models declared by their own `safetensors` init file (`declared`),
//! weights on disk (`weights`), and global gradient-norm clipping over
//! the model's tensors (`clip`).

pub mod clip;
pub mod declared;
pub mod layout;
pub mod weights;

/// Most parameters of the model (2^31 - 1: the largest a CUDA GEMM dimension or a 32-bit
/// element count can index; 8 GiB of f32).
pub const MAX_PARAMS: u64 = i32::MAX as u64;
