//! [`Grid`]: one rank's place in the 3D grid (pipeline stages x data-parallel replicas x
//! tensor-parallel slices) and the communicators of its three groups: what Megatron-LM calls
//! the `mpu` and DeepSpeed's `initialize(mpu=...)` takes, built here from the config.

use std::sync::Arc;

use burn::tensor::Device;
use burn_deepspeed_strategies::comm::{
    CommStats, CommsLogger, Communicator, ThreadWorld, ThreadWorldOptions,
};
use burn_deepspeed_strategies::device::device_collectives;
use burn_deepspeed_strategies::pipe::{GridAxis, GridCoord, GridTopology};

use crate::moe::ExpertParallel;
use crate::sequence::{SEQUENCE_PARALLEL_KEY, SequenceParallel};
use crate::tensor_parallel::TensorParallel;
use crate::{DeepSpeedConfig, DeepSpeedError, Result};

/// This rank's groups in a pp x dp x tp grid (DeepSpeed's rank order: the tensor axis
/// fastest, so a tensor-parallel group is consecutive ranks, placed on one node by a
/// launcher).
///
/// Build one per rank (a collective: every rank of `world` calls it), slice the model with
/// [`tensor_parallel`](Self::tensor_parallel), and hand both to
/// [`DeepSpeedEngine::with_grid`](crate::DeepSpeedEngine::with_grid):
///
/// ```no_run
/// # use std::sync::Arc;
/// # use burn::tensor::Device;
/// # use burn_deepspeed::{DeepSpeedConfig, comm::Communicator, grid::Grid};
/// # fn run(config: DeepSpeedConfig, world: Arc<dyn Communicator>) -> burn_deepspeed::Result<()> {
/// let device = Device::flex().autodiff();
/// let grid = Grid::from_config(&config, world, &device)?;
/// let tp = grid.tensor_parallel().clone();
/// // let model = MyModel::new(&device).slice(tp);
/// // let engine = DeepSpeedEngine::with_grid(model, config, &grid)?;
/// # let _ = tp; Ok(()) }
/// ```
#[derive(Clone)]
pub struct Grid {
    topology: GridTopology,
    coord: GridCoord,
    world: Arc<dyn Communicator>,
    pipe: Arc<dyn Communicator>,
    data: Arc<dyn Communicator>,
    tensor: Arc<dyn Communicator>,
    tp: TensorParallel,
    experts: ExpertParallel,
    sequence: SequenceParallel,
}

impl std::fmt::Debug for Grid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grid")
            .field("topology", &self.topology)
            .field("coord", &self.coord)
            .finish()
    }
}

impl Grid {
    /// The grid of `world`'s ranks in `pipe` stages of `tensor` slices each (the replicas
    /// take the rest); the tensor-parallel ops run on `device`'s collectives (NCCL on CUDA
    /// where every rank can load it). A collective.
    pub fn new(
        world: Arc<dyn Communicator>,
        pipe: usize,
        tensor: usize,
        device: &Device,
    ) -> Result<Self> {
        let key = match tensor > 1 {
            true => "tensor_parallel.tp_size",
            false => "pipeline.stages",
        };
        let topology = GridTopology::new(world.world_size(), pipe, tensor).map_err(|e| {
            DeepSpeedError::Unsupported {
                key: key.into(),
                reason: e.to_string(),
            }
        })?;
        let rank = world.rank();
        let coord = topology.coords(rank);
        // The same splits, in the same order, on every rank; a group that is the whole
        // world is the world itself (its traffic counted in the world's stats), and a group
        // of one rank a world of its own (no split: nothing to agree on, nothing sent).
        let group = |axis: GridAxis| -> Result<Arc<dyn Communicator>> {
            match topology.len(axis) {
                n if n == topology.world() => Ok(world.clone()),
                1 => alone(),
                _ => Ok(world.split(topology.color(axis, rank))?),
            }
        };
        let pipe = group(GridAxis::Pipe)?;
        let data = group(GridAxis::Data)?;
        let tensor = group(GridAxis::Tensor)?;
        let tp = match topology.tensor > 1 {
            true => TensorParallel::new(device_collectives(tensor.clone(), device)?),
            false => TensorParallel::none(),
        };
        Ok(Self {
            topology,
            coord,
            world,
            pipe,
            data,
            tensor,
            tp,
            experts: ExpertParallel::none(),
            sequence: SequenceParallel::none(),
        })
    }

    /// The grid a config names: `tensor_parallel.tp_size` slices and `pipeline.stages`
    /// stages, and the sequence-parallel groups of `sequence_parallel_size` (see
    /// [`with_sequence_parallel`](Self::with_sequence_parallel)). With `comms_logger` enabled, `world` is wrapped in a
    /// [`burn_deepspeed_strategies::comm::CommsLogger`] first, so that every
    /// group's traffic is logged ([`Communicator::comms_log`] on any of them). A collective.
    pub fn from_config(
        config: &DeepSpeedConfig,
        world: Arc<dyn Communicator>,
        device: &Device,
    ) -> Result<Self> {
        let world = match config.comms_logger.enabled {
            true => CommsLogger::wrap(world, config.comms_logger.options()?),
            false => world,
        };
        let grid = Self::new(world, config.pipeline_stages(), config.tp_size(), device)?;
        match config.sp_size() {
            1 => Ok(grid),
            sp => grid.with_sequence_parallel(sp, device),
        }
    }

    /// Data parallelism alone: every rank a replica (the pipe and tensor groups are this
    /// rank alone; nothing is split, nothing communicated).
    pub fn data_parallel(world: Arc<dyn Communicator>) -> Result<Self> {
        Self::new(world, 1, 1, &Device::flex())
    }

    /// The grid's shape.
    pub fn topology(&self) -> GridTopology {
        self.topology
    }

    /// This rank's place.
    pub fn coord(&self) -> GridCoord {
        self.coord
    }

    /// Every rank of the grid.
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// The ranks of this rank's pipeline (same replica and slice, every stage).
    pub fn pipe(&self) -> &Arc<dyn Communicator> {
        &self.pipe
    }

    /// The ranks that average gradients with this one (same stage and slice, every
    /// replica): where ZeRO partitions the state.
    pub fn data(&self) -> &Arc<dyn Communicator> {
        &self.data
    }

    /// The ranks that hold the other slices of this rank's layers.
    pub fn tensor(&self) -> &Arc<dyn Communicator> {
        &self.tensor
    }

    /// Bytes this rank sent so far along each axis, measured by the communicators (a group
    /// that is the whole world is counted under its axis; `other` is what the world's own
    /// communicator sent beside the groups: agreements, shared losses and figures).
    pub fn bytes_sent_per_axis(&self) -> AxisBytes {
        let sent = |c: &Arc<dyn Communicator>| c.stats().total_sent();
        let is_world = |c: &Arc<dyn Communicator>| Arc::ptr_eq(c, &self.world);
        let axes = [&self.tensor, &self.pipe, &self.data];
        let [tensor, pipe, data] = axes.map(sent);
        AxisBytes {
            tensor,
            pipe,
            data,
            sequence: self.sequence.group().map_or(0, sent),
            other: match axes.into_iter().any(is_world) {
                true => 0,
                false => sent(&self.world),
            },
        }
    }

    /// This rank's counters summed over the world and its distinct groups (pipe, data,
    /// tensor, sequence; a group that is the world counted once): every byte the grid's
    /// communicators moved for it.
    pub fn traffic(&self) -> CommStats {
        let mut seen: Vec<&Arc<dyn Communicator>> = Vec::new();
        let sequence = self.sequence.group();
        for c in [&self.world, &self.pipe, &self.data, &self.tensor]
            .into_iter()
            .chain(sequence)
        {
            if !seen.iter().any(|s| Arc::ptr_eq(s, c)) {
                seen.push(c);
            }
        }
        seen.iter()
            .fold(CommStats::default(), |sum, c| sum.plus(&c.stats()))
    }

    /// The grid with expert parallelism of `ep_size` over its data-parallel group
    /// (DeepSpeed-MoE's expert-parallel and expert-data-parallel groups, see
    /// [`ExpertParallel::new`]); the all-to-alls run on `device`'s collectives. Cut the
    /// model's MoE layers with [`expert_parallel`](Self::expert_parallel), and the engine
    /// reduces their experts in their own groups. A collective.
    pub fn with_expert_parallel(mut self, ep_size: usize, device: &Device) -> Result<Self> {
        if ep_size > 1 && self.sequence.size() > 1 {
            return Err(not_with_sequence_parallel(
                "moe.ep_size",
                "expert parallelism",
            ));
        }
        self.experts = ExpertParallel::new(&self.data, ep_size, device)?;
        Ok(self)
    }

    /// The grid with DeepSpeed-Ulysses sequence parallelism of `sp_size` over its
    /// data-parallel group (see [`SequenceParallel::new`]): groups of `sp_size` consecutive
    /// data-parallel ranks share each sequence. The model's attention exchanges through
    /// [`sequence_parallel`](Self::sequence_parallel), and the engine averages gradients over
    /// the whole data group (the replicas and the sequence blocks together), its batch sizes
    /// counting `data / sp_size` replicas. Beside tensor slicing each tensor-parallel rank
    /// has its own groups (the data group is per tensor rank), so a rank's attention splits
    /// its `heads / tp` heads over the group. A collective.
    pub fn with_sequence_parallel(mut self, sp_size: usize, device: &Device) -> Result<Self> {
        if sp_size > 1 {
            if self.topology.pipe > 1 {
                return Err(not_with_sequence_parallel("pipeline.stages", "a pipeline"));
            }
            if self.experts.size() > 1 {
                return Err(not_with_sequence_parallel(
                    "moe.ep_size",
                    "expert parallelism",
                ));
            }
        }
        self.sequence = SequenceParallel::new(&self.data, sp_size, device)?;
        Ok(self)
    }

    /// The sequence-parallel group ([`SequenceParallel::none`] unless
    /// [`with_sequence_parallel`](Self::with_sequence_parallel) asked for more than one rank).
    pub fn sequence_parallel(&self) -> &SequenceParallel {
        &self.sequence
    }

    /// The expert-parallel groups of the MoE layers ([`ExpertParallel::none`] unless
    /// [`with_expert_parallel`](Self::with_expert_parallel) asked for more than one rank).
    pub fn expert_parallel(&self) -> &ExpertParallel {
        &self.experts
    }

    /// The tensor-parallel group the sliced layers run their ops on
    /// ([`TensorParallel::none`] when `tp` is 1).
    pub fn tensor_parallel(&self) -> &TensorParallel {
        &self.tp
    }
}

/// The refusal of `what` (at `key`) beside sequence parallelism.
fn not_with_sequence_parallel(key: &str, what: &str) -> DeepSpeedError {
    DeepSpeedError::Unsupported {
        key: key.into(),
        reason: format!(
            "{what} with {SEQUENCE_PARALLEL_KEY} above 1 is not built: sequence parallelism \
             runs beside data parallelism (ZeRO stages 0-3) and tensor slicing"
        ),
    }
}

/// Bytes sent along each axis of a [`Grid`] (see [`Grid::bytes_sent_per_axis`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AxisBytes {
    /// Within the tensor-parallel group (the sliced layers' all-reduces).
    pub tensor: u64,
    /// Along the pipeline (activations and their gradients).
    pub pipe: u64,
    /// Within the data-parallel group (gradient reductions, ZeRO's gathers).
    pub data: u64,
    /// Within the sequence-parallel group (Ulysses' all-to-alls around attention).
    pub sequence: u64,
    /// On the world's communicator beside the groups.
    pub other: u64,
}

/// The group of `size` consecutive ranks of `data` that holds this rank, as a host
/// communicator and as the tensor ops' group on `device`'s collectives (`None` at `size` 1).
/// A `size` of 0 or one that does not divide the ranks is refused at `key`, with `why` (given
/// the data-parallel world size) as the reason. A collective: every rank of `data` calls it.
pub(crate) fn consecutive_groups(
    data: &Arc<dyn Communicator>,
    size: usize,
    device: &Device,
    key: &str,
    why: impl FnOnce(usize) -> String,
) -> Result<Option<(Arc<dyn Communicator>, TensorParallel)>> {
    let world = data.world_size();
    if size == 0 || !world.is_multiple_of(size) {
        return Err(DeepSpeedError::Unsupported {
            key: key.into(),
            reason: why(world),
        });
    }
    if size == 1 {
        return Ok(None);
    }
    let group = data.split(data.rank() / size)?;
    let exchange = TensorParallel::new(device_collectives(group.clone(), device)?);
    Ok(Some((group, exchange)))
}

/// A world of this rank alone.
pub(crate) fn alone() -> Result<Arc<dyn Communicator>> {
    let mut world = ThreadWorld::new(1, ThreadWorldOptions::default())?.communicators();
    let comm = world.pop().ok_or_else(|| {
        DeepSpeedError::Comm(burn_deepspeed_strategies::CommError::InvalidArgument {
            rank: 0,
            op: "ThreadWorld::communicators",
            detail: "a world of one rank made no communicator".into(),
        })
    })?;
    Ok(Arc::new(comm))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::launch::launch;

    /// 8 ranks as (pp 2, tp 2): each rank's groups are the topology's, ranked in grid order.
    #[test]
    fn the_groups_follow_the_topology() {
        let (_, ranks) = launch(8, Duration::from_secs(60), |world| {
            let grid = Grid::new(world.clone(), 2, 2, &Device::flex())?;
            let sizes = [grid.pipe(), grid.data(), grid.tensor()].map(|c| c.world_size());
            let index = [grid.pipe(), grid.data(), grid.tensor()].map(|c| c.rank());
            Ok((
                world.rank(),
                grid.coord(),
                sizes,
                index,
                grid.tensor_parallel().size(),
            ))
        })
        .expect("the ranks run");
        for (rank, coord, sizes, index, tp) in ranks {
            // rank = (pipe · dp + data) · tp + tensor with dp 2, tp 2.
            assert_eq!(rank, (coord.pipe * 2 + coord.data) * 2 + coord.tensor);
            assert_eq!(sizes, [2, 2, 2]);
            assert_eq!(index, [coord.pipe, coord.data, coord.tensor]);
            assert_eq!(tp, 2);
        }
    }

    #[test]
    fn a_world_that_does_not_split_is_refused_by_key() {
        let (_, ranks) = launch(3, Duration::from_secs(60), |world| {
            Ok(Grid::new(world, 1, 2, &Device::flex()).map(|_| ()))
        })
        .expect("the ranks run");
        for r in ranks {
            let e = r
                .expect_err("3 ranks are not a multiple of tp 2")
                .to_string();
            assert!(e.contains("tensor_parallel.tp_size"), "{e}");
        }
    }
}
