//! [`DeepSpeedStrategy`]: data-parallel training inside Burn's `SupervisedTraining`.
//!
//! ```text
//! SupervisedTraining::new(dir, train, valid)
//!     .with_training_strategy(TrainingStrategy::Custom(Arc::new(
//!         DeepSpeedStrategy::new(ds_config, 4),
//!     )))
//!     .launch(Learner::new(model, optim, lr_scheduler));
//! ```
//!
//! Each rank trains a replica on its own contiguous slice of the training set (as DeepSpeed's
//! distributed sampler), so every global step combines one disjoint micro-batch per rank;
//! gradients are averaged by the same bucketed all-reduce and global-norm clipping as the
//! engine; then every rank applies the `Learner`'s own optimizer and schedule. Rank 0 reports
//! events, validates and checkpoints. Under `mpirun` (feature `mpi`) each process is one rank.
//!
//! At ZeRO stages 1 and 2 (arXiv 1910.02054) the model's tensors are cut into one contiguous,
//! balanced group per rank, at tensor boundaries. Gradients are reduce-scattered (stage 2:
//! after every micro-batch), and each rank gives the `Learner`'s optimizer the gradients of its
//! own tensors only. Burn's optimizers keep state for the parameters they step, so each rank
//! holds the optimizer state of its group. The updated groups are then all-gathered. Whole
//! tensors are what any Burn optimizer (LAMB's trust ratio included) needs; the balance is
//! limited by the largest tensor.
//!
//! At stage 3 the parameters are partitioned too, so the model must be sharded before the
//! `Learner` is built: pass it through [`DeepSpeedStrategy::prepare_model`]. Each rank then
//! holds its chunks, gathers each tensor for its forward and again for its backward, and its
//! gradients come back reduce-scattered; the `Learner`'s optimizer steps the chunks. At the
//! end of every epoch the ranks gather the whole model together for rank 0's validation, and
//! `fit` returns it whole.
//!
//! With `offload_optimizer.device: "cpu"` (stages 1-3) the fp32 masters and the `Learner`'s
//! optimizer state live in host memory and the optimizer steps there (ZeRO-Offload, arXiv
//! 2101.06840); the device keeps the working copy and the gradients.
//!
//! Burn's checkpointer works at every stage and in bf16 (see [`checkpoint`](super::checkpoint)
//! and [`chunked`](super::chunked)): the ranks join their optimizer partitions (at stage 3
//! their chunks) into one record, and rank 0 saves it with the whole fp32 parameters, so the
//! files are those of an unpartitioned fp32 run; on resume each rank keeps its own
//! partition of the record Burn loaded. It is refused in fp16, whose loss scale Burn's
//! checkpoint has no place for; checkpoint fp16 runs with
//! [`DeepSpeedEngine`](crate::DeepSpeedEngine).

use super::reader::{Read, StepReader};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::data::dataset::DatasetError;
use burn::tensor::{Device, FloatDType};
use burn::train::metric::store::EventStoreClient;
use burn::train::train::WorkerFailure;
use burn::train::{
    Learner, LearnerModel, SupervisedLearningStrategy, SupervisedTrainingEventProcessor,
    TrainLoader, TrainingComponents, TrainingError, TrainingItem, ValidLoader,
};
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp, agree};

use super::checkpoint::built_from_config;
use super::checkpoint::owned_ids;
use super::chunked::ChunkPlan;
use super::leader::{EpochEvent, LeaderEvents};
use super::masters::Masters;
use super::prepare::{Prepared, materialize, take_prepared};
use super::settings::{Settings, Surroundings, resolve_settings};
use crate::DeepSpeedConfig;
use crate::activation::{take_stats, with_config_options};
use crate::flat::ParamLayout;
use crate::launch::{launch_with_leader, launched_by_mpirun, mpirun_world_size};
use crate::precision::{unscaled_backward_message, with_loss_scale};
use crate::step::core::StepCore;
use crate::sync::{self, GradSync, ShardedSync, SyncOptions, broadcast_params};
use crate::zero3::GatherGroup;

/// A `SupervisedLearningStrategy` that trains with DeepSpeed-style data parallelism.
///
/// ```no_run
/// use std::sync::Arc;
/// use burn::train::{LearnerModel, SupervisedTraining, TrainLoader, TrainingStrategy, ValidLoader};
/// use burn_deepspeed::prelude::*;
///
/// fn train<M: LearnerModel>(model: M, train: TrainLoader<M>, valid: ValidLoader<M>) -> Result<M> {
///     let (config, _warnings) = DeepSpeedConfig::from_file("ds_config.json")?;
///     let strategy = DeepSpeedStrategy::new(config, 2); // 2 ranks as threads
///     let model = strategy.prepare_model(model); // shards it at ZeRO stage 3, else a no-op
///     let learner = strategy.learner(model)?; // the config's optimizer and scheduler
///     let result = SupervisedTraining::new("runs/ds", train, valid)
///         .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
///         .num_epochs(2)
///         .launch(learner);
///     match result.error {
///         None => Ok(result.model),
///         Some(e) => Err(DeepSpeedError::LearnerStrategy(e.to_string())),
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct DeepSpeedStrategy {
    pub(super) config: DeepSpeedConfig,
    pub(super) ranks: usize,
    /// Rank `r`'s device is `devices[r % len]`; empty: the `Learner`'s model's device.
    devices: Vec<Device>,
    timeout: Duration,
}

impl DeepSpeedStrategy {
    /// `ranks` data-parallel ranks as threads (ignored under `mpirun`, where each process is
    /// one rank). The config is resolved and checked when training starts, and each key is
    /// honoured or refused by name: the batch keys set the micro-batches per step and the
    /// loader's batch size, `optimizer` and `scheduler` need a `Learner` built by
    /// [`learner`](Self::learner), and the rest is validated as in the engine. `ranks` 0 is
    /// refused then too.
    pub fn new(config: DeepSpeedConfig, ranks: usize) -> Self {
        Self {
            config,
            ranks,
            devices: Vec::new(),
            timeout: Duration::from_secs(1800),
        }
    }

    /// One rank per device, as Burn's own multi-device strategies take them: rank `r`'s
    /// `Learner` is forked onto `devices[r]`, and its part of the training set is loaded onto
    /// it. A device may be listed more than once: those ranks share it (on a GPU their
    /// collectives then stage through host memory). Under `mpirun` each process is one rank
    /// and takes `devices[rank % devices.len()]`. An empty list is refused when training
    /// starts, as 0 ranks are.
    pub fn on_devices(config: DeepSpeedConfig, devices: Vec<Device>) -> Self {
        Self {
            ranks: devices.len(),
            devices,
            ..Self::new(config, 0)
        }
    }

    /// How long a rank waits for the others (default 30 minutes, like NCCL's).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// This thread answers a prepared model's keys with its rank's gather group until dropped.
struct Answering(u64);

impl Drop for Answering {
    fn drop(&mut self) {
        GatherGroup::forget_on_this_thread(self.0);
    }
}

pub(super) struct RankRun<'a, M: LearnerModel> {
    pub(super) comm: Arc<dyn Communicator>,
    pub(super) learner: Learner<M>,
    train: TrainLoader<M>,
    pub(super) settings: &'a Settings,
    /// Stage 3: the whole parameters the model was prepared from, dropped once loaded.
    prepared: Option<Arc<Prepared>>,
    /// Where a rank leaves its loader's error, for `fit` to report as Burn's dataset error.
    loader_error: &'a Mutex<Option<DatasetError>>,
    /// The device the strategy gave this rank (its batches are loaded there).
    device: Option<Device>,
    /// At stages 1-2, the parameters whose optimizer state this rank holds.
    pub(super) owned: Option<HashSet<u64>>,
    /// At stage 3, the partitioned parameters (for Burn's checkpointer).
    pub(super) chunks: Option<ChunkPlan>,
    /// Burn's event store (the checkpointer's strategy reads it).
    pub(super) store: Arc<EventStoreClient>,
}

impl<M: LearnerModel> RankRun<'_, M> {
    /// This rank's contiguous slice of the training set, loaded onto its device.
    fn shard(&self) -> TrainLoader<M> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let n = self.train.num_items();
        let per = n / world;
        let slice = self.train.slice(rank * per, (rank + 1) * per);
        match &self.device {
            Some(device) => slice.to_device(device),
            None => slice,
        }
    }

    /// The gradient regime around the Learner's optimizer, with every rank's model starting
    /// from rank 0's parameters. At stage 3 this rank's gather group answers the prepared
    /// model's keys until the returned guard drops.
    fn build_sync(&mut self) -> crate::Result<(Box<dyn GradSync<M>>, Option<Answering>)> {
        let options = SyncOptions::of(&self.settings.config);
        if options.plan.shards_parameters() {
            let (sync, answering) = self.load_chunks(&options)?;
            return Ok((Box::new(sync), Some(answering)));
        }
        let start = self.learner.model();
        let layout = ParamLayout::of(&start);
        let sync = sync::for_caller_optimizer(layout.clone(), self.comm.clone(), &options)?;
        // Every replica starts from rank 0's parameters; the optimizer and schedule are kept.
        let model = broadcast_params(self.comm.as_ref(), &layout, start)?;
        self.learner.load_model(model.into_record());
        let (world, rank) = (self.comm.world_size(), self.comm.rank());
        self.owned = options
            .plan
            .cut()
            .and_then(|cut| owned_ids(&layout, cut, world, rank));
        self.keep_own_optimizer_state()?;
        Ok((sync, None))
    }

    /// Stage 3: registers this rank's gather group for the prepared model's keys and loads
    /// this rank's chunks of rank 0's whole parameters into the `Learner`.
    fn load_chunks(&mut self, options: &SyncOptions) -> crate::Result<(ShardedSync, Answering)> {
        let prepared = self.prepared.take().ok_or_else(|| {
            crate::DeepSpeedError::LearnerStrategy(
                "ZeRO stage 3 needs the model prepared by DeepSpeedStrategy::prepare_model".into(),
            )
        })?;
        let sync = ShardedSync::for_learner(prepared.layout.clone(), self.comm.clone(), options);
        sync.secondary_partition(options.hpz)?;
        if options.quantized_gradients {
            sync.quantized_gradients(options.ranks_per_node(self.comm.world_size()))?;
        }
        sync.group().answer_on_this_thread(prepared.id);
        let answering = Answering(prepared.id);
        let mut flat = prepared.flat();
        let chunks = ChunkPlan::new(prepared.id, &prepared.layout, sync.group().plan());
        drop(prepared);
        self.comm.broadcast(&mut flat, 0)?;
        materialize(&self.learner.model());
        let model = sync.load_flat(self.learner.model(), &flat)?;
        drop(flat);
        self.learner.load_model(model.into_record());
        self.chunks = Some(chunks);
        self.cut_optimizer_state()?;
        Ok((sync, answering))
    }

    /// Trains epochs; `on_epoch` sees the epoch's events on this rank (rank 0 forwards them
    /// to the event processor, validates and checkpoints). Returns the trained model whole.
    fn run_epochs(
        mut self,
        epochs: std::ops::RangeInclusive<usize>,
        mut on_epoch: impl FnMut(EpochEvent<'_, M>) -> bool,
    ) -> crate::Result<M> {
        let shard = self.shard();
        let (mut sync, _answering) = self.build_sync()?;
        let mut mixed = self.separate_masters(sync.as_mut())?;
        // The loss scale and the skipped steps; the Learner keeps its own schedule, which
        // a skipped step does not advance either.
        let mut core = StepCore::new(&self.settings.config)?;
        let per_step = self.settings.grad_accumulation;
        for epoch in epochs {
            if !on_epoch(EpochEvent::Start(epoch, shard.num_items())) {
                break;
            }
            let mut reader = StepReader::new(shard.iter(), self.settings.micro_batch);
            let mut iteration = 0;
            let mut steps = 0u64;
            let mut stopped;
            loop {
                let (micro, failure) = match reader.next_step(per_step) {
                    Read::Step(micro) => (Some(micro), None),
                    Read::End => (None, None),
                    Read::Failed(reason, error) => {
                        if let Some(error) = error {
                            let mut slot =
                                self.loader_error.lock().unwrap_or_else(|e| e.into_inner());
                            slot.get_or_insert(error);
                        }
                        (None, Some(reason))
                    }
                };
                agree(self.comm.as_ref(), "training data", failure.as_deref())?;
                // Every rank must take part in every step: stop the epoch when any rank ran
                // out of data or was asked to stop.
                // 0: go on; 1: a rank's data ran out; 2: rank 0 was asked to stop.
                let asked = on_epoch(EpochEvent::ShouldStop);
                let mut flag = [if asked {
                    2u8
                } else {
                    u8::from(micro.is_none())
                }];
                self.comm.all_reduce(&mut flag, ReduceOp::Max)?;
                stopped = flag[0];
                let Some(micro) = micro.filter(|_| stopped == 0) else {
                    break;
                };
                let outputs = self.step(sync.as_mut(), &mut core, micro, mixed.as_mut())?;
                steps += 1;
                for item in outputs {
                    iteration += 1;
                    on_epoch(EpochEvent::Item(TrainingItem::new(
                        item,
                        reader.progress(),
                        Some(iteration),
                        Some(self.learner.lr_current()),
                    )));
                }
            }
            // The ranks stopped together, after the same number of steps.
            if steps == 0 && stopped == 1 {
                return Err(crate::DeepSpeedError::Data(format!(
                    "epoch {epoch} took no optimizer step: each rank's {} items of training \
                     data gave fewer than {per_step} micro-batch(es) of the configured size",
                    shard.num_items()
                )));
            }
            // Validation runs the working copy, as training does.
            let whole = sync.whole_model(&self.learner.model())?;
            let (saved, _saving) = self.learner_to_save(sync.as_mut(), mixed.as_ref())?;
            let learner = saved.as_ref().unwrap_or(&self.learner);
            if !on_epoch(EpochEvent::End(epoch, learner, whole)) {
                break;
            }
        }
        match mixed {
            // The trained model is the fp32 masters, not their 16-bit copy (at stage 3
            // their chunks are gathered in f32).
            // Offloaded, it comes back on the device the Learner trained on.
            Some(mixed) => {
                sync.track_working_copy(&mixed.masters, FloatDType::F32);
                let whole = sync.whole_model(&mixed.masters)?;
                Ok(match mixed.home {
                    Some(_) => whole.fork(&mixed.working),
                    None => whole,
                })
            }
            None => sync.whole_model(&self.learner.model()),
        }
    }

    /// One optimizer step over `micro`: the Learner computes each micro-batch's gradients,
    /// the regime reduces them, the Learner's optimizer steps what this rank owns (whole
    /// tensors at stage 0, its tensors at stages 1-2, its chunks at stage 3), and the regime
    /// makes every rank's model consistent again.
    fn step(
        &mut self,
        sync: &mut dyn GradSync<M>,
        core: &mut StepCore,
        micro: Vec<<M as burn::train::TrainStep>::Input>,
        mixed: Option<&mut Masters<M>>,
    ) -> crate::Result<Vec<<M as burn::train::TrainStep>::Output>> {
        let model = self.learner.model();
        let mut outputs = Vec::with_capacity(micro.len());
        let scale = core.loss_scale();
        let mut unscaled = false;
        for item in micro {
            let learner = &mut self.learner;
            let (out, scaled) = with_config_options(&self.settings.config, || {
                with_loss_scale(scale, || learner.train_step(item))
            });
            unscaled |= !scaled;
            sync.accumulate(&model, &out.grads);
            outputs.push(out.item);
        }
        let stats = take_stats();
        let section = self.settings.config.activation_checkpointing.as_ref();
        if section.is_some_and(|c| c.profile) {
            stats.log(self.comm.rank());
        }
        // fp16 (every rank has the same config): before the reduction's collectives, every
        // rank learns whether one ran unscaled.
        if scale.is_some() {
            let failure = unscaled.then(unscaled_backward_message);
            if let Err(e) = agree(self.comm.as_ref(), "fp16 loss scaling", failure.as_deref()) {
                sync.discard();
                return Err(e.into());
            }
        }
        let reduced = sync.reduce(scale.unwrap_or(1.0))?;
        // As the engines: a non-finite gradient norm skips the step on every rank (the norm
        // is global), and the schedule does not advance.
        let step = core.decide(reduced.overflow, reduced.norm)?;
        core.finish(&[], None, Duration::ZERO, |record| record);
        if !step {
            sync.discard();
            return Ok(outputs);
        }
        let Some(mixed) = mixed else {
            let grads = sync.reduced_gradients(&model)?;
            self.learner.lr_step();
            self.learner.optimizer_step(grads);
            if let Some(updated) = sync.finish_external_step(&self.learner.model())? {
                self.learner.load_model(updated.into_record());
            }
            return Ok(outputs);
        };
        self.step_masters(sync, mixed)?;
        Ok(outputs)
    }
}

impl<M: LearnerModel> SupervisedLearningStrategy<M> for DeepSpeedStrategy {
    /// Trains on every rank. An error (a refused config, a rank's failure, a loader's error)
    /// stops every rank and is reported as Burn's strategies report theirs: in the
    /// `LearningResult`'s `error` (a loader's own error as `TrainingError::Dataset`), with the
    /// model as it was given.
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let interrupter = components.interrupter.clone();
        let given = learner.model();
        let loader_error = Mutex::new(None);
        let (result, processor) = self.try_fit(
            components,
            learner,
            train,
            valid,
            starting_epoch,
            &loader_error,
        );
        match result {
            Ok(model) => (model, processor),
            Err(e) => {
                tracing::error!(error = %e, "burn-deepspeed: training failed");
                let loader = loader_error.into_inner().unwrap_or_else(|e| e.into_inner());
                match loader {
                    Some(dataset) => interrupter.fail(TrainingError::Dataset(dataset)),
                    None => interrupter.fail(TrainingError::Workers(vec![WorkerFailure {
                        device_id: 0,
                        message: format!("burn-deepspeed: {e}"),
                    }])),
                }
                (given, processor)
            }
        }
    }
}

impl DeepSpeedStrategy {
    /// [`fit`](SupervisedLearningStrategy::fit), with its error.
    #[allow(clippy::type_complexity)]
    fn try_fit<M: LearnerModel>(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
        loader_error: &Mutex<Option<DatasetError>>,
    ) -> (crate::Result<M>, SupervisedTrainingEventProcessor<M>) {
        // Rank 0 validates on its own device: the first one the strategy was given, if any.
        let valid = match self.devices.first() {
            Some(device) => valid.to_device(device),
            None => valid,
        };
        let store = components.event_store.clone();
        let mut leader_events = LeaderEvents {
            processor: components.event_processor,
            interrupter: components.interrupter.clone(),
            checkpointer: components.checkpointer,
            event_store: components.event_store.clone(),
            valid,
        };
        let world = mpirun_world_size().unwrap_or(self.ranks);
        let settings = built_from_config(&learner, &store).and_then(|learner_from_config| {
            resolve_settings(
                &self.config,
                Surroundings {
                    world,
                    learner_accumulation: components.grad_accumulation,
                    checkpointer: leader_events.checkpointer.is_some(),
                    learner_from_config,
                },
            )
        });
        let settings = settings.and_then(|settings| {
            if train.num_items() < world {
                return Err(crate::DeepSpeedError::Data(format!(
                    "the training set has {} items for {world} ranks: each rank needs at least \
                     one",
                    train.num_items()
                )));
            }
            Ok(settings)
        });
        let settings = match settings {
            Ok(s) => s,
            Err(e) => return (Err(e), leader_events.processor),
        };
        let prepared = match self.prepared_for(&learner) {
            Ok(p) => p,
            Err(e) => return (Err(e), leader_events.processor),
        };
        let epochs = starting_epoch..=components.num_epochs;
        let device = learner
            .model()
            .devices()
            .into_iter()
            .next()
            .unwrap_or_default();
        let mut rank0_events = |event: EpochEvent<'_, M>| leader_events.on(event);

        // Each rank trains its own copy of the Learner (forked onto the device, in the thread
        // world) with its own communicator.
        let mpi = launched_by_mpirun();
        let settings = &settings;
        let rank_run = |comm: Arc<dyn Communicator>, mut learner: Learner<M>| {
            if let Some(p) = &prepared
                && p.world != comm.world_size()
            {
                return Err(prepared_world_mismatch(p.world, comm.world_size()));
            }
            let given = (!self.devices.is_empty())
                .then(|| self.devices[comm.rank() % self.devices.len()].clone());
            match (&given, mpi) {
                (Some(d), _) => learner.fork(d),
                (None, false) => learner.fork(&device),
                (None, true) => {}
            }
            Ok(RankRun {
                comm,
                learner,
                train: train.clone(),
                settings,
                prepared: prepared.clone(),
                loader_error,
                device: given,
                owned: None,
                chunks: None,
                store: store.clone(),
            })
        };
        let follower = || {
            let learner = learner.clone();
            let epochs = epochs.clone();
            let rank_run = &rank_run;
            move |comm| {
                rank_run(comm, learner)?
                    .run_epochs(epochs, |e| !matches!(e, EpochEvent::ShouldStop))
            }
        };
        let leader =
            |comm| rank_run(comm, learner.clone())?.run_epochs(epochs.clone(), &mut rank0_events);
        let result = launch_with_leader(self.ranks, self.timeout, leader, follower);
        (result.map(|(_, model)| model), leader_events.processor)
    }

    /// Stage 3: the whole parameters the `Learner`'s model was prepared from.
    fn prepared_for<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
    ) -> crate::Result<Option<Arc<Prepared>>> {
        if !crate::sync::ZeroPlan::of(&self.config).shards_parameters() {
            return Ok(None);
        }
        let prepared = take_prepared(&learner.model()).ok_or_else(|| {
            crate::DeepSpeedError::LearnerStrategy(
                "ZeRO stage 3 shards the model before the Learner is built (and a prepared \
                 model trains once): pass it through DeepSpeedStrategy::prepare_model, then \
                 Learner::new"
                    .into(),
            )
        })?;
        if !launched_by_mpirun() && prepared.world != self.ranks {
            return Err(prepared_world_mismatch(prepared.world, self.ranks));
        }
        Ok(Some(prepared))
    }
}

fn prepared_world_mismatch(prepared: usize, world: usize) -> crate::DeepSpeedError {
    crate::DeepSpeedError::LearnerStrategy(format!(
        "the model was prepared for ZeRO stage 3 on {prepared} ranks but the training runs on \
         {world}; prepare it with the strategy that trains it"
    ))
}
