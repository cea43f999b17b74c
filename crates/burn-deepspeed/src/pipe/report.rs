//! What a pipelined step reports: [`PipeStepReport`] and each stage's time per phase.

use std::time::{Duration, Instant};

use burn_deepspeed_strategies::pipe::PipeInstruction;
use serde::Serialize;

/// The result of one pipelined optimizer step.
#[derive(Debug, Clone, Serialize)]
pub struct PipeStepReport {
    /// Optimizer steps taken so far (this one included).
    pub step: u64,
    /// Mean loss over every micro-batch of every replica (computed by the last stage and
    /// shared with every rank).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm (over every stage) before clipping.
    pub grad_norm: f64,
    /// The gradient norm was not finite: the step was skipped on every rank.
    pub overflow: bool,
    /// fp16: the loss scale this step's gradients were computed with.
    pub loss_scale: Option<f32>,
    /// This stage's idle share of the schedule: 1 − (time in forward and backward passes) /
    /// (time from the first instruction to the last backward's gradient send).
    pub stage_bubble_fraction: f64,
    /// [`stage_bubble_fraction`](Self::stage_bubble_fraction) averaged over every rank.
    pub bubble_fraction: f64,
    /// The most activations this stage held at once (forwarded, not yet backwarded).
    pub peak_live_activations: usize,
    /// Time of this stage's schedule (up to the gradient reductions).
    pub schedule_time: Duration,
    /// Time of this stage in forward and backward passes.
    pub compute_time: Duration,
    /// This stage's time per phase of the step (`wall_clock_breakdown`).
    pub phases: PipePhases,
}

/// A pipeline stage's time per phase of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PipePhases {
    /// Loading micro-batches (first and last stage).
    pub load: Duration,
    /// Forward passes.
    pub forward: Duration,
    /// Backward passes.
    pub backward: Duration,
    /// Activation and gradient sends and receives, waiting for the neighbour included.
    pub send_recv: Duration,
    /// Tied-gradient sums and the gradient reduction over the replicas.
    pub reduce: Duration,
    /// The optimizer step.
    pub optimizer: Duration,
    /// The whole step.
    pub step: Duration,
}

impl PipePhases {
    /// The phase an instruction's time counts in.
    pub(super) fn of(&mut self, inst: PipeInstruction) -> &mut Duration {
        match inst {
            PipeInstruction::LoadMicroBatch { .. } => &mut self.load,
            PipeInstruction::ForwardPass { .. } => &mut self.forward,
            PipeInstruction::BackwardPass { .. } => &mut self.backward,
            PipeInstruction::SendActivation { .. }
            | PipeInstruction::RecvActivation { .. }
            | PipeInstruction::SendGrad { .. }
            | PipeInstruction::RecvGrad { .. } => &mut self.send_recv,
            PipeInstruction::ReduceTiedGrads | PipeInstruction::ReduceGrads => &mut self.reduce,
            PipeInstruction::OptimizerStep => &mut self.optimizer,
        }
    }

    /// The phases by name, in the order `wall_clock_breakdown` prints them.
    pub fn named(&self) -> [(&'static str, Duration); 7] {
        [
            ("load", self.load),
            ("forward", self.forward),
            ("backward", self.backward),
            ("send/recv", self.send_recv),
            ("reduce", self.reduce),
            ("optimizer", self.optimizer),
            ("step", self.step),
        ]
    }
}

/// Adds the time since `t0` to `phase` when dropped (after the instruction, whichever way
/// its arm leaves the loop body).
pub(super) struct PhaseTimer<'a> {
    pub(super) phase: &'a mut Duration,
    pub(super) t0: Instant,
}

impl Drop for PhaseTimer<'_> {
    fn drop(&mut self) {
        *self.phase += self.t0.elapsed();
    }
}
