//! [`PipelineEngine`]: runs one stage of a pipelined model (DeepSpeed's `PipelineEngine`).

use std::marker::PhantomData;
use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor};
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::{CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::pipe::{
    InferenceSchedule, PipeDataTopology, PipeInstruction, PipeSchedule, ScheduleKind,
};

use super::build::WholeTensor;
use super::layer::{LayerInput, PipeBatch, PipeLayer};
use super::report::{PhaseTimer, PipePhases, PipeStepReport};
use super::run::{Mode, Run, Slot};
use super::ties::TiedGroup;
use super::wire::{self, TAG_ACTIVATION, TAG_GRADIENT};
use crate::activation::{checkpoint, with_config_options};
use crate::config::{BatchSizes, DeepSpeedConfig};
use crate::flat::ParamLayout;
use crate::grid::Grid;
use crate::monitor::MonitorRecord;
use crate::step::core::StepCore;
use crate::sync::{GradSync, Reduced};
use crate::{DeepSpeedError, Result, agreed};

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
    pub(super) parts: Vec<usize>,
    pub(super) topo: PipeDataTopology,
    pub(super) pipe_stage: usize,
    pub(super) replica: usize,
    /// The grid: its world, pipe, data and tensor groups, and the tensor-parallel group
    /// the layers are sliced over.
    pub(super) grid: Grid,
    pub(super) ties: Vec<TiedGroup>,
    pub(super) config: DeepSpeedConfig,
    pub(super) batch: BatchSizes,
    /// This stage's regime over its replicas, the engine's own: ZeRO stage 0
    /// ([`ReplicatedSync`](crate::sync::ReplicatedSync): gradients averaged and stepped whole
    /// by Burn's optimizer, on fp32 masters in 16-bit) or stage 1
    /// ([`PartitionedSync`](crate::sync::PartitionedSync): each replica steps its slice).
    pub(super) grads: Box<dyn GradSync<Vec<L>>>,
    /// This stage's parameter layout.
    pub(super) layout: ParamLayout,
    /// Every tensor of the whole model, whole (its slices joined), in layer order: what a
    /// checkpoint holds whatever the grid.
    pub(super) catalog: Vec<WholeTensor>,
    /// The catalog index of this stage's first tensor.
    pub(super) first_slot: usize,
    /// The reduction [`GradSync::reduce`] left for the optimizer step.
    pub(super) reduced: Option<Reduced>,
    pub(super) kind: ScheduleKind,
    pub(super) device: Device,
    pub(super) total_params: usize,
    /// The step protocol: loss scale, step counters, breakdown and monitor.
    pub(super) core: StepCore,
    pub(super) _batch: PhantomData<fn(&B)>,
}

pub(super) fn pipeline_error(msg: String) -> DeepSpeedError {
    DeepSpeedError::Comm(CommError::Pipeline(msg))
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
                        // Stage 1 refuses ties at build: its gradient is whole only at stage 0.
                        if !self.ties.is_empty() {
                            let ties = &self.ties;
                            self.grads.edit_accumulated(&mut |flat| {
                                ties.iter().try_for_each(|tie| tie.sum(flat))
                            })?;
                        }
                    }
                    PipeInstruction::ReduceGrads => {
                        let scale = self.loss_scale();
                        self.reduced = Some(self.grads.reduce(scale)?);
                    }
                    PipeInstruction::OptimizerStep => {
                        grad_norm = self.clip()?;
                        // The norm is summed over the pipeline and the gradient averaged over
                        // the replicas: every rank sees the same norm, and skips together.
                        overflow = !grad_norm.is_finite();
                        if self.core.decide(overflow, grad_norm)? {
                            let layers = std::mem::take(&mut self.layers);
                            self.layers = self.grads.step(layers, lr)?;
                        } else {
                            self.grads.discard();
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
        self.grads.accumulate(&self.layers, &grads);
        Ok(())
    }

    /// The gradient norm over every stage (tied copies counted once), by which the regime
    /// clipped this rank's gradient when it reduced.
    fn clip(&mut self) -> Result<f64> {
        // A sliced layer's collective that failed left zeros: the step stops here (the op
        // aborted the world, so every rank fails).
        if let Some(e) = self.grid.tensor_parallel().take_error() {
            return Err(DeepSpeedError::Comm(e));
        }
        self.reduced
            .take()
            .map(|r| r.norm)
            .ok_or_else(|| pipeline_error("an optimizer step before the reduction".into()))
    }
}
