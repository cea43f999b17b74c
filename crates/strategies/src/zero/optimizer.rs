//! [`PartitionedOptimizer`]: Adam, AdamW or LAMB on one rank's slice of the flat parameters
//! (ZeRO stage 1 and up, arXiv 1910.02054 §5.1): each rank keeps m and v for its slice only.
//!
//! Adam and AdamW are element-wise, so a slice steps on its own. LAMB's trust ratio needs the
//! norms of whole tensors, and a tensor may straddle ranks: each rank sums ‖p‖² and ‖u‖² over
//! its pieces, one all-reduce of `2 × tensors` values adds them up, and every rank then applies
//! the ratio of the whole tensor to its pieces.

use std::ops::Range;

use burn_deepspeed_cubecl_kernels::adam::{AdamParams, AdamTensor, adam_step_multi};
use burn_deepspeed_cubecl_kernels::lamb::{
    LambNorms, LambParams, lamb_apply, lamb_moments, trust_ratio,
};

use super::{FlatPartition, Segment};
use crate::comm::{Communicator, CommunicatorExt, ReduceOp};
use crate::{CommError, Result};

/// Which update the partitioned optimizer applies (the learning rate is given per step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PartitionedKind {
    /// Adam or AdamW.
    Adam(AdamParams),
    /// LAMB.
    Lamb(LambParams),
}

/// The saved state of one rank's slice: per-tensor step counts (the same on every rank) and
/// the slice's moments.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionState {
    /// Steps taken by each tensor of the layout.
    pub steps: Vec<u32>,
    /// First moment of the slice.
    pub m: Vec<f32>,
    /// Second moment of the slice.
    pub v: Vec<f32>,
}

/// Adam/AdamW/LAMB state and step for one rank's slice of a flat parameter buffer.
#[derive(Debug, Clone)]
pub struct PartitionedOptimizer {
    kind: PartitionedKind,
    segments: Vec<Segment>,
    own: Range<usize>,
    state: PartitionState,
}

impl PartitionedOptimizer {
    /// The optimizer of `rank`'s slice of `partition`, over tensors of `sizes` elements laid
    /// out back to back.
    pub fn new(
        kind: PartitionedKind,
        partition: &FlatPartition,
        rank: usize,
        sizes: &[usize],
    ) -> Self {
        let own = partition.range(rank);
        Self::over_segments(kind, partition.segments(rank, sizes), own, sizes.len())
    }

    /// The optimizer of a rank that owns the pieces `segments` (back to back in its buffer)
    /// of `tensors` tensors, e.g. a stage-3 [`ShardPlan`](super::ShardPlan)'s; `own` is the
    /// buffer's range (its length is the state's).
    pub fn over_segments(
        kind: PartitionedKind,
        segments: Vec<Segment>,
        own: Range<usize>,
        tensors: usize,
    ) -> Self {
        Self {
            kind,
            segments,
            state: PartitionState {
                steps: vec![0; tensors],
                m: vec![0.0; own.len()],
                v: vec![0.0; own.len()],
            },
            own,
        }
    }

    /// This rank's slice of the flat buffer.
    pub fn own(&self) -> Range<usize> {
        self.own.clone()
    }

    /// Bytes of optimizer state this rank holds (m and v of its slice).
    pub fn state_bytes(&self) -> u64 {
        4 * (self.state.m.len() + self.state.v.len()) as u64
    }

    /// One step on this rank's slice: `params` and `grads` are the slice (of
    /// [`own`](Self::own)`.len()` elements); `present[t]` says whether tensor `t` had a
    /// gradient on any rank (tensors without one are left alone, as Burn's optimizers do).
    /// Collective for LAMB at world size > 1: every rank calls it.
    pub fn step(
        &mut self,
        comm: &dyn Communicator,
        params: &mut [f32],
        grads: &[f32],
        present: &[u8],
        lr: f64,
    ) -> Result<()> {
        let n = self.own.len();
        if params.len() != n || grads.len() != n || present.len() != self.state.steps.len() {
            return Err(CommError::Optimizer {
                optimizer: "PartitionedOptimizer",
                detail: format!(
                    "slice of {n} elements over {} tensors; got {} parameters, {} gradients \
                     and {} presence marks",
                    self.state.steps.len(),
                    params.len(),
                    grads.len(),
                    present.len()
                ),
            });
        }
        for (s, &p) in self.state.steps.iter_mut().zip(present) {
            *s += u32::from(p != 0);
        }
        let steps = &self.state.steps;
        let live = self.segments.iter().filter(|s| present[s.tensor] != 0);
        match self.kind {
            PartitionedKind::Adam(mut h) => {
                h.lr = lr as f32;
                let mut tensors = Vec::new();
                let (mut p_rest, mut g_rest) = (&mut params[..], grads);
                let (mut m_rest, mut v_rest) = (&mut self.state.m[..], &mut self.state.v[..]);
                let mut at = 0;
                for seg in live {
                    let skip = seg.local.start - at;
                    let len = seg.local.len();
                    let (p, pr) = std::mem::take(&mut p_rest)[skip..].split_at_mut(len);
                    let (g, gr) = g_rest[skip..].split_at(len);
                    let (m, mr) = std::mem::take(&mut m_rest)[skip..].split_at_mut(len);
                    let (v, vr) = std::mem::take(&mut v_rest)[skip..].split_at_mut(len);
                    (p_rest, g_rest, m_rest, v_rest) = (pr, gr, mr, vr);
                    at = seg.local.end;
                    tensors.push(AdamTensor {
                        p,
                        g,
                        m,
                        v,
                        step: steps[seg.tensor],
                    });
                }
                adam_step_multi(&h, &mut tensors);
            }
            PartitionedKind::Lamb(mut h) => {
                h.lr = lr as f32;
                let live: Vec<&Segment> = live.collect();
                let mut norms = vec![0.0f32; 2 * steps.len()];
                for seg in &live {
                    let r = seg.local.clone();
                    let t = seg.tensor;
                    let part = lamb_moments(
                        &h,
                        steps[t],
                        &params[r.clone()],
                        &grads[r.clone()],
                        &mut self.state.m[r.clone()],
                        &mut self.state.v[r],
                    );
                    norms[2 * t] += part.param_sq as f32;
                    norms[2 * t + 1] += part.update_sq as f32;
                }
                if comm.world_size() > 1 {
                    comm.all_reduce(&mut norms, ReduceOp::Sum)?;
                }
                for seg in &live {
                    let t = seg.tensor;
                    let whole = LambNorms {
                        param_sq: norms[2 * t] as f64,
                        update_sq: norms[2 * t + 1] as f64,
                    };
                    let r = seg.local.clone();
                    lamb_apply(
                        &h,
                        steps[t],
                        trust_ratio(&h, whole),
                        &mut params[r.clone()],
                        &self.state.m[r.clone()],
                        &self.state.v[r],
                    );
                }
            }
        }
        Ok(())
    }

    /// This rank's state, to save.
    pub fn export(&self) -> &PartitionState {
        &self.state
    }

    /// Replaces this rank's state with `state` (steps for every tensor, moments of this slice).
    pub fn restore(&mut self, state: PartitionState) -> Result<()> {
        if state.steps.len() != self.state.steps.len()
            || state.m.len() != self.own.len()
            || state.v.len() != self.own.len()
        {
            return Err(CommError::Optimizer {
                optimizer: "PartitionedOptimizer",
                detail: format!(
                    "saved state has {} tensors and moments of {}/{} elements; this slice \
                     has {} tensors and {} elements",
                    state.steps.len(),
                    state.m.len(),
                    state.v.len(),
                    self.state.steps.len(),
                    self.own.len()
                ),
            });
        }
        self.state = state;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{ThreadWorld, ThreadWorldOptions};
    use burn_deepspeed_cubecl_kernels::adam::adam_step;
    use burn_deepspeed_cubecl_kernels::lamb::lamb_step;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    fn kinds() -> [PartitionedKind; 2] {
        [
            PartitionedKind::Adam(AdamParams {
                lr: 0.0,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
                decoupled: true,
                bias_correction: true,
            }),
            PartitionedKind::Lamb(LambParams {
                lr: 0.0,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
                weight_decay: 0.01,
                bias_correction: true,
                trust_clip: None,
            }),
        ]
    }

    /// The slices of every rank, stepped together, equal whole-tensor steps on one rank.
    #[test]
    fn slices_step_like_whole_tensors() {
        let sizes = [5usize, 17, 1, 9, 30];
        let numel: usize = sizes.iter().sum();
        let present = [1u8, 1, 0, 1, 1];
        for kind in kinds() {
            // Serial reference: whole tensors.
            let mut p = values(numel, 1);
            let mut m = vec![0.0; numel];
            let mut v = vec![0.0; numel];
            for step in 1..=3u32 {
                let g = values(numel, 10 + step);
                let mut off = 0;
                for (t, &n) in sizes.iter().enumerate() {
                    let r = off..off + n;
                    off += n;
                    if present[t] == 0 {
                        continue;
                    }
                    match kind {
                        PartitionedKind::Adam(mut h) => {
                            h.lr = 0.01;
                            let (pp, mm, vv) =
                                (&mut p[r.clone()], &mut m[r.clone()], &mut v[r.clone()]);
                            adam_step(&h, step, pp, &g[r], mm, vv);
                        }
                        PartitionedKind::Lamb(mut h) => {
                            h.lr = 0.01;
                            let (pp, mm, vv) =
                                (&mut p[r.clone()], &mut m[r.clone()], &mut v[r.clone()]);
                            lamb_step(&h, step, pp, &g[r], mm, vv);
                        }
                    }
                }
            }
            for world in 1..=4 {
                let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
                    let part = FlatPartition::new(numel, world);
                    let mut opt = PartitionedOptimizer::new(kind, &part, c.rank(), &sizes);
                    let own = opt.own();
                    let mut p = values(numel, 1)[own.clone()].to_vec();
                    for step in 1..=3u32 {
                        let g = values(numel, 10 + step);
                        opt.step(&c, &mut p, &g[own.clone()], &present, 0.01)
                            .unwrap();
                    }
                    p
                });
                let gathered: Vec<f32> = out.into_iter().flat_map(|r| r.unwrap()).collect();
                for (a, b) in gathered.iter().zip(&p) {
                    assert!(
                        (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                        "world {world}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn restore_refuses_a_state_of_another_slice() {
        let part = FlatPartition::new(10, 2);
        let mut opt = PartitionedOptimizer::new(kinds()[0], &part, 0, &[10]);
        let bad = PartitionState {
            steps: vec![1],
            m: vec![0.0; 4],
            v: vec![0.0; 4],
        };
        assert!(opt.restore(bad).is_err());
    }
}
