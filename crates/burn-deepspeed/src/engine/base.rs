//! [`DeepSpeedEngine`]: data-parallel training of any Burn [`TrainStep`] module, in the spirit
//! of DeepSpeed's `engine.train_batch()`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Device;
use burn::train::TrainStep;
use burn_deepspeed_compress::pld::ProgressiveLayerDrop;
use burn_deepspeed_strategies::comm::{
    CommStats, CommsLogger, Communicator, CommunicatorExt, ReduceOp,
};
use burn_deepspeed_strategies::onebit::OneBitPhase;
use burn_deepspeed_strategies::zero::PartitionState;

use crate::activation::{CheckpointStats, take_stats, with_config_options};
use crate::checkpoint::{self, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointMeta};
use crate::config::{
    BatchSizes, DeepSpeedConfig, EntryPoint, OptimizerKind, ZeroStage, check_supported,
};
use crate::flat::param_paths;
use crate::grid::Grid;
use crate::memory::ModelStateBytes;
use crate::memory::estimate::{StatePrecision, estimate_model_states};
use crate::memory::heap::HeapWindow;
use crate::monitor::MonitorRecord;
use crate::moq::Moq;
use crate::precision::{
    LossScalerState, take_backward_time, unscaled_backward_message, with_loss_scale,
};
use crate::profiler::{ProfileOptions, StepFigures, get_model_profile};
use crate::step::core::StepCore;
use crate::step::{StepLoss, StepReport};
use crate::sync::{self, GradSync, ModelParallelNorm};
use crate::tensor_parallel::join_flat;
use crate::{DeepSpeedError, Result, agreed};

/// The forward [`DeepSpeedEngine::set_profile_forward`] registers.
type ProfileForward<M> = Box<dyn Fn(&M, &Device) + Send>;

/// Data-parallel training engine with ZeRO (arXiv 1910.02054) stages 0 to 3.
///
/// The engine owns the model, the step counter and the schedule; how gradients become an
/// update is the [`GradSync`] regime the config names ([`crate::sync`]):
///
/// - stage 0 ([`ReplicatedSync`](crate::sync::ReplicatedSync)): gradients averaged by
///   bucketed all-reduce, clipped by global norm, and the same step on every rank (Burn's
///   optimizer, or a 1-bit one through [`CompressedSync`](crate::sync::CompressedSync));
/// - stages 1 and 2 ([`PartitionedSync`](crate::sync::PartitionedSync)): gradients
///   reduce-scattered, each rank steps its slice and the slices are all-gathered;
/// - stage 3 ([`ShardedSync`](crate::sync::ShardedSync)): the parameters too are stored as
///   per-rank chunks, gathered whole only while a forward or backward op uses them.
///
/// SPMD: create one engine per rank, each with that rank's [`Communicator`]. Rank 0's
/// parameters are broadcast at creation, so every replica starts identical.
pub struct DeepSpeedEngine<M: Module> {
    model: M,
    sync: Box<dyn GradSync<M>>,
    pld: Option<ProgressiveLayerDrop>,
    /// The data-parallel group: where gradients are averaged and ZeRO cuts the state.
    comm: Arc<dyn Communicator>,
    /// The grid: the data-parallel group alone, or with tensor slicing its tensor-parallel
    /// group too; every rank of its world agrees on each step.
    grid: Grid,
    config: DeepSpeedConfig,
    batch: BatchSizes,
    loss_sum: f64,
    /// The step protocol: loss scale, step counters, breakdown and monitor.
    core: StepCore,
    fb_time: Duration,
    /// Time in `TrainStep::step` this step (forward and backward).
    train_step_time: Duration,
    /// Time handing gradients to the regime this step.
    accumulate_time: Duration,
    /// Time in [`precision::backward`](crate::precision::backward) this step; `None` once a
    /// micro-batch ran its backward without it.
    bwd_time: Option<Duration>,
    /// When this step's first micro-batch started.
    step_start: Option<Instant>,
    /// The forward the flops profiler runs at `flops_profiler.profile_step`.
    profile_forward: Option<ProfileForward<M>>,
    /// Counters before this step's first micro-batch (stages 2-3 communicate in backward).
    stats_at_step_start: Option<CommStats>,
    /// fp16: a micro-batch of this step ran a plain `loss.backward()`, so its gradients are not
    /// scaled: the step is refused.
    unscaled: bool,
    /// The most heap one micro-batch's forward and backward held above what was live before
    /// them, in this step (with the counting allocator installed).
    activation_peak: Option<u64>,
    /// MoQ: the weights quantized after each step, when configured.
    moq: Option<Moq>,
}

impl<M> DeepSpeedEngine<M>
where
    M: Module + TrainStep,
    M::Output: StepLoss,
{
    /// Creates the engine for this rank: resolves the config for the communicator's world
    /// size, refuses what it cannot run, builds the gradient regime (with its optimizer), and
    /// broadcasts rank 0's parameters.
    pub fn new(model: M, config: DeepSpeedConfig, comm: Arc<dyn Communicator>) -> Result<Self> {
        if config.tp_size() > 1 {
            return Err(DeepSpeedError::Unsupported {
                key: "tensor_parallel.tp_size".into(),
                reason: format!(
                    "tp_size is {}: build a `grid::Grid` from the config, slice the model \
                     with its `tensor_parallel()` group, and create the engine with \
                     `DeepSpeedEngine::with_grid`",
                    config.tp_size()
                ),
            });
        }
        let comm = match config.comms_logger.enabled {
            true => CommsLogger::wrap(comm, config.comms_logger.options()?),
            false => comm,
        };
        Self::with_grid(model, config, &Grid::data_parallel(comm)?)
    }

    /// [`new`](Self::new) on a [`Grid`] (DeepSpeed's `initialize(mpu=...)`): `model` is this
    /// rank's slice of the model over the grid's
    /// [`tensor_parallel`](Grid::tensor_parallel) group (its sliced layers record their
    /// layouts there), and the engine is data-parallel over the grid's
    /// [`data`](Grid::data) group: gradients are averaged there, ZeRO cuts the state there,
    /// and the batch sizes count its ranks. The global gradient norm counts each logical
    /// parameter once ([`ModelParallelNorm`](crate::sync::ModelParallelNorm)). Every rank of the grid agrees
    /// on each step, so a failure on one slice fails the step everywhere.
    ///
    /// With tensor slicing this version runs ZeRO stages 0-3 with Adam or AdamW (LAMB's
    /// per-tensor trust ratios would see slices, and 1-bit compression would cross the
    /// tensor group: both are refused by key); its checkpoints are the pipeline engine's
    /// (a pipeline of one stage loads them on any grid).
    pub fn with_grid(model: M, mut config: DeepSpeedConfig, grid: &Grid) -> Result<Self> {
        let comm = grid.data().clone();
        let batch = config.resolve(comm.world_size())?;
        // Tensor slices and experts communicate during every micro-batch, beside the reductions
        // that `overlap_comm` would run on a second thread (under MPI, every call of a process
        // is serialized, and the two could wait on each other): it runs with data
        // parallelism alone.
        let sliced = grid.topology().tensor > 1 || grid.expert_parallel().size() > 1;
        let zero = &config.zero_optimization;
        let overlapping = matches!(zero.stage, ZeroStage::Gradients | ZeroStage::Parameters)
            && zero.overlap_comm();
        if sliced && overlapping {
            // Stage 3 turns it on by default: only an explicit request is worth a warning.
            if zero.overlap_comm == Some(true) {
                tracing::warn!(
                    "zero_optimization.overlap_comm is off under tensor slicing and expert \
                     parallelism: their collectives run during each micro-batch"
                );
            }
            config.zero_optimization.overlap_comm = Some(false);
        }
        check_supported(&config, EntryPoint::Engine)?;
        check_grid(&config, grid)?;
        let (model, mut sync) = match grid.expert_parallel().size() > 1 {
            true => {
                sync::build_expert_parallel(model, &config, comm.clone(), grid.expert_parallel())?
            }
            false => sync::build(model, &config, comm.clone())?,
        };
        if grid.topology().tensor > 1 {
            let tp = grid.tensor_parallel();
            sync.model_parallel_norm(ModelParallelNorm::none().with_tensor(
                grid.tensor().clone(),
                sync.layout(),
                tp,
            ))?;
        }
        // Mixed precision: the regime keeps fp32 masters of the (broadcast) f32 parameters,
        // and the model becomes their 16-bit working copy.
        let model = match config.working_dtype() {
            Some(dtype) => sync.keep_masters(model, dtype)?,
            None => model,
        };
        // MoQ quantizes the weights the model computes with (the working copy in mixed
        // precision; check_supported refused stage 3).
        let moq = match config.moq()? {
            Some(settings) => Some(Moq::new(&model, settings)?),
            None => None,
        };
        let pld = config
            .progressive_layer_drop
            .enabled
            .then_some(ProgressiveLayerDrop {
                theta: config.progressive_layer_drop.theta,
                gamma: config.progressive_layer_drop.gamma,
            });
        let core = StepCore::with_monitor(&config, grid.world().as_ref())?;
        Ok(Self {
            model,
            sync,
            pld,
            comm,
            grid: grid.clone(),
            config,
            batch,
            loss_sum: 0.0,
            core,
            fb_time: Duration::ZERO,
            train_step_time: Duration::ZERO,
            accumulate_time: Duration::ZERO,
            bwd_time: Some(Duration::ZERO),
            step_start: None,
            profile_forward: None,
            stats_at_step_start: None,
            unscaled: false,
            activation_peak: None,
            moq,
        })
    }

    /// Runs forward and backward on one micro-batch and accumulates its gradient
    /// (DeepSpeed's `engine.forward` + `engine.backward`). Returns the step's output.
    ///
    /// Under `fp16` the module's [`TrainStep::step`] must call
    /// [`precision::backward(&loss)`](crate::precision::backward) instead of
    /// `loss.backward()`, so that the loss is multiplied by the current loss scale before
    /// backward; a step that does not is refused at the next [`step`](Self::step).
    pub fn forward_backward(&mut self, input: M::Input) -> M::Output {
        let start = Instant::now();
        self.step_start.get_or_insert(start);
        self.stats_at_step_start
            .get_or_insert_with(|| self.comm.stats());
        take_backward_time();
        let scale = self.core.loss_scale();
        let window = HeapWindow::open();
        let train_step = Instant::now();
        let (out, scaled) = {
            let _span = tracing::debug_span!("forward_backward", rank = self.comm.rank()).entered();
            let model = &self.model;
            self.sync.forward_scope(true);
            let out = with_config_options(&self.config, || {
                with_loss_scale(scale, || TrainStep::step(model, input))
            });
            self.sync.forward_scope(false);
            out
        };
        self.train_step_time += train_step.elapsed();
        if let Some(window) = window {
            let peak = window.peak_above_start();
            self.activation_peak = Some(self.activation_peak.map_or(peak, |p| p.max(peak)));
        }
        self.unscaled |= !scaled;
        self.bwd_time = match (self.bwd_time, take_backward_time()) {
            (Some(sum), Some(took)) => Some(sum + took),
            _ => None,
        };
        self.loss_sum += out.item.loss();
        let accumulate = Instant::now();
        {
            let _span = tracing::debug_span!("accumulate", rank = self.comm.rank()).entered();
            self.sync.accumulate(&self.model, &out.grads);
        }
        self.accumulate_time += accumulate.elapsed();
        self.fb_time += start.elapsed();
        out.item
    }

    /// What this step's activation checkpoints did (see [`StepReport::activation_checkpoints`]),
    /// logged when the section asks for `profile`.
    fn checkpoint_stats(&self) -> Option<CheckpointStats> {
        let stats = take_stats();
        let section = self.config.activation_checkpointing.as_ref();
        if section.is_some_and(|s| s.profile) {
            stats.log(self.comm.rank());
        }
        (section.is_some() || stats.forwards > 0).then_some(stats)
    }

    /// Averages the accumulated gradient over ranks and micro-batches, clips it, and takes
    /// one optimizer step (DeepSpeed's `engine.step` at an accumulation boundary).
    ///
    /// The ranks first agree that each of them has a gradient to step (a rank that calls it
    /// before any `forward_backward` fails every rank, not only itself). When the global
    /// gradient norm is not finite (NaN or inf anywhere, on any rank) the step is skipped on
    /// every rank, as DeepSpeed does: parameters, optimizer moments and 1-bit error buffers
    /// stay as they were, the gradient is dropped, [`skipped_steps`](Self::skipped_steps)
    /// counts it, the report's `overflow` says so, and the learning-rate schedule does not advance.
    pub fn step(&mut self) -> Result<StepReport> {
        self.step_agreed(None)
    }

    /// [`step`](Self::step), after agreeing with the other ranks on `failure` (this rank's
    /// reason not to step, if any).
    fn step_agreed(&mut self, failure: Option<String>) -> Result<StepReport> {
        // Stage 2's `overlap_comm` may still be reducing the last micro-batch's buckets: the
        // step's own collectives come after them.
        self.sync.settle();
        let micro_steps = self.sync.micro_steps();
        let failure = failure
            .or_else(|| {
                (micro_steps == 0)
                    .then(|| "step() called before any forward_backward()".to_string())
            })
            .or_else(|| self.unscaled.then(unscaled_backward_message));
        // A sliced layer's collective that failed in forward or backward left zeros.
        let failure = match self.grid.tensor_parallel().take_error() {
            Some(e) => Some(format!("a tensor-parallel collective failed: {e}")),
            None => failure,
        };
        let failure = match self.grid.expert_parallel().take_error() {
            Some(e) => Some(format!("an expert-parallel all-to-all failed: {e}")),
            None => failure,
        };
        let failure = self.core.take_monitor_failure().or(failure);
        let local = failure.map_or(Ok(()), |f| Err(DeepSpeedError::Data(f)));
        if let Err(e) = agreed(self.grid.world().as_ref(), "step", local) {
            self.sync.discard();
            self.loss_sum = 0.0;
            self.stats_at_step_start = None;
            self.unscaled = false;
            self.activation_peak = None;
            self.fb_time = Duration::ZERO;
            self.train_step_time = Duration::ZERO;
            self.accumulate_time = Duration::ZERO;
            self.bwd_time = Some(Duration::ZERO);
            self.step_start = None;
            return Err(e);
        }
        let before = self
            .stats_at_step_start
            .take()
            .unwrap_or_else(|| self.comm.stats());
        let lr = self.core.lr(&self.config);
        // `wall_clock_breakdown`: the time this rank waits for the slowest one, apart from
        // the reduction's own (a barrier first; without the breakdown the reduction's first
        // collective waits instead).
        let reduce_wait = match self.config.wall_clock_breakdown && self.comm.world_size() > 1 {
            true => {
                let start = Instant::now();
                self.grid.world().barrier()?;
                Some(start.elapsed())
            }
            false => None,
        };
        let start = Instant::now();
        let loss_scale = self.core.loss_scale();
        let reduced = {
            let _span = tracing::debug_span!("reduce", rank = self.comm.rank()).entered();
            self.sync.reduce(loss_scale.unwrap_or(1.0))?
        };
        let reduce = start.elapsed();
        // Ranks that clipped their own gradients (1-bit compression) learn of another rank's
        // overflow here; a global norm is the same on every rank already.
        let overflow = match reduced.local_norm_sq {
            Some(_) if self.comm.world_size() > 1 => {
                let mut flag = [f32::from(u8::from(reduced.overflow))];
                self.comm.all_reduce(&mut flag, ReduceOp::Max)?;
                flag[0] != 0.0
            }
            _ => reduced.overflow,
        };
        let start = Instant::now();
        // The overflow flag is the same on every rank, and so is the core's decision.
        if self.core.decide(overflow, reduced.norm)? {
            self.model = self.sync.step(self.model.clone(), lr)?;
            if let Some(moq) = &mut self.moq {
                let taken = self.core.global_step() + 1 - self.core.skipped_steps();
                self.model = moq.after_step(self.model.clone(), taken);
            }
        } else {
            self.sync.discard();
        }
        let optimizer = start.elapsed();
        let mut scalars = [
            (self.loss_sum / micro_steps as f64) as f32,
            reduced.local_norm_sq.unwrap_or(0.0) as f32,
        ];
        if self.comm.world_size() > 1 {
            self.comm.all_reduce(&mut scalars, ReduceOp::Mean)?;
        }
        let grad_norm = match reduced.local_norm_sq {
            Some(_) => (scalars[1] as f64).sqrt(),
            None => reduced.norm,
        };
        let pld_theta = self.pld_theta();
        let moved = self.comm.stats().since(&before);
        let forward_backward = std::mem::take(&mut self.fb_time);
        let train_step = std::mem::take(&mut self.train_step_time);
        let accumulate = std::mem::take(&mut self.accumulate_time);
        let backward = self.bwd_time.replace(Duration::ZERO);
        let step_time = self
            .step_start
            .take()
            .map_or(Duration::ZERO, |t| t.elapsed());
        let report = StepReport {
            step: self.core.global_step() + 1,
            loss: scalars[0] as f64,
            lr,
            grad_norm,
            overflow,
            bytes_sent: moved.total_sent(),
            model_bytes_sent: moved.total_model_sent(),
            compressed: reduced.compressed,
            pld_theta,
            moq_bits: self.moq.as_ref().map(Moq::bits),
            loss_scale,
            activation_checkpoints: self.checkpoint_stats(),
            peak_activation_bytes: self.activation_peak.take(),
            forward_backward,
            forward: backward.map(|b| train_step.saturating_sub(b)),
            backward,
            accumulate,
            reduce_wait,
            reduce,
            optimizer,
            step_time,
        };
        self.loss_sum = 0.0;
        let print_as = (self.grid.world().rank() == 0).then_some((0, ""));
        let (sync, model) = (&self.sync, &self.model);
        let ms = |d: Duration| Some(d.as_secs_f64() * 1e3);
        self.core
            .finish(&report.phases(), print_as, report.step_time, |timed| {
                MonitorRecord {
                    train_loss: report.loss,
                    lr: report.lr,
                    loss_scale: report.loss_scale.map(f64::from),
                    grad_norm: report.grad_norm,
                    model_state_bytes: Some(sync.held(model).total() as f64),
                    forward_ms: report.forward.and_then(ms),
                    backward_ms: report.backward.and_then(ms),
                    accumulate_ms: ms(report.accumulate),
                    reduce_ms: ms(report.reduce),
                    optimizer_ms: ms(report.optimizer),
                    ..timed
                }
            });
        self.profile_at_step(&report);
        Ok(report)
    }

    /// The forward the flops profiler runs (`flops_profiler.enabled`): given the model and a
    /// device, build one micro-batch's input there and run the forward (DeepSpeed's profiler
    /// hooks the engine's own forward; Burn's `TrainStep` runs forward and backward in one
    /// call, so the engine asks for the forward alone). See
    /// [`get_model_profile`](crate::profiler::get_model_profile).
    pub fn set_profile_forward(&mut self, forward: impl Fn(&M, &Device) + Send + 'static) {
        self.profile_forward = Some(Box::new(forward));
    }

    /// `flops_profiler`: at `profile_step`, global rank 0 profiles the model's forward and
    /// prints it (or writes `output_file`) with the step's measured times. A profile that
    /// cannot be made is reported and training goes on: it changes nothing other ranks see.
    fn profile_at_step(&mut self, report: &StepReport) {
        let section = &self.config.flops_profiler;
        if !section.enabled || report.step != section.profile_step || self.grid.world().rank() != 0
        {
            return;
        }
        let Some(forward) = &self.profile_forward else {
            eprintln!(
                "flops profiler: step {}: no forward to profile; call \
                 `DeepSpeedEngine::set_profile_forward` with one micro-batch's forward",
                report.step
            );
            return;
        };
        let options = ProfileOptions::from(section);
        let profile = get_model_profile(&self.model, |m, d| forward(m, d), &options).map(|p| {
            p.with_step(StepFigures {
                fwd: report.forward,
                bwd: report.backward,
                step: report.step_time,
                samples: self.batch.train_batch_size,
                micro_batches: self.batch.gradient_accumulation_steps,
            })
        });
        let text = match profile {
            Ok(p) => p.report(),
            Err(e) => {
                eprintln!("flops profiler: step {}: {e}", report.step);
                return;
            }
        };
        match &section.output_file {
            Some(path) => {
                if let Err(e) = std::fs::write(path, &text) {
                    eprintln!("flops profiler: cannot write {path}: {e}");
                }
            }
            None => print!("{text}"),
        }
    }

    /// Declares how many tokens one sample holds, so that the monitor also records
    /// tokens per second (a sequence model's sequence length).
    pub fn set_tokens_per_sample(&mut self, tokens: u64) {
        self.core.set_tokens_per_sample(tokens);
    }

    /// The files the monitor writes on this rank (empty when it has none).
    pub fn monitor_paths(&self) -> Vec<PathBuf> {
        self.core.monitor_paths()
    }

    /// This rank's communication log, when the config enables `comms_logger` (or the
    /// communicator the engine was given logs).
    pub fn comms_log(&self) -> Option<Arc<burn_deepspeed_strategies::comm::CommsLog>> {
        self.grid.world().comms_log()
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches of this rank
    /// (DeepSpeed's `engine.train_batch`).
    pub fn train_batch(
        &mut self,
        micro_batches: impl IntoIterator<Item = M::Input>,
    ) -> Result<StepReport> {
        let mut n = 0;
        for input in micro_batches {
            self.forward_backward(input);
            n += 1;
        }
        let gas = self.batch.gradient_accumulation_steps;
        let failure = (n as u64 != gas).then(|| {
            format!("train_batch got {n} micro-batches; gradient_accumulation_steps is {gas}")
        });
        self.step_agreed(failure)
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        self.config.lr_at(step)
    }

    /// Progressive layer dropping (arXiv 2010.13369): θ(t) for the next step's forward passes,
    /// `(1 − θ̄)·e^(−γt) + θ̄` with t the optimizer steps taken, or `None` when
    /// `progressive_layer_drop` is off. As in DeepSpeed, the model does the dropping: pass θ to
    /// its forward (e.g. in the batch) and keep layer l of L with probability
    /// [`keep_probabilities`](crate::pld::ProgressiveLayerDrop::keep_probabilities)`(θ, L)[l]`.
    /// Every rank must draw the same layers in a micro-step (seed the draw with the step and
    /// micro-step, not the rank): at ZeRO stage 3 a dropped layer is not gathered, and ranks
    /// that dropped different layers would pair different gathers (the communicator's labels
    /// then refuse the step).
    pub fn pld_theta(&self) -> Option<f64> {
        self.pld.map(|p| p.theta_at(self.core.global_step()))
    }

    /// Saves the model, the optimizer state and the step as checkpoint `tag` (default
    /// `global_step{N}`, as in DeepSpeed) under `dir`, atomically, and points `dir/latest` at
    /// it. Collective: every rank calls it (see [`checkpoint`] for who writes what; the
    /// directory must be visible to every rank). Returns the checkpoint's directory.
    ///
    /// 1-bit optimizers save m, v, their frozen coefficients and the step (which fixes the
    /// phase), not the compression error buffers: after a load those start from zero, as in
    /// DeepSpeed.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<PathBuf> {
        self.refuse_sliced_checkpoint()?;
        self.sync.settle();
        let tag = tag.map_or_else(
            || format!("global_step{}", self.core.global_step()),
            String::from,
        );
        let meta = self.meta();
        checkpoint::save(
            dir.as_ref(),
            &tag,
            self.comm.as_ref(),
            self.sync.as_ref(),
            &self.model,
            meta,
        )
    }

    /// Loads checkpoint `tag` (default: the one `dir/latest` names) into this engine: model,
    /// optimizer state and step. Refuses, with the reason, a checkpoint whose files are
    /// corrupt or whose parameters, optimizer or ZeRO stage differ from this engine's (stages
    /// 1-3 load each other's). The world size may differ from the one that saved it: the
    /// saved slices are joined and cut again for this world. Every rank calls it (rank 0
    /// reads `latest` and tells the others the tag; each reads the files, so they must be
    /// visible to every rank). All or nothing: when any rank cannot read or restore the
    /// checkpoint, every rank returns the error and the engine is left as it was. Returns the
    /// step.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<u64> {
        self.refuse_sliced_checkpoint()?;
        self.sync.settle();
        let comm = self.comm.clone();
        let loaded = checkpoint::load(dir.as_ref(), tag, &self.meta(), comm.as_ref())?;
        // The step protocol's position is checked before the regime takes the state.
        let restored = self
            .core
            .restorable(&loaded.meta.position())
            .and_then(|position| Ok((self.sync.load(self.model.clone(), &loaded)?, position)));
        let (model, position) = agreed(comm.as_ref(), "checkpoint restore", restored)?;
        self.model = model;
        self.core.restore(position);
        self.loss_sum = 0.0;
        Ok(self.core.global_step())
    }

    /// Checkpoints store whole tensors' slices with their layout only from the grid-aware
    /// format on (not yet): a sliced model is refused rather than saved as if whole.
    fn refuse_sliced_checkpoint(&self) -> Result<()> {
        match self.grid.topology().tensor {
            1 => Ok(()),
            tp => Err(DeepSpeedError::Unsupported {
                key: "tensor_parallel.tp_size".into(),
                reason: format!(
                    "checkpoints of a model sliced over {tp} ranks are not implemented yet"
                ),
            }),
        }
    }

    /// This engine's checkpoint metadata (no files yet).
    fn meta(&self) -> CheckpointMeta {
        let layout = self.sync.layout();
        // Expert parallelism stores the whole model, every expert.
        let stored = self.sync.stored_layout();
        let position = self.core.position();
        CheckpointMeta {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            global_step: position.global_step,
            skipped_steps: position.skipped_steps,
            world_size: self.comm.world_size(),
            zero_stage: self.config.zero_optimization.stage.into(),
            optimizer: format!("{:?}", self.config.optimizer_kind()),
            compressing: self.sync.one_bit().map(|o| o.compressing()),
            param_ids: match stored {
                Some(w) => w.ids.clone(),
                None => layout.slots.iter().map(|s| s.id.val()).collect(),
            },
            shapes: match stored {
                Some(w) => w.shapes.clone(),
                None => layout.slots.iter().map(|s| s.shape.clone()).collect(),
            },
            paths: match stored {
                Some(w) => w.paths.clone(),
                None => param_paths(&self.model, layout),
            },
            loss_scaler: position.loss_scaler,
            dtype: self
                .config
                .working_dtype()
                .map(|_| self.config.precision_name().into()),
            ep_size: Some(self.grid.expert_parallel().size()).filter(|&n| n > 1),
            files: Vec::new(),
        }
    }
}

impl<M: Module> DeepSpeedEngine<M> {
    /// The model (identical on every rank after each step). At ZeRO stage 3 its partitioned
    /// parameters store this rank's chunk and gather the whole tensor when read (a
    /// collective: every rank must read them together, as a forward pass does).
    pub fn model(&self) -> &M {
        &self.model
    }
    /// The device to make a micro-batch's float tensors on: the one the model's parameters
    /// live on, with the gradient checkpointing ZeRO stage 3 turns on (under autodiff, a
    /// float input made on a device without it cannot meet the gathered weights in one op).
    /// `None` for a model without float parameters.
    pub fn device(&self) -> Option<Device> {
        sync::module_device(&self.model)
    }
    /// The whole parameters, flat in layout order (the order the module visits them). At
    /// ZeRO stage 3, and with bf16 masters (gathered in fp32), a collective: every rank calls
    /// it, and a rank that fails to take part in the gather fails it on every rank.
    ///
    /// With tensor slicing the slices are joined over the tensor-parallel group (a
    /// collective), so that every rank returns the whole model's parameters, in the layout
    /// of the same model unsliced. With expert parallelism every rank's experts are joined
    /// the same way (a collective over the expert-parallel group), in the layout of the model
    /// that holds every expert.
    pub fn flat_params(&self) -> Result<Vec<f32>> {
        let local = self
            .sync
            .whole_params(&self.model, true)?
            .unwrap_or_default();
        let grid = &self.grid;
        join_flat(
            grid.tensor().as_ref(),
            grid.tensor_parallel(),
            self.sync.layout(),
            &local,
        )
    }
    /// Consumes the engine and returns the model with whole parameters. At ZeRO stage 3 a
    /// collective (every rank calls it); the returned model's parameters read as stored.
    pub fn into_model(self) -> Result<M> {
        self.sync.release_whole(self.model)
    }
    /// The whole optimizer state (steps, m and v in layout order), joined from every rank's
    /// slice at ZeRO stages 1-3: a collective. `None` at stage 0, where Burn's (or a 1-bit)
    /// optimizer keeps it.
    pub fn optimizer_moments(&self) -> Result<Option<PartitionState>> {
        self.sync.whole_moments()
    }
    /// ZeRO stage 3's gather counters (`None` at other stages).
    pub fn gather_stats(&self) -> Option<crate::zero3::GatherStats> {
        self.sync.gather_stats()
    }
    /// ZeRO-Infinity's optimizer offload to NVMe: the swap file's size, the I/O engine and
    /// the bytes moved so far on this rank (measured where the transfers happen).
    pub fn swap(&self) -> Option<burn_deepspeed_strategies::swap::SwapSummary> {
        self.sync.swap()
    }
    /// ZeRO-Infinity's parameter offload (stage 3): where this rank's pieces live (bytes in
    /// host memory, the swap file) and what the read-ahead achieved, measured so far.
    pub fn param_store(&self) -> Option<crate::zero3::ParamStoreSummary> {
        self.sync.param_store()
    }
    /// The resolved config.
    pub fn config(&self) -> &DeepSpeedConfig {
        &self.config
    }
    /// The resolved batch sizes.
    pub fn batch(&self) -> BatchSizes {
        self.batch
    }
    /// This rank's communicator.
    /// The grid this engine trains on (data parallelism alone when created with
    /// [`new`](DeepSpeedEngine::new)).
    pub fn grid(&self) -> &Grid {
        &self.grid
    }
    /// Parameters of the whole model: this rank's, with each sliced tensor counted whole and
    /// each expert once per rank of its expert-parallel group (which holds the other experts
    /// of the layer, shaped alike); equal to [`num_params`](Self::num_params) without tensor
    /// slicing or expert parallelism.
    pub fn model_params(&self) -> usize {
        let (tp, ep) = (self.grid.tensor_parallel(), self.grid.expert_parallel());
        let layout = self.sync.layout();
        layout
            .slots
            .iter()
            .map(|s| match tp.layout(s.id) {
                Some(_) => s.numel * tp.size(),
                None if ep.is_expert(s.id) => s.numel * ep.size(),
                None => s.numel,
            })
            .sum()
    }
    /// The data-parallel group.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }
    /// Optimizer steps taken, skipped ones included (DeepSpeed's `global_steps`).
    pub fn global_step(&self) -> u64 {
        self.core.global_step()
    }
    /// Steps skipped because the gradient norm was not finite (DeepSpeed's `skipped_steps`).
    pub fn skipped_steps(&self) -> u64 {
        self.core.skipped_steps()
    }
    /// fp16: the loss scale the next micro-batches' backward passes use (`None` without
    /// fp16).
    pub fn loss_scale(&self) -> Option<f32> {
        self.core.loss_scale()
    }
    /// fp16: the loss scaler's position (`None` without fp16).
    pub fn loss_scaler_state(&self) -> Option<LossScalerState> {
        self.core.loss_scaler_state()
    }
    /// Number of float parameters this rank holds (its slices under tensor slicing).
    pub fn num_params(&self) -> usize {
        self.sync.layout().numel
    }
    /// The model state this rank holds now, measured where it is allocated (see
    /// [`memory`](crate::memory)).
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        self.sync.held(&self.model)
    }
    /// The largest model state this rank held at once (held plus a step's transient buffers),
    /// measured.
    pub fn peak_model_state_bytes(&self) -> u64 {
        self.sync.peak().max(self.model_state_bytes().total())
    }
    /// What ZeRO's formula gives for this engine's parameters, world size, stage and
    /// precision: the figure the measured [`model_state_bytes`](Self::model_state_bytes) is
    /// checked against. fp32 Adam: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N. fp16, with fp16
    /// gradient buffers ([`StatePrecision::Mixed`], the paper's): 16Ψ, 4Ψ + 12Ψ/N,
    /// 2Ψ + 14Ψ/N, 16Ψ/N. bf16, whose gradients accumulate in fp32 as in DeepSpeed's bf16
    /// optimizer ([`StatePrecision::MixedFp32Grads`]): 18Ψ, 6Ψ + 12Ψ/N, 2Ψ + 16Ψ/N, 18Ψ/N.
    pub fn model_state_bytes_formula(&self) -> u64 {
        let stage: u8 = self.config.zero_optimization.stage.into();
        let (params, world) = (self.num_params() as u64, self.comm.world_size() as u64);
        estimate_model_states(params, world, stage, self.state_precision(), 0, 0).total
    }
    /// The bytes per parameter this engine's model states take ([`StatePrecision`]).
    pub fn state_precision(&self) -> StatePrecision {
        StatePrecision::of(&self.config)
    }
    /// Burn's module optimizer, when the engine steps with one (ZeRO stage 0, no 1-bit
    /// optimizer).
    pub fn optimizer(&self) -> Option<&ModuleOptimizer> {
        self.sync.burn_optimizer()
    }
    /// The 1-bit optimizer's phase, when the config names one.
    pub fn one_bit_optimizer(&self) -> Option<&dyn OneBitPhase> {
        self.sync.one_bit()
    }
}

/// What a grid's shape asks of the config: the same tensor-parallel size, no pipeline (the
/// pipeline engine trains those), and with slicing the optimizers whose step is elementwise.
fn check_grid(config: &DeepSpeedConfig, grid: &Grid) -> Result<()> {
    let topology = grid.topology();
    let refuse = |key: &str, reason: String| {
        Err(DeepSpeedError::Unsupported {
            key: key.into(),
            reason,
        })
    };
    if topology.tensor != config.tp_size() {
        return refuse(
            "tensor_parallel.tp_size",
            format!(
                "the config asks for {} but the grid has {} tensor-parallel ranks",
                config.tp_size(),
                topology.tensor
            ),
        );
    }
    if grid.expert_parallel().size() > 1 && topology.tensor > 1 {
        return refuse(
            "tensor_parallel.tp_size",
            "expert parallelism with tensor slicing is not supported yet".into(),
        );
    }
    if topology.pipe > 1 {
        return refuse(
            "pipeline.stages",
            "DeepSpeedEngine trains one stage per rank; train a pipeline with \
             `burn_deepspeed::pipe::PipelineEngine`"
                .into(),
        );
    }
    let kind = config.optimizer_kind();
    if topology.tensor > 1 && !matches!(kind, OptimizerKind::Adam | OptimizerKind::AdamW) {
        return refuse(
            "optimizer.type",
            format!(
                "{kind:?} with tensor slicing is not implemented: its per-tensor norms would \
                 see one slice (LAMB's trust ratio) or its compression would cross the \
                 tensor-parallel group (1-bit); use Adam or AdamW"
            ),
        );
    }
    Ok(())
}
