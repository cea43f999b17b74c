//! The gather group's collectives on device buffers: with device collectives handed over by
//! a device-resident regime, the chunks are gathered and the gradients reduce-scattered on the
//! model's device.

use std::sync::Arc;

use burn::tensor::Tensor;
use burn_deepspeed_strategies::comm::ReduceOp;
use burn_deepspeed_strategies::device::DeviceCollectives;

use super::group::*;
use crate::transfer;

impl GatherGroup {
    /// From now on the op gathers and reduce-scatters the tensors of a Cube device (wgpu,
    /// CUDA) through `coll` on their own buffers ([`gather_on_device`](Self::gather_on_device)):
    /// NCCL moves them without leaving the GPU, the host collectives stage them as they must.
    /// Set once, by the device-resident regime.
    pub fn set_device_collectives(&self, coll: Arc<dyn DeviceCollectives>) {
        // A second call keeps the first collectives: a group has one transport.
        let _ = self.device.set(coll);
    }

    /// The device collectives, when the regime gathers on the device.
    pub fn device_collectives(&self) -> Option<&Arc<dyn DeviceCollectives>> {
        self.device.get()
    }

    /// [`gather`](Self::gather) on the device: tensor `t` whole (rank-1, `numel` elements)
    /// from this rank's `shard` (`chunk` elements), in the shard's dtype, through the device
    /// collectives. The same trace, prefetch bundles (one all-gather, the rest cached on the
    /// device) and counters as on the host.
    pub fn gather_on_device(&self, t: usize, shard: Tensor<1>, phase: Phase) -> Tensor<1> {
        let mut st = self.state();
        self.note_gather(&mut st, t, phase);
        if phase == Phase::Forward
            && let Some(values) = st.device_cache.remove(&t)
        {
            st.cache_elems -= values.dims()[0];
            return values;
        }
        let mut bundle = vec![t];
        if phase == Phase::Forward && !st.recording {
            self.plan_prefetch(&st, t, &mut bundle);
        }
        let dtype = shard.dtype();
        let mut shards = vec![shard];
        let mut fetched = vec![t];
        for &j in &bundle[1..] {
            if let Some(s) = st.shards.get(j).cloned().flatten() {
                fetched.push(j);
                shards.push(s.cast(dtype));
            }
        }
        let mut wholes = self.all_gather_on_device(&mut st, &fetched, shards);
        let first = wholes.remove(0);
        for (&j, values) in fetched[1..].iter().zip(wholes) {
            st.cache_elems += values.dims()[0];
            st.device_cache.insert(j, values);
        }
        let live = st.cache_elems + first.dims()[0];
        st.stats.peak_prefetched = st.stats.peak_prefetched.max(st.cache_elems);
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(live);
        first
    }

    /// One device all-gather of the chunks of `bundle` (`shards`, this rank's): each tensor
    /// whole, joined from every rank's chunk. A failed collective is kept (the world is
    /// aborted) and zeros come back.
    pub(super) fn all_gather_on_device(
        &self,
        st: &mut State,
        bundle: &[usize],
        shards: Vec<Tensor<1>>,
    ) -> Vec<Tensor<1>> {
        let coll = self
            .device
            .get()
            .expect("gathers on the device have collectives");
        let tensors = self.plan.tensors();
        let (rank, world) = (coll.rank(), coll.world_size());
        let per_rank: usize = bundle.iter().map(|&j| tensors[j].chunk).sum();
        let (device, dtype) = (shards[0].device(), shards[0].dtype());
        let zeros = |n: usize| Tensor::<1>::zeros([n], (&device, dtype));
        let input = Tensor::cat(shards, 0);
        let mut out = None;
        if st.error.is_none() {
            st.stats.all_gathers += 1;
            st.stats.on_device += 1;
            let _span =
                tracing::trace_span!("zero3_all_gather", elems = per_rank * world).entered();
            if coll.kind() == "host" {
                self.comm.label_next(label("gather", bundle));
            }
            let before = self.comm.stats().total_sent();
            let result = transfer::staged_collective(coll.as_ref(), &device, |c| {
                match self.fetch_by_all_reduce {
                    true => {
                        let padded = zeros(per_rank * world)
                            .slice_assign(rank * per_rank..(rank + 1) * per_rank, input);
                        c.all_reduce(padded, ReduceOp::Sum)
                    }
                    false => c.all_gather(input, &vec![per_rank; world]),
                }
            });
            st.stats.gather_bytes_sent += self.comm.stats().total_sent() - before;
            match result {
                Ok(o) => out = Some(o),
                Err(e) => self.fail(st, e),
            }
        }
        let out = out.unwrap_or_else(|| zeros(per_rank * world));
        let mut parts: Vec<Vec<Tensor<1>>> = vec![Vec::with_capacity(world); bundle.len()];
        for r in 0..world {
            let mut at = r * per_rank;
            for (k, &j) in bundle.iter().enumerate() {
                let c = tensors[j].chunk;
                parts[k].push(out.clone().slice(at..at + c));
                at += c;
            }
        }
        parts
            .into_iter()
            .zip(bundle)
            .map(|(p, &j)| Tensor::cat(p, 0).slice(0..tensors[j].numel))
            .collect()
    }

    /// [`reduce_scatter`](Self::reduce_scatter) on the device: this rank's chunk of the sum
    /// over ranks of tensor `t`'s whole gradient `grad` (rank-1), in its dtype.
    pub fn reduce_scatter_on_device(&self, t: usize, grad: Tensor<1>) -> Tensor<1> {
        let coll = self
            .device
            .get()
            .expect("gathers on the device have collectives");
        let mut st = self.state();
        self.end_forward(&mut st);
        st.stats.reduce_scatters += 1;
        let s = self.plan.tensors()[t];
        let world = coll.world_size();
        let (device, dtype) = (grad.device(), grad.dtype());
        let zeros = |n: usize| Tensor::<1>::zeros([n], (&device, dtype));
        let n = grad.dims()[0];
        let padded = match s.chunk * world > n {
            true => Tensor::cat(vec![grad, zeros(s.chunk * world - n)], 0),
            false => grad,
        };
        let padded = match self.pre {
            1.0 => padded,
            pre => padded.mul_scalar(pre),
        };
        st.stats.peak_live_elems = st.stats.peak_live_elems.max(s.chunk * (world + 1));
        if st.error.is_some() {
            return zeros(s.chunk);
        }
        st.stats.on_device += 1;
        let _span = tracing::trace_span!("zero3_reduce_scatter", elems = s.chunk * world).entered();
        if coll.kind() == "host" {
            self.comm.label_next(label("reduce", &[t]));
        }
        let result = transfer::staged_collective(coll.as_ref(), &device, |c| {
            c.reduce_scatter(padded, &vec![s.chunk; world])
        });
        match result {
            Ok(chunk) => chunk,
            Err(e) => {
                self.fail(&mut st, e);
                zeros(s.chunk)
            }
        }
    }
}
