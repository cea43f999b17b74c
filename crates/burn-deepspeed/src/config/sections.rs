//! The smaller sections: mixed precision, pipeline, progressive layer drop, flops profiler and
//! activation checkpointing, each with DeepSpeed's defaults.

use serde::{Deserialize, Serialize};

use super::serde_util::count;

/// `fp16`: half-precision training with dynamic loss scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Fp16Config {
    /// Train in fp16.
    pub enabled: bool,
    /// Autocast (DeepSpeed's `auto_cast`).
    pub auto_cast: bool,
    /// 0 means dynamic loss scaling; any other value is a static scale.
    pub loss_scale: f64,
    /// Initial dynamic scale 2^power.
    pub initial_scale_power: u32,
    /// Overflow-free steps before the scale doubles.
    #[serde(deserialize_with = "count")]
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves.
    pub hysteresis: u32,
    /// Reset hysteresis on every overflow-free step.
    pub consecutive_hysteresis: bool,
    /// Smallest dynamic scale.
    pub min_loss_scale: f64,
    /// Keep master weights and gradients in fp16.
    pub fp16_master_weights_and_grads: bool,
}

impl Default for Fp16Config {
    fn default() -> Self {
        Self {
            enabled: false,
            auto_cast: false,
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            consecutive_hysteresis: false,
            min_loss_scale: 1.0,
            fp16_master_weights_and_grads: false,
        }
    }
}

/// `bf16` (alias `bfloat16`): bf16 weights with fp32 masters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Bf16Config {
    /// Train in bf16.
    pub enabled: bool,
    /// Apply each gradient to its parameter as soon as it is ready.
    pub immediate_grad_update: bool,
}

/// Number of pipeline stages: a count or `"auto"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PipelineStages {
    /// DeepSpeed decides (from the model's topology).
    Auto(AutoTag),
    /// A fixed number of stages.
    Count(u32),
}

/// The literal `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AutoTag {
    /// `"auto"`.
    Auto,
}

/// `tensor_parallel`: tensor slicing (Megatron-LM, arXiv 1909.08053), the third axis of
/// 3D parallelism. DeepSpeed spells the size `tp_size` in its inference config and
/// `autotp_size` in its training config; both are read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TensorParallelConfig {
    /// Ranks that each hold a slice of every sliced layer (1: no slicing).
    #[serde(alias = "autotp_size", deserialize_with = "count")]
    pub tp_size: u64,
}

impl Default for TensorParallelConfig {
    fn default() -> Self {
        Self { tp_size: 1 }
    }
}

/// `pipeline`: pipeline parallelism.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineConfig {
    /// Number of stages.
    pub stages: PipelineStages,
    /// How layers are split into stages: `parameters`, `uniform`, `type:REGEX` (DeepSpeed's
    /// `partition_method`; `best` is its default alias of `parameters`).
    #[serde(alias = "partition_method")]
    pub partition: String,
    /// Seed each layer's initialization separately.
    pub seed_layers: bool,
    /// Checkpoint activations every this many layers (0: off).
    #[serde(deserialize_with = "count")]
    pub activation_checkpoint_interval: u64,
    /// Send 1/TP of each activation between stages.
    pub pipe_partitioned: bool,
    /// Send 1/TP of each gradient between stages.
    pub grad_partitioned: bool,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            stages: PipelineStages::Auto(AutoTag::Auto),
            partition: "best".into(),
            seed_layers: false,
            activation_checkpoint_interval: 0,
            pipe_partitioned: true,
            grad_partitioned: true,
        }
    }
}

impl PipelineConfig {
    /// The fixed number of stages, if any.
    pub fn stage_count(&self) -> Option<u32> {
        match self.stages {
            PipelineStages::Count(n) => Some(n),
            PipelineStages::Auto(_) => None,
        }
    }
}

/// `progressive_layer_drop` (PLD, arXiv 2010.13369).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PldConfig {
    /// Drop layers progressively.
    pub enabled: bool,
    /// θ̄: the keep probability the schedule decays towards.
    pub theta: f64,
    /// γ: decay rate per optimizer step.
    pub gamma: f64,
}

impl Default for PldConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            theta: 1.0,
            gamma: 0.001,
        }
    }
}

/// `flops_profiler`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlopsProfilerConfig {
    /// Profile one step.
    pub enabled: bool,
    /// Extra forward passes recomputed by activation checkpointing (for backward flops).
    pub recompute_fwd_factor: f64,
    /// The step to profile.
    #[serde(deserialize_with = "count")]
    pub profile_step: u64,
    /// Depth of the module tree printed (−1: all).
    pub module_depth: i64,
    /// Modules listed per depth.
    #[serde(deserialize_with = "count")]
    pub top_modules: u64,
    /// Print the per-module profile.
    pub detailed: bool,
    /// File for the profile (stdout when unset).
    pub output_file: Option<String>,
}

impl Default for FlopsProfilerConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            recompute_fwd_factor: 0.0,
            profile_step: 1,
            module_depth: -1,
            top_modules: 1,
            detailed: true,
            output_file: None,
        }
    }
}

/// `activation_checkpointing`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ActivationCheckpointingConfig {
    /// Partition checkpointed activations across model-parallel ranks.
    pub partition_activations: bool,
    /// Copy checkpoints into one contiguous buffer.
    pub contiguous_memory_optimization: bool,
    /// Keep checkpoints in host memory.
    pub cpu_checkpointing: bool,
    /// Number of checkpoints (for the contiguous buffer).
    pub number_checkpoints: Option<u64>,
    /// Synchronize at checkpoint boundaries.
    pub synchronize_checkpoint_boundary: bool,
    /// Time checkpoint functions.
    pub profile: bool,
}
