//! What can go wrong on a device or a model's pass ([`BackendError`]): below the device
//! operations (`crate::ops`) and the backends (`crate::backend`), which both return it.

/// What can go wrong on a device.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No usable GPU: no driver library, no device, or CUDA support missing.
    #[error("no GPU: {0}")]
    NoGpu(String),
    /// A CUDA call failed.
    #[error("cuda: {0}")]
    Cuda(String),
    /// A device name that is not `cpu`, `cuda`, `cuda:N` or `auto`.
    #[error("{0}")]
    BadDevice(String),
    /// Inputs of the wrong size.
    #[error("shape: {0}")]
    Shape(String),
    /// The weights of a layer did not arrive: their pull failed, or took too long.
    #[error("weights not pulled: {0}")]
    Gate(#[from] crate::gate::GateError),
    /// A gradient the exact sum cannot carry (`[train] exact_sum`).
    #[error("exact sum: {0}")]
    Exact(#[from] ps_net::exact::ExactError),
}

/// Result with a [`BackendError`].
pub type BackendResult<T> = Result<T, BackendError>;
