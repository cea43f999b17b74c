//! [`ReplicatedSync`]: ZeRO stage 0. Every rank holds the whole model, its whole gradient and
//! its whole optimizer state; gradients are averaged by bucketed all-reduce, clipped by their
//! global norm, and every rank takes the same step with one of Burn's optimizers.
//!
//! In mixed precision ([`GradSync::keep_masters`]) Burn's optimizer would step the 16-bit
//! parameters and keep 16-bit moments; instead every rank keeps fp32 masters of the whole
//! model and steps them with the flat Adam/AdamW/LAMB that stages 1-3 use on their slices
//! (here the slice is everything), then rounds them into the 16-bit working copy: DeepSpeed's
//! 2Ψ + 2Ψ + 12Ψ replicated model states (arXiv 1910.02054 §3), with the gradient buffer in
//! fp16 under fp16 and in fp32 under bf16 (as DeepSpeed's bf16 optimizer).

use std::borrow::Cow;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Bytes, FloatDType};
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::zero::{
    FlatPartition, PartitionState, PartitionedKind, PartitionedOptimizer,
};

use super::ModelParallelNorm;
use super::buffer::GradBuffer;
use super::elem::GradElem;
use super::partitioned::check_whole;
use super::scale::{clip_local, clip_to, scale};
use super::{GradSync, Reduced, SavedState, SyncOptions, caller_optimizer_keeps_no_masters};
use crate::checkpoint::{Loaded, partition_state_bytes, partition_state_from_bytes};
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
    /// The flat optimizer the config's optimizer maps to, when it has one (Adam, AdamW,
    /// LAMB): what steps fp32 masters.
    flat_kind: Option<PartitionedKind>,
    /// Mixed precision: the whole model's fp32 masters and their optimizer.
    masters: Option<Masters>,
    /// Tensor slicing: the norm's group.
    slices: Option<ModelParallelNorm>,
}

/// The fp32 masters of the whole model and the flat optimizer that steps them.
struct Masters {
    values: Vec<f32>,
    optim: PartitionedOptimizer,
    /// A world of this rank alone: the flat optimizer's LAMB norms cover whole tensors
    /// already, so they are summed over no other rank.
    alone: Arc<dyn Communicator>,
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
            flat_kind: None,
            masters: None,
            slices: None,
        }
    }

    /// The flat optimizer that steps fp32 masters if mixed precision asks for them
    /// ([`GradSync::keep_masters`]); without one, mixed precision is refused.
    pub fn with_flat_kind(mut self, kind: Option<PartitionedKind>) -> Self {
        self.flat_kind = kind;
        self
    }

    /// The mixed-precision step: the flat optimizer steps the masters with the reduced
    /// gradient, and the model receives them rounded to its dtype.
    fn step_masters<M: Module>(&mut self, model: M, lr: f64) -> Result<M> {
        let span = tracing::debug_span!("optimizer_step").entered();
        let grads = G::widen_all(self.buffer.flat());
        // A 16-bit buffer is stepped through a transient fp32 copy.
        if let Cow::Owned(widened) = &grads {
            let held = GradSync::<M>::held(self, &model);
            self.meter.observe(held, vec_bytes(widened));
        }
        let Some(masters) = self.masters.as_mut() else {
            return Ok(model);
        };
        masters.optim.step(
            masters.alone.as_ref(),
            &mut masters.values,
            &grads,
            self.buffer.present(),
            lr,
        )?;
        drop((grads, span));
        let model = params_from_flat(model, self.buffer.layout(), &masters.values);
        self.buffer.reset();
        self.buffer.clear_marks();
        // The rounded parameters are built while the old ones are alive.
        let held = GradSync::<M>::held(self, &model);
        self.meter.observe(held, held.params);
        Ok(model)
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
        if self.masters.is_some() {
            return self.step_masters(model, lr);
        }
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
        let masters = self
            .masters
            .as_ref()
            .map_or(0, |m| m.optim.state_bytes() + vec_bytes(&m.values));
        ModelStateBytes {
            params: param_bytes(model),
            grads: self.buffer.bytes(),
            optimizer: self.optim_bytes + masters,
            offloaded: 0,
        }
    }

    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        let kind = match (self.flat_kind, &self.optim) {
            (Some(kind), Some(_)) => kind,
            (_, None) => return Err(caller_optimizer_keeps_no_masters(dtype)),
            (None, Some(_)) => {
                return Err(DeepSpeedError::Unsupported {
                    key: "optimizer.type".into(),
                    reason: "16-bit training steps fp32 masters with Adam, AdamW or LAMB; \
                             this optimizer has no flat form"
                        .into(),
                });
            }
        };
        let layout = self.buffer.layout();
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let whole = FlatPartition::new(layout.numel, 1);
        let alone = crate::grid::alone()?;
        self.masters = Some(Masters {
            values: params_to_flat(&model, layout),
            optim: PartitionedOptimizer::new(kind, &whole, 0, &sizes),
            alone,
        });
        // Burn's optimizer is not used from here on; its (empty) state goes.
        self.optim = None;
        self.fresh = None;
        Ok(cast_module(model, dtype))
    }

    /// With masters, the fp32 values (the same on every rank), not the rounded copy.
    fn whole_params(&self, model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        Ok(wanted.then(|| match &self.masters {
            Some(m) => m.values.clone(),
            None => params_to_flat(model, self.buffer.layout()),
        }))
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    fn save(&self, root: bool) -> Result<SavedState> {
        if let Some(m) = &self.masters {
            let bytes = match root {
                true => {
                    let state = m.optim.export()?;
                    Some(partition_state_bytes(&state))
                }
                false => None,
            };
            return Ok(SavedState::Replicated(bytes));
        }
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
    fn load(&mut self, model: M, loaded: &Loaded) -> Result<M> {
        let bytes = loaded.replicated_state()?;
        let optim = match &mut self.masters {
            Some(m) => {
                m.optim
                    .restore(partition_state_from_bytes(bytes, "optim.bin")?, None)?;
                m.values = loaded.params.clone();
                None
            }
            None => {
                let fresh = self.fresh.clone().ok_or_else(no_optimizer)?;
                let optim = fresh
                    .from_bytes(Bytes::from_bytes_vec(bytes.to_vec()))
                    .map_err(|e| DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}")))?;
                Some(optim)
            }
        };
        let model = restore_params(
            model,
            self.buffer.layout(),
            &loaded.meta.param_ids,
            &loaded.params,
        );
        self.buffer.set_layout(ParamLayout::of(&model));
        self.buffer.reset();
        if let Some(optim) = optim {
            self.optim = Some(optim);
            // A loaded optimizer keeps state for every parameter.
            self.stepped.iter_mut().for_each(|s| *s = false);
            self.buffer.mark_all_present();
            self.track_optimizer_state();
        }
        self.buffer.clear_marks();
        Ok(model)
    }

    fn burn_optimizer(&self) -> Option<&ModuleOptimizer> {
        self.optim.as_ref()
    }

    /// With fp32 masters, their flat optimizer's state (the same on every rank).
    fn whole_moments(&self) -> Result<Option<PartitionState>> {
        let state = self
            .masters
            .as_ref()
            .map(|m| m.optim.export())
            .transpose()?;
        Ok(state.map(|s| s.into_owned()))
    }
}

impl<G: GradElem> ReplicatedSync<G> {
    /// Restores the whole parameters `params` and the masters' optimizer `state` (flat in
    /// this regime's layout) into `model` and the masters, keeping the parameters' ids: a
    /// regime over part of a model (expert parallelism's) loads a checkpoint this way.
    /// Refused without masters (Burn's optimizer keeps its state by parameter id).
    pub fn restore_whole<M: Module>(
        &mut self,
        model: M,
        params: &[f32],
        state: PartitionState,
    ) -> Result<M> {
        check_whole(self.buffer.layout(), params, &state)?;
        let Some(masters) = self.masters.as_mut() else {
            return Err(DeepSpeedError::Checkpoint(
                "this stage-0 regime steps Burn's optimizer, whose state is not flat".into(),
            ));
        };
        masters.optim.restore(state, None)?;
        masters.values = params.to_vec();
        self.buffer.reset();
        self.buffer.clear_marks();
        Ok(params_from_flat(model, self.buffer.layout(), params))
    }
}

fn no_optimizer() -> DeepSpeedError {
    DeepSpeedError::Data(
        "this stage-0 sync steps with its caller's optimizer; call reduced_gradients".into(),
    )
}
