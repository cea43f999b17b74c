//! How [`ShardedSync`] reads and rewrites a sharded module: this rank's pieces in buffer
//! order, the chunks written back after a step, the whole parameters gathered (or loaded from
//! a checkpoint), and the chunk-shaped gradients a caller's optimizer steps.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_strategies::comm::CommunicatorExt;

use std::collections::HashMap;

use super::elem::GradElem;
use super::sharded::piece_of;
use super::{PieceReader, ShardedSync};
use crate::agreed;
use crate::flat::{ParamLayout, to_f32_vec};
use crate::transfer;
use crate::zero3::{chunk_of, chunk_shape};
use crate::{DeepSpeedError, Result};

impl<G: GradElem> ShardedSync<G> {
    /// Calls `f(t, piece)` with this rank's piece of every tensor the module stores values
    /// of (not the placeholders of a parameter store), in layout order.
    fn visit_module_pieces<M: Module>(&self, model: &M, f: impl FnMut(usize, &[f32])) {
        struct V<'a, G: GradElem, F> {
            sync: &'a ShardedSync<G>,
            f: F,
            rank: usize,
        }
        impl<G: GradElem, F: FnMut(usize, &[f32])> ModuleVisitor for V<'_, G, F> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.local_start[t].is_none() || s.held_in_store(t) {
                    return;
                }
                let own = s.plan().own(self.rank, t);
                let values = to_f32_vec(param.base());
                let src = if s.persistent_at[t].is_some() {
                    &values[own.clone()]
                } else {
                    &values[..own.len()]
                };
                (self.f)(t, src);
            }
        }
        model.visit(&mut V {
            sync: self,
            f,
            rank: self.comm.rank(),
        });
    }

    /// This rank's pieces of the persistent tensors, read from the module.
    pub(super) fn persistent_pieces<M: Module>(&self, model: &M) -> HashMap<usize, Vec<f32>> {
        let mut kept = HashMap::new();
        self.visit_module_pieces(model, |t, piece| {
            if self.persistent_at[t].is_some() {
                kept.insert(t, piece.to_vec());
            }
        });
        kept
    }

    /// This rank's pieces of the model's parameters, in buffer order: from the module, and
    /// under `offload_param` the partitioned ones from the store (a read that can fail).
    pub(super) fn read_own<M: Module>(&self, model: &M, out: &mut [f32]) -> Result<()> {
        match &self.store {
            None => {
                self.visit_module_pieces(model, |t, piece| {
                    let at = self.local_start[t].expect("visited pieces are this rank's");
                    out[at..at + piece.len()].copy_from_slice(piece);
                });
                Ok(())
            }
            Some(store) => {
                let kept = self.persistent_pieces(model);
                PieceReader::new(&self.segments)
                    .fill(0..out.len(), out, |t| piece_of(store, &kept, t))
                    .map_err(DeepSpeedError::from)
            }
        }
    }

    /// [`read_own`](Self::read_own), agreed on by the ranks when it reads the store (every
    /// rank calls it).
    pub(super) fn read_own_agreed<M: Module>(&self, model: &M, out: &mut [f32]) -> Result<()> {
        let read = self.read_own(model, out);
        match self.store {
            Some(_) => agreed(self.comm.as_ref(), "read offloaded parameters", read),
            None => read,
        }
    }

    /// This rank's pieces of the persistent tensors back to back (the input of
    /// [`gather_persistent_input`](Self::gather_persistent_input)), `piece(t)` giving each.
    pub(super) fn persistent_input<'p>(&self, piece: impl Fn(usize) -> &'p [f32]) -> Vec<f32> {
        let mut input = Vec::new();
        for t in 0..self.plan().tensors().len() {
            if self.persistent_at[t].is_some() && self.local_start[t].is_some() {
                input.extend_from_slice(piece(t));
            }
        }
        input
    }

    /// The persistent tensors whole, from every rank's updated pieces (one all-gather).
    pub(super) fn gather_persistent(&self, params: &[f32]) -> Result<Vec<f32>> {
        let rank = self.comm.rank();
        let input = self.persistent_input(|t| {
            let at = self.local_start[t].expect("persistent_input asks for own pieces");
            &params[at..at + self.plan().own(rank, t).len()]
        });
        self.gather_persistent_input(input)
    }

    /// The persistent tensors whole from every rank's pieces of them (this rank's in `input`,
    /// back to back; one all-gather).
    pub(super) fn gather_persistent_input(&self, input: Vec<f32>) -> Result<Vec<f32>> {
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
        if input.len() != counts[self.comm.rank()] {
            return Err(DeepSpeedError::Data(format!(
                "{} elements of persistent pieces for {}",
                input.len(),
                counts[self.comm.rank()]
            )));
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
                    .register::<D>(param.id, transfer::write_default(data, &self.device));
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
                if s.persistent_at[t].is_none() && !s.held_in_store(t) {
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
        if let Some(store) = &self.store {
            // The placeholders' chunks come from the store: a local read the ranks agree on
            // before the gathers.
            let read = (0..chunks.len())
                .filter(|&t| store.holds(t))
                .try_for_each(|t| {
                    chunks[t] = Some(store.read_chunk(t, plan.tensors()[t].chunk)?);
                    Ok(())
                });
            agreed(self.comm.as_ref(), "read offloaded parameters", read)?;
        }
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
        let mut pieces = vec![0.0f32; self.own_len];
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
    /// parameters `flat` (layout order), e.g. from a checkpoint. Under `offload_param` the
    /// pieces are written to the store (a write that can fail, on this rank alone).
    pub fn load_flat<M: Module>(&self, model: M, flat: &[f32]) -> Result<M> {
        let rank = self.comm.rank();
        if let Some(store) = &self.store {
            for t in (0..self.layout.slots.len()).filter(|&t| store.holds(t)) {
                let own = self.plan().own(rank, t);
                let at = self.offset(t);
                store.write(t, &flat[at + own.start..at + own.end])?;
            }
        }
        Ok(self.replace(
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
        ))
    }

    fn offset(&self, t: usize) -> usize {
        self.layout.slots[t].offset
    }

    fn numel(&self, t: usize) -> usize {
        self.layout.slots[t].numel
    }

    /// Maps every parameter `t` to `values(t, persistent)`: whole shapes when `whole` (or
    /// persistent), chunk shapes otherwise. The placeholders of a parameter store stay as they
    /// are unless `whole`.
    pub(super) fn replace<M: Module>(
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
                if s.held_in_store(t) && !self.whole {
                    return param;
                }
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
                    let flat = transfer::write::<1>(
                        TensorData::new(values.clone(), [shard.chunk]),
                        &device,
                        dtype,
                    );
                    s.group.set_shard(t, flat.inner());
                    chunk_shape(shard.chunk, D)
                };
                let new = transfer::write::<D>(TensorData::new(values, shape), &device, dtype)
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
