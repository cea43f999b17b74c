//! [`DeepSpeedEngine`]: data-parallel training of any Burn [`TrainStep`] module, in the spirit
//! of DeepSpeed's `engine.train_batch()`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::train::TrainStep;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use serde::Serialize;

use super::memory::{MemoryLedger, ModelStateBytes};
use super::optim::{build_optimizer, state_tensors_per_param};
use super::sync::GradientSync;
use crate::config::{BatchSizes, DeepSpeedConfig, ZeroStage};
use crate::{DeepSpeedError, Result};

/// What the engine reads from a training step's output: the micro-batch's mean loss.
pub trait StepLoss {
    /// The loss of this micro-batch (a mean over its samples), on the host.
    fn loss(&self) -> f64;
}

/// The result of one optimizer step.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// Optimizer steps taken so far (this one included).
    pub step: u64,
    /// Mean loss over every micro-batch of every rank in this step.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Time in forward and backward passes on this rank.
    pub forward_backward: Duration,
    /// Time in gradient reduction (communication included).
    pub reduce: Duration,
    /// Time in the optimizer step.
    pub optimizer: Duration,
}

/// Data-parallel training engine (ZeRO stage 0): every rank holds the whole model, gradients
/// are averaged by bucketed all-reduce (`reduce_bucket_size` elements per collective), clipped
/// by global norm, and every rank takes the same optimizer step.
///
/// SPMD: create one engine per rank, each with that rank's [`Communicator`]. Rank 0's
/// parameters are broadcast at creation, so every replica starts identical.
pub struct DeepSpeedEngine<M> {
    model: M,
    optim: ModuleOptimizer,
    comm: Arc<dyn Communicator>,
    config: DeepSpeedConfig,
    batch: BatchSizes,
    sync: GradientSync,
    loss_sum: f64,
    global_step: u64,
    ledger: MemoryLedger,
    params_with_state: usize,
    fb_time: Duration,
}

impl<M> DeepSpeedEngine<M>
where
    M: Module + TrainStep,
    M::Output: StepLoss,
{
    /// Creates the engine for this rank: resolves the config for the communicator's world
    /// size, refuses what it cannot run, builds the optimizer, and broadcasts rank 0's
    /// parameters.
    pub fn new(model: M, mut config: DeepSpeedConfig, comm: Arc<dyn Communicator>) -> Result<Self> {
        let batch = config.resolve(comm.world_size())?;
        refuse_unsupported(&config)?;
        let optim_cfg = config
            .optimizer
            .clone()
            .expect("resolve fills the optimizer");
        let optim = build_optimizer(&optim_cfg)?;
        let sync = GradientSync::new(&model, &config, comm.clone());
        let model = sync.broadcast_params(model)?;
        let n = sync.layout().numel;
        let mut ledger = MemoryLedger::default();
        ledger.update(|m| {
            m.params = 4 * n as u64;
            m.grads = 4 * n as u64;
        });
        Ok(Self {
            model,
            optim,
            comm,
            config,
            batch,
            sync,
            loss_sum: 0.0,
            global_step: 0,
            ledger,
            params_with_state: 0,
            fb_time: Duration::ZERO,
        })
    }

    /// Runs forward and backward on one micro-batch and accumulates its gradient
    /// (DeepSpeed's `engine.forward` + `engine.backward`). Returns the step's output.
    pub fn forward_backward(&mut self, input: M::Input) -> M::Output {
        let start = Instant::now();
        let out = {
            let _span = tracing::debug_span!("forward_backward", rank = self.comm.rank()).entered();
            TrainStep::step(&self.model, input)
        };
        self.loss_sum += out.item.loss();
        // The gradient tensors from backward are alive while they are copied into the buffer.
        self.ledger
            .transient_grads(4 * self.sync.layout().numel as u64);
        self.sync.accumulate(&self.model, &out.grads);
        self.fb_time += start.elapsed();
        out.item
    }

    /// Averages the accumulated gradient over ranks and micro-batches, clips it, and takes
    /// one optimizer step (DeepSpeed's `engine.step` at an accumulation boundary).
    pub fn step(&mut self) -> Result<StepReport> {
        let micro_steps = self.sync.micro_steps();
        if micro_steps == 0 {
            return Err(DeepSpeedError::Data(
                "step() called before any forward_backward()".into(),
            ));
        }
        let world = self.comm.world_size();
        let reduce_start = Instant::now();
        let (grads, grad_norm) = self.sync.reduce(&self.model)?;
        let mut loss = [(self.loss_sum / micro_steps as f64) as f32];
        if world > 1 {
            self.comm.all_reduce(&mut loss, ReduceOp::Mean)?;
        }
        let reduce = reduce_start.elapsed();

        let opt_start = Instant::now();
        let lr = self.lr_at(self.global_step);
        let numel = self.sync.layout().numel;
        let model = self.model.clone();
        self.model = {
            let _span = tracing::debug_span!("optimizer_step", rank = self.comm.rank()).entered();
            self.optim.step(lr, model, grads)
        };
        let with_state: usize = self
            .sync
            .layout()
            .slots
            .iter()
            .zip(self.sync.present())
            .filter(|(_, p)| **p != 0)
            .map(|(s, _)| s.numel)
            .sum();
        self.params_with_state = self.params_with_state.max(with_state);
        let kind = self.config.optimizer_kind();
        let state = (4 * state_tensors_per_param(kind) * self.params_with_state) as u64;
        self.ledger.update(|m| m.optimizer = state);
        // The peak of the step: the optimizer state is written while the rebuilt gradients
        // are still alive.
        self.ledger.transient_grads(4 * numel as u64);
        let optimizer = opt_start.elapsed();
        self.sync.clear_marks();
        self.global_step += 1;
        let report = StepReport {
            step: self.global_step,
            loss: loss[0] as f64,
            lr,
            grad_norm,
            forward_backward: std::mem::take(&mut self.fb_time),
            reduce,
            optimizer,
        };
        self.loss_sum = 0.0;
        if self.config.wall_clock_breakdown
            && self.comm.rank() == 0
            && self
                .global_step
                .is_multiple_of(self.config.steps_per_print.max(1))
        {
            eprintln!(
                "[step {}] forward+backward {:.1} ms | reduce {:.1} ms | optimizer {:.1} ms",
                report.step,
                report.forward_backward.as_secs_f64() * 1e3,
                report.reduce.as_secs_f64() * 1e3,
                report.optimizer.as_secs_f64() * 1e3
            );
        }
        Ok(report)
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
        if n as u64 != self.batch.gradient_accumulation_steps {
            return Err(DeepSpeedError::Data(format!(
                "train_batch got {n} micro-batches; gradient_accumulation_steps is {}",
                self.batch.gradient_accumulation_steps
            )));
        }
        self.step()
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        self.config.lr_at(step)
    }

    /// The model (identical on every rank after each step).
    pub fn model(&self) -> &M {
        &self.model
    }
    /// Consumes the engine and returns the model.
    pub fn into_model(self) -> M {
        self.model
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
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }
    /// Optimizer steps taken.
    pub fn global_step(&self) -> u64 {
        self.global_step
    }
    /// Number of float parameters.
    pub fn num_params(&self) -> usize {
        self.sync.layout().numel
    }
    /// The model state this rank holds now.
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        self.ledger.current()
    }
    /// The largest model state this rank held during a step.
    pub fn peak_model_state_bytes(&self) -> u64 {
        self.ledger.peak()
    }
    /// The module optimizer (for checkpoints and inspection).
    pub fn optimizer(&self) -> &ModuleOptimizer {
        &self.optim
    }
}

/// Refuses settings that would change the math and that this version does not run yet.
pub(crate) fn refuse_unsupported(config: &DeepSpeedConfig) -> Result<()> {
    if config.zero_optimization.stage != ZeroStage::Disabled {
        return Err(unsupported(
            "zero_optimization.stage",
            "this version runs ZeRO stage 0 (data parallelism); set the stage to 0",
        ));
    }
    if config
        .pipeline
        .as_ref()
        .and_then(|p| p.stage_count())
        .unwrap_or(1)
        > 1
    {
        return Err(unsupported(
            "pipeline.stages",
            "DeepSpeedEngine is data-parallel only; train a pipeline with \
             `burn_deepspeed::pipe::PipelineEngine`",
        ));
    }
    refuse_unsupported_precision_and_pld(config)
}

/// The refusals every engine shares: mixed precision and progressive layer dropping.
pub(crate) fn refuse_unsupported_precision_and_pld(config: &DeepSpeedConfig) -> Result<()> {
    if config.fp16.enabled {
        return Err(unsupported(
            "fp16.enabled",
            "mixed precision is not implemented yet; train in fp32",
        ));
    }
    if config.bf16.enabled {
        return Err(unsupported(
            "bf16.enabled",
            "mixed precision is not implemented yet; train in fp32",
        ));
    }
    if config.progressive_layer_drop.enabled {
        return Err(unsupported(
            "progressive_layer_drop.enabled",
            "progressive layer dropping is not implemented yet",
        ));
    }
    Ok(())
}

pub(crate) fn unsupported(key: &str, reason: &str) -> DeepSpeedError {
    DeepSpeedError::Unsupported {
        key: key.into(),
        reason: reason.into(),
    }
}

impl StepLoss for burn::train::ClassificationOutput {
    fn loss(&self) -> f64 {
        self.loss.clone().into_scalar::<f32>() as f64
    }
}

impl StepLoss for burn::train::RegressionOutput {
    fn loss(&self) -> f64 {
        self.loss.clone().into_scalar::<f32>() as f64
    }
}
