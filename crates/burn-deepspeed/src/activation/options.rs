//! What the `activation_checkpointing` section asks of [`checkpoint`](super::checkpoint), and
//! what the checkpoints of a step did.

use std::cell::Cell;

use serde::Serialize;

use crate::config::{ActivationCheckpointingConfig, DeepSpeedConfig};

/// How [`checkpoint`](super::checkpoint) runs, from DeepSpeed's `activation_checkpointing`
/// section (the keys that apply here; [`check_supported`](crate::config::check_supported)
/// refuses the others by name).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointOptions {
    /// `cpu_checkpointing`: keep each checkpoint's input in host memory until its recompute
    /// (on a CPU backend the input is already there; the copy is still made).
    pub cpu_checkpointing: bool,
    /// `synchronize_checkpoint_boundary`: wait for the device after each checkpoint's forward
    /// and recompute.
    pub synchronize_checkpoint_boundary: bool,
    /// `profile`: time the checkpoints' forwards and recomputes (in [`CheckpointStats`] and
    /// a `tracing` event per step).
    pub profile: bool,
}

impl CheckpointOptions {
    /// The options of a config's `activation_checkpointing` section.
    pub fn from_config(config: &ActivationCheckpointingConfig) -> Self {
        Self {
            cpu_checkpointing: config.cpu_checkpointing,
            synchronize_checkpoint_boundary: config.synchronize_checkpoint_boundary,
            profile: config.profile,
        }
    }
}

/// What the checkpoints on this thread did since the last [`take_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CheckpointStats {
    /// Checkpointed forwards (closures run without keeping their activations).
    pub forwards: u64,
    /// Recomputes (closures run again in backward).
    pub recomputes: u64,
    /// Seconds in checkpointed forwards (measured with `profile` only).
    pub forward_seconds: f64,
    /// Seconds in recomputes, their backward included (measured with `profile` only).
    pub recompute_seconds: f64,
    /// Bytes of checkpoint inputs copied to host memory (`cpu_checkpointing`), counted as
    /// each copy is made.
    pub host_bytes: u64,
}

impl CheckpointStats {
    /// The `tracing` event of `activation_checkpointing.profile`.
    pub(crate) fn log(&self, rank: usize) {
        tracing::info!(
            rank,
            forwards = self.forwards,
            recomputes = self.recomputes,
            forward_ms = self.forward_seconds * 1e3,
            recompute_ms = self.recompute_seconds * 1e3,
            host_bytes = self.host_bytes,
            "activation checkpoints"
        );
    }
}

thread_local! {
    static OPTIONS: Cell<CheckpointOptions> = const {
        Cell::new(CheckpointOptions {
            cpu_checkpointing: false,
            synchronize_checkpoint_boundary: false,
            profile: false,
        })
    };
    static STATS: Cell<CheckpointStats> = const {
        Cell::new(CheckpointStats {
            forwards: 0,
            recomputes: 0,
            forward_seconds: 0.0,
            recompute_seconds: 0.0,
            host_bytes: 0,
        })
    };
}

/// Runs `f` with `options` for the checkpoints it makes on this thread (the engines call it
/// around each `TrainStep::step` when the config has an `activation_checkpointing` section);
/// the previous options are back afterwards, even if `f` panics.
pub fn with_options<T>(options: CheckpointOptions, f: impl FnOnce() -> T) -> T {
    struct Reset(CheckpointOptions);
    impl Drop for Reset {
        fn drop(&mut self) {
            OPTIONS.with(|o| o.set(self.0));
        }
    }
    let _reset = Reset(OPTIONS.with(|o| o.replace(options)));
    f()
}

/// Runs `f` with the options of `config`'s `activation_checkpointing` section when it has one,
/// as it is otherwise (what every engine does around a training step).
pub(crate) fn with_config_options<T>(config: &DeepSpeedConfig, f: impl FnOnce() -> T) -> T {
    match &config.activation_checkpointing {
        Some(section) => with_options(CheckpointOptions::from_config(section), f),
        None => f(),
    }
}

/// The options checkpoints made on this thread now use.
pub fn current_options() -> CheckpointOptions {
    OPTIONS.with(Cell::get)
}

/// What the checkpoints on this thread did since the last call, and a fresh count.
pub fn take_stats() -> CheckpointStats {
    STATS.with(|s| s.take())
}

pub(crate) fn record(f: impl FnOnce(&mut CheckpointStats)) {
    STATS.with(|s| {
        let mut stats = s.get();
        f(&mut stats);
        s.set(stats);
    });
}
