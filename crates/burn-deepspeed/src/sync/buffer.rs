//! [`GradBuffer`]: a rank's whole gradient, accumulated in one flat buffer and averaged over
//! the data-parallel world by bucketed all-reduce. The replicated regimes and the pipeline
//! engine's stages keep their gradients in one.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};

use super::SyncOptions;
use super::elem::{GradElem, add_into};
use super::scale::{Scaling, all_reduce_mean};
use crate::flat::{ParamLayout, for_each_grad, grads_from_flat, params_from_flat, params_to_flat};
use crate::memory::vec_bytes;
use crate::{DeepSpeedError, Result};

/// Makes every rank's `module` (laid out as `layout`) equal to rank 0's.
pub fn broadcast_params<M: Module>(
    comm: &dyn Communicator,
    layout: &ParamLayout,
    module: M,
) -> Result<M> {
    if comm.world_size() == 1 {
        return Ok(module);
    }
    let mut flat = params_to_flat(&module, layout);
    comm.broadcast(&mut flat, 0)?;
    Ok(params_from_flat(module, layout, &flat))
}

/// Marks, on every rank, the tensors that had a gradient on any rank (one all-reduce). With
/// `refuse_unused`, a tensor that had none on any rank is an error naming it
/// (`zero_optimization.ignore_unused_parameters: false`).
pub fn merge_presence(
    comm: &dyn Communicator,
    present: &mut [u8],
    refuse_unused: Option<&ParamLayout>,
) -> Result<()> {
    if comm.world_size() > 1 {
        comm.all_reduce(present, ReduceOp::Max)?;
    }
    match (refuse_unused, present.iter().position(|&p| p == 0)) {
        (Some(layout), Some(i)) => Err(DeepSpeedError::Data(format!(
            "parameter {i} (shape {:?}) got no gradient on any rank and \
             zero_optimization.ignore_unused_parameters is false",
            layout.slots[i].shape
        ))),
        _ => Ok(()),
    }
}

/// A rank's flat gradient accumulation buffer (of [`GradElem`] `G`: f32, or f16 under fp16)
/// and its reduction over the world.
pub struct GradBuffer<G: GradElem = f32> {
    comm: Arc<dyn Communicator>,
    layout: ParamLayout,
    flat: Vec<G>,
    present: Vec<u8>,
    device: Option<Device>,
    micro_steps: u64,
    bucket_size: usize,
    predivide: Option<f32>,
}

impl<G: GradElem> GradBuffer<G> {
    /// A buffer for the parameters of `layout`, reduced over `comm` as `options` say.
    pub fn new(layout: ParamLayout, comm: Arc<dyn Communicator>, options: &SyncOptions) -> Self {
        Self {
            comm,
            flat: vec![G::default(); layout.numel],
            present: vec![0; layout.slots.len()],
            layout,
            device: None,
            micro_steps: 0,
            bucket_size: options.reduce_bucket,
            predivide: options.predivide,
        }
    }

    /// The parameter layout.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// The communicator the buffer is reduced over.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Micro-batches accumulated since the last reduction.
    pub fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    /// Per parameter slot, 1 when the parameter has had a gradient since the last
    /// [`clear_marks`](Self::clear_marks) (on any rank, once reduced), else 0.
    pub fn present(&self) -> &[u8] {
        &self.present
    }

    /// Bytes of the buffer's allocation.
    pub fn bytes(&self) -> u64 {
        vec_bytes(&self.flat)
    }

    /// Adds one micro-batch's gradients. Returns the bytes of the gradient tensors read.
    pub fn accumulate<M: Module>(&mut self, module: &M, grads: &GradientsParams) -> u64 {
        let (flat, present, layout) = (&mut self.flat, &mut self.present, &self.layout);
        let bytes = for_each_grad(module, layout, grads, &mut self.device, |i, values| {
            if let Some(values) = values {
                let slot = &layout.slots[i];
                add_into(&mut flat[slot.offset..slot.offset + slot.numel], &values);
                present[i] = 1;
            }
        });
        self.micro_steps += 1;
        bytes
    }

    /// Averages the accumulated gradient over ranks and micro-batches in place (bucketed
    /// all-reduce) and divides out `loss_scale`; a parameter counts as having a gradient when
    /// any rank produced one.
    pub fn average(&mut self, loss_scale: f32) -> Result<()> {
        merge_presence(self.comm.as_ref(), &mut self.present, None)?;
        let scaling = Scaling::mean(self.predivide, self.comm.world_size(), self.micro_steps)
            .unscaled(loss_scale);
        all_reduce_mean(
            self.comm.as_ref(),
            &mut self.flat,
            self.bucket_size,
            scaling,
        )
    }

    /// Zeroes the buffer and the micro-batch count.
    pub fn reset(&mut self) {
        self.flat.iter_mut().for_each(|g| *g = G::default());
        self.micro_steps = 0;
    }

    /// The flat gradient buffer (in [`layout`](Self::layout) order).
    pub fn flat_mut(&mut self) -> &mut [G] {
        &mut self.flat
    }

    /// The flat gradient buffer, read-only.
    pub fn flat(&self) -> &[G] {
        &self.flat
    }

    /// The buffer as [`GradientsParams`] of `module` (the parameters marked present); clears
    /// the buffer.
    pub fn take<M: Module>(&mut self, module: &M) -> GradientsParams {
        let device = self.device.clone().unwrap_or_default();
        let flat = G::widen_all(&self.flat);
        let grads = grads_from_flat(module, &self.layout, &flat, 0, &self.present, &device);
        self.reset();
        grads
    }

    /// Marks every parameter as having a gradient.
    pub fn mark_all_present(&mut self) {
        self.present.iter_mut().for_each(|p| *p = 1);
    }

    /// Clears the per-parameter gradient marks (after the optimizer has consumed them).
    pub fn clear_marks(&mut self) {
        self.present.iter_mut().for_each(|p| *p = 0);
    }

    /// Replaces the layout (the same tensors with other ids, after a checkpoint load).
    pub fn set_layout(&mut self, layout: ParamLayout) {
        self.layout = layout;
        self.reset();
        self.clear_marks();
    }
}
