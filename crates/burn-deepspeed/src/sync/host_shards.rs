//! [`HostShards`]: a stage-3 step's gradient in host memory (f32, or f16 under fp16): the
//! gradient of this rank's pieces, which the gathers' backward reduce-scattered already, and
//! the persistent tensors' whole gradients, all-reduced at the boundary. Under
//! `offload_param` the gather group sums the chunk gradients of the stored tensors itself.

use std::borrow::Cow;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn_deepspeed_strategies::comm::{CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::place::{HostPlace, Place};

use super::elem::{GradElem, add_into};
use super::grads::GradStore;
use super::scale::{Scaling, scale, squared_sum};
use super::{ModelParallelNorm, ShardCut};
use crate::flat::{ParamLayout, for_each_grad};
use crate::memory::vec_bytes;
use crate::zero3::{GatherGroup, ParamStore};
use crate::{DeepSpeedError, Result};

/// A rank's stage-3 gradient in host memory (see the module docs).
pub struct HostShards<G: GradElem> {
    group: Arc<GatherGroup>,
    cut: ShardCut,
    /// The gradient of this rank's pieces (buffer order). Under `offload_param` the group
    /// sums the chunk gradients, and this holds them only from the reduction to the reset.
    grads: Vec<G>,
    /// The persistent tensors' whole gradients, back to back.
    persistent: Vec<G>,
    /// `offload_param`: the store whose tensors' chunk gradients the group sums.
    store: Option<Arc<ParamStore>>,
    device: Option<Device>,
}

impl<G: GradElem> HostShards<G> {
    /// The gradient of `cut`'s pieces, reduce-scattered by `group`.
    pub fn new(group: Arc<GatherGroup>, cut: ShardCut) -> Self {
        Self {
            grads: vec![G::default(); cut.own_len],
            persistent: vec![G::default(); cut.persistent_len],
            group,
            cut,
            store: None,
            device: None,
        }
    }

    /// From now on the chunk gradients of `store`'s tensors are summed by the group.
    pub fn sum_in_group(&mut self, store: Arc<ParamStore>) {
        self.store = Some(store);
    }
}

impl<G: GradElem> GradStore for HostShards<G> {
    type Place = HostPlace;

    /// Adds the chunk gradients (the f32 sums of a 16-bit module's reduce-scatters, where the
    /// group kept them) and the persistent tensors' whole gradients.
    fn accumulate<M: Module>(
        &mut self,
        _place: &HostPlace,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
        _deferred: &mut Option<DeepSpeedError>,
    ) -> u64 {
        let (group, cut, store) = (&self.group, &self.cut, self.store.as_deref());
        let (persistent, own) = (&mut self.persistent, &mut self.grads);
        let tensors = for_each_grad(model, layout, grads, &mut self.device, |t, values| {
            let Some(values) = values else {
                return;
            };
            present[t] = 1;
            // Under `offload_param` the group summed the chunk gradient already.
            if store.is_some_and(|s| s.holds(t)) {
                return;
            }
            match (cut.persistent_at[t], &cut.local[t]) {
                (Some(at), _) => add_into(&mut persistent[at..at + values.len()], &values),
                (None, local) => {
                    // A 16-bit module's chunk gradient, unrounded.
                    let values = group.take_chunk_grad(t).unwrap_or(values);
                    if let Some(r) = local {
                        add_into(&mut own[r.clone()], &values);
                    }
                }
            }
        });
        // Beyond the store: the micro-batch's gradient tensors, and what the gathers
        // allocated at once (gathered weights and the prefetch cache).
        tensors + 4 * group.stats().peak_live_elems as u64
    }

    /// All-reduces the persistent tensors' gradients and copies this rank's pieces of them
    /// into its buffer; the mean that `scaling` describes.
    fn reduce(&mut self, place: &HostPlace, scaling: Scaling) -> Result<()> {
        if self.store.is_some() {
            let summed = self.group.exchange_offloaded_grads(Vec::new());
            self.grads = G::from_f32_vec(summed);
        }
        let comm = place.comm();
        if !self.persistent.is_empty() {
            scaling.apply_pre(&mut self.persistent);
            if comm.world_size() > 1 {
                let _span = tracing::debug_span!("zero3_persistent_all_reduce").entered();
                comm.all_reduce(&mut self.persistent, ReduceOp::Sum)?;
            }
            let (plan, cut) = (self.group.plan(), &self.cut);
            for t in cut.persistent() {
                if let (Some(at), Some(r)) = (cut.persistent_at[t], &cut.local[t]) {
                    let own = plan.own(cut.rank, t);
                    self.grads[r.clone()]
                        .copy_from_slice(&self.persistent[at + own.start..at + own.end]);
                }
            }
        }
        scaling.apply_post(&mut self.grads);
        Ok(())
    }

    fn own_sq(&self, _place: &HostPlace, slices: Option<&ModelParallelNorm>) -> Result<f64> {
        Ok(match slices {
            Some(slices) => slices.host_sq_windows(&self.grads, self.cut.windows()),
            None => squared_sum(&self.grads),
        })
    }

    fn scale_own(&mut self, _place: &HostPlace, factor: f32) {
        scale(&mut self.grads, factor);
    }

    fn own(&self) -> Result<Cow<'_, [f32]>> {
        Ok(G::widen_all(&self.grads))
    }

    fn bytes(&self) -> u64 {
        vec_bytes(&self.grads) + vec_bytes(&self.persistent) + self.group.offloaded_grad_bytes()
    }

    fn reset(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = G::default());
        self.persistent.iter_mut().for_each(|g| *g = G::default());
        if self.store.is_some() {
            // The zeroed buffer goes back to the group, which sums the next chunk gradients.
            match self.grads.is_empty() {
                true => self.group.zero_offloaded_grads(),
                false => {
                    let grads = G::into_f32_vec(std::mem::take(&mut self.grads));
                    self.group.exchange_offloaded_grads(grads);
                }
            }
        }
    }

    fn device(&self) -> Option<Device> {
        self.device.clone()
    }
}
