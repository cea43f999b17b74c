//! ZeRO stage 3 in the Learner strategy: the model is sharded before the `Learner` is built.
//!
//! Burn's `Learner` takes a new model only as a record, and a record carries values, not the
//! reparameterization that gathers a chunk (and only values of the shapes the model already
//! has). So at stage 3 the user hands the model to [`DeepSpeedStrategy::prepare_model`]
//! first. It keeps the whole parameters aside, and gives back the model with every
//! partitioned parameter cut to its chunk shape and a [`ShardGather`](crate::zero3::ShardGather)
//! whose keys no rank answers yet. In `fit`, each rank registers its own gather group for
//! those keys on its thread, takes rank 0's whole values (a broadcast), and loads its own
//! chunks into its `Learner` as a record.

use std::sync::{Arc, LazyLock, Mutex};

use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::{Module, ParamId};
use burn::train::{Learner, LearnerModel};

use super::{ConfigSchedule, DeepSpeedStrategy};
use crate::config::OptimizerConfig;
use crate::flat::{ParamLayout, params_to_flat};
use crate::launch::mpirun_world_size;
use crate::optim::build_optimizer;
use crate::sync::{SyncOptions, shard_plan};
use crate::zero3::{prepared_id, shard_module_ahead};

/// A model prepared for stage 3, waiting for its ranks.
#[derive(Debug)]
pub(crate) struct Prepared {
    /// The keys' group id (see [`prepared_id`]).
    pub id: u64,
    /// The whole tensors' layout (the prepared model keeps the parameter ids).
    pub layout: ParamLayout,
    /// The whole parameters, flat in layout order.
    pub flat: Vec<f32>,
    /// The world size the chunks were cut for.
    pub world: usize,
}

fn waiting() -> std::sync::MutexGuard<'static, Vec<Arc<Prepared>>> {
    static WAITING: LazyLock<Mutex<Vec<Arc<Prepared>>>> = LazyLock::new(|| Mutex::new(Vec::new()));
    WAITING.lock().unwrap_or_else(|e| e.into_inner())
}

/// The first parameter of each model whose `Learner` [`DeepSpeedStrategy::learner`] built.
fn built() -> std::sync::MutexGuard<'static, Vec<ParamId>> {
    static BUILT: LazyLock<Mutex<Vec<ParamId>>> = LazyLock::new(|| Mutex::new(Vec::new()));
    BUILT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether `model`'s `Learner` was built by [`DeepSpeedStrategy::learner`] (once: the mark is
/// taken).
pub(crate) fn take_built<M: Module>(model: &M) -> bool {
    let Some(first) = ParamLayout::of(model).slots.first().map(|s| s.id) else {
        return false;
    };
    let mut built = built();
    let at = built.iter().position(|id| *id == first);
    at.map(|at| built.remove(at)).is_some()
}

/// Takes the prepared entry of `model` (matched by parameter ids), if it was prepared.
pub(crate) fn take_prepared<M: Module>(model: &M) -> Option<Arc<Prepared>> {
    let layout = ParamLayout::of(model);
    let first = layout.slots.first()?.id;
    let mut waiting = waiting();
    let at = waiting.iter().position(|p| {
        p.layout.slots.len() == layout.slots.len() && p.layout.slot_of(first) == Some(0)
    })?;
    Some(waiting.remove(at))
}

impl DeepSpeedStrategy {
    /// The `Learner` for `model` with the config's optimizer and learning-rate schedule, as
    /// `deepspeed.initialize` builds them: the `optimizer` section (AdamW with DeepSpeed's
    /// defaults without one; Adam, AdamW or Lamb) and the `scheduler` section (constant at
    /// the optimizer's `lr` without one), stepping the same rates as
    /// [`DeepSpeedEngine`](crate::DeepSpeedEngine). The model is prepared as by
    /// [`prepare_model`](Self::prepare_model). A `Learner` built any other way keeps its own
    /// optimizer and schedule, and the strategy then refuses a config that has either section.
    pub fn learner<M: LearnerModel>(&self, model: M) -> crate::Result<Learner<M>> {
        let mut config = self.config.clone();
        config
            .optimizer
            .get_or_insert_with(OptimizerConfig::default);
        config.resolve_values()?;
        let optimizer = build_optimizer(config.optimizer.get_or_insert_with(Default::default))?;
        let schedule = ModuleLrScheduler::new(ConfigSchedule::new(config));
        let model = self.prepare_model(model);
        if let Some(first) = ParamLayout::of(&model).slots.first() {
            built().push(first.id);
        }
        Ok(Learner::new(model, optimizer, schedule))
    }

    /// Prepares `model` for this strategy; call it before `Learner::new` at ZeRO stage 3
    /// (at stages 0-2 the model comes back unchanged).
    ///
    /// The whole parameters are kept aside until `fit` hands each rank its chunks; the model
    /// that comes back stores, per partitioned parameter, a chunk-shaped placeholder and a
    /// reparameterization that gathers the whole tensor on the rank that runs it. It is
    /// usable only inside the `SupervisedTraining` that runs this strategy (once), which
    /// returns the trained model whole. Its parameters move to the gradient-checkpointing
    /// form of their device, so that a gathered weight is gathered again for its backward
    /// instead of being kept (ZeRO arXiv 1910.02054 §5.3).
    ///
    /// At stage 3 the `Learner`'s optimizer steps each rank's chunks (padded with zeros)
    /// and the persistent tensors whole: element-wise optimizers (SGD, Adam, AdamW) give the
    /// single-rank result; one that uses a tensor's norm (LAMB's trust ratio, or Burn's
    /// per-parameter norm clipping) sees the chunk as the tensor. `gradient_clipping` from
    /// the config clips by the global norm across ranks, as at every stage.
    pub fn prepare_model<M: Module>(&self, model: M) -> M {
        if !crate::sync::ZeroPlan::of(&self.config).shards_parameters() {
            return model;
        }
        // 0 ranks is refused when training starts; the plan needs one.
        let world = mpirun_world_size().unwrap_or(self.ranks).max(1);
        let layout = ParamLayout::of(&model);
        let flat = params_to_flat(&model, &layout);
        let plan = shard_plan(&layout, &SyncOptions::of(&self.config), world);
        let shapes: Vec<Vec<usize>> = layout.slots.iter().map(|s| s.shape.clone()).collect();
        let id = prepared_id();
        let model = shard_module_ahead(model, &plan, &shapes, id);
        waiting().push(Arc::new(Prepared {
            id,
            layout,
            flat,
            world,
        }));
        model
    }
}
