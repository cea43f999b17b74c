//! [`DeepSpeedEngine`]: data-parallel training of any Burn [`TrainStep`] module, in the spirit
//! of DeepSpeed's `engine.train_batch()`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::ModuleOptimizer;
use burn::tensor::{Bytes, Tensor};
use burn::train::TrainStep;
use burn_deepspeed_compress::pld::ProgressiveLayerDrop;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use serde::Serialize;

use super::checkpoint::{
    CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointMeta, f32_bytes, f32_values,
    one_bit_state_bytes, one_bit_state_from_bytes, read_checkpoint, write_checkpoint,
};
use super::flat::{ParamLayout, params_from_flat, params_to_flat};
use super::memory::{MemoryLedger, ModelStateBytes};
use super::onebit::build_one_bit;
use super::optim::{build_optimizer, state_tensors_per_param};
use super::reduce::clip_global_norm;
use super::sync::GradientSync;
use crate::config::{BatchSizes, DeepSpeedConfig, ZeroStage};
use crate::{DeepSpeedError, Result};
use burn_deepspeed_strategies::onebit::OneBitOptimizer;

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
    /// Global gradient norm before clipping. In a 1-bit optimizer's compression stage, where
    /// gradients are not all-reduced and each rank clips its own, the root mean square of the
    /// ranks' local norms.
    pub grad_norm: f64,
    /// Bytes this rank sent during the step.
    pub bytes_sent: u64,
    /// Whether the step exchanged 1-bit compressed momenta instead of all-reducing gradients.
    pub compressed: bool,
    /// Progressive layer dropping: the θ this step's forward passes were given.
    pub pld_theta: Option<f64>,
    /// Time in forward and backward passes on this rank.
    pub forward_backward: Duration,
    /// Time in gradient reduction (communication included).
    pub reduce: Duration,
    /// Time in the optimizer step.
    pub optimizer: Duration,
}

/// The optimizer the engine steps: one of Burn's on [`GradientsParams`](burn::optim::GradientsParams), or a
/// 1-bit optimizer on the flat buffers.
enum EngineOptimizer {
    Burn(ModuleOptimizer),
    OneBit(Box<dyn OneBitOptimizer>),
}

impl EngineOptimizer {
    /// The fresh optimizer a resolved config names, over `sync`'s layout.
    fn build(config: &DeepSpeedConfig, sync: &GradientSync, world: usize) -> Result<Self> {
        let cfg = config
            .optimizer
            .as_ref()
            .expect("resolve fills the optimizer");
        Ok(match build_one_bit(cfg, sync.layout(), world)? {
            Some(onebit) => Self::OneBit(onebit),
            None => Self::Burn(build_optimizer(cfg)?),
        })
    }
}

/// Data-parallel training engine (ZeRO stage 0): every rank holds the whole model, gradients
/// are averaged by bucketed all-reduce (`reduce_bucket_size` elements per collective), clipped
/// by global norm, and every rank takes the same optimizer step.
///
/// SPMD: create one engine per rank, each with that rank's [`Communicator`]. Rank 0's
/// parameters are broadcast at creation, so every replica starts identical.
pub struct DeepSpeedEngine<M> {
    model: M,
    optim: EngineOptimizer,
    pld: Option<ProgressiveLayerDrop>,
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
        let sync = GradientSync::new(&model, &config, comm.clone());
        let optim = EngineOptimizer::build(&config, &sync, comm.world_size())?;
        let pld = config
            .progressive_layer_drop
            .enabled
            .then_some(ProgressiveLayerDrop {
                theta: config.progressive_layer_drop.theta,
                gamma: config.progressive_layer_drop.gamma,
            });
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
            pld,
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
        let sent_before = self.comm.stats().total_sent();
        let reduce_start = Instant::now();
        let compressed = matches!(&self.optim, EngineOptimizer::OneBit(o) if o.compressing());
        let (grads, norm) = match &self.optim {
            EngineOptimizer::Burn(_) => {
                let (grads, norm) = self.sync.reduce(&self.model)?;
                (Some(grads), norm)
            }
            EngineOptimizer::OneBit(_) => {
                // Compression stage: no gradient all-reduce; each rank clips its own gradient
                // (DeepSpeed's `enable_backward_allreduce = False`).
                if compressed {
                    self.sync.average_local();
                } else {
                    self.sync.average()?;
                }
                let clip = self.sync.clip_threshold();
                (None, clip_global_norm(self.sync.flat_mut(), clip))
            }
        };
        let mut scalars = [
            (self.loss_sum / micro_steps as f64) as f32,
            if compressed {
                (norm * norm) as f32
            } else {
                0.0
            },
        ];
        if world > 1 {
            self.comm.all_reduce(&mut scalars, ReduceOp::Mean)?;
        }
        let grad_norm = if compressed {
            (scalars[1] as f64).sqrt()
        } else {
            norm
        };
        let reduce = reduce_start.elapsed();

        let opt_start = Instant::now();
        let lr = self.lr_at(self.global_step);
        let numel = self.sync.layout().numel;
        let model = self.model.clone();
        let state = {
            let _span = tracing::debug_span!("optimizer_step", rank = self.comm.rank()).entered();
            match (&mut self.optim, grads) {
                (EngineOptimizer::Burn(optim), Some(grads)) => {
                    self.model = optim.step(lr, model, grads);
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
                    (4 * state_tensors_per_param(kind) * self.params_with_state) as u64
                }
                (EngineOptimizer::OneBit(optim), _) => {
                    let mut params = params_to_flat(&model, self.sync.layout());
                    optim.apply(self.comm.as_ref(), &mut params, self.sync.flat_mut(), lr)?;
                    self.model = params_from_flat(model, self.sync.layout(), &params);
                    self.sync.reset();
                    optim.state_bytes()
                }
                (EngineOptimizer::Burn(_), None) => unreachable!("Burn optimizers get gradients"),
            }
        };
        self.ledger.update(|m| m.optimizer = state);
        // The peak of the step: the optimizer state is written while the rebuilt gradients
        // are still alive.
        self.ledger.transient_grads(4 * numel as u64);
        let optimizer = opt_start.elapsed();
        self.sync.clear_marks();
        let pld_theta = self.pld_theta();
        self.global_step += 1;
        let report = StepReport {
            step: self.global_step,
            loss: scalars[0] as f64,
            lr,
            grad_norm,
            bytes_sent: self.comm.stats().total_sent() - sent_before,
            compressed,
            pld_theta,
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

    /// Progressive layer dropping (arXiv 2010.13369): θ(t) for the next step's forward passes,
    /// `(1 − θ̄)·e^(−γt) + θ̄` with t the optimizer steps taken, or `None` when
    /// `progressive_layer_drop` is off. As in DeepSpeed, the model does the dropping: pass θ to
    /// its forward (e.g. in the batch) and keep layer l of L with probability
    /// [`keep_probabilities`](crate::pld::ProgressiveLayerDrop::keep_probabilities)`(θ, L)[l]`.
    pub fn pld_theta(&self) -> Option<f64> {
        self.pld.map(|p| p.theta_at(self.global_step))
    }

    /// Saves the model, the optimizer state and the step as checkpoint `tag` (default
    /// `global_step{N}`, as in DeepSpeed) under `dir`, atomically, and points `dir/latest` at
    /// it. Collective: every rank calls it; at ZeRO stage 0 rank 0 writes, since every rank
    /// holds the same state. Returns the checkpoint's directory.
    ///
    /// 1-bit optimizers save m, v, their frozen coefficients and the step (which fixes the
    /// phase), not the compression error buffers: after a load those start from zero, as in
    /// DeepSpeed.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<PathBuf> {
        let dir = dir.as_ref();
        let tag = tag.map_or_else(|| format!("global_step{}", self.global_step), String::from);
        let mut written = Ok(dir.join(&tag));
        if self.comm.rank() == 0 {
            written = self.write_checkpoint(dir, &tag);
        }
        // Every rank learns whether rank 0's write succeeded.
        let mut ok = [u8::from(written.is_ok())];
        self.comm.broadcast(&mut ok, 0)?;
        if ok[0] == 0 && written.is_ok() {
            return Err(DeepSpeedError::Checkpoint(format!(
                "rank 0 could not write {}",
                dir.join(&tag).display()
            )));
        }
        written
    }

    fn write_checkpoint(&self, dir: &Path, tag: &str) -> Result<PathBuf> {
        let layout = self.sync.layout();
        let optim = match &self.optim {
            EngineOptimizer::Burn(o) => o
                .into_bytes()
                .map_err(|e| DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}")))?
                .to_vec(),
            EngineOptimizer::OneBit(o) => one_bit_state_bytes(&o.export()),
        };
        let meta = CheckpointMeta {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            global_step: self.global_step,
            world_size: self.comm.world_size(),
            zero_stage: self.config.zero_optimization.stage.into(),
            optimizer: format!("{:?}", self.config.optimizer_kind()),
            compressing: self.one_bit_optimizer().map(|o| o.compressing()),
            param_ids: layout.slots.iter().map(|s| s.id.val()).collect(),
            shapes: layout.slots.iter().map(|s| s.shape.clone()).collect(),
            files: Vec::new(),
        };
        let params = f32_bytes(&params_to_flat(&self.model, layout));
        write_checkpoint(
            dir,
            tag,
            meta,
            &[("model.bin", params), ("optim.bin", optim)],
        )
    }

    /// Loads checkpoint `tag` (default: the one `dir/latest` names) into this engine: model,
    /// optimizer state and step. Refuses, with the reason, a checkpoint whose files are
    /// corrupt or whose parameters, optimizer or ZeRO stage differ from this engine's. At
    /// ZeRO stage 0 the world size may differ from the one that saved it. Every rank calls
    /// it (each reads the files, so they must be visible to every rank). Returns the step.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<u64> {
        let (meta, files) = read_checkpoint(dir.as_ref(), tag)?;
        let refuse = |what: String| Err(DeepSpeedError::Checkpoint(what));
        let stage: u8 = self.config.zero_optimization.stage.into();
        if meta.zero_stage != stage {
            return refuse(format!(
                "written at ZeRO stage {}; this engine runs stage {stage}",
                meta.zero_stage
            ));
        }
        let kind = format!("{:?}", self.config.optimizer_kind());
        if meta.optimizer != kind {
            return refuse(format!(
                "written by optimizer {}; the config names {kind}",
                meta.optimizer
            ));
        }
        let layout = self.sync.layout();
        let shapes: Vec<Vec<usize>> = layout.slots.iter().map(|s| s.shape.clone()).collect();
        if meta.shapes != shapes || meta.param_ids.len() != shapes.len() {
            let count =
                |s: &[Vec<usize>]| s.iter().map(|s| s.iter().product::<usize>()).sum::<usize>();
            return refuse(format!(
                "it holds {} parameters in {} tensors; this model has {} in {} (or the \
                 shapes differ)",
                count(&meta.shapes),
                meta.shapes.len(),
                count(&shapes),
                shapes.len()
            ));
        }
        let [model_bytes, optim_bytes] = <[Vec<u8>; 2]>::try_from(files).map_err(|f| {
            DeepSpeedError::Checkpoint(format!("expected 2 state files, found {}", f.len()))
        })?;
        let params = f32_values(&model_bytes, "model.bin")?;
        if params.len() != layout.numel {
            return refuse(format!(
                "model.bin holds {} values; the model has {}",
                params.len(),
                layout.numel
            ));
        }
        // The saved ids go back into the model, so that the optimizer state (keyed by id)
        // finds its parameters.
        let model = restore_params(self.model.clone(), layout, &meta.param_ids, &params);
        let sync = GradientSync::new(&model, &self.config, self.comm.clone());
        let optim = match EngineOptimizer::build(&self.config, &sync, self.comm.world_size())? {
            EngineOptimizer::OneBit(mut onebit) => {
                onebit.restore(one_bit_state_from_bytes(&optim_bytes)?)?;
                EngineOptimizer::OneBit(onebit)
            }
            EngineOptimizer::Burn(burn) => EngineOptimizer::Burn(
                burn.from_bytes(Bytes::from_bytes_vec(optim_bytes))
                    .map_err(|e| DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}")))?,
            ),
        };
        self.model = model;
        self.sync = sync;
        self.optim = optim;
        self.global_step = meta.global_step;
        self.params_with_state = self.sync.layout().numel;
        self.loss_sum = 0.0;
        Ok(meta.global_step)
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
    /// Burn's module optimizer, unless a 1-bit optimizer runs.
    pub fn optimizer(&self) -> Option<&ModuleOptimizer> {
        match &self.optim {
            EngineOptimizer::Burn(o) => Some(o),
            EngineOptimizer::OneBit(_) => None,
        }
    }

    /// The 1-bit optimizer, when the config names one.
    pub fn one_bit_optimizer(&self) -> Option<&dyn OneBitOptimizer> {
        match &self.optim {
            EngineOptimizer::OneBit(o) => Some(o.as_ref()),
            EngineOptimizer::Burn(_) => None,
        }
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
    refuse_unsupported_precision(config)
}

/// The refusals every engine shares: mixed precision.
pub(crate) fn refuse_unsupported_precision(config: &DeepSpeedConfig) -> Result<()> {
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
    Ok(())
}

pub(crate) fn unsupported(key: &str, reason: &str) -> DeepSpeedError {
    DeepSpeedError::Unsupported {
        key: key.into(),
        reason: reason.into(),
    }
}

/// `module` with the parameter ids `ids` and the values `flat`, both in `layout` order.
fn restore_params<M: Module>(module: M, layout: &ParamLayout, ids: &[u64], flat: &[f32]) -> M {
    struct Mapper<'a> {
        ids: &'a [u64],
        next: usize,
    }
    impl ModuleMapper for Mapper<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (_, tensor, mapper) = param.consume();
            let id = ParamId::from(self.ids[self.next]);
            self.next += 1;
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    let module = params_from_flat(module, layout, flat);
    module.map(&mut Mapper { ids, next: 0 })
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
