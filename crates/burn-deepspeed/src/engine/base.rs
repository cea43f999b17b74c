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
    CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CheckpointFile, CheckpointMeta, check_tag,
    commit_checkpoint, create_staging, f32_bytes, f32_values, one_bit_state_bytes,
    one_bit_state_from_bytes, partition_state_bytes, partition_state_from_bytes, read_checkpoint,
    staging_dir, write_checkpoint, write_state_file,
};
use super::flat::{ParamLayout, params_from_flat, params_to_flat};
use super::memory::{MemoryLedger, ModelStateBytes};
use super::onebit::build_one_bit;
use super::optim::{build_optimizer, state_tensors_per_param};
use super::reduce::clip_global_norm;
use super::sync::{GradientSync, broadcast_params};
use super::zero::{ZeroSync, refuse_zero_keys};
use super::zero3::Zero3Sync;
use crate::config::{BatchSizes, DeepSpeedConfig, ZeroStage};
use crate::{DeepSpeedError, Result};
use burn_deepspeed_strategies::onebit::OneBitOptimizer;
use burn_deepspeed_strategies::zero::{PartitionState, Segment, ShardPlan};

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

/// The optimizer of a replicated (stage 0) engine: one of Burn's on
/// [`GradientsParams`](burn::optim::GradientsParams), or a 1-bit optimizer on the flat buffers.
enum EngineOptimizer {
    Burn(ModuleOptimizer),
    OneBit(Box<dyn OneBitOptimizer>),
}

impl EngineOptimizer {
    /// The fresh optimizer a resolved config names, over `layout`.
    fn build(config: &DeepSpeedConfig, layout: &ParamLayout, world: usize) -> Result<Self> {
        let cfg = config
            .optimizer
            .as_ref()
            .expect("resolve fills the optimizer");
        Ok(match build_one_bit(cfg, layout, world)? {
            Some(onebit) => Self::OneBit(onebit),
            None => Self::Burn(build_optimizer(cfg)?),
        })
    }
}

/// How gradients become an update. One per engine, built once: the variants' sizes do not
/// matter.
#[allow(clippy::large_enum_variant)]
enum Reduction {
    /// ZeRO stage 0: whole gradients all-reduced, every rank steps everything.
    Replicated {
        sync: GradientSync,
        optim: EngineOptimizer,
    },
    /// ZeRO stages 1 and 2: gradients reduce-scattered, each rank steps its slice.
    Partitioned(ZeroSync),
    /// ZeRO stage 3: parameters stored as chunks too, gathered for use.
    Sharded(Zero3Sync),
}

impl Reduction {
    fn build(
        model: &impl Module,
        layout: &ParamLayout,
        config: &DeepSpeedConfig,
        comm: &Arc<dyn Communicator>,
    ) -> Result<Self> {
        Ok(match config.zero_optimization.stage {
            ZeroStage::Disabled => Self::Replicated {
                sync: GradientSync::new(model, config, comm.clone()),
                optim: EngineOptimizer::build(config, layout, comm.world_size())?,
            },
            ZeroStage::Parameters => {
                Self::Sharded(Zero3Sync::new(layout.clone(), config, comm.clone())?)
            }
            _ => Self::Partitioned(ZeroSync::new(layout.clone(), config, comm.clone())?),
        })
    }
}

/// Data-parallel training engine with ZeRO (arXiv 1910.02054) stages 0 to 3.
///
/// - Stage 0: every rank holds the whole model, gradients are averaged by bucketed all-reduce
///   (`reduce_bucket_size` elements per collective), clipped by global norm, and every rank
///   takes the same optimizer step (Burn's optimizer, or a 1-bit one).
/// - Stages 1 and 2 ([`ZeroSync`]): gradients are reduce-scattered, each rank keeps the
///   optimizer state of (and steps) its slice of the flat parameters, and the updated slices
///   are all-gathered; stage 2 also keeps only its slice of the gradients.
/// - Stage 3 ([`Zero3Sync`]): the parameters too are stored as per-rank chunks and gathered
///   whole only while a forward or backward op uses them ([`crate::zero3`]); each rank steps
///   its chunks.
///
/// SPMD: create one engine per rank, each with that rank's [`Communicator`]. Rank 0's
/// parameters are broadcast at creation, so every replica starts identical.
pub struct DeepSpeedEngine<M> {
    model: M,
    layout: ParamLayout,
    reduction: Reduction,
    pld: Option<ProgressiveLayerDrop>,
    comm: Arc<dyn Communicator>,
    config: DeepSpeedConfig,
    batch: BatchSizes,
    loss_sum: f64,
    global_step: u64,
    ledger: MemoryLedger,
    params_with_state: usize,
    fb_time: Duration,
    /// Bytes sent before this step's first micro-batch (stage 2 communicates in backward).
    sent_at_step_start: Option<u64>,
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
        let layout = ParamLayout::of(&model);
        let reduction = Reduction::build(&model, &layout, &config, &comm)?;
        let pld = config
            .progressive_layer_drop
            .enabled
            .then_some(ProgressiveLayerDrop {
                theta: config.progressive_layer_drop.theta,
                gamma: config.progressive_layer_drop.gamma,
            });
        let model = broadcast_params(comm.as_ref(), &layout, model)?;
        let model = match &reduction {
            Reduction::Sharded(z) => z.shard(model),
            _ => model,
        };
        let mut ledger = MemoryLedger::default();
        ledger.update(|m| match &reduction {
            Reduction::Replicated { .. } => {
                m.params = 4 * layout.numel as u64;
                m.grads = 4 * layout.numel as u64;
            }
            Reduction::Partitioned(z) => *m = z.state_bytes(),
            Reduction::Sharded(z) => *m = z.state_bytes(),
        });
        Ok(Self {
            model,
            layout,
            reduction,
            pld,
            comm,
            config,
            batch,
            loss_sum: 0.0,
            global_step: 0,
            ledger,
            params_with_state: 0,
            fb_time: Duration::ZERO,
            sent_at_step_start: None,
        })
    }

    /// Runs forward and backward on one micro-batch and accumulates its gradient
    /// (DeepSpeed's `engine.forward` + `engine.backward`). Returns the step's output.
    pub fn forward_backward(&mut self, input: M::Input) -> M::Output {
        let start = Instant::now();
        self.sent_at_step_start
            .get_or_insert_with(|| self.comm.stats().total_sent());
        let out = {
            let _span = tracing::debug_span!("forward_backward", rank = self.comm.rank()).entered();
            TrainStep::step(&self.model, input)
        };
        self.loss_sum += out.item.loss();
        // The gradient tensors from backward are alive while they are copied into the buffer
        // (and, at stage 2, while one bucket is staged for its reduce-scatter).
        let numel = self.layout.numel as u64;
        match &mut self.reduction {
            Reduction::Replicated { sync, .. } => {
                self.ledger.transient_grads(4 * numel);
                sync.accumulate(&self.model, &out.grads);
            }
            Reduction::Partitioned(z) => {
                self.ledger
                    .transient_grads(4 * (numel + z.bucket_elems() as u64));
                z.accumulate(&self.model, &out.grads);
            }
            Reduction::Sharded(z) => {
                z.accumulate(&self.model, &out.grads);
                self.ledger.transient_grads(4 * z.transient_elems() as u64);
            }
        }
        self.fb_time += start.elapsed();
        out.item
    }

    /// Averages the accumulated gradient over ranks and micro-batches, clips it, and takes
    /// one optimizer step (DeepSpeed's `engine.step` at an accumulation boundary).
    pub fn step(&mut self) -> Result<StepReport> {
        let micro_steps = match &self.reduction {
            Reduction::Replicated { sync, .. } => sync.micro_steps(),
            Reduction::Partitioned(z) => z.micro_steps(),
            Reduction::Sharded(z) => z.micro_steps(),
        };
        if micro_steps == 0 {
            return Err(DeepSpeedError::Data(
                "step() called before any forward_backward()".into(),
            ));
        }
        let sent_before = self
            .sent_at_step_start
            .take()
            .unwrap_or_else(|| self.comm.stats().total_sent());
        let lr = self.lr_at(self.global_step);
        let inner = match self.reduction {
            Reduction::Replicated { .. } => self.step_replicated(lr)?,
            Reduction::Partitioned(_) | Reduction::Sharded(_) => self.step_partitioned(lr)?,
        };
        let mut scalars = [
            (self.loss_sum / micro_steps as f64) as f32,
            inner.local_norm_sq.unwrap_or(0.0) as f32,
        ];
        if self.comm.world_size() > 1 {
            self.comm.all_reduce(&mut scalars, ReduceOp::Mean)?;
        }
        let grad_norm = match inner.local_norm_sq {
            Some(_) => (scalars[1] as f64).sqrt(),
            None => inner.norm,
        };
        let pld_theta = self.pld_theta();
        self.global_step += 1;
        let report = StepReport {
            step: self.global_step,
            loss: scalars[0] as f64,
            lr,
            grad_norm,
            bytes_sent: self.comm.stats().total_sent() - sent_before,
            compressed: inner.compressed,
            pld_theta,
            forward_backward: std::mem::take(&mut self.fb_time),
            reduce: inner.reduce,
            optimizer: inner.optimizer,
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

    /// Stage 0: all-reduce, clip, and the same step on every rank.
    fn step_replicated(&mut self, lr: f64) -> Result<InnerStep> {
        let Reduction::Replicated { sync, optim } = &mut self.reduction else {
            unreachable!("called on the replicated path")
        };
        let reduce_start = Instant::now();
        let compressed = matches!(optim, EngineOptimizer::OneBit(o) if o.compressing());
        let (grads, norm) = match optim {
            EngineOptimizer::Burn(_) => {
                let (grads, norm) = sync.reduce(&self.model)?;
                (Some(grads), norm)
            }
            EngineOptimizer::OneBit(_) => {
                // Compression stage: no gradient all-reduce; each rank clips its own gradient
                // (DeepSpeed's `enable_backward_allreduce = False`).
                if compressed {
                    sync.average_local();
                } else {
                    sync.average()?;
                }
                let clip = sync.clip_threshold();
                (None, clip_global_norm(sync.flat_mut(), clip))
            }
        };
        let reduce = reduce_start.elapsed();

        let opt_start = Instant::now();
        let model = self.model.clone();
        let state = {
            let _span = tracing::debug_span!("optimizer_step", rank = self.comm.rank()).entered();
            match (optim, grads) {
                (EngineOptimizer::Burn(optim), Some(grads)) => {
                    self.model = optim.step(lr, model, grads);
                    let with_state: usize = self
                        .layout
                        .slots
                        .iter()
                        .zip(sync.present())
                        .filter(|(_, p)| **p != 0)
                        .map(|(s, _)| s.numel)
                        .sum();
                    self.params_with_state = self.params_with_state.max(with_state);
                    let kind = self.config.optimizer_kind();
                    (4 * state_tensors_per_param(kind) * self.params_with_state) as u64
                }
                (EngineOptimizer::OneBit(optim), _) => {
                    let mut params = params_to_flat(&model, &self.layout);
                    optim.apply(self.comm.as_ref(), &mut params, sync.flat_mut(), lr)?;
                    self.model = params_from_flat(model, &self.layout, &params);
                    sync.reset();
                    optim.state_bytes()
                }
                (EngineOptimizer::Burn(_), None) => unreachable!("Burn optimizers get gradients"),
            }
        };
        self.ledger.update(|m| m.optimizer = state);
        // The peak of the step: the optimizer state is written while the rebuilt gradients
        // are still alive.
        self.ledger.transient_grads(4 * self.layout.numel as u64);
        sync.clear_marks();
        Ok(InnerStep {
            norm,
            local_norm_sq: compressed.then_some(norm * norm),
            compressed,
            reduce,
            optimizer: opt_start.elapsed(),
        })
    }

    /// Stages 1-3: reduce (stages 1 and 2: reduce-scatter; stage 3: the persistent
    /// tensors), clip, step this rank's part, and all-gather (stage 3: write the chunks back).
    fn step_partitioned(&mut self, lr: f64) -> Result<InnerStep> {
        let start = Instant::now();
        let norm = match &mut self.reduction {
            Reduction::Partitioned(zero) => zero.reduce()?,
            Reduction::Sharded(zero) => zero.reduce()?,
            Reduction::Replicated { .. } => unreachable!("called on a partitioned path"),
        };
        let reduce = start.elapsed();
        let opt_start = Instant::now();
        let model = self.model.clone();
        // During the step the new parameters (stage 3: chunks) are assembled while the old
        // ones are alive.
        let (model, held, transient) = match &mut self.reduction {
            Reduction::Partitioned(zero) => {
                let model = zero.step_reduced(model, lr)?;
                (model, zero.state_bytes(), 4 * self.layout.numel as u64)
            }
            Reduction::Sharded(zero) => {
                let model = zero.step_reduced(model, lr)?;
                let held = zero.state_bytes();
                (model, held, held.params)
            }
            Reduction::Replicated { .. } => unreachable!("called on a partitioned path"),
        };
        self.model = model;
        self.ledger.update(|m| *m = held);
        self.ledger.transient_grads(transient);
        Ok(InnerStep {
            norm,
            local_norm_sq: None,
            compressed: false,
            reduce,
            optimizer: opt_start.elapsed(),
        })
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
    /// it. Collective: every rank calls it. At ZeRO stage 0 rank 0 writes, since every rank
    /// holds the same state; at stages 1 and 2 every rank writes its slice of the optimizer
    /// state into the same staging directory (which must be visible to every rank) and rank 0
    /// commits the checkpoint once all succeeded. Returns the checkpoint's directory.
    ///
    /// 1-bit optimizers save m, v, their frozen coefficients and the step (which fixes the
    /// phase), not the compression error buffers: after a load those start from zero, as in
    /// DeepSpeed.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<PathBuf> {
        let dir = dir.as_ref();
        let tag = tag.map_or_else(|| format!("global_step{}", self.global_step), String::from);
        check_tag(&tag)?;
        let written = match &self.reduction {
            Reduction::Replicated { optim, .. } => {
                if self.comm.rank() == 0 {
                    self.write_replicated(dir, &tag, optim)
                } else {
                    Ok(dir.join(&tag))
                }
            }
            Reduction::Partitioned(zero) => {
                let state = zero
                    .export()
                    .expect("the engine's ZeroSync has an optimizer");
                self.write_partitioned(dir, &tag, state, None)
            }
            Reduction::Sharded(zero) => {
                // Every rank takes part in gathering the whole parameters; rank 0 writes them.
                let params = zero.full_params(&self.model)?;
                let state = zero
                    .export()
                    .expect("the engine's Zero3Sync has an optimizer");
                self.write_partitioned(dir, &tag, state, Some(params))
            }
        };
        // Every rank learns whether rank 0's commit succeeded.
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

    fn meta(&self) -> CheckpointMeta {
        CheckpointMeta {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            global_step: self.global_step,
            world_size: self.comm.world_size(),
            zero_stage: self.config.zero_optimization.stage.into(),
            optimizer: format!("{:?}", self.config.optimizer_kind()),
            compressing: self.one_bit_optimizer().map(|o| o.compressing()),
            param_ids: self.layout.slots.iter().map(|s| s.id.val()).collect(),
            shapes: self.layout.slots.iter().map(|s| s.shape.clone()).collect(),
            files: Vec::new(),
        }
    }

    fn write_replicated(&self, dir: &Path, tag: &str, optim: &EngineOptimizer) -> Result<PathBuf> {
        let optim = match optim {
            EngineOptimizer::Burn(o) => o
                .into_bytes()
                .map_err(|e| DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}")))?
                .to_vec(),
            EngineOptimizer::OneBit(o) => one_bit_state_bytes(&o.export()),
        };
        let params = f32_bytes(&params_to_flat(&self.model, &self.layout));
        write_checkpoint(
            dir,
            tag,
            self.meta(),
            &[("model.bin", params), ("optim.bin", optim)],
        )
    }

    /// Stages 1-3: every rank stages its optimizer slice; rank 0 adds the model (`params`,
    /// or its own whole parameters) and commits.
    fn write_partitioned(
        &self,
        dir: &Path,
        tag: &str,
        state: &PartitionState,
        params: Option<Vec<f32>>,
    ) -> Result<PathBuf> {
        let comm = self.comm.as_ref();
        let staging = staging_dir(dir, tag, "ranks");
        let mut ok = [u8::from(
            comm.rank() != 0 || create_staging(&staging).is_ok(),
        )];
        comm.broadcast(&mut ok, 0)?;
        if ok[0] == 0 {
            return Err(DeepSpeedError::Checkpoint(format!(
                "rank 0 could not create {}",
                staging.display()
            )));
        }
        let name = partition_file(comm.rank());
        let mine = write_state_file(&staging, &name, &partition_state_bytes(state));
        // Each rank reports [ok, length, checksum] so that rank 0 can list every file.
        let mut record = [0u8; 17];
        if let Ok(f) = &mine {
            record[0] = 1;
            record[1..9].copy_from_slice(&f.bytes.to_le_bytes());
            let sum = u64::from_str_radix(&f.fnv64, 16).unwrap_or_default();
            record[9..].copy_from_slice(&sum.to_le_bytes());
        }
        let world = comm.world_size();
        let mut all = vec![0u8; 17 * world];
        comm.all_gather_equal(&record, &mut all)?;
        mine?;
        if let Some(r) = all.chunks(17).position(|c| c[0] == 0) {
            return Err(DeepSpeedError::Checkpoint(format!(
                "rank {r} could not write its optimizer slice into {}",
                staging.display()
            )));
        }
        if comm.rank() != 0 {
            return Ok(dir.join(tag));
        }
        let mut meta = self.meta();
        let params =
            f32_bytes(&params.unwrap_or_else(|| params_to_flat(&self.model, &self.layout)));
        meta.files
            .push(write_state_file(&staging, "model.bin", &params)?);
        for (r, c) in all.chunks(17).enumerate() {
            meta.files.push(CheckpointFile {
                name: partition_file(r),
                bytes: u64::from_le_bytes(c[1..9].try_into().expect("8 bytes")),
                fnv64: format!(
                    "{:016x}",
                    u64::from_le_bytes(c[9..].try_into().expect("8 bytes"))
                ),
            });
        }
        commit_checkpoint(dir, tag, &staging, &meta)
    }

    /// Loads checkpoint `tag` (default: the one `dir/latest` names) into this engine: model,
    /// optimizer state and step. Refuses, with the reason, a checkpoint whose files are
    /// corrupt or whose parameters, optimizer or ZeRO stage differ from this engine's (stages
    /// 1 and 2 share one format and load each other's checkpoints). The world size may differ
    /// from the one that saved it: at stages 1 and 2 the saved slices are joined and cut again
    /// for this world. Every rank calls it (each reads the files, so they must be visible to
    /// every rank). Returns the step.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>, tag: Option<&str>) -> Result<u64> {
        let (meta, files) = read_checkpoint(dir.as_ref(), tag)?;
        let refuse = |what: String| Err(DeepSpeedError::Checkpoint(what));
        let stage: u8 = self.config.zero_optimization.stage.into();
        let partitioned = |s: u8| (1..=3).contains(&s);
        if meta.zero_stage != stage && !(partitioned(meta.zero_stage) && partitioned(stage)) {
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
        let layout = &self.layout;
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
        let mut files = files.into_iter();
        let params = f32_values(&files.next().unwrap_or_default(), "model.bin")?;
        if params.len() != layout.numel {
            return refuse(format!(
                "model.bin holds {} values; the model has {}",
                params.len(),
                layout.numel
            ));
        }
        // The saved ids go back into the model, so that the optimizer state (keyed by id)
        // finds its parameters.
        if let Reduction::Sharded(zero) = &mut self.reduction {
            let model = zero.load_flat(self.model.clone(), &params);
            let model = set_param_ids(model, &meta.param_ids);
            let layout = self.layout.with_ids(&meta.param_ids);
            zero.set_layout(layout.clone());
            let slices = read_slices(files)?;
            let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
            let whole = join_slices(slices, &sizes, meta.zero_stage, meta.world_size)?;
            zero.restore(cut_state(&whole, zero.segments(), zero.own_len()))?;
            self.model = model;
            self.layout = layout;
            self.global_step = meta.global_step;
            self.params_with_state = self.layout.numel;
            self.loss_sum = 0.0;
            return Ok(meta.global_step);
        }
        let model = restore_params(self.model.clone(), layout, &meta.param_ids, &params);
        let layout = ParamLayout::of(&model);
        let mut reduction = Reduction::build(&model, &layout, &self.config, &self.comm)?;
        match &mut reduction {
            Reduction::Replicated { optim, .. } => {
                let optim_bytes = files.next().ok_or_else(|| {
                    DeepSpeedError::Checkpoint("the optimizer state file is missing".into())
                })?;
                match optim {
                    EngineOptimizer::OneBit(onebit) => {
                        onebit.restore(one_bit_state_from_bytes(&optim_bytes)?)?
                    }
                    EngineOptimizer::Burn(burn) => {
                        *burn = burn
                            .clone()
                            .from_bytes(Bytes::from_bytes_vec(optim_bytes))
                            .map_err(|e| {
                                DeepSpeedError::Checkpoint(format!("optimizer state: {e:?}"))
                            })?
                    }
                }
            }
            Reduction::Partitioned(zero) => {
                let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
                let whole = join_slices(
                    read_slices(files)?,
                    &sizes,
                    meta.zero_stage,
                    meta.world_size,
                )?;
                let own = zero.own();
                let segment = Segment {
                    tensor: 0,
                    global: own.clone(),
                    local: 0..own.len(),
                };
                zero.restore(cut_state(&whole, &[segment], own.len()))?;
            }
            Reduction::Sharded(_) => unreachable!("loaded above"),
        }
        self.model = model;
        self.layout = layout;
        self.reduction = reduction;
        self.global_step = meta.global_step;
        self.params_with_state = self.layout.numel;
        self.loss_sum = 0.0;
        Ok(meta.global_step)
    }

    /// The model (identical on every rank after each step). At ZeRO stage 3 its partitioned
    /// parameters store this rank's chunk and gather the whole tensor when read (a
    /// collective: every rank must read them together, as a forward pass does).
    pub fn model(&self) -> &M {
        &self.model
    }
    /// The whole parameters, flat in layout order (the order the module visits them). At
    /// ZeRO stage 3 a collective: every rank calls it.
    ///
    /// # Panics
    /// At stage 3, when a rank fails to take part in the gather (see
    /// [`try_flat_params`](Self::try_flat_params)).
    pub fn flat_params(&self) -> Vec<f32> {
        self.try_flat_params()
            .unwrap_or_else(|e| panic!("gathering the ZeRO-3 parameters failed: {e}"))
    }
    /// [`flat_params`](Self::flat_params), with the gather's failure as an error.
    pub fn try_flat_params(&self) -> Result<Vec<f32>> {
        match &self.reduction {
            Reduction::Sharded(z) => z.full_params(&self.model),
            _ => Ok(params_to_flat(&self.model, &self.layout)),
        }
    }
    /// Consumes the engine and returns the model with whole parameters. At ZeRO stage 3 a
    /// collective (every rank calls it); the returned model's parameters read as stored.
    ///
    /// # Panics
    /// At stage 3, when the gather fails (see [`try_into_model`](Self::try_into_model)).
    pub fn into_model(self) -> M {
        self.try_into_model()
            .unwrap_or_else(|e| panic!("gathering the ZeRO-3 parameters failed: {e}"))
    }
    /// [`into_model`](Self::into_model), with the gather's failure as an error.
    pub fn try_into_model(self) -> Result<M> {
        match &self.reduction {
            Reduction::Sharded(z) => {
                let flat = z.full_params(&self.model)?;
                Ok(z.unshard(self.model, &flat))
            }
            _ => Ok(self.model),
        }
    }
    /// ZeRO stage 3's gather counters (`None` at other stages).
    pub fn gather_stats(&self) -> Option<crate::zero3::GatherStats> {
        match &self.reduction {
            Reduction::Sharded(z) => Some(z.gather_stats()),
            _ => None,
        }
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
        self.layout.numel
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
        match &self.reduction {
            Reduction::Replicated {
                optim: EngineOptimizer::Burn(o),
                ..
            } => Some(o),
            _ => None,
        }
    }

    /// The 1-bit optimizer, when the config names one.
    pub fn one_bit_optimizer(&self) -> Option<&dyn OneBitOptimizer> {
        match &self.reduction {
            Reduction::Replicated {
                optim: EngineOptimizer::OneBit(o),
                ..
            } => Some(o.as_ref()),
            _ => None,
        }
    }
}

/// What one path's step reports to [`DeepSpeedEngine::step`].
struct InnerStep {
    /// Global gradient norm before clipping.
    norm: f64,
    /// When each rank clipped its own gradient: this rank's squared norm, averaged over ranks
    /// for the report.
    local_norm_sq: Option<f64>,
    compressed: bool,
    reduce: Duration,
    optimizer: Duration,
}

/// Refuses settings that would change the math and that this version does not run yet.
pub(crate) fn refuse_unsupported(config: &DeepSpeedConfig) -> Result<()> {
    refuse_zero_keys(config)?;
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

/// The name of rank `rank`'s optimizer slice in a stage 1/2 checkpoint.
fn partition_file(rank: usize) -> String {
    format!("zero_pp_rank_{rank}_optim_states.bin")
}

/// The saved optimizer slices of a checkpoint, in rank order.
fn read_slices(files: impl Iterator<Item = Vec<u8>>) -> Result<Vec<PartitionState>> {
    files
        .enumerate()
        .map(|(r, b)| partition_state_from_bytes(&b, &partition_file(r)))
        .collect()
}

/// The whole optimizer state (steps, and m and v in layout order) from the slices that
/// `world` ranks saved at ZeRO stage `stage`: contiguous slices at stages 1 and 2, each
/// rank's pieces of every tensor at stage 3.
fn join_slices(
    slices: Vec<PartitionState>,
    sizes: &[usize],
    stage: u8,
    world: usize,
) -> Result<PartitionState> {
    let numel: usize = sizes.iter().sum();
    let steps = slices.first().map(|s| s.steps.clone()).unwrap_or_default();
    if steps.len() != sizes.len() || slices.iter().any(|s| s.steps != steps) {
        return Err(DeepSpeedError::Checkpoint(format!(
            "the optimizer slices disagree on the step counts of {} tensors",
            sizes.len()
        )));
    }
    let total: usize = slices.iter().map(|s| s.m.len()).sum();
    if total != numel || slices.len() != world {
        return Err(DeepSpeedError::Checkpoint(format!(
            "{} optimizer slices hold {total} elements; expected {world} slices of a model \
             of {numel}",
            slices.len()
        )));
    }
    let (mut m, mut v) = (vec![0.0f32; numel], vec![0.0f32; numel]);
    if stage == 3 {
        let plan = ShardPlan::new(sizes, world, 0, 0);
        for (r, s) in slices.iter().enumerate() {
            if s.m.len() != plan.own_len(r) {
                return Err(DeepSpeedError::Checkpoint(format!(
                    "{} holds {} elements; rank {r} of {world} owns {} at stage 3",
                    partition_file(r),
                    s.m.len(),
                    plan.own_len(r)
                )));
            }
            for seg in plan.segments(r) {
                m[seg.global.clone()].copy_from_slice(&s.m[seg.local.clone()]);
                v[seg.global].copy_from_slice(&s.v[seg.local]);
            }
        }
    } else {
        let mut at = 0;
        for s in &slices {
            m[at..at + s.m.len()].copy_from_slice(&s.m);
            v[at..at + s.v.len()].copy_from_slice(&s.v);
            at += s.m.len();
        }
    }
    Ok(PartitionState { steps, m, v })
}

/// The state of a rank that owns `segments` (of `len` elements in all) of the whole state.
fn cut_state(whole: &PartitionState, segments: &[Segment], len: usize) -> PartitionState {
    let (mut m, mut v) = (Vec::with_capacity(len), Vec::with_capacity(len));
    for seg in segments {
        m.extend_from_slice(&whole.m[seg.global.clone()]);
        v.extend_from_slice(&whole.v[seg.global.clone()]);
    }
    PartitionState {
        steps: whole.steps.clone(),
        m,
        v,
    }
}

/// `module` with the parameter ids `ids` (in layout order).
fn set_param_ids<M: Module>(module: M, ids: &[u64]) -> M {
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
    module.map(&mut Mapper { ids, next: 0 })
}

/// `module` with the parameter ids `ids` and the values `flat`, both in `layout` order.
fn restore_params<M: Module>(module: M, layout: &ParamLayout, ids: &[u64], flat: &[f32]) -> M {
    set_param_ids(params_from_flat(module, layout, flat), ids)
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
