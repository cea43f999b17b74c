//! [`DeepSpeedEngine`]: data-parallel training of any Burn [`TrainStep`] module, in the spirit
//! of DeepSpeed's `engine.train_batch()`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::tensor::Device;
use burn::train::TrainStep;
use burn_deepspeed_compress::pld::ProgressiveLayerDrop;
use burn_deepspeed_strategies::comm::{CommStats, Communicator, CommunicatorExt, ReduceOp};

use crate::activation::{CheckpointStats, take_stats, with_config_options};
use crate::config::{BatchSizes, DeepSpeedConfig};
use crate::grid::Grid;
use crate::memory::heap::HeapWindow;
use crate::monitor::MonitorRecord;
use crate::moq::Moq;
use crate::precision::{take_backward_time, unscaled_backward_message, with_loss_scale};
use crate::step::core::StepCore;
use crate::step::{StepLoss, StepReport};
use crate::sync::GradSync;
use crate::{DeepSpeedError, Result, agreed};

/// The forward [`DeepSpeedEngine::set_profile_forward`] registers.
pub(super) type ProfileForward<M> = Box<dyn Fn(&M, &Device) + Send>;

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
///
/// Any Burn module that implements `TrainStep` trains as it is:
///
/// ```
/// use std::time::Duration;
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use burn::train::{RegressionOutput, TrainOutput, TrainStep};
/// use burn_deepspeed::prelude::*;
///
/// #[derive(Module, Debug)]
/// struct Model {
///     linear: Linear,
/// }
///
/// impl TrainStep for Model {
///     type Input = (Tensor<2>, Tensor<2>);
///     type Output = RegressionOutput;
///
///     fn step(&self, (x, y): Self::Input) -> TrainOutput<RegressionOutput> {
///         let output = self.linear.forward(x);
///         let loss = (output.clone() - y.clone()).powi_scalar(2).mean();
///         let grads = loss.backward();
///         TrainOutput::new(self, grads, RegressionOutput { loss, output, targets: y })
///     }
/// }
///
/// let (config, _warnings) = DeepSpeedConfig::from_json_str(
///     r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2}}"#,
/// )?;
/// // Two ranks as threads (one per process under `mpirun`), each with its communicator.
/// let (_, losses) = launch(2, Duration::from_secs(60), |comm| {
///     let device = Device::flex().autodiff();
///     let model = Model { linear: LinearConfig::new(4, 1).init(&device) };
///     let mut engine = DeepSpeedEngine::new(model, config.clone(), comm)?;
///     let mut loss = f64::NAN;
///     for _ in 0..3 {
///         // 8 samples per step over 2 ranks: one micro-batch of 4 on each.
///         let x = Tensor::<2>::ones([4, 4], &device);
///         let y = Tensor::<2>::zeros([4, 1], &device);
///         loss = engine.train_batch([(x, y)])?.loss;
///     }
///     Ok(loss)
/// })?;
/// assert_eq!(losses[0], losses[1]); // the step's loss is averaged over the ranks
/// # Ok::<(), burn_deepspeed::DeepSpeedError>(())
/// ```
pub struct DeepSpeedEngine<M: Module> {
    pub(super) model: M,
    pub(super) sync: Box<dyn GradSync<M>>,
    pub(super) pld: Option<ProgressiveLayerDrop>,
    /// The data-parallel group: where gradients are averaged and ZeRO cuts the state.
    pub(super) comm: Arc<dyn Communicator>,
    /// The grid: the data-parallel group alone, or with tensor slicing its tensor-parallel
    /// group too; every rank of its world agrees on each step.
    pub(super) grid: Grid,
    pub(super) config: DeepSpeedConfig,
    pub(super) batch: BatchSizes,
    pub(super) loss_sum: f64,
    /// The step protocol: loss scale, step counters, breakdown and monitor.
    pub(super) core: StepCore,
    pub(super) fb_time: Duration,
    /// Time in `TrainStep::step` this step (forward and backward).
    pub(super) train_step_time: Duration,
    /// Time handing gradients to the regime this step.
    pub(super) accumulate_time: Duration,
    /// Time in [`precision::backward`](crate::precision::backward) this step; `None` once a
    /// micro-batch ran its backward without it.
    pub(super) bwd_time: Option<Duration>,
    /// When this step's first micro-batch started.
    pub(super) step_start: Option<Instant>,
    /// The forward the flops profiler runs at `flops_profiler.profile_step`.
    pub(super) profile_forward: Option<ProfileForward<M>>,
    /// Counters before this step's first micro-batch (stages 2-3 communicate in backward).
    pub(super) stats_at_step_start: Option<CommStats>,
    /// fp16: a micro-batch of this step ran a plain `loss.backward()`, so its gradients are not
    /// scaled: the step is refused.
    pub(super) unscaled: bool,
    /// The most heap one micro-batch's forward and backward held above what was live before
    /// them, in this step (with the counting allocator installed).
    pub(super) activation_peak: Option<u64>,
    /// MoQ: the weights quantized after each step, when configured.
    pub(super) moq: Option<Moq>,
}

impl<M> DeepSpeedEngine<M>
where
    M: Module + TrainStep,
    M::Output: StepLoss,
{
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
}
