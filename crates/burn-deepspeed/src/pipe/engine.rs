//! [`PipelineEngine`]: runs one stage of a pipelined model (DeepSpeed's `PipelineEngine`).

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::pipe::{
    InferenceSchedule, PartitionMethod, PipeDataTopology, PipeInstruction, PipeSchedule,
    ScheduleKind,
};
use serde::Serialize;

use super::layer::{LayerInput, PipeBatch, PipeLayer};
use super::ties::{TiedGroup, find_ties};
use super::wire::{self, TAG_ACTIVATION, TAG_GRADIENT};
use crate::config::{BatchSizes, DeepSpeedConfig, PipelineStages, ZeroStage};
use crate::engine::flat::{ParamLayout, params_from_flat, params_to_flat};
use crate::engine::reduce::scale_to_norm;
use crate::engine::{
    GradientSync, build_optimizer, refuse_unsupported_precision, state_tensors_per_param,
    unsupported,
};
use crate::{DeepSpeedError, Result};

/// The result of one pipelined optimizer step.
#[derive(Debug, Clone, Serialize)]
pub struct PipeStepReport {
    /// Optimizer steps taken so far (this one included).
    pub step: u64,
    /// Mean loss over every micro-batch of every replica (computed by the last stage and
    /// shared with every rank).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm (over every stage) before clipping.
    pub grad_norm: f64,
    /// This stage's idle share of the schedule: 1 − (time in forward and backward passes) /
    /// (time from the first instruction to the last backward's gradient send).
    pub stage_bubble_fraction: f64,
    /// [`stage_bubble_fraction`](Self::stage_bubble_fraction) averaged over every rank.
    pub bubble_fraction: f64,
    /// The most activations this stage held at once (forwarded, not yet backwarded).
    pub peak_live_activations: usize,
    /// Time of this stage's schedule (up to the gradient reductions).
    pub schedule_time: Duration,
    /// Time of this stage in forward and backward passes.
    pub compute_time: Duration,
}

/// One buffer slot of the schedule.
struct Slot<B> {
    batch: Option<B>,
    input: Option<Tensor<3>>,
    output: Option<Tensor<3>>,
    loss: Option<Tensor<1>>,
    output_grad: Option<Tensor<3>>,
    input_grad: Option<Tensor<3>>,
}

impl<B> Default for Slot<B> {
    fn default() -> Self {
        Self {
            batch: None,
            input: None,
            output: None,
            loss: None,
            output_grad: None,
            input_grad: None,
        }
    }
}

/// Pipeline-parallel training of a model given as a sequence of [`PipeLayer`]s.
///
/// SPMD over `stages x replicas` ranks (`pipeline.stages` from the config; the world size
/// must be a multiple of it). Rank `r` runs stage `r / replicas` of replica `r % replicas`
/// ([`PipeDataTopology`]). Each rank keeps only its stage's layers (split by
/// `pipeline.partition`), runs the stage's instruction stream over
/// `gradient_accumulation_steps` micro-batches, sends activations forward and gradients
/// backward to its neighbours, sums tied layers' gradients, averages gradients over the
/// replicas of its stage, clips by the norm over all stages, and steps its own layers. The
/// result equals data-parallel training over `replicas` ranks with the same global batch.
pub struct PipelineEngine<L, B> {
    layers: Vec<L>,
    parts: Vec<usize>,
    topo: PipeDataTopology,
    stage: usize,
    replica: usize,
    world: Arc<dyn Communicator>,
    pipe: Arc<dyn Communicator>,
    data: Arc<dyn Communicator>,
    ties: Vec<TiedGroup>,
    optim: ModuleOptimizer,
    config: DeepSpeedConfig,
    batch: BatchSizes,
    sync: GradientSync,
    kind: ScheduleKind,
    device: Device,
    total_params: usize,
    global_step: u64,
    _batch: PhantomData<fn(&B)>,
}

fn pipeline_error(msg: String) -> DeepSpeedError {
    DeepSpeedError::Comm(CommError::Pipeline(msg))
}

impl<L, B> PipelineEngine<L, B>
where
    L: PipeLayer<B>,
    B: PipeBatch,
{
    /// Builds this rank's stage from the whole model's `layers` (every rank passes the same
    /// list; each keeps its stage's layers and drops the rest). `device` is the autodiff
    /// device the layers live on. Collective: every rank of `comm` must call it.
    pub fn new(
        layers: Vec<L>,
        mut config: DeepSpeedConfig,
        comm: Arc<dyn Communicator>,
        device: Device,
    ) -> Result<Self> {
        let pipeline = config.pipeline.clone().unwrap_or_default();
        let stages = match pipeline.stages {
            PipelineStages::Count(n) => n as usize,
            PipelineStages::Auto(_) => {
                return Err(unsupported(
                    "pipeline.stages",
                    "\"auto\" has no model to size the pipeline from here; give the number of \
                     stages",
                ));
            }
        };
        let topo = PipeDataTopology::new(comm.world_size(), stages)?;
        match config.zero_optimization.stage {
            ZeroStage::Disabled => {}
            ZeroStage::OptimizerStates => {
                return Err(unsupported(
                    "zero_optimization.stage",
                    "ZeRO stage 1 with a pipeline is not implemented yet; set the stage to 0",
                ));
            }
            _ => {
                return Err(unsupported(
                    "zero_optimization.stage",
                    "ZeRO stages 2 and 3 cannot be combined with pipeline parallelism (as in \
                     DeepSpeed: gradients are accumulated across micro-batches on each stage); \
                     use stage 0 or 1",
                ));
            }
        }
        refuse_unsupported_precision(&config)?;
        if config.progressive_layer_drop.enabled {
            return Err(unsupported(
                "progressive_layer_drop.enabled",
                "the pipeline engine does not hand θ to its layers yet; progressive layer \
                 dropping runs in `DeepSpeedEngine`",
            ));
        }
        // The batch arithmetic counts data-parallel replicas, not ranks.
        let batch = config.resolve(topo.replicas)?;
        if layers.len() < stages {
            return Err(pipeline_error(format!(
                "{} layers cannot fill {stages} stages",
                layers.len()
            )));
        }
        let (stage, replica) = topo.coords(comm.rank());
        let method = PartitionMethod::parse(&pipeline.partition)?;
        let counts: Vec<usize> = layers.iter().map(|l| ParamLayout::of(l).numel).collect();
        let types: Vec<String> = layers.iter().map(|l| l.type_name()).collect();
        let type_refs: Vec<&str> = types.iter().map(String::as_str).collect();
        let parts = method.partition(&counts, &type_refs, stages)?;
        if parts.windows(2).any(|w| w[0] == w[1]) {
            return Err(pipeline_error(format!(
                "partition `{}` leaves a stage without layers: boundaries {parts:?}",
                pipeline.partition
            )));
        }
        let total_params = counts.iter().sum();
        let keys: Vec<Option<String>> = layers.iter().map(|l| l.tie_key()).collect();

        let pipe = comm.split(replica)?;
        let data = comm.split(stage)?;
        let mine: Vec<L> = layers
            .into_iter()
            .skip(parts[stage])
            .take(parts[stage + 1] - parts[stage])
            .collect();
        let mut offset = 0;
        let ranges: Vec<Range<usize>> = counts[parts[stage]..parts[stage + 1]]
            .iter()
            .map(|&n| {
                offset += n;
                offset - n..offset
            })
            .collect();
        let ties = find_ties(&keys, &parts, stage, &ranges, pipe.as_ref())?;

        let optim_cfg = config
            .optimizer
            .clone()
            .expect("resolve fills the optimizer");
        let optim = build_optimizer(&optim_cfg)?;
        let sync = GradientSync::new(&mine, &config, data.clone());
        let mut mine = sync.broadcast_params(mine)?;
        if !ties.is_empty() {
            let layout = sync.layout();
            let mut flat = params_to_flat(&mine, layout);
            for tie in &ties {
                tie.copy_first(&mut flat)?;
            }
            mine = params_from_flat(mine, layout, &flat);
        }
        Ok(Self {
            layers: mine,
            parts,
            topo,
            stage,
            replica,
            world: comm,
            pipe,
            data,
            ties,
            optim,
            config,
            batch,
            sync,
            kind: ScheduleKind::default(),
            device,
            total_params,
            global_step: 0,
            _batch: PhantomData,
        })
    }

    /// Runs `kind` instead of 1F1B (GPipe, for comparison).
    pub fn with_schedule(mut self, kind: ScheduleKind) -> Self {
        self.kind = kind;
        self
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches of this replica
    /// (DeepSpeed's `PipelineEngine.train_batch`). `load(i)` returns micro-batch `i` of this
    /// replica's share of the step; only the first and the last stage call it.
    pub fn train_batch(&mut self, mut load: impl FnMut(usize) -> B) -> Result<PipeStepReport> {
        let stages = self.topo.stages;
        let micro = self.batch.gradient_accumulation_steps as usize;
        let (first, last) = (self.stage == 0, self.stage == stages - 1);
        let schedule = self.kind.schedule(micro, stages, self.stage);
        let mut slots: Vec<Slot<B>> = (0..schedule.num_pipe_buffers())
            .map(|_| Slot::default())
            .collect();
        let (mut loaded, mut live, mut peak) = (0usize, 0usize, 0usize);
        let mut compute = Duration::ZERO;
        let mut schedule_time = Duration::ZERO;
        let mut loss_sum = 0.0f64;
        let mut grad_norm = 0.0;
        let lr = self.lr_at(self.global_step);
        let start = Instant::now();
        for step in schedule.steps() {
            for inst in step {
                let _span = tracing::trace_span!("pipe", stage = self.stage, %inst).entered();
                match inst {
                    PipeInstruction::LoadMicroBatch { buffer } => {
                        slots[buffer].batch = Some(load(loaded));
                        loaded += 1;
                    }
                    PipeInstruction::RecvActivation { buffer } => {
                        let x = wire::recv(
                            self.pipe.as_ref(),
                            self.stage - 1,
                            TAG_ACTIVATION,
                            &self.device,
                        )?;
                        slots[buffer].input = Some(x.require_grad());
                    }
                    PipeInstruction::ForwardPass { buffer } => {
                        let t0 = Instant::now();
                        let slot = &mut slots[buffer];
                        let y = self.forward_stage(slot)?;
                        if last {
                            let batch = slot.batch.as_ref().ok_or_else(|| {
                                pipeline_error("the last stage has no micro-batch loaded".into())
                            })?;
                            let loss = batch.loss(y);
                            loss_sum += loss.clone().into_scalar::<f32>() as f64;
                            slot.loss = Some(loss);
                        } else {
                            slot.output = Some(y);
                        }
                        if !last {
                            // Only the last stage needs the batch again (for the loss).
                            slot.batch = None;
                        }
                        live += 1;
                        peak = peak.max(live);
                        compute += t0.elapsed();
                    }
                    PipeInstruction::SendActivation { buffer } => {
                        let y = slots[buffer].output.as_ref().ok_or_else(|| {
                            pipeline_error(format!("no activation in buffer {buffer} to send"))
                        })?;
                        wire::send(self.pipe.as_ref(), y, self.stage + 1, TAG_ACTIVATION)?;
                    }
                    PipeInstruction::RecvGrad { buffer } => {
                        let dy = wire::recv(
                            self.pipe.as_ref(),
                            self.stage + 1,
                            TAG_GRADIENT,
                            &self.device,
                        )?;
                        slots[buffer].output_grad = Some(dy);
                    }
                    PipeInstruction::BackwardPass { buffer } => {
                        let t0 = Instant::now();
                        self.backward_stage(&mut slots[buffer], last)?;
                        live -= 1;
                        compute += t0.elapsed();
                    }
                    PipeInstruction::SendGrad { buffer } => {
                        let dx = slots[buffer].input_grad.take().ok_or_else(|| {
                            pipeline_error(format!("no input gradient in buffer {buffer} to send"))
                        })?;
                        wire::send(self.pipe.as_ref(), &dx, self.stage - 1, TAG_GRADIENT)?;
                    }
                    PipeInstruction::ReduceTiedGrads => {
                        schedule_time = start.elapsed();
                        let flat = self.sync.flat_mut();
                        for tie in &self.ties {
                            tie.sum(flat)?;
                        }
                    }
                    PipeInstruction::ReduceGrads => self.sync.average()?,
                    PipeInstruction::OptimizerStep => {
                        grad_norm = self.clip()?;
                        let grads: GradientsParams = self.sync.take(&self.layers);
                        let layers = std::mem::take(&mut self.layers);
                        self.layers = self.optim.step(lr, layers, grads);
                        self.sync.clear_marks();
                    }
                }
            }
        }
        if loaded != if first || last { micro } else { 0 } {
            return Err(pipeline_error(format!(
                "stage {} loaded {loaded} micro-batches for {micro}",
                self.stage
            )));
        }
        // The loss lives on the last stage: average it over its replicas, then hand it down
        // each pipeline.
        let mut loss = [(loss_sum / micro as f64) as f32];
        if last && self.data.world_size() > 1 {
            self.data.all_reduce(&mut loss, ReduceOp::Mean)?;
        }
        if stages > 1 {
            self.pipe.broadcast(&mut loss, stages - 1)?;
        }
        let stage_bubble = if schedule_time.is_zero() {
            0.0
        } else {
            1.0 - compute.as_secs_f64() / schedule_time.as_secs_f64()
        };
        let mut bubble = [stage_bubble as f32];
        if self.world.world_size() > 1 {
            self.world.all_reduce(&mut bubble, ReduceOp::Mean)?;
        }
        self.global_step += 1;
        Ok(PipeStepReport {
            step: self.global_step,
            loss: loss[0] as f64,
            lr,
            grad_norm,
            stage_bubble_fraction: stage_bubble,
            bubble_fraction: bubble[0] as f64,
            peak_live_activations: peak,
            schedule_time,
            compute_time: compute,
        })
    }

    /// Mean loss of `gradient_accumulation_steps` micro-batches per replica without training
    /// (DeepSpeed's `eval_batch`, on its [`InferenceSchedule`]); every rank gets the mean over
    /// all replicas. `load` is called as in [`train_batch`](Self::train_batch).
    pub fn eval_batch(&mut self, mut load: impl FnMut(usize) -> B) -> Result<f64> {
        let stages = self.topo.stages;
        let micro = self.batch.gradient_accumulation_steps as usize;
        let last = self.stage == stages - 1;
        let schedule = InferenceSchedule::new(micro, stages, self.stage);
        let mut slots: Vec<Slot<B>> = (0..schedule.num_pipe_buffers())
            .map(|_| Slot::default())
            .collect();
        let (mut loaded, mut loss_sum) = (0usize, 0.0f64);
        for inst in schedule.steps().into_iter().flatten() {
            match inst {
                PipeInstruction::LoadMicroBatch { buffer } => {
                    slots[buffer].batch = Some(load(loaded));
                    loaded += 1;
                }
                PipeInstruction::RecvActivation { buffer } => {
                    slots[buffer].input = Some(wire::recv(
                        self.pipe.as_ref(),
                        self.stage - 1,
                        TAG_ACTIVATION,
                        &self.device,
                    )?);
                }
                PipeInstruction::ForwardPass { buffer } => {
                    let slot = &mut slots[buffer];
                    let y = self.forward_stage(slot)?.detach();
                    if last {
                        let batch = slot.batch.take().ok_or_else(|| {
                            pipeline_error("the last stage has no micro-batch loaded".into())
                        })?;
                        loss_sum += batch.loss(y).into_scalar::<f32>() as f64;
                    } else {
                        slot.output = Some(y);
                    }
                    slot.input = None;
                }
                PipeInstruction::SendActivation { buffer } => {
                    let y = slots[buffer].output.take().ok_or_else(|| {
                        pipeline_error(format!("no activation in buffer {buffer} to send"))
                    })?;
                    wire::send(self.pipe.as_ref(), &y, self.stage + 1, TAG_ACTIVATION)?;
                }
                other => {
                    return Err(pipeline_error(format!(
                        "`{other}` in an inference schedule"
                    )));
                }
            }
        }
        let mut loss = [(loss_sum / micro as f64) as f32];
        if last && self.data.world_size() > 1 {
            self.data.all_reduce(&mut loss, ReduceOp::Mean)?;
        }
        if stages > 1 {
            self.pipe.broadcast(&mut loss, stages - 1)?;
        }
        Ok(loss[0] as f64)
    }

    /// Runs this stage's layers on a slot's input.
    fn forward_stage(&self, slot: &mut Slot<B>) -> Result<Tensor<3>> {
        let mut hidden = if self.stage == 0 {
            None
        } else {
            Some(slot.input.clone().ok_or_else(|| {
                pipeline_error("a forward pass found no received activation".into())
            })?)
        };
        for layer in &self.layers {
            let input = match hidden.take() {
                Some(h) => LayerInput::Hidden(h),
                None => LayerInput::Batch(slot.batch.as_ref().ok_or_else(|| {
                    pipeline_error("the first stage has no micro-batch loaded".into())
                })?),
            };
            hidden = Some(layer.forward(input));
        }
        Ok(hidden.expect("a stage has at least one layer"))
    }

    /// Backward through a slot: from the loss on the last stage, else from the received
    /// gradient of the output; keeps the input's gradient for `SendGrad`.
    fn backward_stage(&mut self, slot: &mut Slot<B>, last: bool) -> Result<()> {
        let grads = if last {
            let loss = slot
                .loss
                .take()
                .ok_or_else(|| pipeline_error("a backward pass found no loss".into()))?;
            loss.backward()
        } else {
            let (y, dy) = slot
                .output
                .take()
                .zip(slot.output_grad.take())
                .ok_or_else(|| {
                    pipeline_error("a backward pass found no output or no output gradient".into())
                })?;
            // d(sum(y * dy))/dy = dy: backpropagates the received gradient.
            (y * dy).sum().backward()
        };
        if self.stage > 0 {
            let x = slot.input.take().ok_or_else(|| {
                pipeline_error("a backward pass found no input activation".into())
            })?;
            let dx = x.grad(&grads).ok_or_else(|| {
                pipeline_error(format!(
                    "stage {}'s output does not depend on its input: no gradient to send back",
                    self.stage
                ))
            })?;
            slot.input_grad = Some(dx);
        }
        slot.batch = None;
        let grads = GradientsParams::from_grads(grads, &self.layers);
        self.sync.accumulate(&self.layers, &grads);
        Ok(())
    }

    /// Clips the averaged gradient by its norm over every stage (tied copies counted once).
    /// Returns the norm before clipping.
    fn clip(&mut self) -> Result<f64> {
        let threshold = self.sync.clip_threshold();
        let flat = self.sync.flat_mut();
        let square = |r: &[f32]| r.iter().map(|&g| g as f64 * g as f64).sum::<f64>();
        let duplicates: f64 = self
            .ties
            .iter()
            .flat_map(|t| t.duplicates())
            .map(|r| square(&flat[r.clone()]))
            .sum();
        let mut sq = [(square(flat) - duplicates) as f32];
        if self.topo.stages > 1 {
            self.pipe.all_reduce(&mut sq, ReduceOp::Sum)?;
        }
        let norm = (sq[0].max(0.0) as f64).sqrt();
        scale_to_norm(flat, norm, threshold);
        Ok(norm)
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        self.config.lr_at(step)
    }

    /// This rank's stage.
    pub fn stage(&self) -> usize {
        self.stage
    }
    /// This rank's replica (its index on the data-parallel axis).
    pub fn replica(&self) -> usize {
        self.replica
    }
    /// The pp x dp grid.
    pub fn topology(&self) -> PipeDataTopology {
        self.topo
    }
    /// Stage boundaries over the model's layers (`parts[s]..parts[s + 1]` on stage `s`).
    pub fn parts(&self) -> &[usize] {
        &self.parts
    }
    /// This stage's layers.
    pub fn layers(&self) -> &[L] {
        &self.layers
    }
    /// Consumes the engine and returns this stage's layers.
    pub fn into_layers(self) -> Vec<L> {
        self.layers
    }
    /// The resolved config.
    pub fn config(&self) -> &DeepSpeedConfig {
        &self.config
    }
    /// The resolved batch sizes (per replica micro-batches; global batch over replicas).
    pub fn batch(&self) -> BatchSizes {
        self.batch
    }
    /// Optimizer steps taken.
    pub fn global_step(&self) -> u64 {
        self.global_step
    }
    /// Float parameters of the whole model.
    pub fn total_params(&self) -> usize {
        self.total_params
    }
    /// Float parameters of this stage.
    pub fn stage_params(&self) -> usize {
        self.sync.layout().numel
    }
    /// Bytes of parameters, gradient buffer and optimizer state this rank holds (fp32).
    pub fn model_state_bytes(&self) -> u64 {
        let kind = self.config.optimizer_kind();
        (4 * (2 + state_tensors_per_param(kind)) * self.stage_params()) as u64
    }
    /// Bytes this rank sent over the world, pipeline and data-parallel communicators.
    pub fn bytes_sent(&self) -> u64 {
        [&self.world, &self.pipe, &self.data]
            .iter()
            .map(|c| c.stats().total_sent())
            .sum()
    }
}
