//! [`DeviceGrads`]: a step's gradient as an f32 tensor on the model's device, flattened by
//! device ops and reduced through the device collectives (NCCL on CUDA; staged through the
//! host on wgpu, counted): all-reduced at stage 0, reduce-scattered at the end of the step at
//! stage 1 and at every micro-batch at stage 2, so that only this rank's slice stays.

use std::borrow::Cow;
use std::ops::Range;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};
use burn_deepspeed_strategies::comm::ReduceOp;
use burn_deepspeed_strategies::place::{DevicePlace, Place};

use super::ModelParallelNorm;
use super::device::flat_grads;
use super::grads::{Cut, GradStore, Part};
use super::place::ModelPlace;
use super::scale::Scaling;
use crate::flat::ParamLayout;
use crate::{DeepSpeedError, Result};

/// A rank's gradient on the model's device (see the module docs).
pub struct DeviceGrads {
    cut: Cut,
    own: Range<usize>,
    /// Every rank's slice length (stages 1-2).
    counts: Vec<usize>,
    numel: usize,
    /// Stage 2: the factor applied before each micro-batch's reduce-scatter.
    pre: f32,
    /// The accumulated gradient: whole at stages 0-1 until reduced; this rank's slice at
    /// stage 2 and after the reduction.
    grads: Option<Tensor<1>>,
    /// Tensor slicing: the 0/1 mask of what this rank counts in its part (`None`: all).
    mask: Option<Tensor<1>>,
    /// The dtype the accumulated gradient is held in (f16 under fp16).
    dtype: DType,
    device: Device,
}

impl DeviceGrads {
    /// The gradient of `part` (this rank's) on `place`'s device, accumulated in `dtype`; `pre`
    /// is the factor before a reduction (`1 / gradient_predivide_factor`, or 1).
    pub fn new(place: &DevicePlace, part: &Part, pre: f32, dtype: DType) -> Self {
        Self {
            dtype,
            cut: part.cut,
            own: part.own.clone(),
            counts: part.counts(),
            numel: part.partition.numel(),
            pre,
            grads: None,
            mask: None,
            device: place.device().clone(),
        }
    }
}

impl GradStore for DeviceGrads {
    type Place = DevicePlace;

    fn accumulate<M: Module>(
        &mut self,
        place: &DevicePlace,
        model: &M,
        layout: &ParamLayout,
        grads: &GradientsParams,
        present: &mut [u8],
        deferred: &mut Option<DeepSpeedError>,
    ) -> u64 {
        let flat = flat_grads(model, layout, grads, &self.device, present);
        // Stage 2 keeps only this rank's slice: each micro-batch is reduce-scattered here.
        let flat = match self.cut {
            Cut::Gradients => {
                let flat = place.scaled(flat, self.pre);
                let coll = place.collectives();
                match place.staged(|| coll.reduce_scatter(flat, &self.counts)) {
                    Ok(own) => own,
                    Err(e) => {
                        // Reported by the step's next fallible call.
                        deferred.get_or_insert(e.into());
                        place.zeros(self.own.len())
                    }
                }
            }
            _ => flat,
        };
        self.grads = Some(held(self.grads.take(), flat, self.dtype));
        4 * self.numel as u64
    }

    fn reduce(&mut self, place: &DevicePlace, scaling: Scaling) -> Result<()> {
        let streamed = self.cut == Cut::Gradients;
        let len = if streamed { self.own.len() } else { self.numel };
        let grads = (self.grads.take()).map_or_else(|| place.zeros(len), widened);
        let coll = place.collectives();
        let grads = match self.cut {
            Cut::Nothing => {
                let grads = place.scaled(grads, scaling.pre);
                place.staged(|| coll.all_reduce(grads, ReduceOp::Sum))?
            }
            Cut::OptimizerStates => {
                let grads = place.scaled(grads, scaling.pre);
                place.staged(|| coll.reduce_scatter(grads, &self.counts))?
            }
            // The factor was applied before each micro-batch's reduce-scatter.
            Cut::Gradients => grads,
        };
        self.grads = Some(place.scaled(grads, scaling.post));
        Ok(())
    }

    fn model_parallel(&mut self, _place: &DevicePlace, norm: &ModelParallelNorm) {
        self.mask = norm.mask(self.own.clone(), &self.device);
    }

    fn own_sq(&self, place: &DevicePlace, _slices: Option<&ModelParallelNorm>) -> Result<f64> {
        own_squares(place, &self.grads, &self.mask)
    }

    fn scale_own(&mut self, place: &DevicePlace, factor: f32) {
        self.grads = self.grads.take().map(|g| place.scaled(g, factor));
    }

    fn own(&self) -> Result<Cow<'_, Tensor<1>>> {
        own_part(&self.grads)
    }

    fn bytes(&self) -> u64 {
        self.grads.as_ref().map_or(0, buffer_bytes)
    }

    fn reset(&mut self) {
        self.grads = None;
    }

    fn device(&self) -> Option<Device> {
        Some(self.device.clone())
    }
}

fn before_reduce() -> DeepSpeedError {
    DeepSpeedError::Regime("the gradient was read before the reduction".into())
}

/// `acc` (none yet) plus `add` (f32), held in `dtype`: f32 as it is, a 16-bit dtype summed in
/// f32 and rounded once, as the host's buffers are.
pub(super) fn held(acc: Option<Tensor<1>>, add: Tensor<1>, dtype: DType) -> Tensor<1> {
    match (acc, dtype) {
        (None, DType::F32) => add,
        (Some(acc), DType::F32) => acc + add,
        (None, dtype) => add.cast(dtype),
        (Some(acc), dtype) => (acc.cast(DType::F32) + add).cast(dtype),
    }
}

/// A held gradient in f32, for its reduction.
pub(super) fn widened(grads: Tensor<1>) -> Tensor<1> {
    match grads.dtype() {
        DType::F32 => grads,
        _ => grads.cast(DType::F32),
    }
}

/// Bytes of a device buffer.
pub(super) fn buffer_bytes(buf: &Tensor<1>) -> u64 {
    (buf.dims()[0] * buf.dtype().size()) as u64
}

/// A device store's reduced part, read by the norm, the clip and the step.
pub(super) fn own_part(grads: &Option<Tensor<1>>) -> Result<Cow<'_, Tensor<1>>> {
    grads.as_ref().map(Cow::Borrowed).ok_or_else(before_reduce)
}

/// Σ g² of a device store's reduced part `grads`, of what `mask` counts (all when `None`):
/// one value read to the host, counted as collective staging.
pub(super) fn own_squares(
    place: &DevicePlace,
    grads: &Option<Tensor<1>>,
    mask: &Option<Tensor<1>>,
) -> Result<f64> {
    let grads = own_part(grads)?;
    let counted = match mask {
        Some(mask) => grads.into_owned() * mask.clone(),
        None => grads.into_owned(),
    };
    Ok(place.staged(|| place.squared_norm(&counted))?)
}
