//! The arithmetic every regime shares: the mean over ranks and micro-batches (split around the
//! reduction when prescaling) and global-norm clipping, written once.

use burn_deepspeed_strategies::bucket::bucket_ranges;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp, sum_f64};

use super::elem::GradElem;
use crate::Result;

/// The factors applied to a gradient before and after its sum over ranks, so that the result
/// is the mean over `world` ranks and `micro_steps` micro-batches. With
/// `gradient_predivide_factor` f (`prescale_gradients`) the gradient is divided by f before the
/// sum and by `world × micro_steps / f` after it (DeepSpeed's split, which keeps fp16 sums in
/// range); without it, by `world × micro_steps` after it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scaling {
    /// Factor before the reduction.
    pub pre: f32,
    /// Factor after the reduction.
    pub post: f32,
}

impl Scaling {
    /// The mean's factors for `micro_steps` micro-batches on `world` ranks.
    pub fn mean(predivide: Option<f32>, world: usize, micro_steps: u64) -> Self {
        let world = world as f32;
        let gas = micro_steps.max(1) as f32;
        let (pre, post) = match predivide {
            Some(f) => (1.0 / f, f / (world * gas)),
            None => (1.0, 1.0 / (world * gas)),
        };
        Self { pre, post }
    }

    /// The same mean of gradients computed from a loss multiplied by `loss_scale` (fp16): the
    /// factor after the reduction also divides the scale out, so that unscaling costs no pass
    /// of its own (DeepSpeed folds it into the optimizer's pass instead; the result is the
    /// same).
    pub fn unscaled(self, loss_scale: f32) -> Self {
        Self {
            pre: self.pre,
            post: self.post / loss_scale,
        }
    }

    /// Multiplies `values` by the factor before the reduction.
    pub fn apply_pre<G: GradElem>(&self, values: &mut [G]) {
        scale(values, self.pre);
    }

    /// Multiplies `values` by the factor after the reduction.
    pub fn apply_post<G: GradElem>(&self, values: &mut [G]) {
        scale(values, self.post);
    }
}

/// Multiplies `values` by `factor` (nothing to do for 1).
pub(crate) fn scale<G: GradElem>(values: &mut [G], factor: f32) {
    if factor != 1.0 {
        values
            .iter_mut()
            .for_each(|g| *g = G::narrow(g.widen() * factor));
    }
}

/// All-reduces `flat` in buckets of `bucket_size` elements (0: one bucket) and leaves the mean
/// that `scaling` describes.
pub fn all_reduce_mean<G: GradElem>(
    comm: &dyn Communicator,
    flat: &mut [G],
    bucket_size: usize,
    scaling: Scaling,
) -> Result<()> {
    for range in bucket_ranges(flat.len(), bucket_size) {
        let bucket = &mut flat[range];
        scaling.apply_pre(bucket);
        if comm.world_size() > 1 {
            let _span = tracing::debug_span!("reduce_bucket", elems = bucket.len()).entered();
            comm.all_reduce(bucket, ReduceOp::Sum)?;
        }
        scaling.apply_post(bucket);
    }
    Ok(())
}

/// Σ g², summed in f64.
pub fn squared_sum<G: GradElem>(values: &[G]) -> f64 {
    values
        .iter()
        .map(|&g| {
            let g = g.widen() as f64;
            g * g
        })
        .sum()
}

/// Scales `values`, whose norm (possibly over several ranks' buffers) is `norm`, so that the
/// norm is at most `max_norm` (DeepSpeed: coefficient `max_norm / (norm + 1e-6)` when below
/// 1; `max_norm` 0 disables clipping).
pub fn clip_to<G: GradElem>(values: &mut [G], norm: f64, max_norm: f64) {
    if max_norm > 0.0 {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            scale(values, coef as f32);
        }
    }
}

/// The factor that scales a gradient of finite norm `norm` down to the norm `clip`, when
/// clipping is on (`clip > 0`) and the norm exceeds it (DeepSpeed's `clip / (norm + 1e-6)`);
/// `None` when nothing is clipped.
pub fn clip_factor(norm: f64, clip: f64) -> Option<f32> {
    let coef = clip / (norm + 1e-6);
    (clip > 0.0 && norm.is_finite() && coef < 1.0).then_some(coef as f32)
}

/// Clips a whole gradient held by this rank by its own norm; returns the norm before
/// clipping.
pub fn clip_local<G: GradElem>(values: &mut [G], max_norm: f64) -> f64 {
    let norm = squared_sum(values).sqrt();
    clip_to(values, norm, max_norm);
    norm
}

/// Clips every rank's part `values` of one gradient by the norm of the whole (one all-reduce
/// of the parts' squared sums); returns the norm before clipping.
pub fn clip_across<G: GradElem>(
    comm: &dyn Communicator,
    values: &mut [G],
    max_norm: f64,
) -> Result<f64> {
    let norm = norm_across(comm, squared_sum(values))?;
    clip_to(values, norm, max_norm);
    Ok(norm)
}

/// The norm of a gradient whose parts' squared sums (`local_sq` on this rank) are summed over
/// `comm` (one all-reduce of one f32).
pub fn norm_across(comm: &dyn Communicator, local_sq: f64) -> Result<f64> {
    Ok(sum_across(comm, local_sq)?.sqrt())
}

/// `local` summed over `comm` in f64 (one all-gather of 8 bytes per rank, summed in rank
/// order: an f32 sum would round, and overflow to inf for large squared norms).
pub fn sum_across(comm: &dyn Communicator, local: f64) -> Result<f64> {
    Ok(sum_f64(comm, &[local])?[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_deepspeed_strategies::comm::{ThreadWorld, ThreadWorldOptions};

    #[test]
    fn bucketed_mean_equals_the_serial_mean() {
        for world in 1..=4 {
            for predivide in [None, Some(2.0)] {
                let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
                    let r = c.rank() as f32;
                    let mut flat: Vec<f32> = (0..11).map(|i| i as f32 * (r + 1.0)).collect();
                    let scaling = Scaling::mean(predivide, c.world_size(), 2);
                    all_reduce_mean(&c, &mut flat, 3, scaling).unwrap();
                    flat
                });
                let rank_sum: f32 = (1..=world).map(|r| r as f32).sum();
                for flat in out {
                    for (i, g) in flat.unwrap().iter().enumerate() {
                        let want = i as f32 * rank_sum / (world as f32 * 2.0);
                        assert!((g - want).abs() < 1e-5, "world {world}: {g} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn clipping_caps_the_norm() {
        let mut g = vec![3.0f32, 4.0];
        assert_eq!(clip_local(&mut g, 1.0), 5.0);
        assert!((squared_sum(&g).sqrt() - 1.0).abs() < 1e-5);
        let mut g = vec![0.3f32, 0.4];
        clip_local(&mut g, 1.0);
        assert_eq!(g, vec![0.3, 0.4]);
        let mut g = vec![3.0f32, 4.0];
        clip_to(&mut g, 5.0, 0.0);
        assert_eq!(g, vec![3.0, 4.0], "0 disables clipping");
    }

    #[test]
    fn clipping_across_ranks_uses_the_whole_norm() {
        // Two ranks hold (3) and (4): the whole gradient's norm is 5.
        let out = ThreadWorld::run(2, ThreadWorldOptions::default(), |c| {
            let mut part = vec![3.0f32 + c.rank() as f32];
            let norm = clip_across(&c, &mut part, 1.0).unwrap();
            (norm, part[0])
        });
        for (rank, r) in out.into_iter().enumerate() {
            let (norm, v) = r.unwrap();
            assert!((norm - 5.0).abs() < 1e-6);
            let want = (3.0 + rank as f32) / 5.0;
            assert!((v - want).abs() < 1e-5, "{v} vs {want}");
        }
    }
}
