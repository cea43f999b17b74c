//! Activation checkpointing: [`checkpoint`] a module's forward so that its activations are
//! recomputed in backward instead of kept, with the options of DeepSpeed's
//! `activation_checkpointing` section, and [`checkpoint_tiles`] for a position-wise layer
//! over a long sequence.

mod checkpoint;
mod op;
mod options;
mod tiled;

pub use checkpoint::checkpoint;
pub(crate) use options::with_config_options;
pub use options::{CheckpointOptions, CheckpointStats, current_options, take_stats, with_options};
pub use tiled::checkpoint_tiles;
