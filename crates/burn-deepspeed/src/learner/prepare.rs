//! ZeRO stage 3 in the Learner strategy: the model is sharded before the `Learner` is built.
//!
//! Burn's `Learner` takes a new model only as a record, and a record carries values, not the
//! reparameterization that gathers a chunk (and only values of the shapes the model already
//! has). So at stage 3 the user hands the model to [`DeepSpeedStrategy::prepare_model`]
//! first. It keeps the whole parameters aside, and gives back the model with every
//! partitioned parameter a chunk and a [`ShardGather`](crate::zero3::ShardGather) whose keys
//! no rank answers yet. In `fit`, each rank registers its own gather group for those keys on
//! its thread, takes rank 0's whole values (a broadcast), and loads its own chunks into its
//! `Learner` as a record.
//!
//! Burn's checkpointer saves and loads the `Learner`'s model whole, as an unpartitioned run
//! does. A partitioned parameter of the prepared model is declared with its whole shape (its
//! chunk materializes lazily), so a resume's whole record loads into it: the values replace
//! the whole parameters kept aside, and each rank then takes its chunks of them. A save
//! records, for each chunk, the whole tensor rank 0 gathered for it ([`SavingWholes`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};

use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData};
use burn::train::{Learner, LearnerModel};

use super::{ConfigSchedule, DeepSpeedStrategy};
use crate::config::OptimizerConfig;
use crate::flat::{ParamLayout, params_to_flat};
use crate::launch::mpirun_world_size;
use crate::optim::build_optimizer;
use crate::sync::{SyncOptions, shard_plan};
use crate::zero3::{AheadRecords, prepared_id, shard_module_ahead};

/// A model prepared for stage 3, waiting for its ranks.
#[derive(Debug)]
pub(crate) struct Prepared {
    /// The keys' group id (see [`prepared_id`]).
    pub id: u64,
    /// The whole tensors' layout, with the prepared model's parameter ids.
    pub layout: ParamLayout,
    /// The whole parameters, flat in layout order (a resume's record replaces them).
    flat: Mutex<Vec<f32>>,
    /// The world size the chunks were cut for.
    pub world: usize,
    /// A record loaded whole tensors into the prepared model.
    resumed: AtomicBool,
}

impl Prepared {
    /// The whole parameters, flat in layout order.
    pub fn flat(&self) -> Vec<f32> {
        self.flat.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Tensor `t`'s values from a record, in place of the prepared ones.
    fn load(&self, t: usize, whole: TensorData) {
        let Some(slot) = self.layout.slots.get(t) else {
            return;
        };
        let Ok(values) = whole.convert::<f32>().try_into_vec::<f32>() else {
            return;
        };
        if values.len() == slot.numel {
            let mut flat = self.flat.lock().unwrap_or_else(|e| e.into_inner());
            flat[slot.offset..slot.offset + slot.numel].copy_from_slice(&values);
            self.resumed.store(true, Ordering::SeqCst);
        }
    }
}

thread_local! {
    /// The whole tensors a save on this thread records for chunks, by (prepared id, tensor).
    static SAVING: RefCell<HashMap<(u64, usize), TensorData>> = RefCell::new(HashMap::new());
}

/// While alive, a record taken of prepared model `id` on this thread holds these whole
/// tensors in place of its chunks.
pub(super) struct SavingWholes(u64);

impl SavingWholes {
    pub(super) fn new(id: u64, wholes: impl IntoIterator<Item = (usize, TensorData)>) -> Self {
        SAVING.with(|s| {
            let mut s = s.borrow_mut();
            s.extend(wholes.into_iter().map(|(t, data)| ((id, t), data)));
        });
        Self(id)
    }
}

impl Drop for SavingWholes {
    fn drop(&mut self) {
        SAVING.with(|s| s.borrow_mut().retain(|(id, _), _| *id != self.0));
    }
}

/// The prepared model's link to its entry: a record's whole tensors go to the entry while it
/// waits (a resume), and a save takes the wholes [`SavingWholes`] holds.
struct Records {
    id: u64,
    prepared: Weak<Prepared>,
}

impl AheadRecords for Records {
    fn loaded(&self, t: usize, whole: TensorData) {
        // Once the entry is taken (training started) a whole tensor has no use here.
        if let Some(prepared) = self.prepared.upgrade() {
            prepared.load(t, whole);
        }
    }

    fn saving(&self, t: usize) -> Option<TensorData> {
        SAVING.with(|s| s.borrow().get(&(self.id, t)).cloned())
    }
}

/// Materializes the lazily declared chunks of a prepared model (and of every clone sharing
/// them), so that records of the chunks' shapes load into it.
pub(super) fn materialize<M: Module>(model: &M) {
    struct Touch;
    impl ModuleVisitor for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            // A visitor sees the stored value, not the gathered one.
            let _ = param.val();
        }
    }
    model.visit(&mut Touch);
}

fn waiting() -> std::sync::MutexGuard<'static, Vec<Arc<Prepared>>> {
    static WAITING: LazyLock<Mutex<Vec<Arc<Prepared>>>> = LazyLock::new(|| Mutex::new(Vec::new()));
    WAITING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes the prepared entry of `model`, if it was prepared: matched by parameter ids, or,
/// after a resume (a record restores the ids it was saved with), the entry a record was
/// loaded into, whose layout then takes the model's ids.
pub(crate) fn take_prepared<M: Module>(model: &M) -> Option<Arc<Prepared>> {
    let layout = ParamLayout::of(model);
    let first = layout.slots.first()?.id;
    let mut waiting = waiting();
    let same = |p: &Arc<Prepared>| p.layout.slots.len() == layout.slots.len();
    if let Some(at) = waiting
        .iter()
        .position(|p| same(p) && p.layout.slot_of(first) == Some(0))
    {
        return Some(waiting.remove(at));
    }
    let at = waiting
        .iter()
        .position(|p| same(p) && p.resumed.load(Ordering::SeqCst))?;
    let entry = waiting.remove(at);
    Some(Arc::new(Prepared {
        id: entry.id,
        layout: entry.layout.with_ids_of(&layout)?,
        flat: Mutex::new(entry.flat()),
        world: entry.world,
        resumed: AtomicBool::new(true),
    }))
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
        Ok(Learner::new(model, optimizer, schedule))
    }

    /// Prepares `model` for this strategy; call it before `Learner::new` at ZeRO stage 3
    /// (at stages 0-2 the model comes back unchanged).
    ///
    /// The whole parameters are kept aside until `fit` hands each rank its chunks; the model
    /// that comes back stores, per partitioned parameter, a placeholder chunk (declared with
    /// the whole shape, so that Burn's checkpointer can load a whole model into it on
    /// resume) and a reparameterization that gathers the whole tensor on the rank that runs
    /// it. It is usable only inside the `SupervisedTraining` that runs this strategy (once),
    /// which returns the trained model whole. Its parameters move to the gradient-checkpointing
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
        let prepared = Arc::new(Prepared {
            id,
            layout,
            flat: Mutex::new(flat),
            world,
            resumed: AtomicBool::new(false),
        });
        let records = Arc::new(Records {
            id,
            prepared: Arc::downgrade(&prepared),
        });
        let model = shard_module_ahead(model, &plan, &shapes, id, records);
        waiting().push(prepared);
        model
    }
}
