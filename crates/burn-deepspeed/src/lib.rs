//! # burn-deepspeed
//!
//! DeepSpeed's large-model training techniques for the [Burn](https://burn.dev) framework:
//! a `ds_config.json`-compatible [`config`], a data-parallel [`engine`] that trains any Burn
//! module implementing `TrainStep`, a [`learner`] strategy for Burn's `SupervisedTraining`, and a
//! [`launch`]er that runs ranks as threads or as MPI processes.
//!
//! Ranks are SPMD, as in DeepSpeed: every rank runs the same loop and talks through one
//! [`Communicator`](comm::Communicator). See ZeRO (arXiv 1910.02054) for the memory model
//! the later stages build on.
//!
//! ## Features
//!
//! | feature | what it adds | what the machine needs |
//! |---|---|---|
//! | `mpi` | ranks as processes under `mpirun`, on one or many nodes | OpenMPI and libclang |
//! | `wgpu` | models on a wgpu device, with our ops' CubeCL kernels | a Vulkan, Metal or DX12 driver |
//! | `cuda` | models on CUDA GPUs, with NCCL collectives | CUDA and NCCL at run time, LLVM to build |
//!
//! None is on by default. Burn itself comes with the features this crate is built on:
//! `train` (the engine steps Burn's `TrainStep`, and the strategy is a
//! `SupervisedLearningStrategy`; Burn's training crate also brings its Flex CPU backend),
//! `extension` (our ops are `#[backend_extension]` ops) and `capture` (the flops profiler
//! records a forward on Burn's capture device). The backend a model trains on is chosen by
//! the device it is built on: Flex always, wgpu or CUDA with the feature.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod activation;
pub mod checkpoint;
pub mod config;
pub mod distill;
pub mod engine;
mod error;
pub mod flat;
pub mod fused;
pub mod grid;
pub mod inference;
pub mod launch;
pub mod learner;
pub mod log;
pub mod memory;
pub mod moe;
pub mod monitor;
pub mod moq;
pub mod optim;
pub mod pipe;
pub mod precision;
pub mod prelude;
pub mod primitive;
pub mod profiler;
pub mod progress;
pub mod sequence;
pub mod step;
pub mod sync;
pub mod tensor_parallel;
pub mod trace;
pub mod transfer;
pub mod zero3;

pub use burn_deepspeed_compress::pld;
pub use burn_deepspeed_strategies::comm;
pub use burn_deepspeed_strategies::device;
pub use burn_deepspeed_strategies::swap;
pub use config::DeepSpeedConfig;
pub use engine::DeepSpeedEngine;
pub use error::*;
pub use precision::DynamicLossScaler;
pub use step::{StepLoss, StepReport};
