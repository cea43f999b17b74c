//! [`ExpertParallel`]: one rank's place in DeepSpeed-MoE's expert-parallel layout (arXiv
//! 2201.05596 §4; DeepSpeed's `_create_expert_and_data_parallel`): the data-parallel ranks
//! cut into expert-parallel groups of `ep_size` consecutive ranks, each holding
//! `num_experts / ep_size` experts of every MoE layer, and the expert-data-parallel groups of
//! the ranks that hold the same experts (one per group, strided).

use std::collections::HashSet;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use burn::module::ParamId;
use burn::tensor::{Device, Tensor};
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::Communicator;

use crate::Result;
use crate::grid::{alone, consecutive_groups};
use crate::tensor_parallel::TensorParallel;

/// The groups of expert parallelism, shared by every MoE layer of a model. Cloning shares
/// them. [`ExpertParallel::none`] is `ep_size` 1: every rank holds every expert and its
/// tokens never leave it.
#[derive(Clone, Default)]
pub struct ExpertParallel {
    /// The ranks that exchange tokens (the all-to-all's group), with its ops' failure state.
    exchange: TensorParallel,
    /// The ranks of the exchange group as a host communicator (its norms and maxima).
    ep: Option<Arc<dyn Communicator>>,
    /// The ranks that hold the same experts as this one: where expert gradients are
    /// reduced and their optimizer state partitioned.
    expert_data: Option<Arc<dyn Communicator>>,
    /// The ids of this rank's expert parameters, recorded by the layers.
    experts: Arc<Mutex<HashSet<ParamId>>>,
    /// Each cut layer's gate and local experts, in the order the layers were cut.
    layers: Arc<Mutex<Vec<ExpertLayer>>>,
}

/// One MoE layer cut over an expert-parallel group, as its rank holds it: what a checkpoint
/// needs to store every expert of the whole layer in the order of the uncut model.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertLayer {
    /// The gate's weight (its module path names the layer).
    pub gate: ParamId,
    /// The parameter ids of each local expert, in visiting order: local expert `j` is the
    /// whole layer's expert `rank · local + j`.
    pub experts: Vec<Vec<ParamId>>,
}

impl std::fmt::Debug for ExpertParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertParallel")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("experts", &lock(&self.experts).len())
            .finish()
    }
}

impl ExpertParallel {
    /// The groups of `ep_size` over the data-parallel ranks `data` (a grid's
    /// [`data`](crate::grid::Grid::data) group): ranks `[k·ep, (k+1)·ep)` exchange tokens,
    /// ranks equal modulo `ep` hold the same experts. The all-to-alls run on `device`'s
    /// collectives. A collective: every rank of `data` calls it.
    pub fn new(data: &Arc<dyn Communicator>, ep_size: usize, device: &Device) -> Result<Self> {
        let world = data.world_size();
        // Both splits in the same order on every rank. The exchange group is a communicator
        // of its own even when it spans the data group, so that its traffic counts the
        // all-to-alls alone; an expert-data group of one is a world of its own.
        let groups = consecutive_groups(data, ep_size, device, "moe.ep_size", |world| {
            format!(
                "ep_size {ep_size} must divide the {world} data-parallel ranks \
                 (DeepSpeed's expert-parallel groups tile the data-parallel group)"
            )
        })?;
        let Some((ep, exchange)) = groups else {
            return Ok(Self::none());
        };
        let expert_data = match ep_size == world {
            true => alone()?,
            false => data.split(data.rank() % ep_size)?,
        };
        Ok(Self {
            exchange,
            ep: Some(ep),
            expert_data: Some(expert_data),
            experts: Arc::default(),
            layers: Arc::default(),
        })
    }

    /// `ep_size` 1: every expert on every rank.
    pub fn none() -> Self {
        Self::default()
    }

    /// This rank's index in its expert-parallel group: it holds experts
    /// `[rank · local, (rank + 1) · local)` of each layer.
    pub fn rank(&self) -> usize {
        self.exchange.rank()
    }

    /// `ep_size`: ranks that split a layer's experts.
    pub fn size(&self) -> usize {
        self.exchange.size()
    }

    /// The host communicator of the expert-parallel group (`None` at `ep_size` 1).
    pub fn ep_group(&self) -> Option<&Arc<dyn Communicator>> {
        self.ep.as_ref()
    }

    /// The ranks holding this rank's experts (`None` at `ep_size` 1, where it is the whole
    /// data-parallel group).
    pub fn expert_data_group(&self) -> Option<&Arc<dyn Communicator>> {
        self.expert_data.as_ref()
    }

    /// Records `id` as one of this rank's expert parameters (the MoE layers call it as they
    /// keep their experts).
    pub fn record(&self, id: ParamId) {
        lock(&self.experts).insert(id);
        lock(&EVERY_EXPERT).insert(id);
    }

    /// Records a layer cut over this group (its experts' ids are recorded one by one too).
    pub fn record_layer(&self, layer: ExpertLayer) {
        for id in layer.experts.iter().flatten() {
            self.record(*id);
        }
        lock(&self.layers).push(layer);
    }

    /// The layers recorded by [`record_layer`](Self::record_layer).
    pub fn layers(&self) -> Vec<ExpertLayer> {
        lock(&self.layers).clone()
    }

    /// Whether `id` is an expert parameter of this rank.
    pub fn is_expert(&self, id: ParamId) -> bool {
        lock(&self.experts).contains(&id)
    }

    /// Expert parameters recorded.
    pub fn recorded(&self) -> usize {
        lock(&self.experts).len()
    }

    /// `x`'s equal chunks exchanged over the expert-parallel group (chunk `j` to rank `j`);
    /// its backward is the reverse exchange. The identity at `ep_size` 1.
    pub fn all_to_all<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.exchange.exchange(x)
    }

    /// The elementwise maximum of `x` over the expert-parallel group, outside autodiff.
    pub fn max<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.exchange.max(x)
    }

    /// The first failure of an all-to-all since the last call (the ops return zeros after
    /// one): a training step checks it before it steps.
    pub fn take_error(&self) -> Option<CommError> {
        self.exchange.take_error()
    }
}

/// Every expert parameter recorded in this process, whatever its group: the regimes that
/// know nothing of experts refuse a model that has some (averaging them over the whole
/// data-parallel group would mix different experts).
static EVERY_EXPERT: LazyLock<Mutex<HashSet<ParamId>>> = LazyLock::new(Mutex::default);

/// Whether `id` was recorded as an expert parameter by any [`ExpertParallel`].
pub(crate) fn is_expert_anywhere(id: ParamId) -> bool {
    lock(&EVERY_EXPERT).contains(&id)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
