//! DeepSpeed's communication-compressed optimizers on flat fp32 buffers: 1-bit Adam
//! (arXiv 2102.02888), 1-bit LAMB (arXiv 2104.06069) and 0/1 Adam (arXiv 2202.06009), all over
//! the error-compensated 1-bit all-reduce of [`crate::compressed`], each written once over a
//! [`crate::place::Place`]: host buffers or the model's device.

/// Implements [`OneBitPhase`] for a 1-bit optimizer generic over its place, with fields `step`
/// and `config.freeze_step`.
macro_rules! one_bit_phase {
    ($t:ident) => {
        impl<P: $crate::place::Place> $crate::onebit::OneBitPhase for $t<P> {
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
mod lamb;
mod state;
mod zero_one;

pub use adam::*;
pub use lamb::*;
pub use state::*;
pub use zero_one::*;

use crate::place::Place;
use crate::{CommError, Result};

#[cfg(test)]
mod tests;

/// The phase of a 1-bit optimizer, in any place: warm-up, then compression from
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

/// What a 1-bit optimizer offers its regime, in place `P` (host buffers or the model's
/// device): a step on flat buffers, its phase, and the state a checkpoint keeps (the same
/// [`OneBitState`] in every place, so that a run moves between the host and a device).
pub trait OneBitOptimizer<P: Place>: OneBitPhase {
    /// One step on a prepared gradient (the buffer's length): during warm-up the mean over
    /// ranks (the caller's own, e.g. bucketed, all-reduce), once compressing this rank's local
    /// gradient. Returns the stepped parameters. Every rank calls it with the same `lr`.
    fn apply(&mut self, place: &P, params: P::Buf, grad: P::Buf, lr: f64) -> Result<P::Buf>;

    /// Bytes of optimizer state this rank holds, error buffers included.
    fn state_bytes(&self, place: &P) -> u64;

    /// The state a checkpoint keeps: the step (which fixes the phase) and the buffers, not the
    /// compression error buffers.
    fn export(&self, place: &P) -> Result<OneBitState>;

    /// Restores a state from [`export`](Self::export), in this place or another. The error
    /// buffers start again from zero, as in DeepSpeed.
    fn restore(&mut self, place: &P, state: OneBitState) -> Result<()>;
}

/// Refuses buffers whose lengths differ from the `n` elements the optimizer holds.
fn check_lengths<P: Place>(
    optimizer: &'static str,
    n: usize,
    place: &P,
    params: &P::Buf,
    grad: &P::Buf,
) -> Result<()> {
    let (p, g) = (place.len(params), place.len(grad));
    if p != n || g != n {
        return Err(CommError::Optimizer {
            optimizer,
            detail: format!("it holds {n} elements; got {p} parameters and {g} gradients"),
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
