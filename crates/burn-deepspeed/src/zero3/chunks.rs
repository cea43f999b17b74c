//! [`Chunks`]: what a [`GatherGroup`] moves. The group's gather and reduce-scatter
//! ([`GatherGroup::gather`], [`GatherGroup::reduce_scatter`]: the trace, the prefetch bundles
//! and their cache, the counters, a failure kept for the step) are written once over it; each
//! kind brings its collectives and its prefetch cache:
//!
//! - host values (`Vec<f32>`): the communicator, the chunks travelling in the wire dtype, and
//!   under `offload_param` the pieces read from the parameter store;
//! - a rank-1 tensor of the model's device: the device collectives a device-resident regime
//!   handed over ([`GatherGroup::set_device_collectives`]), on the device's own buffers
//!   (NCCL on CUDA; staged through the host on wgpu).

use std::collections::HashMap;

use burn::tensor::{Tensor, TensorData};
use burn_deepspeed_strategies::comm::{CommunicatorExt, ReduceOp};

use super::group::{GatherGroup, State, label};
use super::wire::fetch_as_set;
use crate::transfer;

/// One kind of buffer the gather group gathers and reduce-scatters (see the module docs).
pub(crate) trait Chunks: Sized {
    /// Whether the group may all-gather the next bundle for this kind on its communication
    /// thread (`overlap_comm`), which moves host values through the communicator.
    fn gathers_ahead(group: &GatherGroup) -> bool;

    /// Elements.
    fn len(&self) -> usize;

    /// The prefetched tensors of this kind.
    fn cache(st: &mut State) -> &mut HashMap<usize, Self>;

    /// Tensor `t` whole from the prefetch cache, as `like` (its device and dtype), if there.
    fn cached(st: &mut State, t: usize, like: &Self) -> Option<Self>;

    /// This rank's chunk of tensor `t` as the gather sends it, given the module's `shard`.
    fn own(group: &GatherGroup, st: &mut State, t: usize, shard: Self) -> Self;

    /// Tensor `j`'s chunk for a prefetch bundle led by `like`; `None` when none is at hand.
    fn bundled(group: &GatherGroup, st: &mut State, j: usize, like: &Self) -> Option<Self>;

    /// One all-gather of the chunks of `bundle` (this rank's `shards`): each tensor whole. A
    /// failed collective is kept (the world is aborted) and zeros come back.
    fn all_gather(
        group: &GatherGroup,
        st: &mut State,
        bundle: &[usize],
        shards: Vec<Self>,
    ) -> Vec<Self>;

    /// Zeros up to `n` elements, then times `factor`.
    fn padded(self, n: usize, factor: f32) -> Self;

    /// This rank's `chunk` elements of the sum over ranks of tensor `t`'s `padded` gradient;
    /// zeros after a failure (kept, as for the gathers).
    fn reduce_scatter(
        group: &GatherGroup,
        st: &mut State,
        t: usize,
        padded: Self,
        chunk: usize,
    ) -> Self;

    /// Tensor `t` whole from the node's secondary slices (ZeRO++'s hpZ), where this kind keeps
    /// them and holds one for `t`.
    fn from_secondary(group: &GatherGroup, st: &mut State, t: usize) -> Option<Self> {
        let _ = (group, st, t);
        None
    }

    /// Keeps this rank's secondary slices of the gathered `wholes` of `fetched`, where this
    /// kind keeps them.
    fn keep_secondary(group: &GatherGroup, st: &mut State, fetched: &[usize], wholes: &[Self]) {
        let _ = (group, st, fetched, wholes);
    }

    /// What the op's backward gets for tensor `t`'s reduced `chunk`.
    fn keep(group: &GatherGroup, st: &mut State, t: usize, chunk: Self) -> Self {
        let _ = (group, st, t);
        chunk
    }
}

impl Chunks for Vec<f32> {
    fn gathers_ahead(_group: &GatherGroup) -> bool {
        true
    }

    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn cache(st: &mut State) -> &mut HashMap<usize, Self> {
        &mut st.cache
    }

    fn cached(st: &mut State, t: usize, _like: &Self) -> Option<Self> {
        st.cache.remove(&t)
    }

    /// Under `offload_param` the module's shard is an empty placeholder: the piece is read.
    fn own(group: &GatherGroup, st: &mut State, t: usize, shard: Self) -> Self {
        match st.offload.is_some() {
            true => group.read_piece(st, t),
            false => shard,
        }
    }

    /// A traced tensor without a registered shard (the same on every rank) is not
    /// prefetched; it is gathered when read.
    fn bundled(group: &GatherGroup, st: &mut State, j: usize, _like: &Self) -> Option<Self> {
        match st.offload.is_some() {
            true => Some(group.read_piece(st, j)),
            false => (st.shards.get(j).cloned().flatten()).map(transfer::read_f32),
        }
    }

    fn all_gather(
        group: &GatherGroup,
        st: &mut State,
        bundle: &[usize],
        shards: Vec<Self>,
    ) -> Vec<Self> {
        let tensors = group.plan.tensors();
        let world = group.comm.world_size();
        let per_rank: usize = bundle.iter().map(|&j| tensors[j].chunk).sum();
        let mut input = Vec::with_capacity(per_rank);
        for (&j, s) in bundle.iter().zip(&shards) {
            debug_assert_eq!(s.len(), tensors[j].chunk);
            input.extend_from_slice(s);
        }
        let mut out = vec![0.0f32; per_rank * world];
        if st.error.is_none() {
            st.stats.all_gathers += 1;
            let _span = tracing::trace_span!("zero3_all_gather", elems = out.len()).entered();
            group.comm.label_next(label("gather", bundle));
            let before = group.comm.stats().total_sent();
            let by_all_reduce = group.fetch_by_all_reduce;
            let result = fetch_as_set(
                group.comm.as_ref(),
                st.quantized,
                st.wire,
                by_all_reduce,
                &input,
                &mut out,
            );
            st.stats.gather_bytes_sent += group.comm.stats().total_sent() - before;
            if let Err(e) = result {
                group.fail(st, e);
                out.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        group.split_wholes(bundle, &out)
    }

    fn from_secondary(group: &GatherGroup, st: &mut State, t: usize) -> Option<Self> {
        let numel = group.plan.tensors()[t].numel;
        let (quantized, wire) = (st.quantized, st.wire);
        let gathered = st.secondary.as_ref()?.gather(t, numel, quantized, wire)?;
        st.stats.secondary_gathers += 1;
        match gathered {
            Ok((whole, sent)) => {
                st.stats.secondary_bytes_sent += sent;
                Some(whole)
            }
            Err(e) => {
                group.fail(st, e);
                Some(vec![0.0; numel])
            }
        }
    }

    fn keep_secondary(group: &GatherGroup, st: &mut State, fetched: &[usize], wholes: &[Self]) {
        let tensors = group.plan.tensors();
        let world = group.comm.world_size();
        if let Some(secondary) = st.secondary.as_mut() {
            for (&j, whole) in fetched.iter().zip(wholes) {
                secondary.keep(j, whole, tensors[j].chunk * world);
            }
        }
    }

    fn padded(mut self, n: usize, factor: f32) -> Self {
        self.resize(n, 0.0);
        if factor != 1.0 {
            self.iter_mut().for_each(|g| *g *= factor);
        }
        self
    }

    fn reduce_scatter(
        group: &GatherGroup,
        st: &mut State,
        t: usize,
        padded: Self,
        chunk: usize,
    ) -> Self {
        let mut out = vec![0.0f32; chunk];
        if st.error.is_none() {
            let _span =
                tracing::trace_span!("zero3_reduce_scatter", elems = padded.len()).entered();
            let reduced = match &st.hierarchy {
                Some(h) => h
                    .reduce_scatter(&padded, chunk)
                    .map(|(sum, (inside, across))| {
                        out = sum;
                        st.stats.quantized_reductions += 1;
                        st.stats.grad_bytes_in_node += inside;
                        st.stats.grad_bytes_across_nodes += across;
                    }),
                None => {
                    group.comm.label_next(label("reduce", &[t]));
                    (group.comm).reduce_scatter_equal(&padded, &mut out, ReduceOp::Sum)
                }
            };
            if let Err(e) = reduced {
                group.fail(st, e);
                out = vec![0.0; chunk];
            }
        }
        out
    }

    /// Under `offload_param` the chunk is summed into the rank's buffer and autodiff gets the
    /// placeholder's empty gradient; a 16-bit module's f32 sums are kept for the regime.
    fn keep(group: &GatherGroup, st: &mut State, t: usize, chunk: Self) -> Self {
        if let Some(o) = st.offload.as_mut() {
            if let Some(at) = o.local_start[t] {
                let n = group.plan.own(group.comm.rank(), t).len();
                (o.grads[at..at + n].iter_mut())
                    .zip(&chunk)
                    .for_each(|(s, g)| *s += g);
            }
            return Vec::new();
        }
        if st.wire.is_some() && st.keep_chunk_grads {
            match st.chunk_grads.get_mut(&t) {
                // A tensor read twice (tied weights) is reduce-scattered once per read.
                Some(sum) => sum.iter_mut().zip(&chunk).for_each(|(s, g)| *s += g),
                None => {
                    st.chunk_grads.insert(t, chunk.clone());
                }
            }
        }
        chunk
    }
}

impl Chunks for Tensor<1> {
    /// Where the device collectives stage through the host anyway (wgpu): the thread's host
    /// all-gather moves the same bytes. NCCL keeps its gathers on the device.
    fn gathers_ahead(group: &GatherGroup) -> bool {
        group
            .device_collectives()
            .is_some_and(|c| c.kind() == "host")
    }

    fn len(&self) -> usize {
        self.dims()[0]
    }

    fn cache(st: &mut State) -> &mut HashMap<usize, Self> {
        &mut st.device_cache
    }

    /// A tensor the communication thread gathered ahead is host values: written to the
    /// device as the staging of that all-gather.
    fn cached(st: &mut State, t: usize, like: &Self) -> Option<Self> {
        if let Some(whole) = st.device_cache.remove(&t) {
            return Some(whole);
        }
        let values = st.cache.remove(&t)?;
        let n = values.len();
        let data = TensorData::new(values, [n]);
        Some(transfer::staging(|| {
            transfer::write(data, &like.device(), like.dtype())
        }))
    }

    fn own(_group: &GatherGroup, _st: &mut State, _t: usize, shard: Self) -> Self {
        shard
    }

    fn bundled(_group: &GatherGroup, st: &mut State, j: usize, like: &Self) -> Option<Self> {
        let shard = st.shards.get(j).cloned().flatten()?;
        Some(shard.cast(like.dtype()))
    }

    fn all_gather(
        group: &GatherGroup,
        st: &mut State,
        bundle: &[usize],
        shards: Vec<Self>,
    ) -> Vec<Self> {
        let coll = group
            .device_collectives()
            .expect("device chunks have collectives");
        let tensors = group.plan.tensors();
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
                group.comm.label_next(label("gather", bundle));
            }
            let before = group.comm.stats().total_sent();
            let result = transfer::staged_collective(coll.as_ref(), &device, |c| {
                match group.fetch_by_all_reduce {
                    true => {
                        let padded = zeros(per_rank * world)
                            .slice_assign(rank * per_rank..(rank + 1) * per_rank, input);
                        c.all_reduce(padded, ReduceOp::Sum)
                    }
                    false => c.all_gather(input, &vec![per_rank; world]),
                }
            });
            st.stats.gather_bytes_sent += group.comm.stats().total_sent() - before;
            match result {
                Ok(o) => out = Some(o),
                Err(e) => group.fail(st, e),
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
        (parts.into_iter().zip(bundle))
            .map(|(p, &j)| Tensor::cat(p, 0).slice(0..tensors[j].numel))
            .collect()
    }

    fn padded(self, n: usize, factor: f32) -> Self {
        let len = self.dims()[0];
        let padded = match n > len {
            true => {
                let zeros = Tensor::<1>::zeros([n - len], (&self.device(), self.dtype()));
                Tensor::cat(vec![self, zeros], 0)
            }
            false => self,
        };
        match factor {
            1.0 => padded,
            factor => padded.mul_scalar(factor),
        }
    }

    fn reduce_scatter(
        group: &GatherGroup,
        st: &mut State,
        t: usize,
        padded: Self,
        chunk: usize,
    ) -> Self {
        let coll = group
            .device_collectives()
            .expect("device chunks have collectives");
        let (device, dtype) = (padded.device(), padded.dtype());
        let zeros = || Tensor::<1>::zeros([chunk], (&device, dtype));
        if st.error.is_some() {
            return zeros();
        }
        st.stats.on_device += 1;
        let elems = chunk * coll.world_size();
        let _span = tracing::trace_span!("zero3_reduce_scatter", elems).entered();
        if coll.kind() == "host" {
            group.comm.label_next(label("reduce", &[t]));
        }
        let counts = vec![chunk; coll.world_size()];
        let result = transfer::staged_collective(coll.as_ref(), &device, |c| {
            c.reduce_scatter(padded, &counts)
        });
        result.unwrap_or_else(|e| {
            group.fail(st, e);
            zeros()
        })
    }
}
