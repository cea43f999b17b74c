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
//! The `Learner`'s checkpointer is refused at stages 1-3: it would save rank 0's optimizer
//! state (its partition) as if it were all of it. Checkpoint those stages with
//! [`DeepSpeedEngine`](crate::DeepSpeedEngine), whose checkpoints hold every rank's part.

use std::sync::Arc;
use std::time::Duration;

use burn::train::InferenceStep;
use burn::train::{
    EventProcessorTraining, Learner, LearnerEvent, LearnerModel, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents, TrainingItem, ValidLoader,
};
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};

use super::prepare::{Prepared, take_prepared};
use crate::DeepSpeedConfig;
use crate::config::{EntryPoint, ZeroStage, check_supported};
use crate::engine::flat::ParamLayout;
use crate::launch::{launch_with_leader, launched_by_mpirun};
use crate::sync::{self, GradSync, ShardedSync, SyncOptions, broadcast_params};
use crate::zero3::GatherGroup;

/// A `SupervisedLearningStrategy` that trains with DeepSpeed-style data parallelism.
#[derive(Debug, Clone)]
pub struct DeepSpeedStrategy {
    pub(super) config: DeepSpeedConfig,
    pub(super) ranks: usize,
    timeout: Duration,
}

impl DeepSpeedStrategy {
    /// `ranks` data-parallel ranks as threads (ignored under `mpirun`, where each process is
    /// one rank). `gradient_clipping`, `reduce_bucket_size` and `prescale_gradients` come
    /// from `config`; the optimizer and schedule are the `Learner`'s; the number of
    /// micro-batches per step is `SupervisedTraining`'s gradient accumulation (default 1).
    /// `ranks` 0 is refused when training starts.
    pub fn new(config: DeepSpeedConfig, ranks: usize) -> Self {
        Self {
            config,
            ranks,
            timeout: Duration::from_secs(1800),
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

struct RankRun<'a, M: LearnerModel> {
    comm: Arc<dyn Communicator>,
    learner: Learner<M>,
    train: TrainLoader<M>,
    grad_accumulation: usize,
    config: &'a DeepSpeedConfig,
    /// Stage 3: the whole parameters the model was prepared from, dropped once loaded.
    prepared: Option<Arc<Prepared>>,
}

impl<M: LearnerModel> RankRun<'_, M> {
    /// This rank's contiguous slice of the training set.
    fn shard(&self) -> TrainLoader<M> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let n = self.train.num_items();
        let per = n / world;
        self.train.slice(rank * per, (rank + 1) * per)
    }

    /// The gradient regime around the Learner's optimizer, with every rank's model starting
    /// from rank 0's parameters. At stage 3 this rank's gather group answers the prepared
    /// model's keys until the returned guard drops.
    fn build_sync(&mut self) -> crate::Result<(Box<dyn GradSync<M>>, Option<Answering>)> {
        let options = SyncOptions::of(self.config);
        if options.stage == ZeroStage::Parameters {
            let (sync, answering) = self.load_chunks(&options)?;
            return Ok((Box::new(sync), Some(answering)));
        }
        let start = self.learner.model();
        let layout = ParamLayout::of(&start);
        let sync = sync::for_caller_optimizer(layout.clone(), self.comm.clone(), &options)?;
        // Every replica starts from rank 0's parameters; the optimizer and schedule are kept.
        let model = broadcast_params(self.comm.as_ref(), &layout, start)?;
        self.learner.load_model(model.into_record());
        Ok((sync, None))
    }

    /// Stage 3: registers this rank's gather group for the prepared model's keys and loads
    /// this rank's chunks of rank 0's whole parameters into the `Learner`.
    fn load_chunks(&mut self, options: &SyncOptions) -> crate::Result<(ShardedSync, Answering)> {
        let prepared = self.prepared.take().ok_or_else(|| {
            crate::DeepSpeedError::Strategy(
                "ZeRO stage 3 needs the model prepared by DeepSpeedStrategy::prepare_model".into(),
            )
        })?;
        let sync = ShardedSync::for_learner(prepared.layout.clone(), self.comm.clone(), options);
        sync.group().answer_on_this_thread(prepared.id);
        let answering = Answering(prepared.id);
        let mut flat = prepared.flat.clone();
        drop(prepared);
        self.comm.broadcast(&mut flat, 0)?;
        let model = sync.load_flat(self.learner.model(), &flat);
        drop(flat);
        self.learner.load_model(model.into_record());
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
        for epoch in epochs {
            if !on_epoch(EpochEvent::Start(epoch, shard.num_items())) {
                break;
            }
            let mut iter = shard.iter();
            let mut iteration = 0;
            loop {
                let mut micro = Vec::with_capacity(self.grad_accumulation);
                while micro.len() < self.grad_accumulation {
                    match iter.next() {
                        Some(Ok(item)) => micro.push(item),
                        _ => break,
                    }
                }
                // Every rank must take part in every step: stop the epoch when any rank ran
                // out of data or was asked to stop.
                let stop = micro.len() < self.grad_accumulation || on_epoch(EpochEvent::ShouldStop);
                let mut flag = [u8::from(stop)];
                self.comm.all_reduce(&mut flag, ReduceOp::Max)?;
                if flag[0] != 0 {
                    break;
                }
                let outputs = self.step(sync.as_mut(), micro)?;
                for item in outputs {
                    iteration += 1;
                    let progress = iter.progress();
                    on_epoch(EpochEvent::Item(TrainingItem::new(
                        item,
                        progress,
                        Some(iteration),
                        Some(self.learner.lr_current()),
                    )));
                }
            }
            let whole = sync.whole_model(&self.learner.model())?;
            if !on_epoch(EpochEvent::End(epoch, &self.learner, whole)) {
                break;
            }
        }
        sync.whole_model(&self.learner.model())
    }

    /// One optimizer step over `micro`: the Learner computes each micro-batch's gradients,
    /// the regime reduces them, the Learner's optimizer steps what this rank owns (whole
    /// tensors at stage 0, its tensors at stages 1-2, its chunks at stage 3), and the regime
    /// makes every rank's model consistent again.
    fn step(
        &mut self,
        sync: &mut dyn GradSync<M>,
        micro: Vec<<M as burn::train::TrainStep>::Input>,
    ) -> crate::Result<Vec<<M as burn::train::TrainStep>::Output>> {
        let model = self.learner.model();
        let mut outputs = Vec::with_capacity(micro.len());
        for item in micro {
            let out = self.learner.train_step(item);
            sync.accumulate(&model, &out.grads);
            outputs.push(out.item);
        }
        sync.reduce()?;
        let grads = sync.reduced_gradients(&model)?;
        self.learner.lr_step();
        self.learner.optimizer_step(grads);
        if let Some(updated) = sync.finish_external_step(&self.learner.model())? {
            self.learner.load_model(updated.into_record());
        }
        Ok(outputs)
    }
}

enum EpochEvent<'a, M: LearnerModel> {
    Start(usize, usize),
    ShouldStop,
    Item(TrainingItem<<M as burn::train::TrainStep>::Output>),
    /// The epoch, the learner, and its model whole (for validation).
    End(usize, &'a Learner<M>, M),
}

/// Rank 0's side of training: the event processor, validation and checkpoints.
struct LeaderEvents<M: LearnerModel> {
    processor: SupervisedTrainingEventProcessor<M>,
    interrupter: burn::train::Interrupter,
    checkpointer: Option<burn::train::LearningCheckpointer<M>>,
    event_store: Arc<burn::train::metric::store::EventStoreClient>,
    valid: ValidLoader<M>,
}

impl<M: LearnerModel> LeaderEvents<M> {
    /// Handles one of rank 0's events; false asks the ranks to stop.
    fn on(&mut self, event: EpochEvent<'_, M>) -> bool {
        let (processor, interrupter) = (&mut self.processor, &self.interrupter);
        match event {
            EpochEvent::Start(epoch, items) => {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: items,
                }));
            }
            EpochEvent::ShouldStop => return interrupter.should_stop(),
            EpochEvent::Item(item) => {
                interrupter
                    .fail_on_error(processor.process_train(LearnerEvent::ProcessedItem(item)));
            }
            EpochEvent::End(epoch, learner, whole) => {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
                self.validate(epoch, whole);
                let (processor, interrupter) = (&mut self.processor, &self.interrupter);
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndEpoch(epoch)));
                if let Some(c) = &mut self.checkpointer {
                    c.checkpoint(learner, epoch, &self.event_store);
                }
            }
        }
        true
    }

    /// Runs the validation split on the whole model.
    fn validate(&mut self, epoch: usize, whole: M) {
        let (processor, interrupter) = (&mut self.processor, &self.interrupter);
        interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
            epoch_number: epoch,
            total_items: self.valid.num_items(),
        }));
        let model = whole.valid();
        let mut it = self.valid.iter();
        let mut iteration = 0;
        while let Some(Ok(item)) = it.next() {
            iteration += 1;
            let out = InferenceStep::step(&model, item);
            let item = TrainingItem::new(out, it.progress(), Some(iteration), None);
            interrupter.fail_on_error(processor.process_valid(LearnerEvent::ProcessedItem(item)));
        }
        interrupter.fail_on_error(processor.process_valid(LearnerEvent::EndSplit(epoch)));
    }
}

impl<M: LearnerModel> SupervisedLearningStrategy<M> for DeepSpeedStrategy {
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        train: TrainLoader<M>,
        valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let mut config = self.config.clone();
        let checkpointer = components.checkpointer.is_some();
        if let Err(e) = check_supported(&config, EntryPoint::Strategy { checkpointer }) {
            panic!("burn-deepspeed: {e}");
        }
        let prepared = match self.prepared_for(&learner) {
            Ok(p) => p,
            Err(e) => panic!("burn-deepspeed: {e}"),
        };
        config.gradient_accumulation_steps = None;
        let grad_accumulation = components.grad_accumulation.unwrap_or(1).max(1);
        let epochs = starting_epoch..=components.num_epochs;
        let device = learner
            .model()
            .devices()
            .into_iter()
            .next()
            .unwrap_or_default();
        let mut leader_events = LeaderEvents {
            processor: components.event_processor,
            interrupter: components.interrupter.clone(),
            checkpointer: components.checkpointer,
            event_store: components.event_store.clone(),
            valid,
        };
        let mut rank0_events = |event: EpochEvent<'_, M>| leader_events.on(event);

        // Each rank trains its own copy of the Learner (forked onto the device, in the thread
        // world) with its own communicator.
        let mpi = launched_by_mpirun();
        let config = &config;
        let rank_run = |comm: Arc<dyn Communicator>, mut learner: Learner<M>| {
            if let Some(p) = &prepared
                && p.world != comm.world_size()
            {
                return Err(prepared_world_mismatch(p.world, comm.world_size()));
            }
            if !mpi {
                learner.fork(&device);
            }
            Ok(RankRun {
                comm,
                learner,
                train: train.clone(),
                grad_accumulation,
                config,
                prepared: prepared.clone(),
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
        match result {
            Ok((_, model)) => (model, leader_events.processor),
            Err(e) => panic!("burn-deepspeed: {e}"),
        }
    }
}

impl DeepSpeedStrategy {
    /// Stage 3: the whole parameters the `Learner`'s model was prepared from.
    fn prepared_for<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
    ) -> crate::Result<Option<Arc<Prepared>>> {
        if self.config.zero_optimization.stage != ZeroStage::Parameters {
            return Ok(None);
        }
        let prepared = take_prepared(&learner.model()).ok_or_else(|| {
            crate::DeepSpeedError::Strategy(
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
    crate::DeepSpeedError::Strategy(format!(
        "the model was prepared for ZeRO stage 3 on {prepared} ranks but the training runs on \
         {world}; prepare it with the strategy that trains it"
    ))
}
