//! One rank of a data-parallel run: the engine's loop ([`run_rank`]) and one step
//! ([`train_step`]).

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{Device, Int, Tensor};
use burn_deepspeed::comm::Communicator;
use burn_deepspeed::grid::Grid;
use burn_deepspeed::progress::TrainProgress;
use burn_deepspeed::transfer::{host_device_bytes, staged_collective_bytes};
use burn_deepspeed::{DeepSpeedEngine, DeepSpeedError, Result, StepReport};

use super::{figures::*, pipelined::*, report::*, spec::*};
use crate::model::{Gpt, LayerDrop, SplitMix64};

/// Trains on this rank: data parallel, or through the pipeline engine when the config has
/// `"pipeline": {"stages": S}` (S stages x world/S replicas). Every rank returns the same
/// report.
pub fn run_rank(spec: &RunSpec, comm: Arc<dyn Communicator>) -> Result<RunReport> {
    check_corpus(spec)?;
    if spec
        .config
        .pipeline
        .as_ref()
        .and_then(|p| p.stage_count())
        .is_some()
    {
        return run_pipelined(spec, comm);
    }
    let device = spec.device.device(comm.rank());
    let (rank, world) = (comm.rank(), comm.world_size());
    // ANCHOR: engine_loop
    // The grid of `tensor_parallel.tp_size` slices x the data-parallel replicas; each rank
    // builds the whole model from the seed and keeps its slice.
    let grid = Grid::from_config(&spec.config, comm.clone(), &device)?
        .with_expert_parallel(spec.ep_size, &device)?;
    // A GPT-MoE keeps its experts of the expert-parallel group; each data-parallel rank
    // routes with its own draws.
    if spec.teacher.is_some() && grid.sequence_parallel().size() > 1 {
        return Err(DeepSpeedError::Unsupported {
            key: "sequence_parallel_size".into(),
            reason: "a student learns from its teacher's logits over whole sequences: train \
                     it without sequence parallelism"
                .into(),
        });
    }
    if spec.teacher.is_some() && grid.topology().tensor > 1 {
        return Err(DeepSpeedError::Unsupported {
            key: "tensor_parallel.tp_size".into(),
            reason: "a student learns from its teacher over the whole vocabulary: train it \
                     without tensor slicing"
                .into(),
        });
    }
    let model = Gpt::new(spec.shape, spec.seed, &device)
        .with_activation_checkpointing(spec.config.activation_checkpointing.is_some())
        .with_long_context(spec.long_context)
        .sliced(grid.tensor_parallel())?
        .with_experts(grid.expert_parallel(), moe_seed(spec, rank))?
        .with_sequence_parallel(grid.sequence_parallel())?;
    let moe_log = model.moe_log().clone();
    let mut engine = DeepSpeedEngine::with_grid(model, spec.config.clone(), &grid)?;
    if let Some(dir) = &spec.resume_from {
        engine.load_checkpoint(dir, None)?;
    }
    let batch = engine.batch();
    let seq = spec.shape.seq_len;
    engine.set_tokens_per_sample(seq as u64);
    // `flops_profiler`: the forward of one micro-batch, for the profile at `profile_step`.
    let micro = batch.train_micro_batch_size_per_gpu as usize;
    engine.set_profile_forward(move |m: &Gpt, device: &Device| {
        drop(m.forward(Tensor::<2, Int>::zeros([micro, seq], device)));
    });
    let gas = batch.gradient_accumulation_steps;
    let progress = TrainProgress::new(if spec.progress { rank } else { usize::MAX }, spec.steps);
    let inner = device.clone().inner();
    let first_step = engine.global_step();
    if first_step > spec.steps {
        return Err(DeepSpeedError::Data(format!(
            "--steps {} is below the step the checkpoint resumes from ({first_step}); ask for \
             at least {first_step} steps",
            spec.steps
        )));
    }
    // Capacity for what a report keeps, not a blind allocation of `--steps` entries.
    let mut losses = Vec::with_capacity((spec.steps - first_step).min(1 << 16) as usize);
    let mut grad_norms = Vec::with_capacity(losses.capacity());
    let mut moq_bits = Vec::new();
    let (mut per_step_bytes, mut per_sample, mut compressed) = (Vec::new(), Vec::new(), 0);
    let mut per_step_model_bytes = Vec::new();
    let (mut fb_seconds, mut optimizer_seconds) = (Vec::new(), Vec::new());
    let (mut host_device, mut staged) = (Vec::new(), Vec::new());
    let (mut breakdown, mut timed_steps) = (StepBreakdown::default(), 0u64);
    let mut pld_theta = None;
    let mut loss_scale = Vec::new();
    let (mut peak_activation, mut checkpoint_host_bytes) = (None, None);
    let mut moe = spec.shape.moe.map(|_| MoeReport::default());
    let all_to_all = || {
        grid.expert_parallel()
            .ep_group()
            .map_or(0, |c| c.stats().total_sent())
    };
    let start = Instant::now();
    for step in first_step..spec.steps {
        let step_start = Instant::now();
        let (copied, staged_before) = (host_device_bytes(), staged_collective_bytes());
        let exchanged = all_to_all();
        let report = train_step(&mut engine, spec, step, &inner)?;
        // ANCHOR_END: engine_loop
        if let Some(moe) = &mut moe {
            moe.record(moe_log.drain(), all_to_all() - exchanged);
        }
        host_device.push(host_device_bytes() - copied);
        staged.push(staged_collective_bytes() - staged_before);
        losses.push(report.loss);
        grad_norms.push(report.grad_norm);
        moq_bits.extend(report.moq_bits);
        per_step_bytes.push(report.bytes_sent);
        per_step_model_bytes.push(report.model_bytes_sent);
        let wall = step_start.elapsed();
        per_sample.push(wall.as_secs_f64() / batch.train_batch_size as f64);
        // The first step warms up (allocations, the optimizer's state): not in the means.
        if step > first_step {
            breakdown.add(&report, wall);
            timed_steps += 1;
        }
        fb_seconds.push(report.forward_backward.as_secs_f64());
        optimizer_seconds.push(report.optimizer.as_secs_f64());
        compressed += u64::from(report.compressed);
        pld_theta = report.pld_theta;
        loss_scale.extend(report.loss_scale);
        peak_activation = peak_activation.max(report.peak_activation_bytes);
        let host = report.activation_checkpoints.map(|c| c.host_bytes);
        checkpoint_host_bytes = checkpoint_host_bytes.max(host.filter(|&b| b > 0));
        let elapsed = start.elapsed().as_secs_f64();
        let tokens = (step + 1 - first_step) * batch.train_batch_size * seq as u64;
        progress.update(step + 1, report.loss, tokens as f64 / elapsed);
    }
    if let Some(dir) = &spec.save_dir {
        engine.save_checkpoint(dir, None)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    progress.finish();
    // Before the figures' own collective, which runs on the world beneath the logger.
    let comms = CommsReport::of(&grid);
    let figures = gather_figures(
        comm.as_ref(),
        RankFigures {
            axis: grid.bytes_sent_per_axis(),
            sent: comm.stats().total_sent(),
            model_sent: comm.stats().total_model_sent(),
            state: engine.model_state_bytes().total(),
            formula: engine.model_state_bytes_formula(),
            peak_state: engine.peak_model_state_bytes(),
            rss: peak_rss_bytes(),
            bubble: 0.0,
            live_activations: 0,
            breakdown: breakdown.mean(timed_steps),
        },
    )?;
    // Collectives for the held-out loss and the tests' comparisons, after the traffic
    // figures were taken.
    let heldout = match &spec.heldout {
        Some(bytes) => Some(crate::generate::heldout(
            &burn::module::Module::valid(engine.model()),
            None,
            bytes,
            spec.shape.seq_len,
        )?),
        None => None,
    };
    let moments = match spec.keep_final_state {
        true => engine
            .optimizer_moments()?
            .map(|s| (FlatParams(s.m), FlatParams(s.v))),
        false => None,
    };
    Ok(RunReport {
        world,
        backend: comm.backend().to_string(),
        zero_stage: engine.config().zero_optimization.stage.into(),
        params: engine.model_params(),
        steps: spec.steps,
        first_step,
        losses,
        grad_norms,
        moq_bits,
        tokens_per_s: ((spec.steps - first_step) * batch.train_batch_size * seq as u64) as f64
            / elapsed,
        train_batch_size: batch.train_batch_size,
        gradient_accumulation_steps: gas,
        model_state_bytes_per_rank: figures.iter().map(|f| f.state).max().unwrap_or(0),
        peak_model_state_bytes_per_rank: figures.iter().map(|f| f.peak_state).max().unwrap_or(0),
        model_state_bytes_formula: engine.model_state_bytes_formula(),
        comm_bytes_per_rank: figures.iter().map(|f| f.sent).collect(),
        comm_bytes_model_per_rank: figures.iter().map(|f| f.model_sent).collect(),
        comm_bytes_per_axis: figures.iter().map(|f| f.axis).collect(),
        comm_bytes_per_step: per_step_bytes,
        comm_bytes_model_per_step: per_step_model_bytes,
        compressed_steps: compressed,
        dtype: engine.config().precision_name().into(),
        loss_scale,
        skipped_steps: engine.skipped_steps(),
        peak_activation_bytes: peak_activation,
        activation_checkpointing: engine.config().activation_checkpointing.is_some(),
        checkpoint_host_bytes,
        seq_len: seq,
        blockwise_attention: spec.long_context.blockwise_attention,
        tile: spec.long_context.tile,
        pld_theta,
        step_seconds_per_sample: per_sample,
        forward_backward_seconds: fb_seconds,
        optimizer_seconds,
        breakdown_per_rank: figures.iter().map(|f| f.breakdown).collect(),
        peak_rss_bytes: figures.iter().map(|f| f.rss).max().unwrap_or(0),
        device: spec.device.name().into(),
        host_device_bytes_per_step: host_device,
        staged_collective_bytes_per_step: staged,
        pipeline_stages: 1,
        data_parallel: grid.topology().data,
        tensor_parallel: grid.topology().tensor,
        bubble_fraction: None,
        peak_live_activations_per_stage: None,
        gather_stats: engine.gather_stats(),
        offload_optimizer: engine
            .config()
            .zero_optimization
            .optimizer_offload()
            .name()
            .into(),
        swap: engine.swap().map(SwapReport::from),
        offload_param: engine
            .config()
            .zero_optimization
            .offload_param
            .as_ref()
            .map_or("none", |o| o.device.name())
            .into(),
        param_store: engine.param_store().map(ParamStoreReport::from),
        disk_baseline: None,
        final_params: match spec.keep_final_state {
            true => FlatParams(engine.flat_params()?),
            false => FlatParams::default(),
        },
        final_moments: moments,
        ep_size: grid.expert_parallel().size(),
        heldout_loss: heldout.map(|h| h.loss),
        heldout_tokens: heldout.map(|h| h.tokens),
        distilled_steps: spec.teacher.as_ref().map_or(0, |t| {
            (first_step..spec.steps)
                .filter(|&s| t.distill.teaches_at(s))
                .count() as u64
        }),
        moe,
        comms,
    })
}

// ANCHOR: train_step
/// One data-parallel optimizer step on this rank: the rank's micro-batches of global step
/// `step` (with θ(t) in each batch when progressive layer dropping is on), through the engine.
pub fn train_step(
    engine: &mut DeepSpeedEngine<Gpt>,
    spec: &RunSpec,
    step: u64,
    device: &Device,
) -> Result<StepReport> {
    let (rank, world) = (
        engine.comm().rank() as u64,
        engine.comm().world_size() as u64,
    );
    // Under sequence parallelism the ranks of a group share their sequences, each taking its
    // block of positions: the sequences are those of the group's replica.
    let sp = engine.model().sequence_parallel().clone();
    let (rank, world) = (rank / sp.size() as u64, world / sp.size() as u64);
    let batch = engine.batch();
    let micro = batch.train_micro_batch_size_per_gpu;
    // Progressive layer dropping: θ(t) travels in the batch, as DeepSpeed passes it to the
    // model's forward.
    let theta = engine.pld_theta();
    // The MoE layers draw from (seed, step): a resumed run draws as an uninterrupted one.
    engine
        .model()
        .reseed_experts(moe_seed(spec, rank as usize), step);
    // Global sequence index of (micro-step k, rank r, row i) = (k·world + r)·micro + i: the
    // ranks hold disjoint shards of each global batch.
    let micro_batches = (0..batch.gradient_accumulation_steps).map(|k| {
        let first = (k * world + rank) * micro;
        // One draw per micro-step, the same on every rank: the ranks drop the same blocks,
        // which ZeRO-3 needs (a dropped block is not gathered, so ranks that dropped
        // different blocks would pair different gathers).
        let layer_drop = theta.map(|theta| LayerDrop {
            theta,
            seed: SplitMix64::new(spec.seed ^ (step << 32) ^ k).next_u64(),
        });
        let batch = spec
            .corpus
            .batch(step, first, micro as usize, spec.shape.seq_len, device)
            .sequence_block(&sp)
            .with_layer_drop(layer_drop);
        // Mixture-of-Students: the teacher's logits for this micro-batch while it teaches.
        let soft = spec
            .teacher
            .as_ref()
            .filter(|t| t.distill.teaches_at(step))
            .map(|t| t.soft_targets(&batch.inputs, device));
        batch.with_soft_targets(soft)
    });
    engine.train_batch(micro_batches)
}
// ANCHOR_END: train_step

/// Data-parallel rank `rank`'s seed of the MoE layers' draws (each rank routes with its own,
/// as each DeepSpeed rank has its own generator).
pub(crate) fn moe_seed(spec: &RunSpec, rank: usize) -> u64 {
    spec.seed ^ (rank as u64) << 40
}

pub(crate) fn check_corpus(spec: &RunSpec) -> Result<()> {
    let seq = spec.shape.seq_len;
    if spec.corpus.len() <= seq + 1 {
        return Err(DeepSpeedError::Data(format!(
            "the corpus has {} bytes; at least {} are needed for sequences of {seq}",
            spec.corpus.len(),
            seq + 2
        )));
    }
    Ok(())
}
