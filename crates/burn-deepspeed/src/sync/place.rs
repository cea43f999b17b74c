//! [`ModelPlace`]: what a regime needs of a [`Place`] beyond flat arithmetic — reading a
//! model's parameters and gradients into flat buffers, writing parameters back, the mean over
//! ranks, and the count of what crosses between host and device — for host memory and for
//! the model's device.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn_deepspeed_strategies::place::{DevicePlace, HostPlace, Place};

use super::device::{flat_grads, flat_params, write_back};
use super::elem::add_into;
use super::scale::{Scaling, all_reduce_mean};
use crate::Result;
use crate::flat::{ParamLayout, for_each_grad, params_from_flat, params_to_flat};
use crate::transfer;

/// A [`Place`] a regime can hold a model's flat state in. The algorithms of the regimes are
/// written once over it; [`HostPlace`] and [`DevicePlace`] implement it.
pub trait ModelPlace: Place + Sized + 'static {
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

    /// Host values in this place, counted as a host/device copy.
    fn write(&self, values: Vec<f32>) -> Self::Buf;

    /// Runs `f`, counting what it moved between host and device memory (the collectives'
    /// staging, the scalars read) as collective staging. Nothing to count on the host.
    fn staged<T>(&self, f: impl FnOnce() -> T) -> T;
}

impl ModelPlace for HostPlace {
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

    fn write(&self, values: Vec<f32>) -> Vec<f32> {
        values
    }

    fn staged<T>(&self, f: impl FnOnce() -> T) -> T {
        f()
    }
}

impl ModelPlace for DevicePlace {
    fn flat_params<M: Module>(&self, model: &M, _layout: &ParamLayout) -> burn::tensor::Tensor<1> {
        flat_params(model, self.device())
    }

    fn write_back<M: Module>(
        &self,
        model: M,
        layout: &ParamLayout,
        flat: &burn::tensor::Tensor<1>,
    ) -> M {
        write_back(model, layout, flat)
    }

    fn accumulate<M: Module>(
        &self,
        acc: Option<burn::tensor::Tensor<1>>,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
    ) -> (burn::tensor::Tensor<1>, u64) {
        let flat = flat_grads(model, layout, grads, self.device(), present);
        let flat = match acc {
            Some(acc) => acc + flat,
            None => flat,
        };
        (flat, 4 * layout.numel as u64)
    }

    fn all_reduce_mean(
        &self,
        buf: burn::tensor::Tensor<1>,
        _bucket: usize,
        scaling: Scaling,
    ) -> Result<burn::tensor::Tensor<1>> {
        let buf = self.scaled(buf, scaling.pre);
        let buf =
            self.staged(|| self.all_reduce(buf, burn_deepspeed_strategies::comm::ReduceOp::Sum))?;
        Ok(self.scaled(buf, scaling.post))
    }

    fn read(&self, buf: &burn::tensor::Tensor<1>) -> Vec<f32> {
        transfer::read_f32(buf.clone())
    }

    fn write(&self, values: Vec<f32>) -> burn::tensor::Tensor<1> {
        let n = values.len();
        let data = burn::tensor::TensorData::new(values, [n]);
        transfer::write::<1>(data, self.device(), burn::tensor::DType::F32)
    }

    fn staged<T>(&self, f: impl FnOnce() -> T) -> T {
        let reads = self.host_reads();
        let out = transfer::staged_collective(self.collectives().as_ref(), self.device(), |_| f());
        let read = (self.host_reads() - reads) as usize;
        transfer::staging(|| transfer::count(self.device(), read));
        out
    }
}

/// `buf`, whose norm (possibly over several ranks' buffers) is `norm`, scaled down to the norm
/// `clip` when clipping is on (`clip > 0`) and the finite norm exceeds it (DeepSpeed's
/// coefficient `clip / (norm + 1e-6)`).
pub fn clipped<P: Place>(place: &P, buf: P::Buf, norm: f64, clip: f64) -> P::Buf {
    let coef = clip / (norm + 1e-6);
    match clip > 0.0 && norm.is_finite() && coef < 1.0 {
        true => place.scaled(buf, coef as f32),
        false => buf,
    }
}
