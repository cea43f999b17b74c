//! ZeRO-Infinity at stage 3 (arXiv 2104.07857): [`ShardedSync`]'s optimizer state in a swap
//! file and its pieces in a parameter store, on the host. The regime itself is in
//! `sharded.rs`; this file holds what moves its bytes to disk and how a step writes them back.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::Module;
use burn_deepspeed_strategies::place::Place;

use super::grads::{GradStore, no_optimizer};
use super::{
    FlatOptimizer, GradElem, HostShards, ModelPlace, NvmeOffload, PieceReader, PieceWriter,
    ShardedSync,
};
use crate::zero3::{ParamStore, shard_module_to_store};
use crate::{DeepSpeedError, Result, agreed};

impl<G: GradElem> ShardedSync<HostShards<G>> {
    /// Moves the optimizer state of this rank's pieces, with their fp32 masters read from the
    /// sharded `model` (still in f32), to its swap file (ZeRO-Infinity). Collective: the
    /// ranks agree on every rank's outcome, so that a full disk on one fails them all.
    /// Under `offload_param` the masters are read from the parameter store tile by tile, so
    /// that the slice is never whole in memory.
    pub fn offload_optimizer<M: Module>(&mut self, model: &M, nvme: &NvmeOffload) -> Result<()> {
        let rank = self.place.rank();
        let kept = self.module_pieces(model);
        let masters = match &self.store {
            Some(_) => Vec::new(),
            None => self.read_pieces(model)?,
        };
        let (segments, params) = (&self.cut.segments, &self.store);
        let local = match self.optim.as_mut() {
            Some(optim) => nvme
                .store(rank, self.cut.own_len)
                .and_then(|swap| match params {
                    Some(params) => {
                        let mut reader = PieceReader::new(segments);
                        let optim = &mut optim.inner;
                        optim
                            .offload_with(swap, |r, out| {
                                reader.fill(r, out, |t| match params.holds(t) {
                                    true => params.read(t),
                                    false => Ok(kept[t].clone().unwrap_or_default()),
                                })
                            })
                            .map_err(DeepSpeedError::from)
                    }
                    None => (optim.inner.offload(swap, &masters)).map_err(DeepSpeedError::from),
                }),
            None => Err(DeepSpeedError::Data(
                "this stage-3 state has no optimizer to offload".into(),
            )),
        };
        agreed(self.place.comm(), "optimizer offload", local)
    }

    /// The length of each tensor's piece on this rank for a parameter store (`None` for the
    /// persistent tensors, which the module keeps whole).
    pub fn piece_lens(&self) -> Vec<Option<usize>> {
        let (plan, rank) = (self.plan(), self.cut.rank);
        (0..plan.tensors().len())
            .map(|t| (!plan.tensors()[t].persistent).then(|| plan.own(rank, t).len()))
            .collect()
    }

    /// Shards a whole `model` (as [`shard`](Self::shard)) into the parameter store `store`
    /// (ZeRO-Infinity's `offload_param`): this rank's pieces go to it one tensor at a time,
    /// and the module keeps empty placeholders. Collective: the ranks agree on creating the
    /// store and on writing it.
    pub fn shard_offloaded<M: Module>(&mut self, model: M, store: Result<ParamStore>) -> Result<M> {
        let store = Arc::new(agreed(self.place.comm(), "parameter offload", store)?);
        let (model, written) = shard_module_to_store(model, &self.group, &store);
        let written = written.map_err(DeepSpeedError::from);
        agreed(self.place.comm(), "parameter offload", written)?;
        self.group.offload_to(store.clone());
        self.grads.sum_in_group(store.clone());
        self.store = Some(store);
        Ok(model)
    }
}

impl<S: GradStore> ShardedSync<S> {
    /// The step under `offload_param`: the stepped pieces go to the store (from an offloaded
    /// optimizer, tile by tile as they are stepped, so that no buffer of the whole slice is
    /// made), and only the persistent tensors are gathered into the module.
    pub(super) fn step_into_store<M: Module>(
        &mut self,
        model: M,
        lr: f64,
        store: &ParamStore,
    ) -> Result<M> {
        store.forget_read_ahead();
        let mixed = self.master.is_some();
        // Without an offloaded optimizer, the step needs the slice's values in memory.
        let mut params = match (self.master.take(), self.offloaded()) {
            (Some(master), _) => Some(master),
            (None, true) => None,
            (None, false) => Some(self.read_pieces_agreed(&model)?),
        };
        let mut kept: HashMap<usize, Vec<f32>> = HashMap::new();
        let mut done = |t: usize, piece: &[f32]| match store.holds(t) {
            true => store.write(t, piece),
            false => {
                kept.insert(t, piece.to_vec());
                Ok(())
            }
        };
        let stepped = (|| {
            let _span = tracing::debug_span!("optimizer_step", rank = self.cut.rank).entered();
            let grads = self.grads.own()?;
            let mut writer = PieceWriter::new(&self.cut.segments);
            let (place, present) = (&self.place, &self.present);
            match (self.optim.as_mut(), params.as_mut()) {
                (Some(optim), None) => optim.step_tiles(&grads, present, lr, &mut |r, p| {
                    writer.push(r, p, &mut done)
                }),
                (Some(optim), Some(params)) => {
                    optim.step(place, params, &grads, present, lr)?;
                    let values = place.read(params);
                    Ok(writer.push(0..values.len(), &values, &mut done)?)
                }
                (None, _) => Err(no_optimizer()),
            }
        })();
        if mixed {
            self.master = params;
        }
        // A swap file can fail on one rank: all agree before the gather.
        agreed(self.place.comm(), "offloaded parameter step", stepped)?;
        let input: Vec<f32> = (self.cut.persistent())
            .filter(|&t| self.cut.local[t].is_some())
            .flat_map(|t| kept.remove(&t).unwrap_or_default())
            .collect();
        let whole = self.gather_persistent_input(self.place.write(input))?;
        let model = self.write_persistent(model, &whole);
        self.clear();
        Ok(model)
    }
}
