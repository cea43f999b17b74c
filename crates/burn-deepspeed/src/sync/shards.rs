//! How [`ShardedSync`] reads and rewrites a sharded module, in its place: this rank's pieces
//! in buffer order, the persistent tensors gathered whole, the chunks written back after a
//! step, the whole parameters gathered (or loaded from a checkpoint), and the chunk-shaped
//! gradients a caller's optimizer steps.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use burn_deepspeed_strategies::place::Place;

use super::grads::GradStore;
use super::{ModelPlace, ShardedSync};
use crate::zero3::chunk_shape;
use crate::{DeepSpeedError, Result, agreed};

/// A flat buffer of the place of store `S`.
type Buf<S> = <<S as GradStore>::Place as Place>::Buf;

impl<S: GradStore> ShardedSync<S> {
    /// The buffers joined in order (an empty buffer for none).
    fn join(&self, parts: Vec<Buf<S>>) -> Buf<S> {
        match parts.is_empty() {
            true => self.place.zeros(0),
            false => self.place.cat(parts),
        }
    }

    /// Per tensor, this rank's piece of the values the module stores (not the placeholders
    /// of a parameter store), in f32.
    pub(super) fn module_pieces<M: Module>(&self, model: &M) -> Vec<Option<Buf<S>>> {
        struct V<'a, S: GradStore> {
            sync: &'a ShardedSync<S>,
            pieces: Vec<Option<Buf<S>>>,
        }
        impl<S: GradStore> ModuleVisitor for V<'_, S> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.cut.local[t].is_none() || s.held_in_store(t) {
                    return;
                }
                let own = s.plan().own(s.cut.rank, t);
                let values = s.place.param_flat(param.base());
                let range = match s.cut.persistent_at[t] {
                    Some(_) => own,
                    None => 0..own.len(),
                };
                self.pieces[t] = Some(s.place.slice(&values, range));
            }
        }
        let mut v = V {
            sync: self,
            pieces: (0..self.layout.slots.len()).map(|_| None).collect(),
        };
        model.visit(&mut v);
        v.pieces
    }

    /// This rank's pieces of the model's parameters in buffer order, in f32: from the module,
    /// and under `offload_param` the partitioned ones from the store (a read that can fail).
    pub(super) fn read_pieces<M: Module>(&self, model: &M) -> Result<Buf<S>> {
        let mut pieces = self.module_pieces(model);
        let mut parts = Vec::with_capacity(self.cut.segments.len());
        for s in &self.cut.segments {
            let piece = match (pieces[s.tensor].take(), &self.store) {
                (Some(piece), _) => piece,
                (None, Some(store)) if store.holds(s.tensor) => {
                    self.place.write(store.read(s.tensor)?)
                }
                (None, _) => self.place.zeros(s.local.len()),
            };
            parts.push(piece);
        }
        Ok(self.join(parts))
    }

    /// [`read_pieces`](Self::read_pieces), agreed on by the ranks when it reads the store
    /// (every rank calls it).
    pub(super) fn read_pieces_agreed<M: Module>(&self, model: &M) -> Result<Buf<S>> {
        let read = self.read_pieces(model);
        match self.store {
            Some(_) => agreed(self.place.comm(), "read offloaded parameters", read),
            None => read,
        }
    }

    /// This rank's pieces (buffer order) cut from the whole flat parameters `flat`.
    pub(super) fn pieces_of(&self, flat: &[f32]) -> Vec<f32> {
        let mut pieces = vec![0.0f32; self.cut.own_len];
        for s in &self.cut.segments {
            pieces[s.local.clone()].copy_from_slice(&flat[s.global.clone()]);
        }
        pieces
    }

    /// Tensor `t`'s chunk (padded with zeros) from this rank's `pieces`.
    fn chunk_of(&self, pieces: &Buf<S>, t: usize) -> Buf<S> {
        let chunk = self.plan().tensors()[t].chunk;
        match &self.cut.local[t] {
            None => self.place.zeros(chunk),
            Some(r) => (self.place).pad(self.place.slice(pieces, r.clone()), chunk),
        }
    }

    /// The persistent tensors whole (per tensor; `None` for the partitioned ones), from every
    /// rank's pieces of them in its `pieces` (one all-gather).
    pub(super) fn gather_persistent(&self, pieces: &Buf<S>) -> Result<Vec<Option<Buf<S>>>> {
        let input = (self.cut.persistent())
            .filter_map(|t| (self.cut.local[t].clone()).map(|r| self.place.slice(pieces, r)))
            .collect();
        self.gather_persistent_input(self.join(input))
    }

    /// [`gather_persistent`](Self::gather_persistent) from this rank's persistent pieces back
    /// to back (`input`).
    pub(super) fn gather_persistent_input(&self, input: Buf<S>) -> Result<Vec<Option<Buf<S>>>> {
        let mut whole: Vec<Option<Buf<S>>> = (0..self.layout.slots.len()).map(|_| None).collect();
        if self.cut.persistent_len == 0 {
            return Ok(whole);
        }
        let counts = &self.cut.gather_counts;
        if self.place.len(&input) != counts[self.cut.rank] {
            return Err(DeepSpeedError::Data(format!(
                "{} elements of persistent pieces for {}",
                self.place.len(&input),
                counts[self.cut.rank]
            )));
        }
        let out = self.place.all_gather_counts(input, counts)?;
        for (t, ranges) in self.cut.persistent().zip(&self.cut.gather_parts) {
            let parts = ranges.iter().map(|r| self.place.slice(&out, r.clone()));
            whole[t] = Some(self.join(parts.collect()));
        }
        Ok(whole)
    }

    /// The whole parameters, flat in layout order, from every rank's `pieces` (buffer order;
    /// e.g. its fp32 masters). A collective: one all-gather of the persistent tensors, then
    /// one per partitioned tensor.
    pub(super) fn full_from_pieces(&self, pieces: &Buf<S>) -> Result<Buf<S>> {
        let mut flat = Vec::with_capacity(self.layout.slots.len());
        self.each_whole_tensor(pieces, |part| flat.push(part))?;
        Ok(self.join(flat))
    }

    /// Every tensor whole, in layout order, from every rank's `pieces`, handed to `each` one
    /// at a time (one all-gather per partitioned tensor, one for the persistent ones): at
    /// most one gathered tensor is held at a time beside the persistent ones.
    pub(super) fn each_whole_tensor(
        &self,
        pieces: &Buf<S>,
        mut each: impl FnMut(Buf<S>),
    ) -> Result<()> {
        let mut whole = self.gather_persistent(pieces)?;
        let world = self.place.world_size();
        for (t, persistent) in whole.iter_mut().enumerate() {
            let part = match persistent.take() {
                Some(p) => p,
                None => {
                    let s = self.plan().tensors()[t];
                    let chunk = self.chunk_of(pieces, t);
                    let all = self.place.all_gather_counts(chunk, &vec![s.chunk; world])?;
                    self.place.slice(&all, 0..s.numel)
                }
            };
            each(part);
        }
        Ok(())
    }

    /// Maps every parameter `t` to `values(t, persistent)`: whole shapes when `whole` (or
    /// persistent), chunk shapes otherwise, recording the new chunks for prefetching. The
    /// placeholders of a parameter store stay as they are unless `whole`, as do the tensors
    /// `values` has nothing for.
    fn write_module<M: Module>(
        &self,
        model: M,
        values: impl Fn(usize, bool) -> Option<Buf<S>>,
        whole: bool,
    ) -> M {
        struct Mapper<'a, S: GradStore, F> {
            sync: &'a ShardedSync<S>,
            values: F,
            whole: bool,
        }
        impl<S: GradStore, F: Fn(usize, bool) -> Option<Buf<S>>> ModuleMapper for Mapper<'_, S, F> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return param;
                };
                if s.held_in_store(t) && !self.whole {
                    return param;
                }
                let shard = s.plan().tensors()[t];
                let Some(values) = (self.values)(t, shard.persistent) else {
                    return param;
                };
                let (id, tensor, mapper) = param.consume();
                let chunked = !self.whole && !shard.persistent;
                let shape = match chunked {
                    true => chunk_shape(shard.chunk, D),
                    false => s.layout.slots[t].shape.clone(),
                };
                // The values are f32 (masters, or a checkpoint's); the module keeps its dtype.
                let new = s.place.to_param::<D>(values, &shape, &tensor);
                if chunked {
                    s.group
                        .set_shard(t, new.clone().inner().reshape([shard.chunk]));
                }
                Param::from_mapped_value(id, new, mapper)
            }
        }
        model.map(&mut Mapper {
            sync: self,
            values,
            whole,
        })
    }

    /// Replaces the module's chunks by this rank's updated `pieces` (padding stays zero) and
    /// the persistent tensors by `whole`.
    pub(super) fn write_back<M: Module>(
        &self,
        model: M,
        pieces: &Buf<S>,
        whole: &[Option<Buf<S>>],
    ) -> M {
        let values = |t: usize, persistent: bool| match persistent {
            true => whole[t].clone(),
            false => Some(self.chunk_of(pieces, t)),
        };
        self.write_module(model, values, false)
    }

    /// Replaces only the persistent tensors, by `whole` (under `offload_param`, where the
    /// pieces went to the store).
    pub(super) fn write_persistent<M: Module>(&self, model: M, whole: &[Option<Buf<S>>]) -> M {
        self.write_module(model, |t, _| whole[t].clone(), false)
    }

    /// `model` with whole parameters from `flat` (layout order) in place of its chunks; the
    /// group is released, so `Param::val()` passes them through. Not a collective.
    pub(super) fn unshard<M: Module>(&self, model: M, flat: &Buf<S>) -> M {
        let slots = &self.layout.slots;
        let whole = |t: usize, _| {
            let range = slots[t].offset..slots[t].offset + slots[t].numel;
            Some(self.place.slice(flat, range))
        };
        let model = self.write_module(model, whole, true);
        self.group.release();
        model
    }

    /// `model` (sharded) with its chunks and persistent tensors cut from the whole flat
    /// parameters `flat` (layout order), e.g. from a checkpoint. Under `offload_param` the
    /// pieces are written to the store (a write that can fail, on this rank alone).
    pub fn load_flat<M: Module>(&self, model: M, flat: &[f32]) -> Result<M> {
        let slots = &self.layout.slots;
        let persistent = (0..slots.len())
            .map(|t| {
                let range = slots[t].offset..slots[t].offset + slots[t].numel;
                self.cut.persistent_at[t].map(|_| flat[range].to_vec())
            })
            .collect();
        self.load_pieces(model, &self.pieces_of(flat), persistent)
    }

    /// [`load_flat`](Self::load_flat) from this rank's `pieces` of the parameters (in its
    /// buffer's order) and the `persistent` tensors whole (per tensor, `None` for the
    /// partitioned ones): what a load reads of a checkpoint, without the rest.
    pub fn load_pieces<M: Module>(
        &self,
        model: M,
        pieces: &[f32],
        persistent: Vec<Option<Vec<f32>>>,
    ) -> Result<M> {
        let slots = &self.layout.slots;
        if let Some(store) = &self.store {
            for t in (0..slots.len()).filter(|&t| store.holds(t)) {
                let own = self.cut.local[t].clone().unwrap_or(0..0);
                store.write(t, &pieces[own])?;
            }
        }
        let whole: Vec<_> = persistent
            .into_iter()
            .map(|p| p.map(|values| self.place.write(values)))
            .collect();
        let pieces = self.place.write(pieces.to_vec());
        Ok(self.write_back(model, &pieces, &whole))
    }

    /// The averaged, clipped gradients as Burn gradients, ready for a caller's
    /// `ModuleOptimizer::step` on `model`'s stored values: a partitioned tensor gets its
    /// chunk's gradient (chunk shape, zero over the padding); a persistent tensor its whole
    /// gradient, the same on every rank (one all-gather of the persistent pieces).
    pub(super) fn chunk_gradients<M: Module>(&self, model: &M) -> Result<GradientsParams> {
        let grads = self.grads.own()?.into_owned();
        let whole = self.gather_persistent(&grads)?;
        struct V<'a, S: GradStore> {
            sync: &'a ShardedSync<S>,
            grads: &'a Buf<S>,
            whole: &'a [Option<Buf<S>>],
            device: Device,
            out: GradientsParams,
        }
        impl<S: GradStore> ModuleVisitor for V<'_, S> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.sync;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.present[t] == 0 {
                    return;
                }
                let (values, shape) = match &self.whole[t] {
                    Some(whole) => (whole.clone(), s.layout.slots[t].shape.clone()),
                    None => {
                        let chunk = s.plan().tensors()[t].chunk;
                        (s.chunk_of(self.grads, t), chunk_shape(chunk, D))
                    }
                };
                let grad = s.place.to_grad::<D>(values, &shape, &self.device);
                self.out.register::<D>(param.id, grad);
            }
        }
        let mut v = V {
            sync: self,
            grads: &grads,
            whole: &whole,
            device: self.grads.device().unwrap_or_default(),
            out: GradientsParams::new(),
        };
        model.visit(&mut v);
        Ok(v.out)
    }

    /// Records `model`'s current chunks for prefetching, after a caller stepped them or the
    /// module was cast.
    pub(super) fn track_shards<M: Module>(&self, model: &M) {
        struct V<'a, S: GradStore>(&'a ShardedSync<S>);
        impl<S: GradStore> ModuleVisitor for V<'_, S> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let s = self.0;
                let Some(t) = s.layout.slot_of(param.id) else {
                    return;
                };
                if s.cut.persistent_at[t].is_none() && !s.held_in_store(t) {
                    let chunk = s.plan().tensors()[t].chunk;
                    s.group.set_shard(t, param.base().inner().reshape([chunk]));
                }
            }
        }
        model.visit(&mut V(self));
    }
}
