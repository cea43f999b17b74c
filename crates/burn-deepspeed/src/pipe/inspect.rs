//! What the pipeline engine tells about its run: its place in the grid, its layers, the step
//! counters and the memory and traffic of its stage.

use std::sync::Arc;

use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::pipe::PipeDataTopology;

use super::engine::*;
use super::layer::{PipeBatch, PipeLayer};
use crate::config::{BatchSizes, DeepSpeedConfig};
use crate::grid::Grid;
use crate::memory::ModelStateBytes;
use crate::memory::estimate::{StatePrecision, estimate_model_states};

impl<L, B> PipelineEngine<L, B>
where
    L: PipeLayer<B> + 'static,
    B: PipeBatch + 'static,
{
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
        self.grads.held(&self.layers)
    }
    /// What ZeRO's formula (arXiv 1910.02054) gives for this rank's model state, not
    /// measured: its stage's parameters (its slices under tensor slicing) as Ψ, the
    /// optimizer state cut over the replicas at stage 1.
    pub fn model_state_bytes_formula(&self) -> u64 {
        let stage = crate::sync::ZeroPlan::of(&self.config).number();
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
