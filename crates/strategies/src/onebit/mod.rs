//! DeepSpeed's communication-compressed optimizers on flat fp32 buffers: 1-bit Adam
//! (arXiv 2102.02888) and 1-bit LAMB (arXiv 2104.06069), both over the error-compensated
//! 1-bit all-reduce of [`crate::compressed`].

/// Implements [`OneBitPhase`] for an optimizer with fields `step` and `config.freeze_step`.
macro_rules! one_bit_phase {
    ($t:ty) => {
        impl $crate::onebit::OneBitPhase for $t {
            fn steps(&self) -> u64 {
                self.step
            }

            fn freeze_step(&self) -> u64 {
                self.config.freeze_step
            }
        }
    };
}

mod adam;
mod device;
mod lamb;
mod state;

pub use adam::*;
pub use device::*;
pub use lamb::*;
pub use state::*;

use crate::comm::Communicator;
use crate::{CommError, Result};

/// The phase of a 1-bit optimizer, on the host or on a device: warm-up, then compression from
/// `freeze_step` on.
pub trait OneBitPhase: std::fmt::Debug + Send {
    /// Optimizer steps taken.
    fn steps(&self) -> u64;

    /// First step of the compression stage (0-based).
    fn freeze_step(&self) -> u64;

    /// Whether the next step compresses (its step number is at least `freeze_step`).
    fn compressing(&self) -> bool {
        self.steps() >= self.freeze_step()
    }
}

/// What a 1-bit optimizer on host buffers offers its engine: a step on flat buffers, its
/// phase, and the state a checkpoint keeps.
pub trait OneBitOptimizer: OneBitPhase {
    /// One step on a prepared gradient: during warm-up the mean over ranks (the caller's own,
    /// e.g. bucketed, all-reduce), once compressing this rank's local gradient. Every rank
    /// must call it with the same `lr`.
    fn apply(
        &mut self,
        comm: &dyn Communicator,
        params: &mut [f32],
        grad: &[f32],
        lr: f64,
    ) -> Result<()>;

    /// Bytes of optimizer state this rank holds, error buffers included.
    fn state_bytes(&self) -> u64;

    /// The state a checkpoint keeps: the step (which fixes the phase) and the buffers, not the
    /// compression error buffers.
    fn export(&self) -> OneBitState;

    /// Restores a state from [`export`](Self::export). The error buffers start again from
    /// zero, as in DeepSpeed.
    fn restore(&mut self, state: OneBitState) -> Result<()>;
}

/// Refuses buffers whose lengths differ from the `n` elements the optimizer holds.
fn check_lengths(optimizer: &'static str, n: usize, params: &[f32], grad: &[f32]) -> Result<()> {
    if params.len() != n || grad.len() != n {
        return Err(CommError::Optimizer {
            optimizer,
            detail: format!(
                "it holds {n} elements; got {} parameters and {} gradients",
                params.len(),
                grad.len()
            ),
        });
    }
    Ok(())
}

/// (β1, β2, eps, weight decay) as f32.
fn coefficients(betas: (f64, f64), eps: f64, weight_decay: f64) -> (f32, f32, f32, f32) {
    (
        betas.0 as f32,
        betas.1 as f32,
        eps as f32,
        weight_decay as f32,
    )
}

/// The ranges of consecutive tensors of `lengths` elements in one flat buffer.
fn consecutive(lengths: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut offset = 0;
    lengths
        .iter()
        .map(|&len| {
            offset += len;
            offset - len..offset
        })
        .collect()
}
