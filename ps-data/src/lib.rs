//! The training data: IDX (MNIST-format) files (`idx`) and the data-order contract that gives
//! every worker its slice of each global batch (`order`).

pub mod idx;
pub mod order;
