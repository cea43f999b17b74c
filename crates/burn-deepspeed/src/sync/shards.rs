//! How [`ShardedSync`] reads and rewrites a sharded module: this rank's pieces in buffer
//! order, the chunks written back after a step, the whole parameters gathered (or loaded from
//! a checkpoint), and the chunk-shaped gradients a caller's optimizer steps.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_strategies::comm::CommunicatorExt;

use super::ShardedSync;
use super::elem::GradElem;
use crate::engine::flat::{ParamLayout, to_f32_vec};
use crate::zero3::{chunk_of, chunk_shape};
use crate::{DeepSpeedError, Result};

impl<G: GradElem> ShardedSync<G> {
    /// This rank's pieces of the model's parameters, in buffer order.
    pub(super) fn read_own<M: Module>(&self, model: &M, out: &mut [f32]) {
        struct V<'a, G: GradElem> {
            sync: &'a ShardedSync<G>,
            out: &'a mut [f32],
            rank: usize,
        }
        impl<G: GradElem> ModuleVisitor for V<'_, G> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                let Some(at) = s.local_start[t] else {
                    return;
                };
                let own = s.plan().own(self.rank, t);
                let values = to_f32_vec(param.base());
                let src = if s.persistent_at[t].is_some() {
                    &values[own.clone()]
                } else {
                    &values[..own.len()]
                };
                self.out[at..at + own.len()].copy_from_slice(src);
            }
        }
        model.visit(&mut V {
            sync: self,
            out,
            rank: self.comm.rank(),
        });
    }

    /// The persistent tensors whole, from every rank's updated pieces (one all-gather).
    pub(super) fn gather_persistent(&self, params: &[f32]) -> Result<Vec<f32>> {
        if self.persistent.is_empty() {
            return Ok(Vec::new());
        }
        let plan = self.plan();
        let world = self.comm.world_size();
        let persistent: Vec<usize> = (0..plan.tensors().len())
            .filter(|&t| self.persistent_at[t].is_some())
            .collect();
        let counts: Vec<usize> = (0..world)
            .map(|r| persistent.iter().map(|&t| plan.own(r, t).len()).sum())
            .collect();
        let rank = self.comm.rank();
        let mut input = Vec::with_capacity(counts[rank]);
        for &t in &persistent {
            if let Some(at) = self.local_start[t] {
                input.extend_from_slice(&params[at..at + plan.own(rank, t).len()]);
            }
        }
        let mut out = vec![0.0f32; counts.iter().sum()];
        self.comm.all_gather(&input, &mut out, &counts)?;
        let mut whole = vec![0.0f32; self.persistent.len()];
        let mut at = 0;
        for r in 0..world {
            for &t in &persistent {
                let own = plan.own(r, t);
                let base = self.persistent_at[t].expect("persistent");
                whole[base + own.start..base + own.end].copy_from_slice(&out[at..at + own.len()]);
                at += own.len();
            }
        }
        Ok(whole)
    }

    /// Replaces the module's chunks by this rank's updated pieces (padding stays zero) and
    /// the persistent tensors by `whole`; records the new chunks for prefetching.
    pub(super) fn write_back<M: Module>(&self, model: M, params: &[f32], whole: Vec<f32>) -> M {
        let rank = self.comm.rank();
        let values = |t: usize, persistent: bool| match self.persistent_at[t] {
            Some(at) if persistent => whole[at..at + self.numel(t)].to_vec(),
            _ => {
                let own = self.plan().own(rank, t);
                let mut chunk = vec![0.0f32; self.plan().tensors()[t].chunk];
                if let Some(at) = self.local_start[t] {
                    chunk[..own.len()].copy_from_slice(&params[at..at + own.len()]);
                }
                chunk
            }
        };
        self.replace(model, values, false)
    }

    /// The averaged, clipped gradients as Burn gradients, ready for a caller's
    /// `ModuleOptimizer::step` on `model`'s stored values: a partitioned tensor gets its
    /// chunk's gradient (chunk shape, zero over the padding); a persistent tensor its whole
    /// gradient, the same on every rank (one all-gather of the persistent pieces).
    pub(super) fn chunk_gradients<M: Module>(&self, model: &M) -> Result<GradientsParams> {
        let grads = G::widen_all(&self.grads);
        let whole = self.gather_persistent(&grads)?;
        struct V<'a, G: GradElem> {
            sync: &'a ShardedSync<G>,
            grads: &'a [f32],
            whole: &'a [f32],
            device: Device,
            rank: usize,
            out: GradientsParams,
        }
        impl<G: GradElem> ModuleVisitor for V<'_, G> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.present[t] == 0 {
                    return;
                }
                let data = match s.persistent_at[t] {
                    Some(at) => TensorData::new(
                        self.whole[at..at + s.numel(t)].to_vec(),
                        s.layout.slots[t].shape.clone(),
                    ),
                    None => {
                        let chunk = s.plan().tensors()[t].chunk;
                        let mut values = vec![0.0f32; chunk];
                        if let Some(at) = s.local_start[t] {
                            let n = s.plan().own(self.rank, t).len();
                            values[..n].copy_from_slice(&self.grads[at..at + n]);
                        }
                        TensorData::new(values, chunk_shape(chunk, D))
                    }
                };
                self.out
                    .register::<D>(param.id, Tensor::from_data(data, &self.device));
            }
        }
        let mut v = V {
            sync: self,
            grads: &grads,
            whole: &whole,
            device: self.grad_device.clone().unwrap_or_default(),
            rank: self.comm.rank(),
            out: GradientsParams::new(),
        };
        model.visit(&mut v);
        Ok(v.out)
    }

    /// Records `model`'s current chunks for prefetching, after a caller stepped them.
    pub(super) fn track_shards<M: Module>(&self, model: &M) {
        struct V<'a, G: GradElem>(&'a ShardedSync<G>);
        impl<G: GradElem> ModuleVisitor for V<'_, G> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.0;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.persistent_at[t].is_none() {
                    let chunk = s.plan().tensors()[t].chunk;
                    s.group.set_shard(t, param.base().inner().reshape([chunk]));
                }
            }
        }
        model.visit(&mut V(self));
    }

    /// The whole parameters, flat in layout order (a collective: one all-gather per
    /// partitioned tensor).
    pub fn full_params<M: Module>(&self, model: &M) -> Result<Vec<f32>> {
        let mut chunks: Vec<Option<Vec<f32>>> = vec![None; self.layout.slots.len()];
        struct V<'a> {
            layout: &'a ParamLayout,
            chunks: &'a mut Vec<Option<Vec<f32>>>,
        }
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(t) = self.layout.slot_of(param.id) {
                    self.chunks[t] = Some(to_f32_vec(param.base()));
                }
            }
        }
        model.visit(&mut V {
            layout: &self.layout,
            chunks: &mut chunks,
        });
        let plan = self.plan();
        let mut flat = Vec::with_capacity(self.layout.numel);
        for (t, chunk) in chunks.into_iter().enumerate() {
            let chunk = chunk.ok_or_else(|| {
                DeepSpeedError::Data(format!("the model has no parameter {t} of the layout"))
            })?;
            let s = plan.tensors()[t];
            if s.persistent {
                flat.extend_from_slice(&chunk);
            } else {
                let mut out = vec![0.0f32; s.chunk * self.comm.world_size()];
                self.comm.all_gather_equal(&chunk, &mut out)?;
                flat.extend_from_slice(&out[..s.numel]);
            }
        }
        Ok(flat)
    }

    /// The whole parameters, flat in layout order, from every rank's pieces (`pieces`: this
    /// rank's, in buffer order; e.g. its fp32 masters). A collective: one all-gather of the
    /// persistent tensors, then one per partitioned tensor.
    pub(super) fn full_from_pieces(&self, pieces: &[f32]) -> Result<Vec<f32>> {
        let whole = self.gather_persistent(pieces)?;
        let (plan, rank) = (self.plan(), self.comm.rank());
        let mut flat = Vec::with_capacity(self.layout.numel);
        for (t, s) in plan.tensors().iter().enumerate() {
            match self.persistent_at[t] {
                Some(at) => flat.extend_from_slice(&whole[at..at + s.numel]),
                None => {
                    let mut chunk = vec![0.0f32; s.chunk];
                    if let Some(at) = self.local_start[t] {
                        let n = plan.own(rank, t).len();
                        chunk[..n].copy_from_slice(&pieces[at..at + n]);
                    }
                    let mut out = vec![0.0f32; s.chunk * self.comm.world_size()];
                    self.comm.all_gather_equal(&chunk, &mut out)?;
                    flat.extend_from_slice(&out[..s.numel]);
                }
            }
        }
        Ok(flat)
    }

    /// This rank's pieces (buffer order) cut from the whole flat parameters `flat`.
    pub(super) fn pieces_of(&self, flat: &[f32]) -> Vec<f32> {
        let mut pieces = vec![0.0f32; self.grads.len()];
        for s in &self.segments {
            pieces[s.local.clone()].copy_from_slice(&flat[s.global.clone()]);
        }
        pieces
    }

    /// `model` with whole parameters from `flat` (layout order) in place of its chunks; the
    /// group is released, so `Param::val()` passes them through. Not a collective.
    pub fn unshard<M: Module>(&self, model: M, flat: &[f32]) -> M {
        let whole = |t: usize, _| flat[self.offset(t)..self.offset(t) + self.numel(t)].to_vec();
        let model = self.replace(model, whole, true);
        self.group.release();
        model
    }

    /// `model` (sharded) with its chunks and persistent tensors cut from the whole flat
    /// parameters `flat` (layout order), e.g. from a checkpoint.
    pub fn load_flat<M: Module>(&self, model: M, flat: &[f32]) -> M {
        let rank = self.comm.rank();
        self.replace(
            model,
            |t, persistent| {
                let whole = &flat[self.offset(t)..self.offset(t) + self.numel(t)];
                if persistent {
                    whole.to_vec()
                } else {
                    chunk_of(whole, self.plan().tensors()[t].chunk, rank)
                }
            },
            false,
        )
    }

    fn offset(&self, t: usize) -> usize {
        self.layout.slots[t].offset
    }

    fn numel(&self, t: usize) -> usize {
        self.layout.slots[t].numel
    }

    /// Maps every parameter `t` to `values(t, persistent)`: whole shapes when `whole` (or
    /// persistent), chunk shapes otherwise.
    fn replace<M: Module>(
        &self,
        model: M,
        values: impl Fn(usize, bool) -> Vec<f32>,
        whole: bool,
    ) -> M {
        struct Mapper<'a, G: GradElem, F> {
            sync: &'a ShardedSync<G>,
            values: F,
            whole: bool,
        }
        impl<G: GradElem, F: Fn(usize, bool) -> Vec<f32>> ModuleMapper for Mapper<'_, G, F> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return param;
                };
                let shard = s.plan().tensors()[t];
                let (id, tensor, mapper) = param.consume();
                let device = tensor.device();
                let require_grad = tensor.is_require_grad();
                // The values are f32 (masters, or a checkpoint's); the module keeps its dtype.
                let dtype = tensor.dtype();
                let values = (self.values)(t, shard.persistent);
                let shape = if self.whole || shard.persistent {
                    s.layout.slots[t].shape.clone()
                } else {
                    let flat = Tensor::<1>::from_data(
                        TensorData::new(values.clone(), [shard.chunk]),
                        &device,
                    )
                    .cast(dtype);
                    s.group.set_shard(t, flat.inner());
                    chunk_shape(shard.chunk, D)
                };
                let new = Tensor::<D>::from_data(TensorData::new(values, shape), &device)
                    .cast(dtype)
                    .set_require_grad(require_grad);
                Param::from_mapped_value(id, new, mapper)
            }
        }
        model.map(&mut Mapper {
            sync: self,
            values,
            whole,
        })
    }
}
