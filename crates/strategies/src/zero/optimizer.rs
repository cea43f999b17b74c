//! [`PartitionedOptimizer`]: Adam, AdamW or LAMB on one rank's slice of the flat parameters
//! (ZeRO stage 1 and up, arXiv 1910.02054 §5.1): each rank keeps m and v for its slice only.
//!
//! Adam and AdamW are element-wise, so a slice steps on its own. LAMB's trust ratio needs the
//! norms of whole tensors, and a tensor may straddle ranks: each rank sums ‖p‖² and ‖u‖² over
//! its pieces, one all-reduce of `2 × tensors` values adds them up, and every rank then applies
//! the ratio of the whole tensor to its pieces.
//!
//! With ZeRO-Infinity's optimizer offload (arXiv 2104.07857) the slice's fp32 masters, m and v
//! live in a [`SwapStore`] instead of memory, and Adam steps them tile by tile
//! (`sub_group_size` elements) while the next tile is read and the previous one written.

use std::borrow::Cow;
use std::ops::Range;

use burn_deepspeed_cubecl_kernels::adam::{AdamParams, AdamTensor, adam_step_multi};
use burn_deepspeed_cubecl_kernels::lamb::{
    LambNorms, LambParams, lamb_apply, lamb_moments, trust_ratio,
};

use super::{FlatPartition, Segment};
use crate::comm::{Communicator, CommunicatorExt, ReduceOp};
use crate::swap::{SwapStore, SwapSummary};
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
#[derive(Debug)]
pub struct PartitionedOptimizer {
    kind: PartitionedKind,
    segments: Vec<Segment>,
    own: Range<usize>,
    /// The steps; m and v too unless swapped (then they are empty).
    state: PartitionState,
    /// ZeRO-Infinity: the fp32 masters, m and v of the slice, in a swap file (fields 0, 1
    /// and 2).
    swap: Option<SwapStore>,
}

/// The fields of a swapped optimizer state's records.
const MASTERS: usize = 0;
const M: usize = 1;
const V: usize = 2;

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
            swap: None,
        }
    }

    /// Moves this rank's state to `swap` (ZeRO-Infinity's `offload_optimizer.device: nvme`),
    /// with `masters` (the slice's fp32 parameters) beside it: from now on the optimizer holds
    /// the masters, and [`step`](Self::step) hands them out instead of reading the caller's.
    /// Adam and AdamW only: LAMB needs whole-tensor norms before it can update a tile, and
    /// DeepSpeed offloads Adam-family optimizers only.
    pub fn offload(&mut self, swap: SwapStore, masters: &[f32]) -> Result<()> {
        if masters.len() != self.own.len() {
            return Err(CommError::Optimizer {
                optimizer: "PartitionedOptimizer",
                detail: format!(
                    "{} masters for a slice of {}",
                    masters.len(),
                    self.own.len()
                ),
            });
        }
        self.offload_with(swap, |r, out| {
            out.copy_from_slice(&masters[r]);
            Ok(())
        })
    }

    /// [`offload`](Self::offload) with the masters read piece by piece: `masters(range, out)`
    /// fills `out` with the slice's parameters over `range`, tile by tile in order, so that a
    /// slice larger than memory (read from a parameter swap file) is never whole in RAM.
    pub fn offload_with(
        &mut self,
        mut swap: SwapStore,
        mut masters: impl FnMut(Range<usize>, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let plan = swap.plan();
        let detail = if matches!(self.kind, PartitionedKind::Lamb(_)) {
            Some(
                "LAMB cannot be offloaded: its trust ratio needs every tile's norms before \
                  any tile is updated; use Adam or AdamW"
                    .to_string(),
            )
        } else if plan.len() != self.own.len() || plan.fields() != 3 {
            Some(format!(
                "a swap store of {} fields of {} elements for a slice of {} (3 fields: \
                 masters, m, v)",
                plan.fields(),
                plan.len(),
                self.own.len()
            ))
        } else {
            None
        };
        if let Some(detail) = detail {
            return Err(CommError::Optimizer {
                optimizer: "PartitionedOptimizer",
                detail,
            });
        }
        let (m, v) = match &self.swap {
            Some(old) => {
                let mut both = old.read_fields(&[M, V])?;
                let v = both.pop().unwrap_or_default();
                (both.pop().unwrap_or_default(), v)
            }
            None => (
                std::mem::take(&mut self.state.m),
                std::mem::take(&mut self.state.v),
            ),
        };
        swap.fill(|_, r, fields| {
            let [p, fm, fv] = fields else {
                unreachable!("three fields checked above")
            };
            masters(r.clone(), p)?;
            fm.copy_from_slice(&m[r.clone()]);
            fv.copy_from_slice(&v[r]);
            Ok(())
        })?;
        self.swap = Some(swap);
        Ok(())
    }

    /// Whether the state lives in a swap file (and the optimizer holds the masters).
    pub fn is_offloaded(&self) -> bool {
        self.swap.is_some()
    }

    /// The swap file's size, engine and transfers so far, when offloaded.
    pub fn swap_summary(&self) -> Option<SwapSummary> {
        self.swap.as_ref().map(SwapStore::summary)
    }

    /// Bytes of state on disk (masters, m and v), when offloaded.
    pub fn disk_bytes(&self) -> u64 {
        self.swap.as_ref().map_or(0, SwapStore::disk_bytes)
    }

    /// When offloaded, the fp32 masters of the slice, read from the swap file.
    pub fn masters(&self) -> Result<Option<Vec<f32>>> {
        match &self.swap {
            Some(s) => Ok(s.read_fields(&[MASTERS])?.pop()),
            None => Ok(None),
        }
    }

    /// This rank's slice of the flat buffer.
    pub fn own(&self) -> Range<usize> {
        self.own.clone()
    }

    /// Bytes of optimizer state this rank holds in memory (m and v of its slice; when
    /// offloaded, the swap buffers).
    pub fn state_bytes(&self) -> u64 {
        let buffers = self.swap.as_ref().map_or(0, SwapStore::buffer_bytes);
        4 * (self.state.m.len() + self.state.v.len()) as u64 + buffers
    }

    /// One step on this rank's slice: `params` and `grads` are the slice (of
    /// [`own`](Self::own)`.len()` elements); `present[t]` says whether tensor `t` had a
    /// gradient on any rank (tensors without one are left alone, as Burn's optimizers do).
    /// When [offloaded](Self::offload), the optimizer steps its own masters and `params`
    /// receives them (its values on entry are not read).
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
        if self.swap.is_some() {
            return self.step_tiles(grads, present, lr, |r, p| {
                params[r].copy_from_slice(p);
                Ok(())
            });
        }
        for (s, &p) in self.state.steps.iter_mut().zip(present) {
            *s = s.saturating_add(u32::from(p != 0));
        }
        let steps = &self.state.steps;
        let live = self.segments.iter().filter(|s| present[s.tensor] != 0);
        match self.kind {
            PartitionedKind::Adam(mut h) => {
                h.lr = lr as f32;
                let live: Vec<&Segment> = live.collect();
                let (m, v) = (&mut self.state.m[..], &mut self.state.v[..]);
                adam_pieces(&h, steps, &live, 0..n, params, grads, m, v);
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

    /// The [offloaded](Self::offload) step, tile by tile: each tile's updated masters go to
    /// `out(range, values)` (ranges of the slice, in order) as soon as the tile is stepped,
    /// so that the caller can write them on (to a parameter swap file) without a buffer of the
    /// whole slice. `grads` is the slice's gradient.
    pub fn step_tiles(
        &mut self,
        grads: &[f32],
        present: &[u8],
        lr: f64,
        mut out: impl FnMut(Range<usize>, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let n = self.own.len();
        let (Some(swap), PartitionedKind::Adam(mut h)) = (&mut self.swap, self.kind) else {
            return Err(CommError::Optimizer {
                optimizer: "PartitionedOptimizer",
                detail: "a tiled step needs the offloaded state of Adam or AdamW".into(),
            });
        };
        if grads.len() != n || present.len() != self.state.steps.len() {
            return Err(CommError::Optimizer {
                optimizer: "PartitionedOptimizer",
                detail: format!(
                    "slice of {n} elements over {} tensors; got {} gradients and {} presence \
                     marks",
                    self.state.steps.len(),
                    grads.len(),
                    present.len()
                ),
            });
        }
        // A state that an earlier failed step left part stepped is not stepped again.
        swap.check_whole()?;
        for (s, &p) in self.state.steps.iter_mut().zip(present) {
            *s = s.saturating_add(u32::from(p != 0));
        }
        h.lr = lr as f32;
        let steps = &self.state.steps;
        let live: Vec<&Segment> = self
            .segments
            .iter()
            .filter(|s| present[s.tensor] != 0)
            .collect();
        swap.update(|_, r, fields| {
            let [p, m, v] = fields else {
                unreachable!("offload checked three fields")
            };
            let g = &grads[r.clone()];
            adam_pieces(&h, steps, &live, r.clone(), p, g, m, v);
            out(r, p)
        })
    }

    /// Each tensor's step count.
    pub fn steps(&self) -> &[u32] {
        &self.state.steps
    }

    /// This rank's moments, to save, without holding them whole: `visit(elements, m, v)` gets
    /// them a tile at a time in one pass over the swap file when offloaded, and in one call
    /// otherwise.
    pub fn export_tiles<E: From<CommError>>(
        &self,
        mut visit: impl FnMut(Range<usize>, &[f32], &[f32]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        match &self.swap {
            Some(swap) => swap.read_tiles(&[M, V], |r, f| visit(r, f[0], f[1])),
            None => visit(0..self.state.m.len(), &self.state.m, &self.state.v),
        }
    }

    /// This rank's state, to save (read from the swap file when offloaded).
    pub fn export(&self) -> Result<Cow<'_, PartitionState>> {
        let Some(swap) = &self.swap else {
            return Ok(Cow::Borrowed(&self.state));
        };
        let mut both = swap.read_fields(&[M, V])?;
        let v = both.pop().unwrap_or_default();
        Ok(Cow::Owned(PartitionState {
            steps: self.state.steps.clone(),
            m: both.pop().unwrap_or_default(),
            v,
        }))
    }

    /// Replaces this rank's state with `state` (steps for every tensor, moments of this
    /// slice). When offloaded, `masters` (the slice's fp32 parameters) are written beside
    /// it and are required.
    pub fn restore(&mut self, state: PartitionState, masters: Option<&[f32]>) -> Result<()> {
        self.check_restore(&state, masters)?;
        match &mut self.swap {
            Some(swap) => {
                swap.write_all(&[masters, Some(&state.m), Some(&state.v)])?;
                self.state.steps = state.steps;
            }
            None => self.state = state,
        }
        Ok(())
    }

    /// Whether [`restore`](Self::restore) takes `state` and `masters`: the error it would
    /// return for a state of another slice, checked before anything changes. (An offloaded
    /// restore can still fail writing its swap file.)
    pub fn check_restore(&self, state: &PartitionState, masters: Option<&[f32]>) -> Result<()> {
        let masters_fit = match (&self.swap, masters) {
            (Some(_), Some(p)) => p.len() == self.own.len(),
            (Some(_), None) => false,
            (None, _) => true,
        };
        if state.steps.len() != self.state.steps.len()
            || state.m.len() != self.own.len()
            || state.v.len() != self.own.len()
            || !masters_fit
        {
            return Err(CommError::Optimizer {
                optimizer: "PartitionedOptimizer",
                detail: format!(
                    "saved state has {} tensors and moments of {}/{} elements ({} masters); \
                     this slice has {} tensors and {} elements{}",
                    state.steps.len(),
                    state.m.len(),
                    state.v.len(),
                    masters.map_or(0, <[f32]>::len),
                    self.state.steps.len(),
                    self.own.len(),
                    if self.swap.is_some() {
                        ", offloaded with its masters"
                    } else {
                        ""
                    }
                ),
            });
        }
        Ok(())
    }
}

/// Adam on the pieces of the `live` segments that fall in `range` (of the slice): `p`, `g`,
/// `m` and `v` hold that range. The in-memory step passes the whole slice, the swapped step
/// one tile at a time; the update is element-wise, so both give the same bits.
#[allow(clippy::too_many_arguments)]
fn adam_pieces(
    h: &AdamParams,
    steps: &[u32],
    live: &[&Segment],
    range: Range<usize>,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let mut tensors = Vec::new();
    let (mut p_rest, mut g_rest, mut m_rest, mut v_rest) = (p, g, m, v);
    let mut at = range.start;
    for seg in live {
        let (lo, hi) = (
            seg.local.start.max(range.start),
            seg.local.end.min(range.end),
        );
        if lo >= hi {
            continue;
        }
        let (skip, len) = (lo - at, hi - lo);
        let (p, pr) = std::mem::take(&mut p_rest)[skip..].split_at_mut(len);
        let (g, gr) = g_rest[skip..].split_at(len);
        let (m, mr) = std::mem::take(&mut m_rest)[skip..].split_at_mut(len);
        let (v, vr) = std::mem::take(&mut v_rest)[skip..].split_at_mut(len);
        (p_rest, g_rest, m_rest, v_rest) = (pr, gr, mr, vr);
        at = hi;
        tensors.push(AdamTensor {
            p,
            g,
            m,
            v,
            step: steps[seg.tensor],
        });
    }
    adam_step_multi(h, &mut tensors);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{ThreadWorld, ThreadWorldOptions};
    use crate::swap::{AioOptions, IoEngine, SwapOptions, TilePlan};
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

    fn swap_options(engine: IoEngine, pipelined: bool) -> SwapOptions {
        SwapOptions {
            aio: AioOptions {
                block_size: 4096,
                queue_depth: 4,
                ..AioOptions::default()
            },
            engine,
            pipeline_read: pipelined,
            pipeline_write: pipelined,
        }
    }

    /// ZeRO-Infinity's tiled step from a swap file gives the in-memory step's bits: the
    /// masters it hands out, the moments it saves, and after a restore, for odd tile sizes,
    /// both engines, pipelined or not.
    #[test]
    fn swapped_adam_steps_bit_identically_to_in_memory_adam() {
        let sizes = [5usize, 17, 1, 9, 3000];
        let numel: usize = sizes.iter().sum();
        let present = [1u8, 1, 0, 1, 1];
        let kind = kinds()[0];
        let dir = tempfile::tempdir().unwrap();
        let engines = crate::swap::engines_here();
        let world = 2;
        let part = FlatPartition::new(numel, world);
        // Adam talks to no other rank: one world of one lends the step a communicator.
        ThreadWorld::run(1, ThreadWorldOptions::default(), |c| {
            for &engine in &engines {
                for (tile, pipelined) in [
                    (1usize, false),
                    (7, true),
                    (1000, true),
                    (1517, false),
                    (99_999, true),
                ] {
                    for rank in 0..world {
                        let mut ram = PartitionedOptimizer::new(kind, &part, rank, &sizes);
                        let mut disk = PartitionedOptimizer::new(kind, &part, rank, &sizes);
                        let own = ram.own();
                        let init = values(numel, 1)[own.clone()].to_vec();
                        let plan = TilePlan::new(own.len(), tile, 3);
                        let path = dir.path().join(format!("r{rank}.swp"));
                        let store = SwapStore::create(&path, plan, swap_options(engine, pipelined))
                            .unwrap();
                        let buffers = store.buffer_bytes();
                        disk.offload(store, &init).unwrap();
                        // Only the tile buffers stay in memory.
                        assert_eq!(disk.state_bytes(), buffers);
                        assert_eq!(disk.disk_bytes(), plan.file_bytes());
                        let (mut p_ram, mut p_disk) = (init.clone(), vec![f32::NAN; own.len()]);
                        for step in 1..=3u32 {
                            let g = values(numel, 10 + step);
                            ram.step(&c, &mut p_ram, &g[own.clone()], &present, 0.01)
                                .unwrap();
                            disk.step(&c, &mut p_disk, &g[own.clone()], &present, 0.01)
                                .unwrap();
                            let same = p_ram
                                .iter()
                                .zip(&p_disk)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{engine:?} tile {tile} step {step}");
                        }
                        assert_eq!(*disk.export().unwrap(), *ram.export().unwrap());
                        // A save reads the swapped moments a tile at a time, in one pass.
                        let before = disk.swap_summary().unwrap().stats.bytes_read;
                        let (mut m, mut v, mut tiles) = (Vec::new(), Vec::new(), 0);
                        disk.export_tiles(|r, tm, tv| {
                            assert_eq!((r.start, r.len(), tv.len()), (m.len(), tm.len(), tm.len()));
                            m.extend_from_slice(tm);
                            v.extend_from_slice(tv);
                            tiles += 1;
                            Ok::<(), CommError>(())
                        })
                        .unwrap();
                        let read = disk.swap_summary().unwrap().stats.bytes_read - before;
                        assert_eq!((tiles, read), (plan.count(), plan.file_bytes()));
                        let whole = ram.export().unwrap();
                        assert!(m == whole.m && v == whole.v, "{engine:?} tile {tile}");
                        assert_eq!(disk.masters().unwrap().unwrap(), p_ram);
                        let s = disk.swap_summary().unwrap().stats;
                        assert!(s.bytes_read > 0 && s.bytes_written > 0);
                        // A restore writes masters and moments back to the file.
                        let saved = ram.export().unwrap().into_owned();
                        assert!(
                            disk.restore(saved.clone(), None).is_err(),
                            "masters are required"
                        );
                        disk.restore(saved, Some(&p_ram)).unwrap();
                        let g = values(numel, 99);
                        ram.step(&c, &mut p_ram, &g[own.clone()], &present, 0.01)
                            .unwrap();
                        disk.step(&c, &mut p_disk, &g[own.clone()], &present, 0.01)
                            .unwrap();
                        assert_eq!(p_ram, p_disk);
                    }
                }
            }
        })
        .into_iter()
        .for_each(|r| r.unwrap());
    }

    #[test]
    fn lamb_and_mismatched_stores_are_not_offloaded() {
        let dir = tempfile::tempdir().unwrap();
        let part = FlatPartition::new(10, 1);
        let store = |len| {
            let plan = TilePlan::new(len, 4, 3);
            SwapStore::create(
                &dir.path().join(format!("{len}")),
                plan,
                swap_options(IoEngine::Pread, false),
            )
            .unwrap()
        };
        let mut lamb = PartitionedOptimizer::new(kinds()[1], &part, 0, &[10]);
        let e = lamb.offload(store(10), &[0.0; 10]).unwrap_err().to_string();
        assert!(e.contains("LAMB"), "{e}");
        let mut adam = PartitionedOptimizer::new(kinds()[0], &part, 0, &[10]);
        let e = adam.offload(store(9), &[0.0; 10]).unwrap_err().to_string();
        assert!(e.contains("9 elements"), "{e}");
        assert!(!adam.is_offloaded());
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
        assert!(opt.restore(bad, None).is_err());
    }

    /// A disk that fails part way through an offloaded step leaves the tiles before the
    /// failure stepped and the rest not: every later step and save is refused, naming the
    /// cause, until a checkpoint's state is restored into it.
    #[test]
    fn a_step_that_fails_part_way_refuses_what_follows_until_a_restore() {
        use crate::swap::{SwapFault, inject_swap_fault};
        let dir = tempfile::tempdir().unwrap();
        // Offloading writes the 3 tiles (writes 1-3); the step's second tile is write 5.
        inject_swap_fault(dir.path(), SwapFault::parse("write:5:ENOSPC").unwrap());
        ThreadWorld::run(1, ThreadWorldOptions::default(), |c| {
            let part = FlatPartition::new(10, 1);
            let mut opt = PartitionedOptimizer::new(kinds()[0], &part, 0, &[10]);
            let plan = TilePlan::new(10, 4, 3);
            let options = swap_options(IoEngine::Pread, false);
            let store = SwapStore::create(&dir.path().join("s.swp"), plan, options).unwrap();
            let init = values(10, 1);
            opt.offload(store, &init).unwrap();
            let saved = opt.export().unwrap().into_owned();
            let (g, mut p) = (values(10, 2), vec![0.0; 10]);
            let e = opt
                .step(&c, &mut p, &g, &[1], 0.01)
                .unwrap_err()
                .to_string();
            assert!(e.contains("No space left"), "{e}");
            for e in [
                opt.step(&c, &mut p, &g, &[1], 0.01).unwrap_err(),
                opt.export().unwrap_err(),
                opt.masters().unwrap_err(),
            ] {
                let e = e.to_string();
                assert!(
                    e.contains("inconsistent") && e.contains("No space left"),
                    "{e}"
                );
                assert!(e.contains("load the last checkpoint"), "{e}");
            }
            opt.restore(saved.clone(), Some(&init)).unwrap();
            opt.step(&c, &mut p, &g, &[1], 0.01).unwrap();
            assert_eq!(opt.export().unwrap().steps, vec![1]);
        })
        .into_iter()
        .for_each(|r| r.unwrap());
    }
}
