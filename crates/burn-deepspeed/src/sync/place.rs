//! [`ModelPlace`]: what a regime needs of a [`Place`] beyond flat arithmetic — reading a
//! model's parameters and gradients into flat buffers, writing parameters back, the mean over
//! ranks, and the count of what crosses between host and device — for host memory and for
//! the model's device.

use std::borrow::Cow;
use std::ops::Range;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_deepspeed_strategies::bucket::bucket_ranges;
use burn_deepspeed_strategies::comm::{CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::place::{DevicePlace, HostPlace, Place};
use burn_deepspeed_strategies::zero::FlatPartition;

use super::device::{flat_grads, flat_params, write_back};
use super::elem::add_into;
use super::flat_optim::{DeviceFlatOptimizer, FlatOptimizer, HostFlatOptimizer};
use super::scale::{Scaling, all_reduce_mean, clip_factor};
use crate::Result;
use crate::flat::{
    ParamLayout, for_each_grad, params_from_flat, params_range, params_to_flat, to_f32_vec,
};
use crate::primitive::autodiff_like;
use crate::transfer;

/// A [`Place`] a regime can hold a model's flat state in. The algorithms of the regimes are
/// written once over it; [`HostPlace`] and [`DevicePlace`] implement it.
pub trait ModelPlace: Place + Sized + 'static {
    /// A flat buffer lent by reference (a gradient store's part): `[f32]` on the host.
    type Slice: ?Sized + ToOwned<Owned = Self::Buf>;

    /// The optimizer of a rank's slice here.
    type Optim: FlatOptimizer<Self>;

    /// Elements `range` of the model's parameters of `layout`, flat in layout order, in f32.
    fn params_range<M: Module>(
        &self,
        model: &M,
        layout: &ParamLayout,
        range: Range<usize>,
    ) -> Self::Buf;

    /// Every rank's slice `own` of `partition`, joined (in buckets of `bucket` elements where
    /// the place gathers in buckets, the host; 0: one). Collective.
    fn all_gather(
        &self,
        own: &Self::Buf,
        partition: &FlatPartition,
        bucket: usize,
    ) -> Result<Self::Buf>;

    /// The model's parameters of `layout`, flat in layout order, in f32.
    fn flat_params<M: Module>(&self, model: &M, layout: &ParamLayout) -> Self::Buf;

    /// `model` with the parameters of `layout` replaced by the flat f32 `flat` (rounded into a
    /// 16-bit parameter), each keeping its id and `require_grad` flag.
    fn write_back<M: Module>(&self, model: M, layout: &ParamLayout, flat: &Self::Buf) -> M;

    /// `acc` (zeros when `None`) plus one micro-batch's gradients of `model`, flat in `layout`
    /// order, marking in `present` the parameters that have one; and the bytes of the
    /// transient copies made on the way.
    fn accumulate<M: Module>(
        &self,
        acc: Option<Self::Buf>,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
    ) -> (Self::Buf, u64);

    /// The mean over ranks and micro-batches that `scaling` describes (`scaling.pre` before
    /// the sum, `scaling.post` after it), in buckets of `bucket` elements where the place
    /// reduces in buckets (the host; 0: one bucket). Collective.
    fn all_reduce_mean(&self, buf: Self::Buf, bucket: usize, scaling: Scaling)
    -> Result<Self::Buf>;

    /// The buffer's values in host memory, counted as a host/device copy.
    fn read(&self, buf: &Self::Buf) -> Vec<f32>;

    /// A lent buffer's values in host memory: the buffer itself on the host, a counted copy
    /// on a device.
    fn host_view<'a>(&self, buf: &'a Self::Slice) -> Cow<'a, [f32]>;

    /// Host values in this place, counted as a host/device copy.
    fn write(&self, values: Vec<f32>) -> Self::Buf;

    /// Runs `f`, counting what it moved between host and device memory (the collectives'
    /// staging, the scalars read) as collective staging. Nothing to count on the host.
    fn staged<T>(&self, f: impl FnOnce() -> T) -> T;

    /// Every rank's `own` joined in rank order, rank `r` giving `counts[r]` elements.
    /// Collective.
    fn all_gather_counts(&self, own: Self::Buf, counts: &[usize]) -> Result<Self::Buf>;

    /// A parameter's stored values (`tensor`, without autodiff) flat, in f32.
    fn param_flat<const D: usize>(&self, tensor: Tensor<D>) -> Self::Buf;

    /// The f32 `values` as a parameter of `shape` like `like`: its device, dtype (rounding
    /// into a 16-bit one), autodiff and `require_grad` flag.
    fn to_param<const D: usize>(
        &self,
        values: Self::Buf,
        shape: &[usize],
        like: &Tensor<D>,
    ) -> Tensor<D>;

    /// The f32 `values` as a gradient of `shape` on `device`.
    fn to_grad<const D: usize>(
        &self,
        values: Self::Buf,
        shape: &[usize],
        device: &Device,
    ) -> Tensor<D>;
}

/// `shape` as an array of rank `D`.
fn dims<const D: usize>(shape: &[usize]) -> [usize; D] {
    shape.try_into().expect("a shape of the tensor's rank")
}

impl ModelPlace for HostPlace {
    type Slice = [f32];
    type Optim = HostFlatOptimizer;

    fn params_range<M: Module>(
        &self,
        model: &M,
        layout: &ParamLayout,
        range: Range<usize>,
    ) -> Vec<f32> {
        params_range(model, layout, range)
    }

    fn all_gather(
        &self,
        own: &Vec<f32>,
        partition: &FlatPartition,
        bucket: usize,
    ) -> Result<Vec<f32>> {
        let comm = self.comm();
        let start = partition.range(comm.rank()).start;
        let mut flat = vec![0.0f32; partition.numel()];
        for range in bucket_ranges(partition.numel(), bucket) {
            let mine = partition.own_in(comm.rank(), &range);
            let counts = partition.counts_in(&range);
            let input = &own[mine.start - start..mine.end - start];
            let _span = tracing::debug_span!("all_gather_bucket", elems = range.len()).entered();
            comm.all_gather(input, &mut flat[range], &counts)?;
        }
        Ok(flat)
    }

    fn flat_params<M: Module>(&self, model: &M, layout: &ParamLayout) -> Vec<f32> {
        params_to_flat(model, layout)
    }

    fn write_back<M: Module>(&self, model: M, layout: &ParamLayout, flat: &Vec<f32>) -> M {
        params_from_flat(model, layout, flat)
    }

    fn accumulate<M: Module>(
        &self,
        acc: Option<Vec<f32>>,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
    ) -> (Vec<f32>, u64) {
        let mut flat = acc.unwrap_or_else(|| vec![0.0; layout.numel]);
        let bytes = for_each_grad(model, layout, grads, &mut None, |i, values| {
            if let Some(values) = values {
                let slot = &layout.slots[i];
                add_into(&mut flat[slot.offset..slot.offset + slot.numel], &values);
                present[i] = 1;
            }
        });
        (flat, bytes)
    }

    fn all_reduce_mean(
        &self,
        mut buf: Vec<f32>,
        bucket: usize,
        scaling: Scaling,
    ) -> Result<Vec<f32>> {
        all_reduce_mean(self.comm(), &mut buf, bucket, scaling)?;
        Ok(buf)
    }

    fn read(&self, buf: &Vec<f32>) -> Vec<f32> {
        buf.clone()
    }

    fn host_view<'a>(&self, buf: &'a [f32]) -> Cow<'a, [f32]> {
        Cow::Borrowed(buf)
    }

    fn write(&self, values: Vec<f32>) -> Vec<f32> {
        values
    }

    fn staged<T>(&self, f: impl FnOnce() -> T) -> T {
        f()
    }

    fn all_gather_counts(&self, own: Vec<f32>, counts: &[usize]) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; counts.iter().sum()];
        self.comm().all_gather(&own, &mut out, counts)?;
        Ok(out)
    }

    fn param_flat<const D: usize>(&self, tensor: Tensor<D>) -> Vec<f32> {
        to_f32_vec(tensor)
    }

    fn to_param<const D: usize>(
        &self,
        values: Vec<f32>,
        shape: &[usize],
        like: &Tensor<D>,
    ) -> Tensor<D> {
        let data = TensorData::new(values, dims::<D>(shape));
        transfer::write::<D>(data, &like.device(), like.dtype())
            .set_require_grad(like.is_require_grad())
    }

    fn to_grad<const D: usize>(
        &self,
        values: Vec<f32>,
        shape: &[usize],
        device: &Device,
    ) -> Tensor<D> {
        transfer::write_default(TensorData::new(values, dims::<D>(shape)), device)
    }
}

impl ModelPlace for DevicePlace {
    type Slice = Tensor<1>;
    type Optim = DeviceFlatOptimizer;

    fn params_range<M: Module>(
        &self,
        model: &M,
        _layout: &ParamLayout,
        range: Range<usize>,
    ) -> Tensor<1> {
        flat_params(model, self.device()).slice(range)
    }

    fn all_gather(
        &self,
        own: &Tensor<1>,
        partition: &FlatPartition,
        _bucket: usize,
    ) -> Result<Tensor<1>> {
        let counts = partition.sizes();
        Ok(self.staged(|| self.collectives().all_gather(own.clone(), &counts))?)
    }

    fn flat_params<M: Module>(&self, model: &M, _layout: &ParamLayout) -> Tensor<1> {
        flat_params(model, self.device())
    }

    fn write_back<M: Module>(&self, model: M, layout: &ParamLayout, flat: &Tensor<1>) -> M {
        write_back(model, layout, flat)
    }

    fn accumulate<M: Module>(
        &self,
        acc: Option<Tensor<1>>,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
    ) -> (Tensor<1>, u64) {
        let flat = flat_grads(model, layout, grads, self.device(), present);
        let flat = match acc {
            Some(acc) => acc + flat,
            None => flat,
        };
        (flat, 4 * layout.numel as u64)
    }

    fn all_reduce_mean(
        &self,
        buf: Tensor<1>,
        _bucket: usize,
        scaling: Scaling,
    ) -> Result<Tensor<1>> {
        let buf = self.scaled(buf, scaling.pre);
        let buf = self.staged(|| self.all_reduce(buf, ReduceOp::Sum))?;
        Ok(self.scaled(buf, scaling.post))
    }

    fn read(&self, buf: &Tensor<1>) -> Vec<f32> {
        transfer::read_f32(buf.clone())
    }

    fn host_view<'a>(&self, buf: &'a Tensor<1>) -> Cow<'a, [f32]> {
        Cow::Owned(transfer::read_f32(buf.clone()))
    }

    fn write(&self, values: Vec<f32>) -> Tensor<1> {
        let n = values.len();
        let data = TensorData::new(values, [n]);
        transfer::write::<1>(data, self.device(), DType::F32)
    }

    fn staged<T>(&self, f: impl FnOnce() -> T) -> T {
        let reads = self.host_reads();
        let out = transfer::staged_collective(self.collectives().as_ref(), self.device(), |_| f());
        let read = (self.host_reads() - reads) as usize;
        transfer::staging(|| transfer::count(self.device(), read));
        out
    }

    fn all_gather_counts(&self, own: Tensor<1>, counts: &[usize]) -> Result<Tensor<1>> {
        Ok(self.staged(|| self.collectives().all_gather(own, counts))?)
    }

    fn param_flat<const D: usize>(&self, tensor: Tensor<D>) -> Tensor<1> {
        let n = tensor.shape().num_elements();
        tensor.inner().reshape([n]).cast(DType::F32)
    }

    fn to_param<const D: usize>(
        &self,
        values: Tensor<1>,
        shape: &[usize],
        like: &Tensor<D>,
    ) -> Tensor<D> {
        let new = values.cast(like.dtype()).reshape(dims::<D>(shape));
        autodiff_like(new, like).set_require_grad(like.is_require_grad())
    }

    fn to_grad<const D: usize>(
        &self,
        values: Tensor<1>,
        shape: &[usize],
        _device: &Device,
    ) -> Tensor<D> {
        values.reshape(dims::<D>(shape))
    }
}

/// `buf`, whose norm (possibly over several ranks' buffers) is `norm`, scaled down to the norm
/// `clip` when clipping is on (`clip > 0`) and the finite norm exceeds it (DeepSpeed's
/// coefficient `clip / (norm + 1e-6)`).
pub fn clipped<P: Place>(place: &P, buf: P::Buf, norm: f64, clip: f64) -> P::Buf {
    match clip_factor(norm, clip) {
        Some(factor) => place.scaled(buf, factor),
        None => buf,
    }
}
