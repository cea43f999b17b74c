//! The state of one run of a pipeline schedule on a stage: its buffer slots and counters.

use std::time::Duration;

use burn::tensor::Tensor;

/// One buffer slot of the schedule.
pub(super) struct Slot<B> {
    pub(super) batch: Option<B>,
    pub(super) input: Option<Tensor<3>>,
    pub(super) output: Option<Tensor<3>>,
    pub(super) loss: Option<Tensor<1>>,
    pub(super) output_grad: Option<Tensor<3>>,
    pub(super) input_grad: Option<Tensor<3>>,
}

impl<B> Default for Slot<B> {
    fn default() -> Self {
        Self {
            batch: None,
            input: None,
            output: None,
            loss: None,
            output_grad: None,
            input_grad: None,
        }
    }
}

/// Training or evaluation, for the instructions both run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Train,
    Eval,
}

/// The state of one schedule's run on this stage.
pub(super) struct Run<B> {
    pub(super) mode: Mode,
    pub(super) slots: Vec<Slot<B>>,
    pub(super) loaded: usize,
    pub(super) loss_sum: f64,
    /// Activations forwarded and not yet backwarded, and their most.
    pub(super) live: usize,
    pub(super) peak: usize,
    pub(super) compute: Duration,
    pub(super) schedule_time: Duration,
}

impl<B> Run<B> {
    pub(super) fn new(buffers: usize, mode: Mode) -> Self {
        Self {
            mode,
            slots: (0..buffers).map(|_| Slot::default()).collect(),
            loaded: 0,
            loss_sum: 0.0,
            live: 0,
            peak: 0,
            compute: Duration::ZERO,
            schedule_time: Duration::ZERO,
        }
    }
}
