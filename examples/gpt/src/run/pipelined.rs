//! One rank of a pipelined run, through the pipeline engine.

use std::sync::Arc;
use std::time::Instant;

use burn_deepspeed::comm::Communicator;
use burn_deepspeed::flat::{ParamLayout, params_to_flat};
use burn_deepspeed::grid::Grid;
use burn_deepspeed::pipe::PipelineEngine;
use burn_deepspeed::progress::TrainProgress;
use burn_deepspeed::transfer::{host_device_bytes, staged_collective_bytes};
use burn_deepspeed::{DeepSpeedError, Result};

use super::{figures::*, report::*, spec::*};
use crate::model::Gpt;

/// Trains one stage of the pipelined GPT on this rank.
pub(crate) fn run_pipelined(spec: &RunSpec, comm: Arc<dyn Communicator>) -> Result<RunReport> {
    if spec.shape.moe.is_some() || spec.ep_size > 1 {
        return Err(DeepSpeedError::Unsupported {
            key: "pipeline.stages".into(),
            reason: "the GPT-MoE presets train without pipeline parallelism".into(),
        });
    }
    if spec.teacher.is_some() || spec.heldout.is_some() {
        return Err(DeepSpeedError::Unsupported {
            key: "pipeline.stages".into(),
            reason: "a teacher and a held-out loss need the whole model's logits on every \
                     rank: train without pipeline parallelism"
                .into(),
        });
    }
    let device = spec.device.device(comm.rank());
    let rank = comm.rank();
    let world = comm.world_size();
    // ANCHOR: pipe_loop
    // The 3D grid: `pipeline.stages` x the replicas x `tensor_parallel.tp_size` slices.
    let grid = Grid::from_config(&spec.config, comm.clone(), &device)?;
    let tp = grid.tensor_parallel().clone();
    let layers = Gpt::new(spec.shape, spec.seed, &device)
        .sliced(&tp)?
        .into_layers();
    let mut engine = PipelineEngine::with_grid(layers, spec.config.clone(), &grid, device.clone())?;
    // A checkpoint written on any grid continues here, on the batches an uninterrupted run
    // would see.
    let first_step = match &spec.resume_from {
        Some(dir) => engine.load_checkpoint(dir, None)?,
        None => 0,
    };
    if first_step > spec.steps {
        return Err(DeepSpeedError::Data(format!(
            "--steps {} is below the step the checkpoint resumes from ({first_step})",
            spec.steps
        )));
    }
    let batch = engine.batch();
    let topo = engine.topology();
    let replica = engine.replica();
    engine.set_tokens_per_sample(spec.shape.seq_len as u64);
    let seq = spec.shape.seq_len;
    let micro = batch.train_micro_batch_size_per_gpu as usize;
    let progress = TrainProgress::new(if spec.progress { rank } else { usize::MAX }, spec.steps);
    let inner = device.clone().inner();
    let mut losses = Vec::with_capacity(spec.steps.min(1 << 16) as usize);
    let mut grad_norms = Vec::with_capacity(losses.capacity());
    let mut loss_scale = Vec::new();
    let (mut compute, mut scheduled, mut live) = (0.0f64, 0.0f64, 0usize);
    let (mut host_device, mut staged) = (Vec::new(), Vec::new());
    let start = Instant::now();
    for step in first_step..spec.steps {
        let (copied, staged_before) = (host_device_bytes(), staged_collective_bytes());
        // Replica d's micro-batch k holds the rows a data-parallel rank d would train on.
        let report = engine.train_batch(|k| {
            let first = (k as u64 * topo.replicas as u64 + replica as u64) * micro as u64;
            spec.corpus
                .batch(step, first, micro, seq, &inner)
                .with_vocab_group(tp.clone())
        })?;
        // ANCHOR_END: pipe_loop
        host_device.push(host_device_bytes() - copied);
        staged.push(staged_collective_bytes() - staged_before);
        losses.push(report.loss);
        grad_norms.push(report.grad_norm);
        loss_scale.extend(report.loss_scale);
        compute += report.compute_time.as_secs_f64();
        scheduled += report.schedule_time.as_secs_f64();
        live = live.max(report.peak_live_activations);
        let tokens = (step + 1 - first_step) * batch.train_batch_size * seq as u64;
        progress.update(
            step + 1,
            report.loss,
            tokens as f64 / start.elapsed().as_secs_f64(),
        );
    }
    if let Some(dir) = &spec.save_dir {
        engine.save_checkpoint(dir, None)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    progress.finish();
    let state = engine.model_state_bytes().total();
    let (sent, model_sent) = engine.bytes_sent();
    let comms = CommsReport::of(&grid);
    let figures = gather_figures(
        comm.as_ref(),
        RankFigures {
            axis: engine.grid().bytes_sent_per_axis(),
            sent,
            model_sent,
            state,
            // This rank's stage slice as Ψ (ZeRO stage 1: the optimizer state over dp).
            formula: engine.model_state_bytes_formula(),
            peak_state: state,
            rss: peak_rss_bytes(),
            bubble: if scheduled > 0.0 {
                1.0 - compute / scheduled
            } else {
                0.0
            },
            live_activations: live as u64,
            breakdown: StepBreakdown::default(),
        },
    )?;
    Ok(RunReport {
        world,
        backend: comm.backend().to_string(),
        zero_stage: engine.config().zero_optimization.stage.into(),
        params: engine.total_params(),
        steps: spec.steps,
        first_step,
        losses,
        grad_norms,
        moq_bits: Vec::new(),
        tokens_per_s: ((spec.steps - first_step) * batch.train_batch_size * seq as u64) as f64
            / elapsed,
        train_batch_size: batch.train_batch_size,
        gradient_accumulation_steps: batch.gradient_accumulation_steps,
        model_state_bytes_per_rank: figures.iter().map(|f| f.state).max().unwrap_or(0),
        peak_model_state_bytes_per_rank: figures.iter().map(|f| f.peak_state).max().unwrap_or(0),
        model_state_bytes_formula: figures.iter().map(|f| f.formula).max().unwrap_or(0),
        comm_bytes_per_rank: figures.iter().map(|f| f.sent).collect(),
        comm_bytes_model_per_rank: figures.iter().map(|f| f.model_sent).collect(),
        comm_bytes_per_axis: figures.iter().map(|f| f.axis).collect(),
        comm_bytes_per_step: Vec::new(),
        comm_bytes_model_per_step: Vec::new(),
        compressed_steps: 0,
        dtype: engine.config().precision_name().into(),
        loss_scale,
        skipped_steps: engine.skipped_steps(),
        peak_activation_bytes: None,
        activation_checkpointing: engine
            .config()
            .pipeline
            .as_ref()
            .is_some_and(|p| p.activation_checkpoint_interval > 0),
        checkpoint_host_bytes: None,
        seq_len: spec.shape.seq_len,
        blockwise_attention: spec.long_context.blockwise_attention,
        tile: spec.long_context.tile,
        pld_theta: None,
        step_seconds_per_sample: Vec::new(),
        forward_backward_seconds: Vec::new(),
        optimizer_seconds: Vec::new(),
        breakdown_per_rank: Vec::new(),
        peak_rss_bytes: figures.iter().map(|f| f.rss).max().unwrap_or(0),
        device: spec.device.name().into(),
        host_device_bytes_per_step: host_device,
        staged_collective_bytes_per_step: staged,
        pipeline_stages: topo.stages,
        data_parallel: topo.replicas,
        tensor_parallel: grid.topology().tensor,
        bubble_fraction: Some(figures.iter().map(|f| f.bubble).sum::<f64>() / world as f64),
        peak_live_activations_per_stage: Some(
            (0..topo.stages)
                // Stage s's first rank: replica 0, slice 0 (the tensor axis fastest).
                .map(|s| {
                    figures[s * topo.replicas * grid.topology().tensor].live_activations as usize
                })
                .collect(),
        ),
        gather_stats: None,
        offload_optimizer: "none".into(),
        swap: None,
        offload_param: "none".into(),
        param_store: None,
        disk_baseline: None,
        // This rank's pipeline stage only (rank 0: the first stage's layers).
        final_params: match spec.keep_final_state {
            true => FlatParams(
                engine
                    .layers()
                    .iter()
                    .flat_map(|l| params_to_flat(l, &ParamLayout::of(l)))
                    .collect(),
            ),
            false => FlatParams::default(),
        },
        final_moments: None,
        ep_size: 1,
        heldout_loss: None,
        heldout_tokens: None,
        distilled_steps: 0,
        moe: None,
        comms,
    })
}
