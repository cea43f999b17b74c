//! What a training program needs, in one import: `use burn_deepspeed::prelude::*;`.
//!
//! The config, the three ways to train (the data-parallel engine from your own loop, the
//! pipeline engine, and the strategy for Burn's `SupervisedTraining`), the launcher that
//! starts the ranks, the grid that lays them out, what a step reports, and the error type.

pub use crate::comm::Communicator;
pub use crate::config::DeepSpeedConfig;
pub use crate::engine::DeepSpeedEngine;
pub use crate::grid::Grid;
pub use crate::launch::{launch, mpirun_rank};
pub use crate::learner::DeepSpeedStrategy;
pub use crate::pipe::{PipeBatch, PipeLayer, PipeStepReport, PipelineEngine};
pub use crate::step::{StepLoss, StepReport};
pub use crate::{DeepSpeedError, Result};
