//! [`SyncOptions`]: the reduction settings of a config, read once for every regime.

use burn::tensor::DType;

use super::ZeroPlan;
use crate::config::DeepSpeedConfig;

/// What the gradient-sync regimes read from a resolved [`DeepSpeedConfig`]. Built once by the
/// caller ([`SyncOptions::of`]) and handed down, so that no regime reads the config itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncOptions {
    /// What the ZeRO stage means for the regimes.
    pub plan: ZeroPlan,
    /// Elements per reduction collective (`zero_optimization.reduce_bucket_size`; 0: one).
    pub reduce_bucket: usize,
    /// Elements per all-gather of updated slices (`zero_optimization.allgather_bucket_size`).
    pub gather_bucket: usize,
    /// `gradient_predivide_factor` when `prescale_gradients` is on.
    pub predivide: Option<f32>,
    /// `gradient_clipping` (0 disables it).
    pub clip: f64,
    /// `zero_optimization.reduce_scatter`: false all-reduces each bucket and keeps the own
    /// part (DeepSpeed's all-reduce path; the result is the same).
    pub reduce_scatter: bool,
    /// `zero_optimization.ignore_unused_parameters`.
    pub ignore_unused: bool,
    /// `stage3_prefetch_bucket_size`.
    pub prefetch_bucket: usize,
    /// `stage3_max_live_parameters`.
    pub max_live: usize,
    /// `stage3_param_persistence_threshold`.
    pub param_persistence: usize,
    /// `stage3_model_persistence_threshold`.
    pub model_persistence: usize,
    /// `stage3_use_all_reduce_for_fetch_params`.
    pub fetch_by_all_reduce: bool,
    /// `zero_quantized_weights` (ZeRO++'s qwZ): stage 3 gathers int8 codes.
    pub quantized_weights: bool,
    /// `zero_hpz_partition_size` (ZeRO++'s hpZ): ranks per node keeping secondary slices
    /// (1: off).
    pub hpz: usize,
    /// `zero_quantized_gradients` (ZeRO++'s qgZ): stage 3 reduces gradients by quantized
    /// all-to-alls inside and across nodes.
    pub quantized_gradients: bool,
    /// The dtype the accumulated gradient is held in: f16 under fp16 (the paper's 2Ψ), f32
    /// otherwise (bf16 accumulates in f32, as DeepSpeed's bf16 optimizer does).
    pub grad_dtype: DType,
}

impl SyncOptions {
    /// The options of a resolved config.
    pub fn of(config: &DeepSpeedConfig) -> Self {
        let z = &config.zero_optimization;
        Self {
            plan: ZeroPlan::of(config),
            reduce_bucket: z.reduce_bucket_size as usize,
            gather_bucket: z.allgather_bucket_size as usize,
            predivide: config
                .prescale_gradients
                .then_some(config.gradient_predivide_factor as f32),
            clip: config.gradient_clipping,
            reduce_scatter: z.reduce_scatter,
            ignore_unused: z.ignore_unused_parameters,
            prefetch_bucket: z.prefetch_bucket_size as usize,
            max_live: z.max_live_parameters as usize,
            param_persistence: z.param_persistence_threshold as usize,
            model_persistence: usize::try_from(z.model_persistence_threshold).unwrap_or(usize::MAX),
            fetch_by_all_reduce: z.stage3_use_all_reduce_for_fetch_params,
            quantized_weights: z.zero_quantized_weights,
            hpz: z.zero_hpz_partition_size.max(1) as usize,
            quantized_gradients: z.zero_quantized_gradients,
            grad_dtype: match config.fp16.enabled {
                true => DType::F16,
                false => DType::F32,
            },
        }
    }

    /// Ranks per node, for ZeRO++: `zero_hpz_partition_size` when set above 1 (DeepSpeed's
    /// node for hpZ), else the ranks `mpirun` started on this node, else `world` (thread ranks
    /// share one process).
    pub fn ranks_per_node(&self, world: usize) -> usize {
        match self.hpz {
            1 => crate::launch::mpirun_local_size().unwrap_or(world),
            g => g,
        }
    }

    /// The factor applied before the reduction (`1 / gradient_predivide_factor` when
    /// prescaling, else 1).
    pub fn pre_factor(&self) -> f32 {
        self.predivide.map_or(1.0, |f| 1.0 / f)
    }
}
