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
use burn_deepspeed_strategies::comm::{
    Communicator, CommunicatorExt, ReduceOp, ThreadWorld, ThreadWorldOptions,
};

use crate::DeepSpeedConfig;
use crate::config::ZeroStage;
use crate::engine::flat::{ParamLayout, params_range};
use crate::engine::{GradientSync, Zero3Sync, ZeroSync, broadcast_params};
use crate::zero3::GatherGroup;

use super::prepare::{Prepared, take_prepared};
use crate::engine::{refuse_unsupported, unsupported};
use crate::launch::{launched_by_mpirun, mpi_world};

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
    pub fn new(config: DeepSpeedConfig, ranks: usize) -> Self {
        Self {
            config,
            ranks: ranks.max(1),
            timeout: Duration::from_secs(1800),
        }
    }

    /// How long a rank waits for the others (default 30 minutes, like NCCL's).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// How the strategy reduces gradients: all-reduce (stage 0), ZeRO stages 1-2 at tensor
/// boundaries so that the Learner's own optimizer steps each rank's tensors, or stage 3,
/// where it steps each rank's chunks.
#[allow(clippy::large_enum_variant)]
enum StrategySync {
    Replicated(GradientSync),
    Zero(ZeroSync),
    Sharded {
        sync: Zero3Sync,
        _answering: Answering,
    },
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

    /// Stage 3: registers this rank's gather group for the prepared model's keys and loads
    /// this rank's chunks of rank 0's whole parameters into the `Learner`.
    fn load_chunks(&mut self) -> crate::Result<StrategySync> {
        let prepared = self.prepared.take().ok_or_else(|| {
            crate::DeepSpeedError::Strategy(
                "ZeRO stage 3 needs the model prepared by DeepSpeedStrategy::prepare_model".into(),
            )
        })?;
        let sync = Zero3Sync::for_learner(prepared.layout.clone(), self.config, self.comm.clone());
        sync.group().answer_on_this_thread(prepared.id);
        let answering = Answering(prepared.id);
        let mut flat = prepared.flat.clone();
        drop(prepared);
        self.comm.broadcast(&mut flat, 0)?;
        let model = sync.load_flat(self.learner.model(), &flat);
        drop(flat);
        self.learner.load_model(model.into_record());
        Ok(StrategySync::Sharded {
            sync,
            _answering: answering,
        })
    }

    /// The whole model: the Learner's own, or at stage 3 gathered (a collective).
    fn whole_model(&self, sync: &StrategySync) -> crate::Result<M> {
        let model = self.learner.model();
        match sync {
            StrategySync::Sharded { sync: z, .. } => {
                // Every parameter's value is gathered, in the same order on every rank.
                let whole = model.materialize();
                match z.group().take_error() {
                    Some(e) => Err(e.into()),
                    None => Ok(whole),
                }
            }
            _ => Ok(model),
        }
    }

    /// Trains epochs; `on_epoch` sees the epoch's events on this rank (rank 0 forwards them
    /// to the event processor, validates and checkpoints). Returns the trained model whole.
    fn run_epochs(
        mut self,
        epochs: std::ops::RangeInclusive<usize>,
        mut on_epoch: impl FnMut(EpochEvent<'_, M>) -> bool,
    ) -> crate::Result<M> {
        let shard = self.shard();
        let start = self.learner.model();
        let layout = ParamLayout::of(&start);
        let mut sync = match self.config.zero_optimization.stage {
            ZeroStage::Disabled => {
                StrategySync::Replicated(GradientSync::new(&start, self.config, self.comm.clone()))
            }
            ZeroStage::Parameters => self.load_chunks()?,
            _ => StrategySync::Zero(ZeroSync::for_whole_tensors(
                layout.clone(),
                self.config,
                self.comm.clone(),
            )),
        };
        if !matches!(sync, StrategySync::Sharded { .. }) {
            // Every replica starts from rank 0's parameters; the optimizer and schedule are
            // kept.
            let model = broadcast_params(self.comm.as_ref(), &layout, start)?;
            self.learner.load_model(model.into_record());
        }
        for epoch in epochs {
            if !on_epoch(EpochEvent::Start(epoch, shard.num_items())) {
                break;
            }
            let mut iter = shard.iter();
            let mut iteration = 0;
            'steps: loop {
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
                    break 'steps;
                }
                let model = self.learner.model();
                let mut outputs = Vec::with_capacity(micro.len());
                for item in micro {
                    let out = self.learner.train_step(item);
                    match &mut sync {
                        StrategySync::Replicated(s) => s.accumulate(&model, &out.grads),
                        StrategySync::Zero(z) => z.accumulate(&model, &out.grads),
                        StrategySync::Sharded { sync: z, .. } => z.accumulate(&model, &out.grads),
                    }
                    outputs.push(out.item);
                }
                match &mut sync {
                    StrategySync::Replicated(s) => {
                        let (grads, _norm) = s.reduce(&model)?;
                        s.clear_marks();
                        self.learner.lr_step();
                        self.learner.optimizer_step(grads);
                    }
                    StrategySync::Zero(z) => {
                        // Each rank steps its own tensors with the Learner's optimizer (which
                        // keeps state for those only), then the ranks exchange the results.
                        z.reduce()?;
                        let grads = z.own_gradients(&model);
                        self.learner.lr_step();
                        self.learner.optimizer_step(grads);
                        let updated = self.learner.model();
                        let own = params_range(&updated, &layout, z.own());
                        let gathered = z.gather(updated, &own)?;
                        self.learner.load_model(gathered.into_record());
                    }
                    StrategySync::Sharded { sync: z, .. } => {
                        // The chunks' gradients came reduce-scattered from the backward; the
                        // Learner's optimizer steps the chunks and the persistent tensors.
                        z.reduce()?;
                        let grads = z.reduced_gradients(&model)?;
                        self.learner.lr_step();
                        self.learner.optimizer_step(grads);
                        z.track_shards(&self.learner.model());
                    }
                }
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
            let whole = self.whole_model(&sync)?;
            if !on_epoch(EpochEvent::End(epoch, &self.learner, whole)) {
                break;
            }
        }
        self.whole_model(&sync)
    }
}

enum EpochEvent<'a, M: LearnerModel> {
    Start(usize, usize),
    ShouldStop,
    Item(TrainingItem<<M as burn::train::TrainStep>::Output>),
    /// The epoch, the learner, and its model whole (for validation).
    End(usize, &'a Learner<M>, M),
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
        if let Err(e) = refuse_unsupported(&config)
            .and_then(|_| refuse_in_strategy(&config, components.checkpointer.is_some()))
        {
            panic!("burn-deepspeed: {e}");
        }
        let prepared = match self.prepared_for(&learner) {
            Ok(p) => p,
            Err(e) => panic!("burn-deepspeed: {e}"),
        };
        config.gradient_accumulation_steps = None;
        let grad_accumulation = components.grad_accumulation.unwrap_or(1).max(1);
        let epochs = starting_epoch..=components.num_epochs;
        let mut processor = components.event_processor;
        let interrupter = components.interrupter.clone();
        let mut checkpointer = components.checkpointer;
        let event_store = components.event_store.clone();
        let device = learner
            .model()
            .devices()
            .into_iter()
            .next()
            .unwrap_or_default();

        // Rank 0's events: the event processor, validation and checkpoints.
        let mut rank0_events = |event: EpochEvent<'_, M>| -> bool {
            match event {
                EpochEvent::Start(epoch, items) => {
                    interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                        epoch_number: epoch,
                        total_items: items,
                    }));
                    true
                }
                EpochEvent::ShouldStop => interrupter.should_stop(),
                EpochEvent::Item(item) => {
                    interrupter
                        .fail_on_error(processor.process_train(LearnerEvent::ProcessedItem(item)));
                    true
                }
                EpochEvent::End(epoch, learner, whole) => {
                    interrupter
                        .fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
                    interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
                        epoch_number: epoch,
                        total_items: valid.num_items(),
                    }));
                    let model = whole.valid();
                    let mut it = valid.iter();
                    let mut iteration = 0;
                    while let Some(Ok(item)) = it.next() {
                        iteration += 1;
                        let out = InferenceStep::step(&model, item);
                        let item = TrainingItem::new(out, it.progress(), Some(iteration), None);
                        interrupter.fail_on_error(
                            processor.process_valid(LearnerEvent::ProcessedItem(item)),
                        );
                    }
                    interrupter
                        .fail_on_error(processor.process_valid(LearnerEvent::EndSplit(epoch)));
                    interrupter
                        .fail_on_error(processor.process_train(LearnerEvent::EndEpoch(epoch)));
                    if let Some(c) = &mut checkpointer {
                        c.checkpoint(learner, epoch, &event_store);
                    }
                    true
                }
            }
        };

        let result = if launched_by_mpirun() {
            mpi_world().and_then(|comm| {
                let rank0 = comm.rank() == 0;
                if let Some(p) = &prepared
                    && p.world != comm.world_size()
                {
                    return Err(prepared_world_mismatch(p.world, comm.world_size()));
                }
                let run = RankRun {
                    comm,
                    learner: learner.clone(),
                    train: train.clone(),
                    grad_accumulation,
                    config: &config,
                    prepared,
                };
                if rank0 {
                    run.run_epochs(epochs.clone(), &mut rank0_events)
                } else {
                    run.run_epochs(epochs.clone(), |e| !matches!(e, EpochEvent::ShouldStop))
                }
            })
        } else {
            let world = ThreadWorld::new(
                self.ranks,
                ThreadWorldOptions {
                    timeout: self.timeout,
                },
            );
            let mut comms = world.communicators().into_iter();
            let comm0 = comms.next().expect("at least one rank");
            std::thread::scope(|scope| {
                let handles: Vec<_> = comms
                    .map(|comm| {
                        let mut learner = learner.clone();
                        learner.fork(&device);
                        let run = RankRun {
                            comm: Arc::new(comm) as Arc<dyn Communicator>,
                            learner,
                            train: train.clone(),
                            grad_accumulation,
                            config: &config,
                            prepared: prepared.clone(),
                        };
                        let epochs = epochs.clone();
                        scope.spawn(move || {
                            run.run_epochs(epochs, |e| !matches!(e, EpochEvent::ShouldStop))
                                .map(|_| ())
                        })
                    })
                    .collect();
                let mut learner0 = learner.clone();
                learner0.fork(&device);
                let run = RankRun {
                    comm: Arc::new(comm0) as Arc<dyn Communicator>,
                    learner: learner0,
                    train: train.clone(),
                    grad_accumulation,
                    config: &config,
                    prepared,
                };
                let r0 = run.run_epochs(epochs.clone(), &mut rank0_events);
                for (i, h) in handles.into_iter().enumerate() {
                    match h.join() {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => panic!("burn-deepspeed: rank {}: {e}", i + 1),
                        Err(_) => panic!("burn-deepspeed: rank {} panicked", i + 1),
                    }
                }
                r0
            })
        };
        match result {
            Ok(model) => (model, processor),
            Err(e) => panic!("burn-deepspeed: rank 0: {e}"),
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

/// What the engine runs but the Learner strategy cannot: the strategy steps the `Learner`'s
/// own optimizer and calls the `Learner`'s model as it is.
fn refuse_in_strategy(config: &DeepSpeedConfig, checkpointer: bool) -> crate::Result<()> {
    let kind = config.optimizer_kind();
    if kind.is_one_bit() {
        return Err(unsupported(
            "optimizer.type",
            &format!(
                "the Learner strategy steps the Learner's own optimizer; {kind:?} runs in \
                 `DeepSpeedEngine`"
            ),
        ));
    }
    if checkpointer && config.zero_optimization.stage != ZeroStage::Disabled {
        return Err(unsupported(
            "zero_optimization.stage",
            "the Learner's checkpointer saves rank 0's Learner, whose optimizer holds only rank \
             0's partition at ZeRO stages 1-3 (and at stage 3 its model holds only rank 0's \
             chunks), so a resumed run would lose the rest; leave the checkpointer off, or \
             checkpoint with `DeepSpeedEngine::save_checkpoint`, which saves every rank's part",
        ));
    }
    if config.progressive_layer_drop.enabled {
        return Err(unsupported(
            "progressive_layer_drop.enabled",
            "the Learner strategy cannot hand θ to the Learner's model; drive the model with \
             `DeepSpeedEngine::pld_theta`",
        ));
    }
    Ok(())
}
