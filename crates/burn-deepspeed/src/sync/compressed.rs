//! [`CompressedSync`]: ZeRO stage 0 with a 1-bit optimizer (1-bit Adam, arXiv 2102.02888;
//! 1-bit LAMB, arXiv 2104.06069), in any [`ModelPlace`]: host memory, or every buffer on the
//! model's device. During warm-up gradients are averaged by the usual all-reduce (bucketed on
//! the host; through the device collectives, NCCL on CUDA, on a device); once the optimizer
//! compresses, each rank keeps its own gradient (DeepSpeed's `enable_backward_allreduce =
//! False`) and the optimizer exchanges momenta through the error-compensated 1-bit
//! all-reduce.
//!
//! The parameters are read flat from the model at each step and written back into it; in
//! mixed precision the optimizer steps fp32 masters kept in the place instead, and the model
//! receives them rounded to its 16-bit dtype. On a device the host reads the gradient norm's
//! square, the two compression scales of each compressed step and 1-bit LAMB's per-tensor
//! norms; nothing else crosses, but what host-staged collectives move (wgpu). Checkpoints are
//! the same in every place, so a run moves between the host and a device.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::FloatDType;
use burn_deepspeed_strategies::onebit::{OneBitOptimizer, OneBitPhase};

use super::place::{ModelPlace, clipped};
use super::scale::Scaling;
use super::{GradSync, Reduced, SavedState, StagedLoad, SyncOptions};
use crate::checkpoint::{Loaded, one_bit_state_bytes, one_bit_state_from_bytes};
use crate::config::OptimizerConfig;
use crate::flat::{ParamLayout, restore_params};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes};
use crate::optim::build_one_bit;
use crate::precision::cast_module;
use crate::{DeepSpeedError, Result};

/// A rank's stage-0 state under a 1-bit optimizer, which steps the flat buffers, in place `P`.
pub struct CompressedSync<P: ModelPlace> {
    place: P,
    layout: ParamLayout,
    clip: f64,
    predivide: Option<f32>,
    bucket: usize,
    optim: Box<dyn OneBitOptimizer<P>>,
    /// What the optimizer was built from, to build it again for a checkpoint load.
    config: OptimizerConfig,
    /// The accumulated gradient (f32, whole), from the first micro-batch of a step to `step`.
    grads: Option<P::Buf>,
    micro_steps: u64,
    present: Vec<u8>,
    /// Mixed precision: the whole model's fp32 masters, which the optimizer steps.
    master: Option<P::Buf>,
    meter: MemoryMeter,
}

impl<P: ModelPlace> CompressedSync<P> {
    /// Stage 0 over `layout` in `place` with the 1-bit optimizer `config` names (`None` when
    /// it names another optimizer).
    pub fn new(
        place: P,
        layout: ParamLayout,
        options: &SyncOptions,
        config: &OptimizerConfig,
    ) -> Result<Option<Self>> {
        let Some(optim) = build_one_bit(config, &layout, &place)? else {
            return Ok(None);
        };
        Ok(Some(Self {
            present: vec![0; layout.slots.len()],
            place,
            layout,
            clip: options.clip,
            predivide: options.predivide,
            bucket: options.reduce_bucket,
            optim,
            config: config.clone(),
            grads: None,
            micro_steps: 0,
            master: None,
            meter: MemoryMeter::default(),
        }))
    }

    fn discard_state(&mut self) {
        self.grads = None;
        self.micro_steps = 0;
        self.present.iter_mut().for_each(|p| *p = 0);
    }

    fn bytes(&self, buf: Option<&P::Buf>) -> u64 {
        buf.map_or(0, |b| 4 * self.place.len(b) as u64)
    }
}

impl<M: Module, P: ModelPlace> GradSync<M> for CompressedSync<P> {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        let acc = self.grads.take();
        let (flat, transient) =
            (self.place).accumulate(acc, model, &self.layout, grads, &mut self.present);
        self.grads = Some(flat);
        self.micro_steps += 1;
        let held = GradSync::<M>::held(self, model);
        self.meter.observe(held, transient);
    }

    fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        let place = &self.place;
        let compressed = self.optim.compressing();
        let grads = (self.grads.take()).unwrap_or_else(|| place.zeros(self.layout.numel));
        let grads = if compressed {
            // Each rank keeps its own gradient: the mean over its micro-batches.
            let local = Scaling::mean(None, 1, self.micro_steps).unscaled(loss_scale);
            place.scaled(grads, local.post)
        } else {
            let world = place.world_size();
            let scaling =
                Scaling::mean(self.predivide, world, self.micro_steps).unscaled(loss_scale);
            place.all_reduce_mean(grads, self.bucket, scaling)?
        };
        let norm = place.staged(|| place.squared_norm(&grads))?.sqrt();
        self.grads = Some(clipped(place, grads, norm, self.clip));
        Ok(Reduced::one_bit(norm, compressed))
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let span = tracing::debug_span!("optimizer_step").entered();
        let grads = (self.grads.take())
            .ok_or_else(|| DeepSpeedError::Regime("step before reduce".into()))?;
        // A step that fails leaves the masters as they were.
        let (params, transient) = match &self.master {
            Some(master) => (master.clone(), 0),
            None => (
                self.place.flat_params(&model, &self.layout),
                4 * self.layout.numel as u64,
            ),
        };
        let (place, optim) = (&self.place, &mut self.optim);
        let stepped = place.staged(|| optim.apply(place, params, grads, lr));
        let params = stepped.inspect_err(|_| self.discard_state())?;
        drop(span);
        self.present.iter_mut().for_each(|p| *p = 0);
        self.micro_steps = 0;
        let model = self.place.write_back(model, &self.layout, &params);
        if self.master.is_some() {
            self.master = Some(params);
        }
        let held = GradSync::<M>::held(self, &model);
        self.meter.observe(held, transient);
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
            grads: self.bytes(self.grads.as_ref()),
            optimizer: self.optim.state_bytes(&self.place) + self.bytes(self.master.as_ref()),
            offloaded: 0,
        }
    }

    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        self.master = Some(self.place.flat_params(&model, &self.layout));
        Ok(cast_module(model, dtype))
    }

    /// The fp32 parameters (the masters under mixed precision), the same on every rank.
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        Ok(wanted.then(|| match &self.master {
            Some(master) => self.place.read(master),
            None => self
                .place
                .read(&self.place.flat_params(model, &self.layout)),
        }))
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    fn save(&self, root: bool) -> Result<SavedState<'_>> {
        let state = match root {
            true => Some(one_bit_state_bytes(&self.optim.export(&self.place)?)),
            false => None,
        };
        Ok(SavedState::Replicated(state))
    }

    /// Everything fallible (reading and restoring the optimizer state) happens before the
    /// parameters are replaced.
    fn stage_load(&self, loaded: &Loaded) -> Result<StagedLoad> {
        let state = one_bit_state_from_bytes(&loaded.replicated_state()?)?;
        // Read now, so that the commit reads nothing.
        loaded.params()?;
        let mut optim = build_one_bit(&self.config, &self.layout, &self.place)?
            .ok_or_else(|| DeepSpeedError::Checkpoint("not a 1-bit optimizer".into()))?;
        optim.restore(&self.place, state)?;
        Ok(StagedLoad::OneBit(Box::new(optim)))
    }

    fn commit_load(&mut self, model: M, loaded: &Loaded, staged: StagedLoad) -> Result<M> {
        let StagedLoad::OneBit(optim) = staged else {
            return Err(StagedLoad::mismatch("a 1-bit optimizer's regime"));
        };
        let optim = optim
            .downcast::<Box<dyn OneBitOptimizer<P>>>()
            .map_err(|_| StagedLoad::mismatch("a 1-bit optimizer's regime"))?;
        let optim = *optim;
        let params = loaded.params()?;
        let model = restore_params(model, &self.layout, &loaded.meta.param_ids, params);
        self.layout = ParamLayout::of(&model);
        self.optim = optim;
        if self.master.is_some() {
            // The checkpoint's fp32 values, not the model's (rounded under mixed precision).
            self.master = Some(self.place.write(params.to_vec()));
        }
        self.discard_state();
        Ok(model)
    }

    fn one_bit(&self) -> Option<&dyn OneBitPhase> {
        Some(self.optim.as_ref() as &dyn OneBitPhase)
    }
}
