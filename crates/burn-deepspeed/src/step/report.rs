//! What a training step reports, and what the engine reads from a step's output.

use std::time::Duration;

use serde::Serialize;

use crate::activation::CheckpointStats;

/// What the engine reads from a training step's output: the micro-batch's mean loss.
pub trait StepLoss {
    /// The loss of this micro-batch (a mean over its samples), on the host.
    fn loss(&self) -> f64;
}

impl StepLoss for burn::train::ClassificationOutput {
    fn loss(&self) -> f64 {
        self.loss.clone().into_scalar::<f32>() as f64
    }
}

impl StepLoss for burn::train::RegressionOutput {
    fn loss(&self) -> f64 {
        self.loss.clone().into_scalar::<f32>() as f64
    }
}

/// The result of one optimizer step.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// Optimizer steps taken so far (this one included).
    pub step: u64,
    /// Mean loss over every micro-batch of every rank in this step.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping. In a 1-bit optimizer's compression stage, where
    /// gradients are not all-reduced and each rank clips its own, the root mean square of the
    /// ranks' local norms.
    pub grad_norm: f64,
    /// The gradient norm was not finite (an inf or NaN in some gradient, on some rank): the
    /// step was skipped on every rank (parameters and optimizer state unchanged).
    pub overflow: bool,
    /// Bytes this rank's transport sent during the step (measured).
    pub bytes_sent: u64,
    /// Bytes the ring model says this rank sent during the step.
    pub model_bytes_sent: u64,
    /// Whether the step exchanged 1-bit compressed momenta instead of all-reducing gradients.
    pub compressed: bool,
    /// Progressive layer dropping: the θ this step's forward passes were given.
    pub pld_theta: Option<f64>,
    /// MoQ: the lowest bits a weight was quantized at after this step (`None` when MoQ is
    /// off; the start bits before the schedule's offset).
    pub moq_bits: Option<u32>,
    /// fp16: the loss scale this step's gradients were computed with (the scaler then halves
    /// it after an overflow, or doubles it after a window of clean steps); `None` without
    /// fp16.
    pub loss_scale: Option<f32>,
    /// What the step's activation checkpoints did on this rank (forwards, recomputes, and
    /// their times under `activation_checkpointing.profile`); `None` when the config has no
    /// `activation_checkpointing` section and the model made no checkpoint.
    pub activation_checkpoints: Option<CheckpointStats>,
    /// The most heap one micro-batch's forward and backward held above what was live before
    /// them (activations, and the gradients backward makes), measured through
    /// [`CountingAllocator`](crate::memory::heap::CountingAllocator); `None` when it is not the global
    /// allocator. Process-wide: ranks running as threads count each other's.
    pub peak_activation_bytes: Option<u64>,
    /// Time in forward and backward passes on this rank.
    pub forward_backward: Duration,
    /// Of `forward_backward`, the time in forward passes: the time in `TrainStep::step`
    /// less its backward passes. `None` when a micro-batch called `loss.backward()` itself
    /// instead of [`precision::backward`](crate::precision::backward), which times them.
    pub forward: Option<Duration>,
    /// Of `forward_backward`, the time in backward passes (see `forward`).
    pub backward: Option<Duration>,
    /// Of `forward_backward`, the time handing each micro-batch's gradients to the regime:
    /// copying them into its buffers and, at stages 2-3, the bucket reductions that run as
    /// buckets fill.
    pub accumulate: Duration,
    /// `wall_clock_breakdown` at more than one rank: the time this rank waited, before the
    /// reduction, for every rank to reach it (a barrier: the slowest rank's lead over this
    /// one); `None` without the breakdown.
    pub reduce_wait: Option<Duration>,
    /// Time in gradient reduction (communication included; after `reduce_wait`, when
    /// measured, the time moving and summing the gradients).
    pub reduce: Duration,
    /// Time in the optimizer step.
    pub optimizer: Duration,
    /// Wall-clock time of the whole step on this rank: from its first micro-batch's forward
    /// to the end of the optimizer step (the host's time between micro-batches included).
    pub step_time: Duration,
}

impl StepReport {
    /// The step's phases for `wall_clock_breakdown`: forward and backward apart when both
    /// were timed, then the gradients' accumulation, the wait for the other ranks (when
    /// measured), the reduction, the optimizer step and the whole step.
    pub fn phases(&self) -> Vec<(&'static str, Duration)> {
        let mut phases = match (self.forward, self.backward) {
            (Some(f), Some(b)) => vec![("forward", f), ("backward", b)],
            _ => vec![(
                "forward+backward",
                self.forward_backward.saturating_sub(self.accumulate),
            )],
        };
        phases.push(("accumulate", self.accumulate));
        if let Some(wait) = self.reduce_wait {
            phases.push(("reduce wait", wait));
        }
        phases.extend([
            ("reduce", self.reduce),
            ("optimizer", self.optimizer),
            ("step", self.step_time),
        ]);
        phases
    }
}
