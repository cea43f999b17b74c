//! Which [`GradSync`] a config asks for: the one place that reads the ZeRO stage.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{DType, Device};
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::device::{device_collectives, host_resident};
use burn_deepspeed_strategies::place::{DevicePlace, HostPlace};
use burn_deepspeed_strategies::zero::PartitionedKind;
use half::f16;

use super::{
    CompressedSync, Cut, GradElem, GradSync, HostGrads, HostShards, NvmeOffload, ParamOffload,
    PartitionedSync, ReplicatedSync, ShardedSync, SyncOptions, broadcast_params, module_device,
};
use crate::config::{DeepSpeedConfig, OffloadDevice, ZeroStage};
use crate::flat::ParamLayout;
use crate::optim::{build_optimizer, partitioned_kind};
use crate::{DeepSpeedError, Result, agreed};

/// The regime a resolved `config` names for `model` on `comm`, and the model as that regime
/// stores it: rank 0's parameters broadcast to every rank, and at stage 3 cut into this
/// rank's chunks. Under fp16 the gradient buffers are fp16 (the paper's 2Ψ); otherwise fp32.
/// With `offload_optimizer.device: "nvme"` the optimizer state of stages 1-3 moves to its swap
/// files here, and with `offload_param` the stage-3 pieces to their store. Collective: every rank calls it.
pub fn build<M: Module>(
    model: M,
    config: &DeepSpeedConfig,
    comm: Arc<dyn Communicator>,
) -> Result<(M, Box<dyn GradSync<M>>)> {
    // The host stores' element is the dtype every regime holds its gradient in.
    match SyncOptions::of(config).grad_dtype {
        DType::F16 => build_with::<M, f16>(model, config, comm),
        _ => build_with::<M, f32>(model, config, comm),
    }
}

fn build_with<M: Module, G: GradElem>(
    model: M,
    config: &DeepSpeedConfig,
    comm: Arc<dyn Communicator>,
) -> Result<(M, Box<dyn GradSync<M>>)> {
    let optimizer = config
        .optimizer
        .as_ref()
        .ok_or_else(|| DeepSpeedError::Data("the config was not resolved".into()))?;
    let options = SyncOptions::of(config);
    let layout = ParamLayout::of(&model);
    agreed(comm.as_ref(), "expert parameters", refuse_experts(&layout))?;
    // The I/O engine is chosen per process (a node may lack io_uring): the ranks agree on
    // every one's choice before the first collective. The config, and so the branch, is the
    // same on every rank.
    let offload = match config.zero_optimization.optimizer_offload() {
        OffloadDevice::Nvme => agreed(comm.as_ref(), "optimizer offload", NvmeOffload::of(config))?,
        _ => None,
    };
    let params = match config.zero_optimization.offload_param.is_some() {
        true => agreed(comm.as_ref(), "parameter offload", ParamOffload::of(config))?,
        false => None,
    };
    let model = broadcast_params(comm.as_ref(), &layout, model)?;
    // The device regimes' collectives (NCCL on CUDA where every rank can load it; host
    // staging otherwise): chosen together by the ranks before the regime's first collective.
    let device = device_resident(&model, config);
    // A 1-bit optimizer (stage 0 only) on a device steps there too.
    if let Some(device) = device.clone().filter(|_| optimizer.kind.is_one_bit()) {
        let coll = device_collectives(comm.clone(), &device)?;
        let place = DevicePlace::new(coll, comm, &device);
        let sync = CompressedSync::new(place, layout, &options, optimizer)?
            .ok_or_else(|| DeepSpeedError::Regime("not a 1-bit optimizer".into()))?;
        return Ok((model, Box::new(sync)));
    }
    let on_device = match device.and_then(|d| device_kind(config).map(|o| (d, o))) {
        Some((device, optim)) => Some((device_collectives(comm.clone(), &device)?, device, optim)),
        None => None,
    };
    Ok(match (options.plan.cut(), on_device) {
        (Some(Cut::Nothing), on_device) => {
            let host = HostPlace::new(comm.clone());
            match CompressedSync::new(host, layout.clone(), &options, optimizer)? {
                Some(sync) => (model, Box::new(sync)),
                None if let Some((coll, device, kind)) = on_device => {
                    let place = DevicePlace::new(coll, comm, &device);
                    let sync =
                        PartitionedSync::on_device(place, layout, &options, Cut::Nothing, kind);
                    (model, Box::new(sync))
                }
                // Mixed precision steps fp32 masters with the flat optimizer.
                None if let (Some(_), Ok(kind)) =
                    (config.working_dtype(), partitioned_kind(optimizer)) =>
                {
                    let sync = PartitionedSync::<HostGrads<G>>::new(
                        layout,
                        comm,
                        &options,
                        Cut::Nothing,
                        kind,
                    )?;
                    (model, Box::new(sync))
                }
                None => {
                    let optim = build_optimizer(optimizer)?;
                    let sync = ReplicatedSync::<G>::new(layout, comm, &options, Some(optim));
                    (model, Box::new(sync))
                }
            }
        }
        (Some(cut), Some((coll, device, kind))) => {
            let place = DevicePlace::new(coll, comm, &device);
            let sync = PartitionedSync::on_device(place, layout, &options, cut, kind);
            (model, Box::new(sync))
        }
        (Some(cut), None) => {
            let kind = partitioned_kind(optimizer)?;
            let overlap = overlaps(config, comm.world_size());
            let mut sync =
                PartitionedSync::<HostGrads<G>>::new(layout, comm.clone(), &options, cut, kind)?;
            // Starting the communication thread can fail on one rank alone: the ranks agree
            // before the next collective.
            if overlap {
                agreed(comm.as_ref(), "overlap_comm thread", sync.overlap_comm())?;
            }
            if let Some(nvme) = &offload {
                sync.offload_optimizer(&model, nvme)?;
            }
            (model, Box::new(sync))
        }
        (None, Some(_))
            if options.quantized_weights || options.hpz > 1 || options.quantized_gradients =>
        {
            let key = match (options.quantized_weights, options.hpz > 1) {
                (true, _) => "zero_quantized_weights",
                (false, true) => "zero_hpz_partition_size",
                (false, false) => "zero_quantized_gradients",
            };
            return Err(DeepSpeedError::Unsupported {
                key: format!("zero_optimization.{key}"),
                reason: "ZeRO++ changes the gathers of parameters held in host memory; with the \
                         model on a device (wgpu, CUDA) the gathers run through the device's \
                         collectives: leave it at its default"
                    .into(),
            });
        }
        (None, Some((coll, device, kind))) => {
            let gather_ahead = gathers_ahead(config, comm.world_size(), &options);
            let host_staged = coll.kind() == "host";
            let place = DevicePlace::new(coll, comm.clone(), &device);
            let sync = ShardedSync::on_device(place, layout, &options, kind);
            // On a device whose collectives stage through the host (wgpu), the communication
            // thread gathers ahead in host memory as the host regime does.
            if gather_ahead && host_staged {
                let started = sync.group().overlap_prefetch().map_err(Into::into);
                agreed(comm.as_ref(), "overlap_comm thread", started)?;
            }
            let model = sync.shard(model);
            (model, Box::new(sync))
        }
        (None, None) => {
            let kind = partitioned_kind(optimizer)?;
            let rank = comm.rank();
            let gather_ahead = gathers_ahead(config, comm.world_size(), &options);
            let mut sync = ShardedSync::<HostShards<G>>::new(layout, comm.clone(), &options, kind);
            sync.secondary_partition(options.hpz)?;
            if options.quantized_gradients {
                sync.quantized_gradients(options.ranks_per_node(comm.world_size()))?;
            }
            // Starting the communication thread can fail on one rank alone: the ranks agree
            // before the next collective.
            if gather_ahead {
                let started = sync.group().overlap_prefetch().map_err(Into::into);
                agreed(comm.as_ref(), "overlap_comm thread", started)?;
            }
            // Under `offload_param` the pieces go to their store as the model is cut.
            let model = match &params {
                Some(p) => {
                    let store = p.store(rank, &sync.piece_lens());
                    sync.shard_offloaded(model, store)?
                }
                None => sync.shard(model),
            };
            if let Some(nvme) = &offload {
                sync.offload_optimizer(&model, nvme)?;
            }
            (model, Box::new(sync))
        }
    })
}

/// Whether stage 2 reduces its buckets on a communication thread (`overlap_comm`, off by
/// default below stage 3 as in DeepSpeed), for `world` ranks. Only the engine's own regime
/// overlaps, where nothing else communicates between two micro-batches' reductions; the
/// engine turns it off under tensor slicing (under MPI every call of a process is
/// serialized, so a rank thread blocked in another group's collective while its
/// communication thread holds MPI would deadlock).
fn overlaps(config: &DeepSpeedConfig, world: usize) -> bool {
    let z = &config.zero_optimization;
    ZeroPlan::of(config).cut() == Some(Cut::Gradients) && z.overlap_comm() && world > 1
}

/// Whether stage 3 all-gathers the next prefetch bundle on a communication thread while the
/// forward computes (`overlap_comm`, on by default at stage 3 as in DeepSpeed), for `world`
/// ranks: not under `offload_param` (its pieces are read from disk on the rank's thread), nor
/// with prefetching off (`stage3_prefetch_bucket_size` 0). The engine turns `overlap_comm`
/// off under tensor slicing, as for stage 2.
fn gathers_ahead(config: &DeepSpeedConfig, world: usize, options: &SyncOptions) -> bool {
    let z = &config.zero_optimization;
    ZeroPlan::of(config).shards_parameters()
        && z.overlap_comm()
        && world > 1
        && z.offload_param.is_none()
        && options.prefetch_bucket > 0
}

/// Refuses a model (laid out as `layout`) with expert-parallel MoE layers: its experts differ from rank to rank, and
/// only [`super::build_expert_parallel`] reduces them in their own groups.
pub(crate) fn refuse_experts(layout: &ParamLayout) -> Result<()> {
    match layout
        .slots
        .iter()
        .any(|s| crate::moe::is_expert_anywhere(s.id))
    {
        true => Err(DeepSpeedError::Unsupported {
            key: "moe.ep_size".into(),
            reason: "the model's MoE layers are cut over an expert-parallel group: build a \
                     grid `with_expert_parallel(ep_size, ..)` and create the engine with \
                     `DeepSpeedEngine::with_grid`, which reduces each expert over the ranks \
                     that hold it"
                .into(),
        }),
        false => Ok(()),
    }
}

/// The model's device when it is not host memory (wgpu, CUDA) and the config offloads
/// nothing: the device-resident regimes' case. `None` otherwise (every Flex run, and every
/// offload, keeps the host regimes).
fn device_resident<M: Module>(model: &M, config: &DeepSpeedConfig) -> Option<Device> {
    let device = module_device(model)?;
    let zero = &config.zero_optimization;
    let offloads = zero.optimizer_offload() != OffloadDevice::None || zero.offload_param.is_some();
    (!host_resident(&device) && !offloads).then_some(device)
}

/// The optimizer the device regimes step: Adam, AdamW or LAMB (in fp32, or fp16/bf16 with
/// fp32 masters); `None` for any other.
fn device_kind(config: &DeepSpeedConfig) -> Option<PartitionedKind> {
    partitioned_kind(config.optimizer.as_ref()?).ok()
}

/// The ZeRO stage of a resolved config as the regimes and the drivers ask about it: this file
/// is the one place outside `config/` that reads `zero_optimization.stage`; everything else
/// asks a [`ZeroPlan`] what the stage means for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroPlan {
    stage: ZeroStage,
}

impl ZeroPlan {
    /// The plan of a resolved config.
    pub fn of(config: &DeepSpeedConfig) -> Self {
        Self {
            stage: config.zero_optimization.stage,
        }
    }

    /// The stage's number (0-3), as checkpoints and reports write it.
    pub fn number(self) -> u8 {
        self.stage.into()
    }

    /// What stages 0-2 cut across the ranks; `None` at stage 3, which shards the parameters.
    pub fn cut(self) -> Option<Cut> {
        match self.stage {
            ZeroStage::Disabled => Some(Cut::Nothing),
            ZeroStage::OptimizerStates => Some(Cut::OptimizerStates),
            ZeroStage::Gradients => Some(Cut::Gradients),
            ZeroStage::Parameters => None,
        }
    }

    /// Stage 3: each rank holds its shard of the parameters, gathered for use.
    pub fn shards_parameters(self) -> bool {
        self.stage == ZeroStage::Parameters
    }

    /// Stages 2-3: gradients are reduced during the backward, which `overlap_comm` can run on
    /// a communication thread.
    pub fn reduces_during_backward(self) -> bool {
        matches!(self.stage, ZeroStage::Gradients | ZeroStage::Parameters)
    }
}

/// The regime for a caller that steps with its own optimizer (the Learner strategy) at ZeRO
/// stages 0-2: whole gradients at stage 0; at stages 1-2 a partition at tensor boundaries, so
/// that each rank steps whole tensors. Stage 3 needs the model sharded first
/// ([`ShardedSync::for_learner`]).
pub fn for_caller_optimizer<M: Module>(
    layout: ParamLayout,
    comm: Arc<dyn Communicator>,
    options: &SyncOptions,
) -> Result<Box<dyn GradSync<M>>> {
    Ok(match options.plan.cut() {
        Some(Cut::Nothing) => Box::new(ReplicatedSync::<f32>::new(layout, comm, options, None)),
        Some(cut) => Box::new(PartitionedSync::<HostGrads<f32>>::for_whole_tensors(
            layout, comm, options, cut,
        )),
        None => {
            return Err(DeepSpeedError::Regime(
                "ZeRO stage 3 needs the model sharded first: build a ShardedSync::for_learner"
                    .into(),
            ));
        }
    })
}
