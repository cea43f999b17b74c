//! # burn-deepspeed
//!
//! DeepSpeed's large-model training techniques for the [Burn](https://burn.dev) framework:
//! a `ds_config.json`-compatible [`config`], a data-parallel [`engine`] that trains any Burn
//! module implementing `TrainStep`, a [`strategy`] for Burn's `SupervisedTraining`, and a
//! [`launch`]er that runs ranks as threads or as MPI processes.
//!
//! Ranks are SPMD, as in DeepSpeed: every rank runs the same loop and talks through one
//! [`Communicator`](comm::Communicator). See ZeRO (arXiv 1910.02054) for the memory model
//! the later stages build on.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod activation;
pub mod config;
pub mod distill;
pub mod engine;
mod error;
pub mod fused;
pub mod grid;
pub mod inference;
pub mod launch;
pub mod moe;
pub mod monitor;
pub mod moq;
pub mod pipe;
pub mod precision;
pub mod profiler;
pub mod progress;
pub mod strategy;
pub mod sync;
pub mod tensor_parallel;
pub mod trace;
pub mod zero3;

pub use burn_deepspeed_compress::pld;
pub use burn_deepspeed_strategies::comm;
pub use burn_deepspeed_strategies::device;
pub use burn_deepspeed_strategies::swap;
pub use config::DeepSpeedConfig;
pub use engine::{DeepSpeedEngine, StepLoss, StepReport};
pub use error::*;
pub use precision::DynamicLossScaler;
