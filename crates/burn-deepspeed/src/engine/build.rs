//! Building a [`DeepSpeedEngine`]: the config resolved for the grid, the refusals, the
//! regime and the step core.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::train::TrainStep;
use burn_deepspeed_compress::pld::ProgressiveLayerDrop;
use burn_deepspeed_strategies::comm::{CommsLogger, Communicator, agree_on_digest};

use super::base::*;
use crate::config::{DeepSpeedConfig, EntryPoint, OptimizerKind, check_supported};
use crate::grid::Grid;
use crate::moq::Moq;
use crate::step::StepLoss;
use crate::step::core::StepCore;
use crate::sync::{self, ModelParallelNorm};
use crate::{DeepSpeedError, Result};

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
        if config.sp_size() > 1 {
            return Err(DeepSpeedError::Unsupported {
                key: crate::sequence::SEQUENCE_PARALLEL_KEY.into(),
                reason: format!(
                    "sequence_parallel_size is {}: build a `grid::Grid` from the config, give \
                     the model's attention its `sequence_parallel()` group, and create the \
                     engine with `DeepSpeedEngine::with_grid`",
                    config.sp_size()
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
        let sp = grid.sequence_parallel().size();
        if sp != config.sp_size() {
            return Err(DeepSpeedError::Unsupported {
                key: crate::sequence::SEQUENCE_PARALLEL_KEY.into(),
                reason: format!(
                    "the config asks for {} but the grid has {sp} sequence-parallel ranks; \
                     build the grid with `Grid::from_config`",
                    config.sp_size()
                ),
            });
        }
        // The ranks of a sequence-parallel group train one replica between them.
        let batch = config.resolve(comm.world_size() / sp)?;
        // Tensor slices and experts communicate during every micro-batch, beside the reductions
        // that `overlap_comm` would run on a second thread (under MPI, every call of a process
        // is serialized, and the two could wait on each other): it runs with data
        // parallelism alone.
        let sliced = grid.topology().tensor > 1
            || grid.expert_parallel().size() > 1
            || grid.sequence_parallel().size() > 1;
        let zero = &config.zero_optimization;
        let overlapping =
            crate::sync::ZeroPlan::of(&config).reduces_during_backward() && zero.overlap_comm();
        // The regime is built from a copy with the overlap off; the engine keeps the caller's
        // config as given.
        let mut regime_config = config.clone();
        if sliced && overlapping {
            // Stage 3 turns it on by default: only an explicit request is worth a warning.
            if zero.overlap_comm == Some(true) {
                tracing::warn!(
                    "zero_optimization.overlap_comm is off under tensor slicing and expert \
                     parallelism: their collectives run during each micro-batch"
                );
            }
            regime_config.zero_optimization.overlap_comm = Some(false);
        }
        check_supported(&config, EntryPoint::Engine)?;
        check_grid(&config, grid)?;
        same_run_everywhere(&config, &model, grid)?;
        let (model, mut sync) = match grid.expert_parallel().size() > 1 {
            true => sync::build_expert_parallel(
                model,
                &regime_config,
                comm.clone(),
                grid.expert_parallel(),
            )?,
            false => sync::build(model, &regime_config, comm.clone())?,
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

/// Refuses, on every rank alike, a run whose ranks were given different configs (resolved),
/// or whose data-parallel peers hold models of different shapes: one all-gather of a digest
/// over the world and one over the data-parallel group. Without it, ranks with different
/// bucket sizes or stages pair collectives of different lengths, or hang.
fn same_run_everywhere<M: Module>(config: &DeepSpeedConfig, model: &M, grid: &Grid) -> Result<()> {
    use sha2::{Digest, Sha256};
    let text = serde_json::to_vec(config)
        .map_err(|e| DeepSpeedError::Data(format!("the config does not serialize: {e}")))?;
    agree_on_digest(
        grid.world().as_ref(),
        "resolved config",
        &Sha256::digest(&text),
    )?;
    // Expert-parallel ranks hold different experts; tensor slices differ between slices, but
    // data-parallel peers hold the same ones.
    if grid.expert_parallel().size() == 1 {
        let shapes: Vec<Vec<usize>> = (crate::flat::ParamLayout::of(model).slots.iter())
            .map(|s| s.shape.clone())
            .collect();
        let text = format!("{shapes:?}");
        agree_on_digest(
            grid.data().as_ref(),
            "model layout",
            &Sha256::digest(text.as_bytes()),
        )?;
    }
    Ok(())
}
