//! Pipeline parallelism: a model given as a sequence of layers, split into stages that run on
//! different ranks and exchange activations and gradients by DeepSpeed's 1F1B schedule, with
//! data parallelism across pipeline replicas (a pp x dp grid).

mod build;
mod checkpoint;
mod engine;
mod inspect;
mod layer;
mod report;
mod run;
mod ties;
mod wire;

pub use burn_deepspeed_strategies::pipe::{
    GPipeSchedule, InferenceSchedule, PartitionMethod, PipeDataTopology, PipeInstruction,
    PipeSchedule, ScheduleKind, TrainSchedule,
};
pub use engine::*;
pub use layer::*;
pub use report::*;

#[cfg(test)]
mod tests;
