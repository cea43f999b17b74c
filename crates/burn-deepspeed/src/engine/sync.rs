//! [`GradientSync`]: accumulates a rank's gradients in a flat buffer and averages them over the
//! data-parallel world (bucketed all-reduce), with global-norm clipping. Shared by the
//! engine and the Learner strategy.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};

use super::flat::{
    ParamLayout, accumulate_grads, grads_from_flat, params_from_flat, params_to_flat,
};
use super::reduce::{ReduceOptions, all_reduce_mean, clip_global_norm};
use crate::Result;
use crate::config::DeepSpeedConfig;

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

/// A rank's gradient accumulation buffer and its reduction over the world.
pub struct GradientSync {
    comm: Arc<dyn Communicator>,
    layout: ParamLayout,
    flat: Vec<f32>,
    present: Vec<u8>,
    device: Option<Device>,
    micro_steps: u64,
    bucket_size: usize,
    predivide: Option<f32>,
    clip: f64,
}

impl GradientSync {
    /// A buffer for `module`'s parameters, with the reduction settings of `config`.
    pub fn new<M: Module>(
        module: &M,
        config: &DeepSpeedConfig,
        comm: Arc<dyn Communicator>,
    ) -> Self {
        let layout = ParamLayout::of(module);
        Self {
            comm,
            flat: vec![0.0; layout.numel],
            present: vec![0; layout.slots.len()],
            layout,
            device: None,
            micro_steps: 0,
            bucket_size: config.zero_optimization.reduce_bucket_size as usize,
            predivide: config
                .prescale_gradients
                .then_some(config.gradient_predivide_factor as f32),
            clip: config.gradient_clipping,
        }
    }

    /// The parameter layout.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
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

    /// Makes every rank's `module` equal to rank 0's.
    pub fn broadcast_params<M: Module>(&self, module: M) -> Result<M> {
        broadcast_params(self.comm.as_ref(), &self.layout, module)
    }

    /// Adds one micro-batch's gradients.
    pub fn accumulate<M: Module>(&mut self, module: &M, grads: &GradientsParams) {
        accumulate_grads(
            module,
            &self.layout,
            grads,
            &mut self.flat,
            &mut self.present,
            &mut self.device,
        );
        self.micro_steps += 1;
    }

    /// Averages the accumulated gradient over ranks and micro-batches, clips it by global
    /// norm, returns it as [`GradientsParams`] with the norm before clipping, and clears the
    /// buffer.
    pub fn reduce<M: Module>(&mut self, module: &M) -> Result<(GradientsParams, f64)> {
        self.average()?;
        let norm = clip_global_norm(&mut self.flat, self.clip);
        Ok((self.take(module), norm))
    }

    /// Averages the accumulated gradient over ranks and micro-batches in place (bucketed
    /// all-reduce), without clipping. Follow with [`take`](Self::take).
    pub fn average(&mut self) -> Result<()> {
        if self.comm.world_size() > 1 {
            // A parameter gets a gradient when any rank produced one.
            self.comm.all_reduce(&mut self.present, ReduceOp::Max)?;
        }
        all_reduce_mean(
            self.comm.as_ref(),
            &mut self.flat,
            ReduceOptions {
                bucket_size: self.bucket_size,
                predivide_factor: self.predivide,
                gradient_accumulation_steps: self.micro_steps.max(1),
            },
        )
    }

    /// Averages the accumulated gradient over this rank's micro-batches only, with no
    /// communication (the 1-bit optimizers' compression stage). Follow with
    /// [`reset`](Self::reset).
    pub fn average_local(&mut self) {
        let scale = 1.0 / self.micro_steps.max(1) as f32;
        self.flat.iter_mut().for_each(|g| *g *= scale);
    }

    /// Zeroes the buffer and the micro-batch count, for callers that consumed
    /// [`flat_mut`](Self::flat_mut) themselves.
    pub fn reset(&mut self) {
        self.flat.iter_mut().for_each(|g| *g = 0.0);
        self.micro_steps = 0;
    }

    /// The flat gradient buffer (in [`layout`](Self::layout) order).
    pub fn flat_mut(&mut self) -> &mut [f32] {
        &mut self.flat
    }

    /// The configured clipping threshold (`gradient_clipping`; 0 disables it).
    pub fn clip_threshold(&self) -> f64 {
        self.clip
    }

    /// The buffer as [`GradientsParams`] of `module`; clears the buffer.
    pub fn take<M: Module>(&mut self, module: &M) -> GradientsParams {
        let device = self.device.clone().unwrap_or_default();
        let grads = grads_from_flat(module, &self.layout, &self.flat, 0, &self.present, &device);
        self.reset();
        grads
    }

    /// Clears the per-parameter gradient marks (after the optimizer has consumed them).
    pub fn clear_marks(&mut self) {
        self.present.iter_mut().for_each(|p| *p = 0);
    }
}
