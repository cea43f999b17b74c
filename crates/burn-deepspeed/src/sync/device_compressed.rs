//! [`DeviceCompressedSync`]: ZeRO stage 0 with a 1-bit optimizer (1-bit Adam, arXiv
//! 2102.02888; 1-bit LAMB, arXiv 2104.06069) with every buffer on the model's device, the
//! device counterpart of [`CompressedSync`](super::CompressedSync).
//!
//! A micro-batch's gradients are flattened into a device buffer by device ops. During
//! warm-up the buffer is all-reduced through the [`DeviceCollectives`] (NCCL on CUDA); once
//! the optimizer compresses, each rank keeps its own gradient and the optimizer exchanges its
//! momenta through the device 1-bit all-reduce, whose packed signs move as u32 words on the
//! device. The flat fp32 parameters (the masters under mixed precision) are a device tensor
//! too, and the model's parameters are written back as slices of it. The host reads the
//! gradient norm's square and the two compression scales of each compressed step; nothing
//! else crosses, but what host-staged collectives move (wgpu).
//!
//! Checkpoints are [`CompressedSync`](super::CompressedSync)'s, so a run moves between the
//! host and a device.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use burn_deepspeed_strategies::comm::{Communicator, ReduceOp};
use burn_deepspeed_strategies::device::DeviceCollectives;
use burn_deepspeed_strategies::onebit::{DeviceOneBitOptimizer, OneBitPhase};

use super::device::{flat_grads, flat_params, write_back};
use super::device_step::{accumulated, clip_to, scaled, squared_norm, staged};
use super::scale::Scaling;
use super::{GradSync, Reduced, SavedState, SyncOptions};
use crate::checkpoint::{Loaded, one_bit_state_bytes, one_bit_state_from_bytes};
use crate::config::OptimizerConfig;
use crate::flat::{ParamLayout, restore_params};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes};
use crate::optim::build_device_one_bit;
use crate::precision::cast_module;
use crate::transfer;
use crate::{DeepSpeedError, Result};

/// A rank's stage-0 state under a 1-bit optimizer on the model's device.
pub struct DeviceCompressedSync {
    layout: ParamLayout,
    comm: Arc<dyn Communicator>,
    coll: Arc<dyn DeviceCollectives>,
    device: Device,
    clip: f64,
    predivide: Option<f32>,
    optim: Box<dyn DeviceOneBitOptimizer>,
    /// What the optimizer was built from, to build it again for a checkpoint load.
    config: OptimizerConfig,
    /// The accumulated gradient (f32, whole), from the first micro-batch of a step to `step`.
    grads: Option<Tensor<1>>,
    micro_steps: u64,
    present: Vec<u8>,
    /// The flat fp32 parameters, in layout order (the masters under mixed precision).
    params: Tensor<1>,
    mixed: bool,
    meter: MemoryMeter,
}

impl DeviceCompressedSync {
    /// Stage 0 of `model` (on `device`) over `coll` with the 1-bit optimizer `config` names
    /// (`None` when it names another optimizer).
    pub fn new<M: Module>(
        model: &M,
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        coll: Arc<dyn DeviceCollectives>,
        options: &SyncOptions,
        config: &OptimizerConfig,
        device: Device,
    ) -> Result<Option<Self>> {
        let device = device.inner();
        let Some(optim) = build_device_one_bit(config, &layout, coll.world_size(), &device)? else {
            return Ok(None);
        };
        Ok(Some(Self {
            params: flat_params(model, &device),
            present: vec![0; layout.slots.len()],
            layout,
            comm,
            coll,
            device,
            clip: options.clip,
            predivide: options.predivide,
            optim,
            config: config.clone(),
            grads: None,
            micro_steps: 0,
            mixed: false,
            meter: MemoryMeter::default(),
        }))
    }

    fn discard_state(&mut self) {
        self.grads = None;
        self.micro_steps = 0;
        self.present.iter_mut().for_each(|p| *p = 0);
    }

    fn state_bytes(&self) -> u64 {
        self.optim.state_bytes()
            + if self.mixed {
                4 * self.layout.numel as u64
            } else {
                0
            }
    }
}

impl<M: Module> GradSync<M> for DeviceCompressedSync {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        let flat = flat_grads(model, &self.layout, grads, &self.device, &mut self.present);
        self.grads = Some(accumulated(self.grads.take(), flat));
        self.micro_steps += 1;
        let held = GradSync::<M>::held(self, model);
        self.meter.observe(held, 4 * self.layout.numel as u64);
    }

    fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        let compressed = self.optim.compressing();
        let grads = self
            .grads
            .take()
            .unwrap_or_else(|| Tensor::zeros([self.layout.numel], &self.device));
        let grads = if compressed {
            // Each rank keeps its own gradient: the mean over its micro-batches.
            scaled(
                grads,
                Scaling::mean(None, 1, self.micro_steps)
                    .unscaled(loss_scale)
                    .post,
            )
        } else {
            let world = self.coll.world_size();
            let scaling =
                Scaling::mean(self.predivide, world, self.micro_steps).unscaled(loss_scale);
            let grads = scaled(grads, scaling.pre);
            let grads = match world {
                1 => grads,
                _ => staged(self.coll.as_ref(), &self.device, |c| {
                    c.all_reduce(grads, ReduceOp::Sum)
                })?,
            };
            scaled(grads, scaling.post)
        };
        let norm = squared_norm(&grads).sqrt();
        self.grads = Some(clip_to(grads, norm, self.clip));
        Ok(Reduced::one_bit(norm, compressed))
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let span = tracing::debug_span!("optimizer_step").entered();
        let grads = self
            .grads
            .take()
            .ok_or_else(|| DeepSpeedError::Regime("step before reduce".into()))?;
        let before = self.optim.host_bytes();
        let coll = self.coll.clone();
        let stepped = staged(coll.as_ref(), &self.device, |c| {
            self.optim
                .apply(c, self.comm.as_ref(), self.params.clone(), grads, lr)
        });
        // The compression scales, read by the host and all-gathered over it.
        let scales = (self.optim.host_bytes() - before) as usize;
        transfer::staging(|| transfer::count(&self.device, scales));
        let stepped = stepped.inspect_err(|_| self.discard_state())?;
        self.params = stepped;
        drop(span);
        self.present.iter_mut().for_each(|p| *p = 0);
        self.micro_steps = 0;
        let model = write_back(model, &self.layout, &self.params);
        let held = GradSync::<M>::held(self, &model);
        self.meter.observe(held, 0);
        Ok(model)
    }

    fn discard(&mut self) {
        self.discard_state();
    }

    fn reduced_gradients(&mut self, _model: &M) -> Result<GradientsParams> {
        Err(super::one_bit_has_no_gradients())
    }

    fn held(&self, model: &M) -> ModelStateBytes {
        ModelStateBytes {
            params: param_bytes(model),
            grads: self.grads.as_ref().map_or(0, |g| 4 * g.dims()[0] as u64),
            optimizer: self.state_bytes(),
            offloaded: 0,
        }
    }

    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        self.mixed = true;
        Ok(cast_module(model, dtype))
    }

    /// The fp32 parameters (the masters under mixed precision), the same on every rank.
    fn whole_params(&self, _model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        Ok(wanted.then(|| transfer::read_f32(self.params.clone())))
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    fn save(&self, root: bool) -> Result<SavedState> {
        let state = match root {
            true => Some(one_bit_state_bytes(&self.optim.export()?)),
            false => None,
        };
        Ok(SavedState::Replicated(state))
    }

    /// Everything fallible (reading and restoring the optimizer state) happens before the
    /// parameters are replaced.
    fn load(&mut self, model: M, loaded: &Loaded) -> Result<M> {
        let state = one_bit_state_from_bytes(loaded.replicated_state()?)?;
        let world = self.coll.world_size();
        let mut optim = build_device_one_bit(&self.config, &self.layout, world, &self.device)?
            .ok_or_else(|| DeepSpeedError::Checkpoint("not a 1-bit optimizer".into()))?;
        optim.restore(state)?;
        let model = restore_params(model, &self.layout, &loaded.meta.param_ids, &loaded.params);
        self.layout = ParamLayout::of(&model);
        self.optim = optim;
        let n = loaded.params.len();
        // The checkpoint's fp32 values, not the model's (rounded under mixed precision).
        self.params = transfer::write::<1>(
            TensorData::new(loaded.params.clone(), [n]),
            &self.device,
            DType::F32,
        );
        self.discard_state();
        Ok(model)
    }

    fn one_bit(&self) -> Option<&dyn OneBitPhase> {
        Some(self.optim.as_ref() as &dyn OneBitPhase)
    }
}
