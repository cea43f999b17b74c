//! Building a [`PipelineEngine`]: the stages cut from the layers, ties found, the stage's
//! gradient regime, and the catalog of whole tensors a checkpoint holds.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use burn::tensor::Device;
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::pipe::{PartitionMethod, PipeDataTopology, ScheduleKind};

use super::engine::*;
use super::layer::{PipeBatch, PipeLayer};
use super::ties::{TiedGroup, find_ties};
use crate::config::{DeepSpeedConfig, EntryPoint, OptimizerKind, check_supported};
use crate::flat::{ParamLayout, param_paths, params_from_flat, params_to_flat};
use crate::grid::Grid;
use crate::optim::build_optimizer;
use crate::optim::partitioned_kind;
use crate::step::core::StepCore;
use crate::sync::{
    Cut, GradSync, HostGrads, ModelParallelNorm, PartitionedSync, ReplicatedSync, SyncOptions,
    broadcast_params,
};
use crate::tensor_parallel::TensorParallel;
use crate::{DeepSpeedError, Result};

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
        let layout = ParamLayout::of(&mine);
        let mine = broadcast_params(data.as_ref(), &layout, mine)?;
        let mine = tie_params(mine, &layout, &ties)?;
        let mut norm = ModelParallelNorm::none().with_group(pipe.clone(), duplicates);
        if shape.tensor > 1 {
            norm = norm.with_tensor(grid.tensor().clone(), &layout, &tp);
        }
        let options = SyncOptions::of(&config);
        // The engine's own regimes over this stage's replicas: stage 0 steps Burn's optimizer
        // (on fp32 masters in 16-bit), stage 1 the flat optimizer on each replica's slice.
        let mut grads: Box<dyn GradSync<Vec<L>>> = match options.plan.cut() {
            Some(Cut::Nothing) => {
                let optim = build_optimizer(&optim_cfg)?;
                let sync =
                    ReplicatedSync::<f32>::new(layout.clone(), data.clone(), &options, Some(optim));
                Box::new(sync)
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
                Box::new(PartitionedSync::<HostGrads>::new(
                    layout.clone(),
                    data.clone(),
                    &options,
                    Cut::OptimizerStates,
                    kind,
                )?)
            }
        };
        grads.model_parallel_norm(norm)?;
        // Mixed precision: the regime keeps fp32 masters, and the layers that run are their
        // 16-bit working copy.
        let layers = match config.working_dtype() {
            Some(dtype) => grads.keep_masters(mine, dtype)?,
            None => mine,
        };
        let core = StepCore::with_monitor(&config, grid.world().as_ref())?;
        Ok(Self {
            layers,
            core,
            parts,
            topo,
            pipe_stage: stage,
            replica,
            grid: grid.clone(),
            ties,
            config,
            batch,
            grads,
            layout,
            catalog,
            first_slot,
            reduced: None,
            kind: ScheduleKind::default(),
            device,
            total_params,
            _batch: PhantomData,
        })
    }
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
