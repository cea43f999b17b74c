//! [`PipelineEngine`]: runs one stage of a pipelined model (DeepSpeed's `PipelineEngine`).

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, FloatDType, Tensor};
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::pipe::{
    InferenceSchedule, PartitionMethod, PipeDataTopology, PipeInstruction, PipeSchedule,
    ScheduleKind,
};
use serde::Serialize;

use super::layer::{LayerInput, PipeBatch, PipeLayer};
use super::run::{Mode, Run, Slot};
use super::ties::{TiedGroup, find_ties};
use super::wire::{self, TAG_ACTIVATION, TAG_GRADIENT};
use crate::activation::{checkpoint, with_config_options};
use crate::config::ZeroStage;
use crate::config::{BatchSizes, DeepSpeedConfig, EntryPoint, OptimizerKind, check_supported};
use crate::flat::{ParamLayout, param_paths, params_from_flat, params_to_flat};
use crate::grid::Grid;
use crate::memory::estimate::{StatePrecision, estimate_model_states};
use crate::memory::{ModelStateBytes, burn_state_bytes_per_elem, param_bytes};
use crate::monitor::MonitorRecord;
use crate::optim::build_optimizer;
use crate::optim::partitioned_kind;
use crate::precision::cast_module;
use crate::step::core::StepCore;
use crate::sync::scale::clip_to;
use crate::sync::{
    GradBuffer, GradSync, ModelParallelNorm, PartitionedSync, Reduced, SyncOptions,
    broadcast_params,
};
use crate::tensor_parallel::TensorParallel;
use crate::{DeepSpeedError, Result, agreed};

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
    /// The gradient norm was not finite: the step was skipped on every rank.
    pub overflow: bool,
    /// fp16: the loss scale this step's gradients were computed with.
    pub loss_scale: Option<f32>,
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
    /// This stage's time per phase of the step (`wall_clock_breakdown`).
    pub phases: PipePhases,
}

/// A pipeline stage's time per phase of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PipePhases {
    /// Loading micro-batches (first and last stage).
    pub load: Duration,
    /// Forward passes.
    pub forward: Duration,
    /// Backward passes.
    pub backward: Duration,
    /// Activation and gradient sends and receives, waiting for the neighbour included.
    pub send_recv: Duration,
    /// Tied-gradient sums and the gradient reduction over the replicas.
    pub reduce: Duration,
    /// The optimizer step.
    pub optimizer: Duration,
    /// The whole step.
    pub step: Duration,
}

impl PipePhases {
    /// The phase an instruction's time counts in.
    fn of(&mut self, inst: PipeInstruction) -> &mut Duration {
        match inst {
            PipeInstruction::LoadMicroBatch { .. } => &mut self.load,
            PipeInstruction::ForwardPass { .. } => &mut self.forward,
            PipeInstruction::BackwardPass { .. } => &mut self.backward,
            PipeInstruction::SendActivation { .. }
            | PipeInstruction::RecvActivation { .. }
            | PipeInstruction::SendGrad { .. }
            | PipeInstruction::RecvGrad { .. } => &mut self.send_recv,
            PipeInstruction::ReduceTiedGrads | PipeInstruction::ReduceGrads => &mut self.reduce,
            PipeInstruction::OptimizerStep => &mut self.optimizer,
        }
    }

    /// The phases by name, in the order `wall_clock_breakdown` prints them.
    pub fn named(&self) -> [(&'static str, Duration); 7] {
        [
            ("load", self.load),
            ("forward", self.forward),
            ("backward", self.backward),
            ("send/recv", self.send_recv),
            ("reduce", self.reduce),
            ("optimizer", self.optimizer),
            ("step", self.step),
        ]
    }
}

/// A `tracing` span named after the instruction (a timeline shows each one by name).
fn instruction_span(inst: PipeInstruction, stage: usize) -> tracing::Span {
    let buffer = inst.buffer();
    macro_rules! span {
        ($name:literal) => {
            tracing::trace_span!($name, stage, buffer)
        };
    }
    match inst {
        PipeInstruction::LoadMicroBatch { .. } => span!("LoadMicroBatch"),
        PipeInstruction::ForwardPass { .. } => span!("ForwardPass"),
        PipeInstruction::BackwardPass { .. } => span!("BackwardPass"),
        PipeInstruction::SendActivation { .. } => span!("SendActivation"),
        PipeInstruction::RecvActivation { .. } => span!("RecvActivation"),
        PipeInstruction::SendGrad { .. } => span!("SendGrad"),
        PipeInstruction::RecvGrad { .. } => span!("RecvGrad"),
        PipeInstruction::ReduceTiedGrads => span!("ReduceTiedGrads"),
        PipeInstruction::ReduceGrads => span!("ReduceGrads"),
        PipeInstruction::OptimizerStep => span!("OptimizerStep"),
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
    pub(super) layers: Vec<L>,
    parts: Vec<usize>,
    topo: PipeDataTopology,
    pub(super) pipe_stage: usize,
    pub(super) replica: usize,
    /// The grid: its world, pipe, data and tensor groups, and the tensor-parallel group
    /// the layers are sliced over.
    pub(super) grid: Grid,
    /// How the gradient norm sums over the stages and the slices.
    norm: ModelParallelNorm,
    ties: Vec<TiedGroup>,
    optim: ModuleOptimizer,
    pub(super) config: DeepSpeedConfig,
    batch: BatchSizes,
    /// This stage's gradients: averaged and stepped whole (ZeRO stage 0), or reduce-scattered
    /// over the replicas and stepped in slices (stage 1).
    pub(super) grads: StageGrads<L>,
    /// This stage's parameter layout.
    pub(super) layout: ParamLayout,
    /// Every tensor of the whole model, whole (its slices joined), in layer order: what a
    /// checkpoint holds whatever the grid.
    pub(super) catalog: Vec<WholeTensor>,
    /// The catalog index of this stage's first tensor.
    pub(super) first_slot: usize,
    /// Stage 1: the reduction [`GradSync::reduce`] left for the optimizer step.
    reduced: Option<Reduced>,
    /// The optimizer as built (stepped nothing), for measuring its state per element.
    fresh_optim: ModuleOptimizer,
    /// Bytes of the optimizer's state (counted after the first step).
    optim_bytes: u64,
    kind: ScheduleKind,
    device: Device,
    total_params: usize,
    /// The step protocol: loss scale, step counters, breakdown and monitor.
    pub(super) core: StepCore,
    /// Mixed precision: the fp32 masters of this stage's layers, which the optimizer steps
    /// (`layers` is their 16-bit working copy).
    masters: Option<Vec<L>>,
    _batch: PhantomData<fn(&B)>,
}

/// One tensor of the whole model: `layer.path` (the layer's index in the whole list) and
/// its whole shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WholeTensor {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
}

impl WholeTensor {
    pub(super) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The whole model's tensors (sliced ones at their whole shape) in layer order, and the index
/// of the first tensor of layer `first_layer`.
fn whole_tensors<L: burn::module::Module>(
    layers: &[L],
    tp: &TensorParallel,
    first_layer: usize,
) -> (Vec<WholeTensor>, usize) {
    let mut catalog = Vec::new();
    let mut first = 0;
    for (i, layer) in layers.iter().enumerate() {
        if i == first_layer {
            first = catalog.len();
        }
        let layout = ParamLayout::of(layer);
        let paths = param_paths(layer, &layout);
        for (slot, path) in layout.slots.iter().zip(paths) {
            let shape = match tp.layout(slot.id) {
                Some(cut) => cut.whole_shape(&slot.shape, tp.size()),
                None => slot.shape.clone(),
            };
            catalog.push(WholeTensor {
                name: format!("{i}.{path}"),
                shape,
            });
        }
    }
    (catalog, first)
}

/// How a stage keeps its gradients and steps: DeepSpeed allows ZeRO stage 1 on a pipeline's
/// data-parallel axis (stages 2 and 3 would cut the gradients that accumulate across
/// micro-batches).
pub(super) enum StageGrads<L> {
    /// Stage 0: the whole flat gradient, averaged over the replicas, and Burn's optimizer.
    Replicated(Box<GradBuffer>),
    /// Stage 1: the ZeRO regime over the data-parallel group ([`PartitionedSync`]): each
    /// replica steps its slice of the stage's optimizer state.
    Partitioned(Box<dyn GradSync<Vec<L>>>),
}

fn pipeline_error(msg: String) -> DeepSpeedError {
    DeepSpeedError::Comm(CommError::Pipeline(msg))
}

/// Each layer's parameter count, and the stage boundaries `partition` cuts them into
/// (`parts[s]..parts[s + 1]` on stage `s`); refuses a stage without layers.
fn partition_layers<L: PipeLayer<B>, B: PipeBatch>(
    layers: &[L],
    partition: &str,
    stages: usize,
) -> Result<(Vec<usize>, Vec<usize>)> {
    if layers.len() < stages {
        return Err(pipeline_error(format!(
            "{} layers cannot fill {stages} stages",
            layers.len()
        )));
    }
    let method = PartitionMethod::parse(partition)?;
    let counts: Vec<usize> = layers.iter().map(|l| ParamLayout::of(l).numel).collect();
    let types: Vec<String> = layers.iter().map(|l| l.type_name()).collect();
    let type_refs: Vec<&str> = types.iter().map(String::as_str).collect();
    let parts = method.partition(&counts, &type_refs, stages)?;
    if parts.windows(2).any(|w| w[0] == w[1]) {
        return Err(pipeline_error(format!(
            "partition `{partition}` leaves a stage without layers: boundaries {parts:?}"
        )));
    }
    Ok((counts, parts))
}

/// `layers` with every tied copy set to its group's first (a collective over the pipeline
/// when a tie spans stages).
fn tie_params<L: burn::module::Module>(
    layers: Vec<L>,
    layout: &ParamLayout,
    ties: &[TiedGroup],
) -> Result<Vec<L>> {
    if ties.is_empty() {
        return Ok(layers);
    }
    let mut flat = params_to_flat(&layers, layout);
    for tie in ties {
        tie.copy_first(&mut flat)?;
    }
    Ok(params_from_flat(layers, layout, &flat))
}

/// The 16-bit working copy of `layers`.
fn cast_layers<L: burn::module::Module>(layers: &[L], dtype: FloatDType) -> Vec<L> {
    layers
        .iter()
        .map(|l| cast_module(l.clone(), dtype))
        .collect()
}

/// `layers` one after the other on hidden states.
fn run_layers<L: PipeLayer<B>, B>(layers: &[L], hidden: Tensor<3>) -> Tensor<3> {
    layers
        .iter()
        .fold(hidden, |h, layer| layer.forward(LayerInput::Hidden(h)))
}

impl<L, B> PipelineEngine<L, B>
where
    L: PipeLayer<B> + 'static,
    B: PipeBatch + 'static,
{
    /// Builds this rank's stage from the whole model's `layers` (every rank passes the same
    /// list; each keeps its stage's layers and drops the rest). `device` is the autodiff
    /// device the layers live on. Collective: every rank of `comm` must call it.
    pub fn new(
        layers: Vec<L>,
        config: DeepSpeedConfig,
        comm: Arc<dyn Communicator>,
        device: Device,
    ) -> Result<Self> {
        check_supported(&config, EntryPoint::Pipeline)?;
        if config.tp_size() > 1 {
            return Err(DeepSpeedError::Unsupported {
                key: "tensor_parallel.tp_size".into(),
                reason: "the layers must be sliced first: build a `grid::Grid` from the \
                         config, slice the layers with its `tensor_parallel()` group, and \
                         create the engine with `PipelineEngine::with_grid`"
                    .into(),
            });
        }
        let grid = Grid::new(comm, config.pipeline_stages(), 1, &device)?;
        Self::with_grid(layers, config, &grid, device)
    }

    /// [`new`](Self::new) on a [`Grid`] (the full 3D grid: pp x dp x tp): `layers` are this
    /// rank's slices over the grid's tensor-parallel group (every rank of the group passes its
    /// slices of the same list), the stages run over the grid's pipe groups and the replicas
    /// average over its data groups. The gradient norm counts each logical parameter once
    /// ([`ModelParallelNorm`]: summed over the stages and the slices). Collective: every rank
    /// of the grid calls it.
    pub fn with_grid(
        layers: Vec<L>,
        mut config: DeepSpeedConfig,
        grid: &Grid,
        device: Device,
    ) -> Result<Self> {
        check_supported(&config, EntryPoint::Pipeline)?;
        let pipeline = config.pipeline.clone().unwrap_or_default();
        let stages = pipeline.stage_count().unwrap_or(1) as usize;
        let shape = grid.topology();
        if shape.pipe != stages || shape.tensor != config.tp_size() {
            return Err(DeepSpeedError::Unsupported {
                key: "pipeline.stages".into(),
                reason: format!(
                    "the config asks for {stages} stages x {} slices, the grid has {} x {}",
                    config.tp_size(),
                    shape.pipe,
                    shape.tensor
                ),
            });
        }
        let kind = config.optimizer_kind();
        if shape.tensor > 1 && !matches!(kind, OptimizerKind::Adam | OptimizerKind::AdamW) {
            return Err(DeepSpeedError::Unsupported {
                key: "optimizer.type".into(),
                reason: format!(
                    "{kind:?} with tensor slicing is not implemented; use Adam or AdamW"
                ),
            });
        }
        let topo = PipeDataTopology::new(shape.pipe * shape.data, stages)?;
        // The batch arithmetic counts data-parallel replicas, not ranks.
        let batch = config.resolve(topo.replicas)?;
        let (stage, replica) = (grid.coord().pipe, grid.coord().data);
        let (counts, parts) = partition_layers(&layers, &pipeline.partition, stages)?;
        let keys: Vec<Option<String>> = layers.iter().map(|l| l.tie_key()).collect();
        let tp = grid.tensor_parallel().clone();
        let (catalog, first_slot) = whole_tensors(&layers, &tp, parts[stage]);
        let total_params = catalog.iter().map(WholeTensor::numel).sum();

        let (pipe, data) = (grid.pipe().clone(), grid.data().clone());
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
        let duplicates: Vec<Range<usize>> =
            ties.iter().flat_map(|t| t.duplicates()).cloned().collect();

        let optim_cfg = config
            .optimizer
            .clone()
            .ok_or_else(|| DeepSpeedError::Data("the config was not resolved".into()))?;
        let optim = build_optimizer(&optim_cfg)?;
        let layout = ParamLayout::of(&mine);
        let mine = broadcast_params(data.as_ref(), &layout, mine)?;
        let mine = tie_params(mine, &layout, &ties)?;
        let mut norm = ModelParallelNorm::none().with_group(pipe.clone(), duplicates);
        if shape.tensor > 1 {
            norm = norm.with_tensor(grid.tensor().clone(), &layout, &tp);
        }
        let options = SyncOptions::of(&config);
        // Mixed precision: the optimizer steps fp32 masters, and the layers that run are
        // their 16-bit working copy.
        let (grads, layers, masters) = match options.stage {
            ZeroStage::Disabled => {
                let grads = StageGrads::Replicated(Box::new(GradBuffer::new(
                    layout.clone(),
                    data.clone(),
                    &options,
                )));
                match config.working_dtype() {
                    Some(dtype) => (grads, cast_layers(&mine, dtype), Some(mine)),
                    None => (grads, mine, None),
                }
            }
            _ => {
                if !ties.is_empty() {
                    return Err(DeepSpeedError::Unsupported {
                        key: "zero_optimization.stage".into(),
                        reason: "ZeRO stage 1 with tied layers across stages is not \
                                 implemented yet; set the stage to 0"
                            .into(),
                    });
                }
                let kind = partitioned_kind(&optim_cfg)?;
                let sync =
                    PartitionedSync::<f32>::new(layout.clone(), data.clone(), &options, kind);
                let mut sync: Box<dyn GradSync<Vec<L>>> = Box::new(sync);
                sync.model_parallel_norm(norm.clone())?;
                let layers = match config.working_dtype() {
                    Some(dtype) => sync.keep_masters(mine, dtype)?,
                    None => mine,
                };
                (StageGrads::Partitioned(sync), layers, None)
            }
        };
        let core = StepCore::with_monitor(&config, grid.world().as_ref())?;
        Ok(Self {
            layers,
            masters,
            core,
            parts,
            topo,
            pipe_stage: stage,
            replica,
            grid: grid.clone(),
            norm,
            ties,
            fresh_optim: optim.clone(),
            optim,
            config,
            batch,
            grads,
            layout,
            catalog,
            first_slot,
            reduced: None,
            optim_bytes: 0,
            kind: ScheduleKind::default(),
            device,
            total_params,
            _batch: PhantomData,
        })
    }

    /// Declares how many tokens one sample holds, so that the monitor also records
    /// tokens per second.
    pub fn set_tokens_per_sample(&mut self, tokens: u64) {
        self.core.set_tokens_per_sample(tokens);
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
        if self.config.tensorboard.enabled || self.config.csv_monitor.enabled {
            // Rank 0's failed write of the last step fails this one everywhere.
            let failure = self.core.take_monitor_failure();
            let local = failure.map_or(Ok(()), |e| Err(DeepSpeedError::Data(e)));
            agreed(self.grid.world().as_ref(), "monitor", local)?;
        }
        let stages = self.topo.stages;
        let micro = self.batch.gradient_accumulation_steps as usize;
        let schedule = self.kind.schedule(micro, stages, self.pipe_stage);
        let mut run = Run::new(schedule.num_pipe_buffers(), Mode::Train);
        let loss_scale = self.loss_scale();
        let mut grad_norm = 0.0;
        let lr = self.core.lr(&self.config);
        let mut overflow = false;
        let start = Instant::now();
        let mut phases = PipePhases::default();
        for step in schedule.steps() {
            for inst in step {
                let _span = instruction_span(inst, self.pipe_stage).entered();
                let t0 = Instant::now();
                let _timer = PhaseTimer {
                    phase: phases.of(inst),
                    t0,
                };
                if self.data_instruction(inst, &mut run, &mut load)? {
                    continue;
                }
                match inst {
                    PipeInstruction::RecvGrad { buffer } => {
                        let dy = wire::recv(
                            self.grid.pipe().as_ref(),
                            self.pipe_stage + 1,
                            TAG_GRADIENT,
                            &self.device,
                            self.wire_dtype(),
                        )?;
                        run.slots[buffer].output_grad = Some(dy);
                    }
                    PipeInstruction::BackwardPass { buffer } => {
                        let t0 = Instant::now();
                        let last = self.pipe_stage == stages - 1;
                        self.backward_stage(&mut run.slots[buffer], last)?;
                        run.live -= 1;
                        run.compute += t0.elapsed();
                    }
                    PipeInstruction::SendGrad { buffer } => {
                        let dx = run.slots[buffer].input_grad.take().ok_or_else(|| {
                            pipeline_error(format!("no input gradient in buffer {buffer} to send"))
                        })?;
                        let (pipe, dtype) = (self.grid.pipe().as_ref(), self.wire_dtype());
                        wire::send(pipe, &dx, self.pipe_stage - 1, TAG_GRADIENT, dtype)?;
                    }
                    PipeInstruction::ReduceTiedGrads => {
                        run.schedule_time = start.elapsed();
                        // Stage 1 refuses ties: its gradient is whole only in the regime.
                        if let StageGrads::Replicated(buffer) = &mut self.grads {
                            let flat = buffer.flat_mut();
                            for tie in &self.ties {
                                tie.sum(flat)?;
                            }
                        }
                    }
                    PipeInstruction::ReduceGrads => {
                        let scale = self.loss_scale();
                        match &mut self.grads {
                            StageGrads::Replicated(buffer) => buffer.average(scale)?,
                            StageGrads::Partitioned(sync) => {
                                self.reduced = Some(sync.reduce(scale)?)
                            }
                        }
                    }
                    PipeInstruction::OptimizerStep => {
                        grad_norm = self.clip()?;
                        // The norm is summed over the pipeline and the gradient averaged over
                        // the replicas: every rank sees the same norm, and skips together.
                        overflow = !grad_norm.is_finite();
                        if self.core.decide(overflow, grad_norm)? {
                            self.optimizer_step(lr)?;
                        } else {
                            match &mut self.grads {
                                StageGrads::Replicated(buffer) => {
                                    buffer.reset();
                                    buffer.clear_marks();
                                }
                                StageGrads::Partitioned(sync) => sync.discard(),
                            }
                        }
                    }
                    other => {
                        return Err(pipeline_error(format!("`{other}` in a train schedule")));
                    }
                }
            }
        }
        self.check_loaded(run.loaded, micro)?;
        let loss = self.share_loss(run.loss_sum, micro)?;
        let stage_bubble = if run.schedule_time.is_zero() {
            0.0
        } else {
            1.0 - run.compute.as_secs_f64() / run.schedule_time.as_secs_f64()
        };
        let mut bubble = [stage_bubble as f32];
        if self.grid.world().world_size() > 1 {
            self.grid.world().all_reduce(&mut bubble, ReduceOp::Mean)?;
        }
        phases.step = start.elapsed();
        // One breakdown line per stage: its first replica's.
        let suffix = format!(" (stage {})", self.pipe_stage);
        let print_as = (self.replica == 0).then_some((self.grid.world().rank(), suffix.as_str()));
        let state_bytes = (self.core.monitoring()).then(|| self.model_state_bytes().total() as f64);
        let report_scale = self.core.loss_scale().map(|_| loss_scale);
        let ms = |d: Duration| Some(d.as_secs_f64() * 1e3);
        let step = self
            .core
            .finish(&phases.named(), print_as, phases.step, |timed| {
                MonitorRecord {
                    train_loss: loss,
                    lr,
                    loss_scale: report_scale.map(f64::from),
                    grad_norm,
                    model_state_bytes: state_bytes,
                    forward_ms: ms(phases.forward),
                    backward_ms: ms(phases.backward),
                    reduce_ms: ms(phases.reduce),
                    optimizer_ms: ms(phases.optimizer),
                    ..timed
                }
            });
        let report = PipeStepReport {
            step,
            loss,
            lr,
            grad_norm,
            overflow,
            loss_scale: report_scale,
            stage_bubble_fraction: stage_bubble,
            bubble_fraction: bubble[0] as f64,
            peak_live_activations: run.peak,
            schedule_time: run.schedule_time,
            compute_time: run.compute,
            phases,
        };
        Ok(report)
    }

    /// Mean loss of `gradient_accumulation_steps` micro-batches per replica without training
    /// (DeepSpeed's `eval_batch`, on its [`InferenceSchedule`]); every rank gets the mean over
    /// all replicas. `load` is called as in [`train_batch`](Self::train_batch).
    pub fn eval_batch(&mut self, mut load: impl FnMut(usize) -> B) -> Result<f64> {
        let micro = self.batch.gradient_accumulation_steps as usize;
        let schedule = InferenceSchedule::new(micro, self.topo.stages, self.pipe_stage);
        let mut run = Run::new(schedule.num_pipe_buffers(), Mode::Eval);
        for inst in schedule.steps().into_iter().flatten() {
            if !self.data_instruction(inst, &mut run, &mut load)? {
                return Err(pipeline_error(format!("`{inst}` in an inference schedule")));
            }
        }
        self.check_loaded(run.loaded, micro)?;
        self.share_loss(run.loss_sum, micro)
    }

    /// The instructions training and evaluation share: loading micro-batches, receiving and
    /// sending activations, and forward passes. Returns false for any other instruction.
    fn data_instruction(
        &self,
        inst: PipeInstruction,
        run: &mut Run<B>,
        load: &mut impl FnMut(usize) -> B,
    ) -> Result<bool> {
        let train = run.mode == Mode::Train;
        let last = self.pipe_stage == self.topo.stages - 1;
        match inst {
            PipeInstruction::LoadMicroBatch { buffer } => {
                run.slots[buffer].batch = Some(load(run.loaded));
                run.loaded += 1;
            }
            PipeInstruction::RecvActivation { buffer } => {
                let x = wire::recv(
                    self.grid.pipe().as_ref(),
                    self.pipe_stage - 1,
                    TAG_ACTIVATION,
                    &self.device,
                    self.wire_dtype(),
                )?;
                run.slots[buffer].input = Some(if train { x.require_grad() } else { x });
            }
            PipeInstruction::ForwardPass { buffer } => {
                let t0 = Instant::now();
                let slot = &mut run.slots[buffer];
                let y = self.forward_stage(slot)?;
                let y = if train { y } else { y.detach() };
                if last {
                    let batch = slot.batch.as_ref().ok_or_else(|| {
                        pipeline_error("the last stage has no micro-batch loaded".into())
                    })?;
                    let loss = batch.loss(y);
                    run.loss_sum += loss.clone().into_scalar::<f32>() as f64;
                    if train {
                        slot.loss = Some(loss);
                    }
                } else {
                    slot.output = Some(y);
                }
                if !last || !train {
                    // Only the last stage needs the batch again (for the loss's backward).
                    slot.batch = None;
                }
                if train {
                    run.live += 1;
                    run.peak = run.peak.max(run.live);
                    run.compute += t0.elapsed();
                } else {
                    slot.input = None;
                }
            }
            PipeInstruction::SendActivation { buffer } => {
                let slot = &mut run.slots[buffer];
                // Training keeps the activation for the backward pass.
                let y = if train {
                    slot.output.clone()
                } else {
                    slot.output.take()
                };
                let y = y.ok_or_else(|| {
                    pipeline_error(format!("no activation in buffer {buffer} to send"))
                })?;
                let (pipe, dtype) = (self.grid.pipe().as_ref(), self.wire_dtype());
                wire::send(pipe, &y, self.pipe_stage + 1, TAG_ACTIVATION, dtype)?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Refuses a run in which this stage loaded another number of micro-batches than the
    /// schedule has (only the first and the last stage load them).
    fn check_loaded(&self, loaded: usize, micro: usize) -> Result<()> {
        let (first, last) = (
            self.pipe_stage == 0,
            self.pipe_stage == self.topo.stages - 1,
        );
        if loaded != if first || last { micro } else { 0 } {
            return Err(pipeline_error(format!(
                "stage {} loaded {loaded} micro-batches for {micro}",
                self.pipe_stage
            )));
        }
        Ok(())
    }

    /// The mean loss over every replica: the last stage averages its replicas', then hands
    /// it down each pipeline.
    fn share_loss(&self, loss_sum: f64, micro: usize) -> Result<f64> {
        let stages = self.topo.stages;
        let mut loss = [(loss_sum / micro as f64) as f32];
        if self.pipe_stage == stages - 1 && self.grid.data().world_size() > 1 {
            self.grid.data().all_reduce(&mut loss, ReduceOp::Mean)?;
        }
        if stages > 1 {
            self.grid.pipe().broadcast(&mut loss, stages - 1)?;
        }
        Ok(loss[0] as f64)
    }

    /// The dtype activations and their gradients cross stages in: the working dtype.
    fn wire_dtype(&self) -> FloatDType {
        self.config.working_dtype().unwrap_or(FloatDType::F32)
    }

    /// fp16: the current loss scale; 1 otherwise.
    fn loss_scale(&self) -> f32 {
        self.core.loss_scale().unwrap_or(1.0)
    }

    /// Steps this stage's layers with the averaged, clipped gradient (under mixed precision,
    /// the fp32 masters, then casts them into the working copy).
    fn optimizer_step(&mut self, lr: f64) -> Result<()> {
        let buffer = match &mut self.grads {
            StageGrads::Replicated(buffer) => buffer,
            StageGrads::Partitioned(sync) => {
                let layers = std::mem::take(&mut self.layers);
                self.layers = sync.step(layers, lr)?;
                return Ok(());
            }
        };
        match self.masters.take() {
            Some(masters) => {
                let grads: GradientsParams = buffer.take(&masters);
                let masters = self.optim.step(lr, masters, grads);
                self.layers = cast_layers(&masters, self.wire_dtype());
                self.masters = Some(masters);
            }
            None => {
                let grads: GradientsParams = buffer.take(&self.layers);
                let layers = std::mem::take(&mut self.layers);
                self.layers = self.optim.step(lr, layers, grads);
            }
        }
        if self.optim_bytes == 0 {
            // The state per element, measured on a probe, for every element of this stage
            // (all of them have a gradient after the first step).
            let per_elem = burn_state_bytes_per_elem(&self.fresh_optim);
            self.optim_bytes = (per_elem * self.stage_params() as f64).round() as u64;
        }
        if let StageGrads::Replicated(buffer) = &mut self.grads {
            buffer.clear_marks();
        }
        Ok(())
    }

    /// Runs this stage's layers on a slot's input. With `activation_checkpoint_interval` k > 0
    /// the layers run in checkpointed runs of k (see [`checkpoint`]): only each run's input is
    /// kept, and its activations are recomputed in backward. The first layer of the model reads
    /// the micro-batch, not a tensor, so it runs as it is and the runs start after it.
    fn forward_stage(&self, slot: &mut Slot<B>) -> Result<Tensor<3>> {
        let mut layers = self.layers.as_slice();
        let hidden = if self.pipe_stage == 0 {
            let batch = slot.batch.as_ref().ok_or_else(|| {
                pipeline_error("the first stage has no micro-batch loaded".into())
            })?;
            let (first, rest) = layers
                .split_first()
                .ok_or_else(|| pipeline_error("a stage has no layers".into()))?;
            layers = rest;
            first.forward(LayerInput::Batch(batch))
        } else {
            slot.input.clone().ok_or_else(|| {
                pipeline_error("a forward pass found no received activation".into())
            })?
        };
        let interval = self
            .config
            .pipeline
            .as_ref()
            .map_or(0, |p| p.activation_checkpoint_interval) as usize;
        if interval == 0 {
            return Ok(run_layers(layers, hidden));
        }
        Ok(with_config_options(&self.config, || {
            layers.chunks(interval).fold(hidden, |h, run| {
                checkpoint(&run.to_vec(), h, |run: &Vec<L>, h| run_layers(run, h))
            })
        }))
    }

    /// Backward through a slot: from the loss on the last stage, else from the received
    /// gradient of the output; keeps the input's gradient for `SendGrad`.
    fn backward_stage(&mut self, slot: &mut Slot<B>, last: bool) -> Result<()> {
        let grads = if last {
            let loss = slot
                .loss
                .take()
                .ok_or_else(|| pipeline_error("a backward pass found no loss".into()))?;
            // fp16: the loss times the scale, which the gradient average divides out.
            match self.core.loss_scale() {
                Some(scale) => (loss * scale).backward(),
                None => loss.backward(),
            }
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
        if self.pipe_stage > 0 {
            let x = slot.input.take().ok_or_else(|| {
                pipeline_error("a backward pass found no input activation".into())
            })?;
            let dx = x.grad(&grads).ok_or_else(|| {
                pipeline_error(format!(
                    "stage {}'s output does not depend on its input: no gradient to send back",
                    self.pipe_stage
                ))
            })?;
            slot.input_grad = Some(dx);
        }
        slot.batch = None;
        let grads = GradientsParams::from_grads(grads, &self.layers);
        match &mut self.grads {
            StageGrads::Replicated(buffer) => {
                buffer.accumulate(&self.layers, &grads);
            }
            StageGrads::Partitioned(sync) => sync.accumulate(&self.layers, &grads),
        }
        Ok(())
    }

    /// Clips the averaged gradient by its norm over every stage (tied copies counted once).
    /// Returns the norm before clipping.
    fn clip(&mut self) -> Result<f64> {
        let threshold = self.config.gradient_clipping;
        // A sliced layer's collective that failed left zeros: the step stops here (the op
        // aborted the world, so every rank fails).
        if let Some(e) = self.grid.tensor_parallel().take_error() {
            return Err(DeepSpeedError::Comm(e));
        }
        match &mut self.grads {
            StageGrads::Replicated(buffer) => {
                let flat = buffer.flat_mut();
                let local = self.norm.host_sq(flat, 0);
                let norm = self.norm.across(local)?.sqrt();
                clip_to(flat, norm, threshold);
                Ok(norm)
            }
            // The regime clipped its slice by the norm over the replicas, the stages and the
            // slices when it reduced.
            StageGrads::Partitioned(_) => self
                .reduced
                .take()
                .map(|r| r.norm)
                .ok_or_else(|| pipeline_error("an optimizer step before the reduction".into())),
        }
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        self.config.lr_at(step)
    }

    /// This rank's pipeline stage (not to be confused with the ZeRO stage).
    pub fn pipe_stage(&self) -> usize {
        self.pipe_stage
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
    /// This stage's layers (under mixed precision, the 16-bit working copy).
    pub fn layers(&self) -> &[L] {
        &self.layers
    }
    /// Mixed precision: the fp32 masters of this stage's layers, which the optimizer steps.
    pub fn master_layers(&self) -> Option<&[L]> {
        self.masters.as_deref()
    }
    /// Steps skipped because the gradient norm was not finite (DeepSpeed's `skipped_steps`).
    pub fn skipped_steps(&self) -> u64 {
        self.core.skipped_steps()
    }
    /// fp16: the loss scale the next step's gradients are computed with.
    pub fn current_loss_scale(&self) -> Option<f32> {
        self.core.loss_scale()
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
        self.core.global_step()
    }
    /// Float parameters of the whole model.
    pub fn total_params(&self) -> usize {
        self.total_params
    }
    /// Float parameters of this stage.
    pub fn stage_params(&self) -> usize {
        self.layout.numel
    }
    /// The model state this rank holds, measured: its layers' stored parameters, its gradient
    /// buffer, and the state tensors of its optimizer (read after the first step), with the
    /// fp32 masters of a mixed-precision run.
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        let buffer = match &self.grads {
            StageGrads::Replicated(buffer) => buffer,
            StageGrads::Partitioned(sync) => return sync.held(&self.layers),
        };
        let masters: u64 = self.masters.iter().flatten().map(param_bytes).sum();
        ModelStateBytes {
            params: self.layers.iter().map(param_bytes).sum(),
            grads: buffer.bytes(),
            optimizer: self.optim_bytes + masters,
            offloaded: 0,
        }
    }
    /// What ZeRO's formula (arXiv 1910.02054) gives for this rank's model state, not
    /// measured: its stage's parameters (its slices under tensor slicing) as Ψ, the
    /// optimizer state cut over the replicas at stage 1.
    pub fn model_state_bytes_formula(&self) -> u64 {
        let stage: u8 = self.config.zero_optimization.stage.into();
        // The pipeline accumulates fp32 gradients under fp16 as under bf16.
        let precision = match StatePrecision::of(&self.config) {
            StatePrecision::Mixed => StatePrecision::MixedFp32Grads,
            other => other,
        };
        let (params, replicas) = (self.stage_params() as u64, self.topo.replicas as u64);
        estimate_model_states(params, replicas, stage, precision, 0, 0).total
    }

    /// The grid this engine runs on.
    pub fn grid(&self) -> &Grid {
        &self.grid
    }

    /// This rank's counters over the world, pipeline and data-parallel communicators:
    /// `(measured bytes sent, ring-model bytes sent)`.
    pub fn bytes_sent(&self) -> (u64, u64) {
        let mut comms: Vec<&Arc<dyn Communicator>> = Vec::new();
        for c in [
            self.grid.world(),
            self.grid.pipe(),
            self.grid.data(),
            self.grid.tensor(),
        ] {
            // A group that is the whole world is the world's communicator: counted once.
            if !comms.iter().any(|k| Arc::ptr_eq(k, c)) {
                comms.push(c);
            }
        }
        comms.iter().map(|c| c.stats()).fold((0, 0), |(m, r), s| {
            (m + s.total_sent(), r + s.total_model_sent())
        })
    }
}

/// Adds the time since `t0` to `phase` when dropped (after the instruction, whichever way
/// its arm leaves the loop body).
struct PhaseTimer<'a> {
    phase: &'a mut Duration,
    t0: Instant,
}

impl Drop for PhaseTimer<'_> {
    fn drop(&mut self) {
        *self.phase += self.t0.elapsed();
    }
}
