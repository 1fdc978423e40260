//! The training data: IDX (MNIST-format) files (`idx`) and the data-order contract that gives
//! every worker its slice of each global batch (`order`). `idx` is the `idx` feature's (on by
//! default; the config, and so ps-plan, needs only `order`).

#[cfg(feature = "idx")]
pub mod idx;
pub mod order;
