//! What the engine tells about its run: the model, its parameters and state, the step
//! counters, the memory it holds and the groups it runs over.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Device;
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::onebit::OneBitPhase;
use burn_deepspeed_strategies::zero::PartitionState;

use super::base::*;
use crate::Result;
use crate::config::{BatchSizes, DeepSpeedConfig};
use crate::grid::Grid;
use crate::memory::ModelStateBytes;
use crate::memory::estimate::{StatePrecision, estimate_model_states};
use crate::precision::LossScalerState;
use crate::sync;
use crate::tensor_parallel::join_flat;

impl<M: Module> DeepSpeedEngine<M> {
    /// The model (identical on every rank after each step). At ZeRO stage 3 its partitioned
    /// parameters store this rank's chunk and gather the whole tensor when read (a
    /// collective: every rank must read them together, as a forward pass does).
    pub fn model(&self) -> &M {
        &self.model
    }
    /// The device to make a micro-batch's float tensors on: the one the model's parameters
    /// live on, with the gradient checkpointing ZeRO stage 3 turns on (under autodiff, a
    /// float input made on a device without it cannot meet the gathered weights in one op).
    /// `None` for a model without float parameters.
    pub fn device(&self) -> Option<Device> {
        sync::module_device(&self.model)
    }
    /// The whole parameters, flat in layout order (the order the module visits them). At
    /// ZeRO stage 3, and with bf16 masters (gathered in fp32), a collective: every rank calls
    /// it, and a rank that fails to take part in the gather fails it on every rank.
    ///
    /// With tensor slicing the slices are joined over the tensor-parallel group (a
    /// collective), so that every rank returns the whole model's parameters, in the layout
    /// of the same model unsliced. With expert parallelism every rank's experts are joined
    /// the same way (a collective over the expert-parallel group), in the layout of the model
    /// that holds every expert.
    pub fn flat_params(&self) -> Result<Vec<f32>> {
        let local = self
            .sync
            .whole_params(&self.model, true)?
            .unwrap_or_default();
        let grid = &self.grid;
        join_flat(
            grid.tensor().as_ref(),
            grid.tensor_parallel(),
            self.sync.layout(),
            &local,
        )
    }
    /// Consumes the engine and returns the model with whole parameters. At ZeRO stage 3 a
    /// collective (every rank calls it); the returned model's parameters read as stored.
    pub fn into_model(self) -> Result<M> {
        self.sync.release_whole(self.model)
    }
    /// The whole optimizer state (steps, m and v in layout order), joined from every rank's
    /// slice at ZeRO stages 1-3: a collective. `None` at stage 0, where Burn's (or a 1-bit)
    /// optimizer keeps it.
    pub fn optimizer_moments(&self) -> Result<Option<PartitionState>> {
        self.sync.whole_moments()
    }
    /// ZeRO stage 3's gather counters (`None` at other stages).
    pub fn gather_stats(&self) -> Option<crate::zero3::GatherStats> {
        self.sync.gather_stats()
    }
    /// ZeRO-Infinity's optimizer offload to NVMe: the swap file's size, the I/O engine and
    /// the bytes moved so far on this rank (measured where the transfers happen).
    pub fn swap(&self) -> Option<burn_deepspeed_strategies::swap::SwapSummary> {
        self.sync.swap()
    }
    /// ZeRO-Infinity's parameter offload (stage 3): where this rank's pieces live (bytes in
    /// host memory, the swap file) and what the read-ahead achieved, measured so far.
    pub fn param_store(&self) -> Option<crate::zero3::ParamStoreSummary> {
        self.sync.param_store()
    }
    /// The resolved config.
    pub fn config(&self) -> &DeepSpeedConfig {
        &self.config
    }
    /// The resolved batch sizes.
    pub fn batch(&self) -> BatchSizes {
        self.batch
    }
    /// This rank's communicator.
    /// The grid this engine trains on (data parallelism alone when created with
    /// [`new`](DeepSpeedEngine::new)).
    pub fn grid(&self) -> &Grid {
        &self.grid
    }
    /// Parameters of the whole model: this rank's, with each sliced tensor counted whole and
    /// each expert once per rank of its expert-parallel group (which holds the other experts
    /// of the layer, shaped alike); equal to [`num_params`](Self::num_params) without tensor
    /// slicing or expert parallelism.
    pub fn model_params(&self) -> usize {
        let (tp, ep) = (self.grid.tensor_parallel(), self.grid.expert_parallel());
        let layout = self.sync.layout();
        layout
            .slots
            .iter()
            .map(|s| match tp.layout(s.id) {
                Some(_) => s.numel * tp.size(),
                None if ep.is_expert(s.id) => s.numel * ep.size(),
                None => s.numel,
            })
            .sum()
    }
    /// The data-parallel group.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }
    /// Optimizer steps taken, skipped ones included (DeepSpeed's `global_steps`).
    pub fn global_step(&self) -> u64 {
        self.core.global_step()
    }
    /// Steps skipped because the gradient norm was not finite (DeepSpeed's `skipped_steps`).
    pub fn skipped_steps(&self) -> u64 {
        self.core.skipped_steps()
    }
    /// fp16: the loss scale the next micro-batches' backward passes use (`None` without
    /// fp16).
    pub fn loss_scale(&self) -> Option<f32> {
        self.core.loss_scale()
    }
    /// fp16: the loss scaler's position (`None` without fp16).
    pub fn loss_scaler_state(&self) -> Option<LossScalerState> {
        self.core.loss_scaler_state()
    }
    /// Number of float parameters this rank holds (its slices under tensor slicing).
    pub fn num_params(&self) -> usize {
        self.sync.layout().numel
    }
    /// The model state this rank holds now, measured where it is allocated (see
    /// [`memory`](crate::memory)).
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        self.sync.held(&self.model)
    }
    /// The largest model state this rank held at once (held plus a step's transient buffers),
    /// measured.
    pub fn peak_model_state_bytes(&self) -> u64 {
        self.sync.peak().max(self.model_state_bytes().total())
    }
    /// What ZeRO's formula gives for this engine's parameters, world size, stage and
    /// precision: the figure the measured [`model_state_bytes`](Self::model_state_bytes) is
    /// checked against. fp32 Adam: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N. fp16, with fp16
    /// gradient buffers ([`StatePrecision::Mixed`], the paper's): 16Ψ, 4Ψ + 12Ψ/N,
    /// 2Ψ + 14Ψ/N, 16Ψ/N. bf16, whose gradients accumulate in fp32 as in DeepSpeed's bf16
    /// optimizer ([`StatePrecision::MixedFp32Grads`]): 18Ψ, 6Ψ + 12Ψ/N, 2Ψ + 16Ψ/N, 18Ψ/N.
    pub fn model_state_bytes_formula(&self) -> u64 {
        let stage = crate::sync::ZeroPlan::of(&self.config).number();
        let (params, world) = (self.num_params() as u64, self.comm.world_size() as u64);
        estimate_model_states(params, world, stage, self.state_precision(), 0, 0).total
    }
    /// The bytes per parameter this engine's model states take ([`StatePrecision`]).
    pub fn state_precision(&self) -> StatePrecision {
        StatePrecision::of(&self.config)
    }
    /// Burn's module optimizer, when the engine steps with one (ZeRO stage 0, no 1-bit
    /// optimizer).
    pub fn optimizer(&self) -> Option<&ModuleOptimizer> {
        self.sync.burn_optimizer()
    }
    /// The 1-bit optimizer's phase, when the config names one.
    pub fn one_bit_optimizer(&self) -> Option<&dyn OneBitPhase> {
        self.sync.one_bit()
    }
}
