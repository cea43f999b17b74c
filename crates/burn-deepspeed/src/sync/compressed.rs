//! [`CompressedSync`]: ZeRO stage 0 with a 1-bit optimizer (1-bit Adam, arXiv 2102.02888;
//! 1-bit LAMB, arXiv 2104.06069). During warm-up gradients are averaged by the usual bucketed
//! all-reduce; once the optimizer compresses, each rank keeps its own gradient (DeepSpeed's
//! `enable_backward_allreduce = False`) and the optimizer exchanges momenta through the
//! error-compensated 1-bit all-reduce.
//!
//! In mixed precision the optimizer steps whole fp32 masters (it steps flat buffers anyway),
//! and the model receives them rounded to its 16-bit dtype.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::FloatDType;
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::onebit::{OneBitOptimizer, OneBitPhase};

use super::buffer::GradBuffer;
use super::scale::clip_local;
use super::{GradSync, Reduced, SavedState, SyncOptions};
use crate::checkpoint::{Loaded, one_bit_state_bytes, one_bit_state_from_bytes};
use crate::config::OptimizerConfig;
use crate::flat::{ParamLayout, params_from_flat, params_to_flat, restore_params};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes, vec_bytes};
use crate::optim::build_one_bit;
use crate::precision::cast_module;
use crate::{DeepSpeedError, Result};

/// A rank's stage-0 state under a 1-bit optimizer, which steps the flat buffers.
pub struct CompressedSync {
    buffer: GradBuffer,
    clip: f64,
    optim: Box<dyn OneBitOptimizer>,
    /// What the optimizer was built from, to build it again for a checkpoint load.
    config: OptimizerConfig,
    meter: MemoryMeter,
    /// Mixed precision: the whole model's fp32 masters, which the optimizer steps.
    master: Option<Vec<f32>>,
}

impl CompressedSync {
    /// Stage 0 over `layout` on `comm` with the 1-bit optimizer `config` names (`None` when
    /// it names another optimizer).
    pub fn new(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        config: &OptimizerConfig,
    ) -> Result<Option<Self>> {
        let Some(optim) = build_one_bit(config, &layout, comm.world_size())? else {
            return Ok(None);
        };
        Ok(Some(Self {
            buffer: GradBuffer::new(layout, comm, options),
            clip: options.clip,
            optim,
            config: config.clone(),
            meter: MemoryMeter::default(),
            master: None,
        }))
    }
}

impl<M: Module> GradSync<M> for CompressedSync {
    fn layout(&self) -> &ParamLayout {
        self.buffer.layout()
    }

    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        let transient = self.buffer.accumulate(model, grads);
        let held = GradSync::<M>::held(self, model);
        self.meter.observe(held, transient);
    }

    fn micro_steps(&self) -> u64 {
        self.buffer.micro_steps()
    }

    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        let compressed = self.optim.compressing();
        if compressed {
            self.buffer.average_local(loss_scale);
        } else {
            self.buffer.average(loss_scale)?;
        }
        let norm = clip_local(self.buffer.flat_mut(), self.clip);
        Ok(Reduced::one_bit(norm, compressed))
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let layout = self.buffer.layout().clone();
        let mixed = self.master.is_some();
        let mut params = match self.master.take() {
            Some(master) => master,
            None => params_to_flat(&model, &layout),
        };
        let comm = self.buffer.comm().clone();
        let stepped = {
            let _span = tracing::debug_span!("optimizer_step").entered();
            self.optim
                .apply(comm.as_ref(), &mut params, self.buffer.flat_mut(), lr)
        };
        if let Err(e) = stepped {
            self.master = mixed.then_some(params);
            return Err(e.into());
        }
        let model = params_from_flat(model, &layout, &params);
        self.buffer.reset();
        self.buffer.clear_marks();
        let held = GradSync::<M>::held(self, &model);
        self.meter.observe(held, (4 * params.capacity()) as u64);
        self.master = mixed.then_some(params);
        Ok(model)
    }

    fn discard(&mut self) {
        self.buffer.reset();
        self.buffer.clear_marks();
    }

    fn reduced_gradients(&mut self, _model: &M) -> Result<GradientsParams> {
        Err(super::one_bit_has_no_gradients())
    }

    fn held(&self, model: &M) -> ModelStateBytes {
        ModelStateBytes {
            params: param_bytes(model),
            grads: self.buffer.bytes(),
            optimizer: self.optim.state_bytes() + self.master.as_ref().map_or(0, vec_bytes),
            offloaded: 0,
        }
    }

    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        self.master = Some(params_to_flat(&model, self.buffer.layout()));
        Ok(cast_module(model, dtype))
    }

    /// With masters, the fp32 values (the same on every rank), not the rounded copy.
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        Ok(wanted.then(|| match &self.master {
            Some(master) => master.clone(),
            None => params_to_flat(model, self.buffer.layout()),
        }))
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    fn save(&self, root: bool) -> Result<SavedState> {
        Ok(SavedState::Replicated(
            root.then(|| one_bit_state_bytes(&self.optim.export())),
        ))
    }

    fn load(&mut self, model: M, loaded: &Loaded) -> Result<M> {
        let state = one_bit_state_from_bytes(loaded.replicated_state()?)?;
        let model = restore_params(
            model,
            self.buffer.layout(),
            &loaded.meta.param_ids,
            &loaded.params,
        );
        let layout = ParamLayout::of(&model);
        let world = self.buffer.comm().world_size();
        let mut optim = build_one_bit(&self.config, &layout, world)?
            .ok_or_else(|| DeepSpeedError::Checkpoint("not a 1-bit optimizer".into()))?;
        optim.restore(state)?;
        self.buffer.set_layout(layout);
        self.optim = optim;
        if self.master.is_some() {
            self.master = Some(loaded.params.clone());
        }
        Ok(model)
    }

    fn one_bit(&self) -> Option<&dyn OneBitPhase> {
        Some(self.optim.as_ref() as &dyn OneBitPhase)
    }
}
