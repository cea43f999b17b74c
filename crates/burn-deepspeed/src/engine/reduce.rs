//! Data-parallel gradient reduction (ZeRO stage 0): bucketed all-reduce of the flat gradient,
//! then global-norm clipping.

use burn_deepspeed_strategies::bucket::bucket_ranges;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};

use crate::Result;

/// How the gradient is averaged over ranks and micro-batches.
#[derive(Debug, Clone, Copy)]
pub struct ReduceOptions {
    /// Elements per all-reduce (`zero_optimization.reduce_bucket_size`).
    pub bucket_size: usize,
    /// Divide by `predivide_factor` before the all-reduce and by `world × gas / factor`
    /// after it (`prescale_gradients`), instead of by `world × gas` after it.
    pub predivide_factor: Option<f32>,
    /// Micro-batches accumulated into the buffer.
    pub gradient_accumulation_steps: u64,
}

/// All-reduces `flat` in buckets and leaves the mean gradient over every rank and micro-batch.
pub fn all_reduce_mean(
    comm: &dyn Communicator,
    flat: &mut [f32],
    opts: ReduceOptions,
) -> Result<()> {
    let world = comm.world_size() as f32;
    let gas = opts.gradient_accumulation_steps as f32;
    let (pre, post) = match opts.predivide_factor {
        Some(f) => (1.0 / f, f / (world * gas)),
        None => (1.0, 1.0 / (world * gas)),
    };
    for range in bucket_ranges(flat.len(), opts.bucket_size) {
        let bucket = &mut flat[range];
        if pre != 1.0 {
            bucket.iter_mut().for_each(|g| *g *= pre);
        }
        if comm.world_size() > 1 {
            let _span = tracing::debug_span!("reduce_bucket", elems = bucket.len()).entered();
            comm.all_reduce(bucket, ReduceOp::Sum)?;
        }
        if post != 1.0 {
            bucket.iter_mut().for_each(|g| *g *= post);
        }
    }
    Ok(())
}

/// Global L2 norm of the (already reduced) gradient.
pub fn global_norm(flat: &[f32]) -> f64 {
    flat.iter()
        .map(|&g| (g as f64) * (g as f64))
        .sum::<f64>()
        .sqrt()
}

/// Scales `flat` so that its norm is at most `max_norm` (DeepSpeed: coefficient
/// `max_norm / (norm + 1e-6)` when below 1). Returns the norm before clipping.
pub fn clip_global_norm(flat: &mut [f32], max_norm: f64) -> f64 {
    let norm = global_norm(flat);
    scale_to_norm(flat, norm, max_norm);
    norm
}

/// Scales `flat`, whose norm (possibly over several ranks' buffers) is `norm`, so that the
/// norm is at most `max_norm` (DeepSpeed: coefficient `max_norm / (norm + 1e-6)` when below
/// 1; `max_norm` 0 disables clipping).
pub fn scale_to_norm(flat: &mut [f32], norm: f64, max_norm: f64) {
    if max_norm > 0.0 {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            let c = coef as f32;
            flat.iter_mut().for_each(|g| *g *= c);
        }
    }
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
                    let opts = ReduceOptions {
                        bucket_size: 3,
                        predivide_factor: predivide,
                        gradient_accumulation_steps: 2,
                    };
                    all_reduce_mean(&c, &mut flat, opts).unwrap();
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
        assert_eq!(clip_global_norm(&mut g, 1.0), 5.0);
        assert!((global_norm(&g) - 1.0).abs() < 1e-5);
        let mut g = vec![0.3f32, 0.4];
        clip_global_norm(&mut g, 1.0);
        assert_eq!(g, vec![0.3, 0.4]);
    }
}
