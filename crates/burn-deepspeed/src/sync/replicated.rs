//! [`ReplicatedSync`]: ZeRO stage 0. Every rank holds the whole model, its whole gradient and
//! its whole optimizer state; gradients are averaged by bucketed all-reduce, clipped by their
//! global norm, and every rank takes the same step with one of Burn's optimizers.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Bytes;
use burn_deepspeed_strategies::comm::Communicator;

use super::buffer::GradBuffer;
use super::scale::clip_local;
use super::{GradSync, Reduced, SavedState, SyncOptions};
use crate::engine::checkpoint::Loaded;
use crate::engine::flat::{ParamLayout, restore_params};
use crate::engine::memory::{
    MemoryMeter, ModelStateBytes, burn_optimizer_bytes, grads_bytes, param_bytes,
};
use crate::{DeepSpeedError, Result};

/// A rank's stage-0 state: the gradient buffer and, when the engine steps, Burn's optimizer.
pub struct ReplicatedSync {
    buffer: GradBuffer,
    clip: f64,
    /// `None` when the caller steps with its own optimizer (the Learner strategy).
    optim: Option<ModuleOptimizer>,
    /// The optimizer as built, before any step: what a checkpoint load starts from.
    fresh: Option<ModuleOptimizer>,
    /// Slots the optimizer has stepped (and so keeps state for).
    stepped: Vec<bool>,
    /// Measured bytes of the optimizer's state tensors (re-read when `stepped` grows).
    optim_bytes: u64,
    meter: MemoryMeter,
}

impl ReplicatedSync {
    /// Stage 0 over `layout` on `comm`, stepping with `optim` (`None`: the caller steps with
    /// [`GradSync::reduced_gradients`]).
    pub fn new(
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        options: &SyncOptions,
        optim: Option<ModuleOptimizer>,
    ) -> Self {
        Self {
            stepped: vec![false; layout.slots.len()],
            buffer: GradBuffer::new(layout, comm, options),
            clip: options.clip,
            fresh: optim.clone(),
            optim,
            optim_bytes: 0,
            meter: MemoryMeter::default(),
        }
    }

    /// Re-reads the optimizer's state size when a parameter got state for the first time.
    fn track_optimizer_state(&mut self) {
        let mut grew = false;
        for (s, &p) in self.stepped.iter_mut().zip(self.buffer.present()) {
            if p != 0 && !*s {
                *s = true;
                grew = true;
            }
        }
        if grew && let Some(optim) = &self.optim {
            self.optim_bytes = burn_optimizer_bytes(optim);
        }
    }
}

impl<M: Module> GradSync<M> for ReplicatedSync {
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

    fn reduce(&mut self) -> Result<Reduced> {
        self.buffer.average()?;
        Ok(Reduced::global(clip_local(
            self.buffer.flat_mut(),
            self.clip,
        )))
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let grads = self.buffer.take(&model);
        let rebuilt = grads_bytes(&model, &grads);
        let optim = self.optim.as_mut().ok_or_else(no_optimizer)?;
        let model = {
            let _span = tracing::debug_span!("optimizer_step").entered();
            optim.step(lr, model, grads)
        };
        self.track_optimizer_state();
        self.buffer.clear_marks();
        // The peak of the step: the optimizer state is written while the rebuilt gradients
        // are still alive.
        let held = GradSync::<M>::held(self, &model);
        self.meter.observe(held, rebuilt);
        Ok(model)
    }

    fn reduced_gradients(&mut self, model: &M) -> Result<GradientsParams> {
        let grads = self.buffer.take(model);
        self.buffer.clear_marks();
        Ok(grads)
    }

    fn held(&self, model: &M) -> ModelStateBytes {
        ModelStateBytes {
            params: param_bytes(model),
            grads: self.buffer.bytes(),
            optimizer: self.optim_bytes,
        }
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    fn save(&self, root: bool) -> Result<SavedState> {
        let optim = self.optim.as_ref().ok_or_else(no_optimizer)?;
        if !root {
            return Ok(SavedState::Replicated(None));
        }
        let bytes = optim
            .into_bytes()
            .map_err(|e| DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}")))?;
        Ok(SavedState::Replicated(Some(bytes.to_vec())))
    }

    fn load(&mut self, model: M, loaded: &Loaded) -> Result<M> {
        let fresh = self.fresh.clone().ok_or_else(no_optimizer)?;
        let bytes = loaded.replicated_state()?;
        let optim = fresh
            .from_bytes(Bytes::from_bytes_vec(bytes.to_vec()))
            .map_err(|e| DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}")))?;
        let model = restore_params(
            model,
            self.buffer.layout(),
            &loaded.meta.param_ids,
            &loaded.params,
        );
        self.buffer.set_layout(ParamLayout::of(&model));
        self.optim = Some(optim);
        self.stepped.iter_mut().for_each(|s| *s = true);
        self.optim_bytes = self.optim.as_ref().map_or(0, burn_optimizer_bytes);
        Ok(model)
    }

    fn burn_optimizer(&self) -> Option<&ModuleOptimizer> {
        self.optim.as_ref()
    }
}

fn no_optimizer() -> DeepSpeedError {
    DeepSpeedError::Data(
        "this stage-0 sync steps with its caller's optimizer; call reduced_gradients".into(),
    )
}
