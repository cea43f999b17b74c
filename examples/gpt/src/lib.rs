//! A byte-level GPT trained with burn-deepspeed: the model, its data, and the training
//! driver that `examples/gpt.rs` and the integration tests call.
#![warn(missing_docs)]

pub mod data;
pub mod generate;
pub mod model;
pub mod run;

/// The config used when no `--config` is given.
pub const DEFAULT_CONFIG: &str = include_str!("../configs/default.json");
