//! [`HostGrads`]: a step's gradient in host memory, as flat buffers of [`GradElem`] `G` (f32,
//! or f16 under fp16: the paper's 2Ψ).
//!
//! - **Stage 0** accumulates the whole gradient and all-reduces it in buckets of
//!   `reduce_bucket_size` elements.
//! - **Stage 1** accumulates the whole gradient; at the boundary the buffer is reduce-scattered
//!   bucket by bucket, and each rank keeps the mean of its own slice (in place in the buffer).
//! - **Stage 2** keeps only its slice: each micro-batch's gradients are streamed into a bucket
//!   and every full bucket is reduce-scattered straight away ([`super::bucket`]), on a
//!   communication thread under `overlap_comm` ([`Overlap`]).

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn_deepspeed_strategies::bucket::bucket_ranges;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::place::HostPlace;
use burn_deepspeed_strategies::zero::FlatPartition;

use super::bucket::{Bucket, Overlap};
use super::elem::{GradElem, add_into};
use super::grads::{Cut, GradStore, Part};
use super::scale::{Scaling, all_reduce_mean, scale, squared_sum};
use super::{ModelParallelNorm, SyncOptions};
use crate::flat::{ParamLayout, for_each_grad};
use crate::memory::vec_bytes;
use crate::{DeepSpeedError, Result};

/// A rank's gradient buffers in host memory (see the module docs).
pub struct HostGrads<G: GradElem = f32> {
    comm: Arc<dyn Communicator>,
    cut: Cut,
    partition: FlatPartition,
    own: Range<usize>,
    /// Stages 0-1: the whole accumulated gradient; stage 2: empty.
    full: Vec<G>,
    /// Stage 2: this rank's accumulated slice; stages 0-1: empty.
    slice: Vec<G>,
    reduce_bucket: usize,
    reduce_scatter: bool,
    pre: f32,
    device: Option<Device>,
    /// Stage 2 under `overlap_comm`: the communication thread that reduces the buckets.
    overlap: Option<Overlap<G>>,
}

impl<G: GradElem> HostGrads<G> {
    /// The buffers of `part` (this rank's, of `comm`), reduced as `options` say.
    pub fn new(comm: Arc<dyn Communicator>, part: &Part, options: &SyncOptions) -> Self {
        let Part {
            cut,
            partition,
            own,
        } = part.clone();
        let numel = partition.numel();
        let streams = cut == Cut::Gradients;
        Self {
            full: match streams {
                true => Vec::new(),
                false => vec![G::default(); numel],
            },
            slice: match streams {
                true => vec![G::default(); own.len()],
                false => Vec::new(),
            },
            comm,
            cut,
            partition,
            own,
            reduce_bucket: options.reduce_bucket,
            reduce_scatter: options.reduce_scatter,
            pre: options.pre_factor(),
            device: None,
            overlap: None,
        }
    }

    /// DeepSpeed's `overlap_comm` at stage 2: from now on each full bucket is reduced on a
    /// communication thread of this rank while the rank goes on; the reduced parts join the
    /// slice, in the same order as without it, at the next [`settle`](GradStore::settle).
    pub fn overlap_comm(&mut self) -> Result<()> {
        if self.cut != Cut::Gradients {
            return Err(DeepSpeedError::Unsupported {
                key: "zero_optimization.overlap_comm".into(),
                reason: "stage 1 reduces the gradient once, at the accumulation boundary; \
                         overlap_comm applies to stage 2"
                    .into(),
            });
        }
        if self.overlap.is_none() {
            self.overlap = Some(Overlap::spawn(self.comm.clone())?);
        }
        Ok(())
    }

    fn own_values(&self) -> &[G] {
        match self.cut {
            Cut::Gradients => &self.slice,
            _ => &self.full[self.own.clone()],
        }
    }

    fn own_values_mut(&mut self) -> &mut [G] {
        match self.cut {
            Cut::Gradients => &mut self.slice,
            _ => &mut self.full[self.own.clone()],
        }
    }

    /// Stage 1's reduce-scatter of the whole buffer, bucket by bucket.
    fn reduce_scatter_full(&mut self, scaling: Scaling) -> Result<()> {
        let comm = self.comm.clone();
        let mut tmp = Vec::new();
        for range in bucket_ranges(self.partition.numel(), self.reduce_bucket) {
            scaling.apply_pre(&mut self.full[range.clone()]);
            let mine = self.partition.own_in(comm.rank(), &range);
            tmp.resize(mine.len(), G::default());
            let counts = self.partition.counts_in(&range);
            let _span =
                tracing::debug_span!("reduce_scatter_bucket", elems = range.len()).entered();
            if self.reduce_scatter {
                comm.reduce_scatter(&self.full[range], &mut tmp, &counts, ReduceOp::Sum)?;
                self.full[mine].copy_from_slice(&tmp);
            } else {
                comm.all_reduce(&mut self.full[range], ReduceOp::Sum)?;
            }
        }
        Ok(())
    }
}

impl<G: GradElem> GradStore for HostGrads<G> {
    type Place = HostPlace;

    fn accumulate<M: Module>(
        &mut self,
        _place: &HostPlace,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
        deferred: &mut Option<DeepSpeedError>,
    ) -> u64 {
        if self.cut != Cut::Gradients {
            let full = &mut self.full;
            return for_each_grad(model, layout, grads, &mut self.device, |i, values| {
                if let Some(values) = values {
                    let s = &layout.slots[i];
                    add_into(&mut full[s.offset..s.offset + s.numel], &values);
                    present[i] = 1;
                }
            });
        }
        let cap = match self.reduce_bucket {
            0 => layout.numel,
            b => b.min(layout.numel),
        };
        let mut bucket = Bucket {
            comm: self.comm.as_ref(),
            partition: &self.partition,
            own_start: self.own.start,
            slice: &mut self.slice,
            buf: Vec::with_capacity(cap),
            reduce_scatter: self.reduce_scatter,
            cap,
            start: 0,
            pre: self.pre,
            error: deferred.take(),
            peak_elems: 0,
            overlap: self.overlap.as_mut(),
        };
        let tensors = for_each_grad(
            model,
            layout,
            grads,
            &mut self.device,
            |i, values| match values {
                Some(values) => {
                    present[i] = 1;
                    bucket.push(&values);
                }
                None => bucket.push_zeros(layout.slots[i].numel),
            },
        );
        bucket.flush();
        *deferred = bucket.error;
        tensors + (size_of::<G>() * bucket.peak_elems) as u64
    }

    fn settle(&mut self) -> Option<DeepSpeedError> {
        let overlap = self.overlap.as_mut()?;
        overlap.settle(&mut self.slice, self.own.start)
    }

    fn quiesce(&self) {
        if let Some(overlap) = &self.overlap {
            overlap.quiesce();
        }
    }

    fn reduce(&mut self, _place: &HostPlace, scaling: Scaling) -> Result<()> {
        match self.cut {
            Cut::Nothing => {
                let bucket = self.reduce_bucket;
                all_reduce_mean(self.comm.as_ref(), &mut self.full, bucket, scaling)?;
                return Ok(());
            }
            Cut::OptimizerStates => self.reduce_scatter_full(scaling)?,
            Cut::Gradients => {}
        }
        scaling.apply_post(self.own_values_mut());
        Ok(())
    }

    fn own_sq(&self, _place: &HostPlace, slices: Option<&ModelParallelNorm>) -> Result<f64> {
        let own = self.own_values();
        Ok(match slices {
            Some(slices) => slices.host_sq(own, self.own.start),
            None => squared_sum(own),
        })
    }

    fn scale_own(&mut self, _place: &HostPlace, factor: f32) {
        scale(self.own_values_mut(), factor);
    }

    fn own(&self) -> Result<Cow<'_, [f32]>> {
        Ok(G::widen_all(self.own_values()))
    }

    fn bytes(&self) -> u64 {
        vec_bytes(&self.full)
            + vec_bytes(&self.slice)
            + self.overlap.as_ref().map_or(0, Overlap::held_bytes)
    }

    fn reset(&mut self) {
        self.full.iter_mut().for_each(|g| *g = G::default());
        self.slice.iter_mut().for_each(|g| *g = G::default());
    }

    fn device(&self) -> Option<Device> {
        self.device.clone()
    }
}
