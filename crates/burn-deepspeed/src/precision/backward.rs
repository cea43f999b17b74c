//! The loss-scaled backward pass of fp16 training.
//!
//! fp16 gradients underflow to zero below 2^-24; DeepSpeed (after Micikevicius et al., arXiv
//! 1710.03740) multiplies the loss by a scale S before backward, so that every gradient is S
//! times larger while it is computed in f16, and divides it out again (in f32) before the
//! optimizer step. The multiplication has to happen on the loss tensor, inside the user's
//! [`TrainStep::step`](burn::train::TrainStep::step), which calls `backward` itself: call
//! [`backward`] there instead of `loss.backward()`.
//!
//! The engines set the current scale for the duration of each `TrainStep::step` call (on the
//! calling thread, which is the rank's thread) and check afterwards that the step used it: a
//! step that called plain `loss.backward()` under fp16 is refused at the next optimizer step,
//! by name, instead of training on unscaled gradients. Outside an fp16 engine [`backward`] is
//! `loss.backward()`.

use std::cell::Cell;
use std::time::{Duration, Instant};

use burn::tensor::{Gradients, Tensor};

thread_local! {
    /// The scale an fp16 engine set for the step running on this thread.
    static SCALE: Cell<Option<f32>> = const { Cell::new(None) };
    /// Whether [`backward`] ran since the scale was set.
    static USED: Cell<bool> = const { Cell::new(false) };
    /// Time spent in [`backward`] on this thread since the engine last took it.
    static BACKWARD_TIME: Cell<Option<Duration>> = const { Cell::new(None) };
}

/// Backward of `loss` times the current loss scale: what a [`TrainStep`] calls instead of
/// `loss.backward()` so that it trains under `fp16` (and unchanged otherwise).
///
/// [`TrainStep`]: burn::train::TrainStep
///
/// It also times the backward pass, which is how the engines split a step's time between
/// forward and backward (`wall_clock_breakdown`, the monitor).
pub fn backward<const D: usize>(loss: &Tensor<D>) -> Gradients {
    let start = Instant::now();
    let grads = match SCALE.with(Cell::get) {
        Some(scale) => {
            USED.with(|u| u.set(true));
            (loss.clone() * scale).backward()
        }
        None => loss.backward(),
    };
    let took = start.elapsed();
    BACKWARD_TIME.with(|t| t.set(Some(t.get().unwrap_or_default() + took)));
    grads
}

/// The time [`backward`] took on this thread since the last call (`None`: it did not run).
pub(crate) fn take_backward_time() -> Option<Duration> {
    BACKWARD_TIME.with(Cell::take)
}

/// The loss scale [`backward`] applies on this thread now (`None`: none, as outside fp16).
pub fn current_loss_scale() -> Option<f32> {
    SCALE.with(Cell::get)
}

/// Runs `f` (one `TrainStep::step`) with `scale` as this thread's loss scale. Returns its
/// result and whether it called [`backward`]; with `scale` `None`, `f` runs as it is and the
/// flag is true.
pub(crate) fn with_loss_scale<T>(scale: Option<f32>, f: impl FnOnce() -> T) -> (T, bool) {
    let Some(scale) = scale else {
        return (f(), true);
    };
    /// Clears the scale even when `f` panics, so that a later step on this thread starts clean.
    struct Reset(Option<f32>);
    impl Drop for Reset {
        fn drop(&mut self) {
            SCALE.with(|s| s.set(self.0));
        }
    }
    let _reset = Reset(SCALE.with(|s| s.replace(Some(scale))));
    USED.with(|u| u.set(false));
    let out = f();
    (out, USED.with(Cell::get))
}

/// The error for a step that ran under a loss scale and did not use it.
pub(crate) fn unscaled_backward_message() -> String {
    "fp16 is enabled, but the TrainStep called loss.backward() instead of \
     burn_deepspeed::precision::backward(&loss): the loss must be multiplied by the loss \
     scale before backward, or f16 gradients underflow"
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn grad_of_square(scale: Option<f32>) -> (f32, bool) {
        let device = Device::flex().autodiff();
        let x = Tensor::<1>::from_data(TensorData::from([3.0f32]), &device).require_grad();
        let (grads, used) = with_loss_scale(scale, || {
            let loss = (x.clone() * x.clone()).sum();
            backward(&loss)
        });
        let g = x
            .grad(&grads)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()[0];
        (g, used)
    }

    #[test]
    fn backward_multiplies_the_gradient_by_the_scale_only_inside_a_scaled_step() {
        assert_eq!(grad_of_square(None), (6.0, true));
        assert_eq!(grad_of_square(Some(1024.0)), (6.0 * 1024.0, true));
        // The scale is gone after the step.
        assert_eq!(current_loss_scale(), None);
        assert_eq!(grad_of_square(None), (6.0, true));
    }

    #[test]
    fn a_step_that_skips_the_scaled_backward_is_detected() {
        let (_, used) = with_loss_scale(Some(8.0), || ());
        assert!(!used);
        let (_, used) = with_loss_scale(None, || ());
        assert!(used);
    }
}
