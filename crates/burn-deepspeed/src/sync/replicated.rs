//! [`ReplicatedSync`]: ZeRO stage 0 stepped by one of Burn's optimizers (fp32 on the host, and
//! the Learner strategy's stage 0, where the caller steps its own optimizer). Every rank holds
//! the whole model, its whole gradient and its whole optimizer state; gradients are averaged by
//! bucketed all-reduce, clipped by their global norm, and every rank takes the same step.
//!
//! In mixed precision ([`GradSync::keep_masters`]) every rank keeps fp32 masters of the whole
//! model, and Burn's optimizer steps them: the model is rebuilt in f32 from the masters, stepped,
//! and cast back into its 16-bit working copy (the pipeline's stage 0, and an optimizer with no
//! flat form). Stage 0 with the flat optimizer (16-bit masters of Adam, AdamW or LAMB, a
//! device, expert parallelism) is [`PartitionedSync`](super::PartitionedSync) with nothing cut.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Bytes, FloatDType};
use burn_deepspeed_strategies::comm::Communicator;

use super::ModelParallelNorm;
use super::buffer::GradBuffer;
use super::elem::GradElem;
use super::scale::{clip_local, clip_to, scale};
use super::{
    GradSync, Reduced, SavedState, StagedLoad, SyncOptions, caller_optimizer_keeps_no_masters,
};
use crate::checkpoint::Loaded;
use crate::flat::{ParamLayout, params_from_flat, params_to_flat, restore_params};
use crate::memory::{
    MemoryMeter, ModelStateBytes, burn_state_bytes_per_elem, grads_bytes, param_bytes, vec_bytes,
};
use crate::precision::cast_module;
use crate::{DeepSpeedError, Result};

/// A rank's stage-0 state: the gradient buffer (of `G`: f32, or f16 under fp16) and, when
/// the engine steps, Burn's optimizer.
pub struct ReplicatedSync<G: GradElem = f32> {
    buffer: GradBuffer<G>,
    clip: f64,
    /// `None` when the caller steps with its own optimizer (the Learner strategy).
    optim: Option<ModuleOptimizer>,
    /// The optimizer as built, before any step: what a checkpoint load starts from.
    fresh: Option<ModuleOptimizer>,
    /// Slots the optimizer has stepped (and so keeps state for).
    stepped: Vec<bool>,
    /// Bytes of optimizer state per element with state (measured once, on a probe).
    state_per_elem: Option<f64>,
    /// Bytes of the optimizer's state: `state_per_elem` times the stepped elements.
    optim_bytes: u64,
    meter: MemoryMeter,
    /// Tensor slicing: the norm's group.
    slices: Option<ModelParallelNorm>,
    /// Mixed precision: the fp32 masters, flat in layout order, and the working dtype.
    masters: Option<(Vec<f32>, FloatDType)>,
}

impl<G: GradElem> ReplicatedSync<G> {
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
            state_per_elem: None,
            optim_bytes: 0,
            meter: MemoryMeter::default(),
            slices: None,
            masters: None,
        }
    }

    /// Counts the optimizer's state again when a parameter got state for the first time.
    fn track_optimizer_state(&mut self) {
        let present = self.buffer.present();
        let mut grew = false;
        for (s, &p) in self.stepped.iter_mut().zip(present) {
            if p != 0 && !*s {
                *s = true;
                grew = true;
            }
        }
        if grew && let Some(fresh) = &self.fresh {
            let per_elem = *self
                .state_per_elem
                .get_or_insert_with(|| burn_state_bytes_per_elem(fresh));
            let layout = self.buffer.layout();
            let elems: usize = (layout.slots.iter().zip(&self.stepped))
                .filter(|(_, s)| **s)
                .map(|(slot, _)| slot.numel)
                .sum();
            self.optim_bytes = (per_elem * elems as f64).round() as u64;
        }
    }
}

impl<M: Module, G: GradElem> GradSync<M> for ReplicatedSync<G> {
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
        self.buffer.average(loss_scale)?;
        let norm = match &self.slices {
            Some(slices) => {
                let norm = slices
                    .across(slices.host_sq(self.buffer.flat_mut(), 0))?
                    .sqrt();
                clip_to(self.buffer.flat_mut(), norm, self.clip);
                norm
            }
            None => clip_local(self.buffer.flat_mut(), self.clip),
        };
        Ok(Reduced::global(norm))
    }

    fn scale_reduced(&mut self, factor: f32) -> Result<()> {
        scale(self.buffer.flat_mut(), factor);
        Ok(())
    }

    fn model_parallel_norm(&mut self, norm: ModelParallelNorm) -> Result<()> {
        self.slices = Some(norm);
        Ok(())
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        if self.optim.is_none() {
            return Err(no_optimizer());
        }
        // Mixed precision: the optimizer steps the model rebuilt in f32 from the masters.
        let layout = self.buffer.layout();
        let (model, mixed) = match self.masters.take() {
            Some((values, dtype)) => {
                let full = cast_module(model, FloatDType::F32);
                (params_from_flat(full, layout, &values), Some(dtype))
            }
            None => (model, None),
        };
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
        Ok(match mixed {
            Some(dtype) => {
                self.masters = Some((params_to_flat(&model, self.buffer.layout()), dtype));
                cast_module(model, dtype)
            }
            None => model,
        })
    }

    /// Lets `edit` change the accumulated gradient (whole, flat in layout order) before the
    /// reduction: the pipeline adds its tied layers' gradients here.
    fn edit_accumulated(&mut self, edit: &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()> {
        let flat = self.buffer.flat_mut();
        let mut wide = G::widen_all(flat).into_owned();
        edit(&mut wide)?;
        flat.iter_mut()
            .zip(wide)
            .for_each(|(g, w)| *g = G::narrow(w));
        Ok(())
    }

    fn discard(&mut self) {
        self.buffer.reset();
        self.buffer.clear_marks();
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
            optimizer: self.optim_bytes + self.masters.as_ref().map_or(0, |(m, _)| vec_bytes(m)),
            offloaded: 0,
        }
    }

    /// Keeps fp32 masters of the whole model (still in f32), which Burn's optimizer steps;
    /// returns the working copy in `dtype`.
    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        if self.optim.is_none() {
            return Err(caller_optimizer_keeps_no_masters(dtype));
        }
        self.masters = Some((params_to_flat(&model, self.buffer.layout()), dtype));
        Ok(cast_module(model, dtype))
    }

    /// With masters, the fp32 values (the same on every rank), not the rounded copy.
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        Ok(wanted.then(|| match &self.masters {
            Some((values, _)) => values.clone(),
            None => params_to_flat(model, self.buffer.layout()),
        }))
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    fn save(&self, root: bool) -> Result<SavedState<'_>> {
        let optim = self.optim.as_ref().ok_or_else(no_optimizer)?;
        if !root {
            return Ok(SavedState::Replicated(None));
        }
        let bytes = optim
            .into_bytes()
            .map_err(|e| DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}")))?;
        Ok(SavedState::Replicated(Some(bytes.to_vec())))
    }

    /// Everything fallible (reading and restoring the optimizer state) happens before the
    /// parameters are replaced.
    fn stage_load(&self, loaded: &Loaded) -> Result<StagedLoad> {
        let bytes = loaded.replicated_state()?;
        // Read now, so that the commit reads nothing.
        loaded.params()?;
        let fresh = self.fresh.clone().ok_or_else(no_optimizer)?;
        let optim = fresh
            .from_bytes(Bytes::from_bytes_vec(bytes))
            .map_err(|e| DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}")))?;
        Ok(StagedLoad::Burn(optim))
    }

    fn commit_load(&mut self, model: M, loaded: &Loaded, staged: StagedLoad) -> Result<M> {
        let StagedLoad::Burn(optim) = staged else {
            return Err(StagedLoad::mismatch("stage 0 with Burn's optimizer"));
        };
        let params = loaded.params()?;
        let model = restore_params(model, self.buffer.layout(), &loaded.meta.param_ids, params);
        self.buffer.set_layout(ParamLayout::of(&model));
        self.buffer.reset();
        self.optim = Some(optim);
        if let Some((values, _)) = &mut self.masters {
            values.clear();
            values.extend_from_slice(params);
        }
        // A loaded optimizer keeps state for every parameter.
        self.stepped.iter_mut().for_each(|s| *s = false);
        self.buffer.mark_all_present();
        self.track_optimizer_state();
        self.buffer.clear_marks();
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
