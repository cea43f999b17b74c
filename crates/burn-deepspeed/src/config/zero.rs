//! The `zero_optimization` section (ZeRO, arXiv 1910.02054), with DeepSpeed's defaults.
//!
//! Every key DeepSpeed documents for stages 1-3 and offload is typed here. The engine runs
//! stages 0-3, and so does the Learner strategy; both refuse offload, ZeRO++ and MiCS
//! (`check_supported`).

use serde::{Deserialize, Serialize};

use super::serde_util::count;

/// Which states ZeRO partitions across data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum ZeroStage {
    /// Stage 0: nothing partitioned (classic data parallelism).
    #[default]
    Disabled,
    /// Stage 1: optimizer states.
    OptimizerStates,
    /// Stage 2: optimizer states and gradients.
    Gradients,
    /// Stage 3: optimizer states, gradients and parameters.
    Parameters,
}

impl From<ZeroStage> for u8 {
    fn from(s: ZeroStage) -> u8 {
        s as u8
    }
}

impl TryFrom<u8> for ZeroStage {
    type Error = String;
    fn try_from(v: u8) -> Result<Self, String> {
        Ok(match v {
            0 => ZeroStage::Disabled,
            1 => ZeroStage::OptimizerStates,
            2 => ZeroStage::Gradients,
            3 => ZeroStage::Parameters,
            _ => return Err(format!("ZeRO stage must be 0, 1, 2 or 3, found {v}")),
        })
    }
}

/// Where offloaded state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffloadDevice {
    /// Not offloaded.
    #[default]
    None,
    /// Host memory (ZeRO-Offload).
    Cpu,
    /// NVMe files (ZeRO-Infinity).
    Nvme,
}

impl OffloadDevice {
    /// Its name in the config.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Cpu => "cpu",
            Self::Nvme => "nvme",
        }
    }
}

/// `offload_optimizer` (stages 1-3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadOptimizerConfig {
    /// Where the optimizer state and step live.
    pub device: OffloadDevice,
    /// Folder for NVMe swap files.
    pub nvme_path: Option<String>,
    /// Page-locked host buffers.
    pub pin_memory: bool,
    /// Swap buffers in flight.
    #[serde(deserialize_with = "count")]
    pub buffer_count: u64,
    /// Overlap NVMe reads with the step.
    pub pipeline_read: bool,
    /// Overlap NVMe writes with the step.
    pub pipeline_write: bool,
    /// Skip initial optimizer-state allocation on NVMe.
    pub fast_init: bool,
    /// Fraction of the state offloaded (stage 3 only below 1).
    pub ratio: f64,
}

impl Default for OffloadOptimizerConfig {
    fn default() -> Self {
        Self {
            device: OffloadDevice::None,
            nvme_path: None,
            pin_memory: false,
            buffer_count: 4,
            pipeline_read: false,
            pipeline_write: false,
            fast_init: false,
            ratio: 1.0,
        }
    }
}

/// `offload_param` (stage 3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OffloadParamConfig {
    /// Where parameter partitions live.
    pub device: OffloadDevice,
    /// Folder for NVMe swap files.
    pub nvme_path: Option<String>,
    /// Swap buffers.
    #[serde(deserialize_with = "count")]
    pub buffer_count: u64,
    /// Elements per swap buffer.
    #[serde(deserialize_with = "count")]
    pub buffer_size: u64,
    /// Elements kept in host memory before swapping to NVMe.
    #[serde(deserialize_with = "count")]
    pub max_in_cpu: u64,
    /// Page-locked host buffers.
    pub pin_memory: bool,
}

impl Default for OffloadParamConfig {
    fn default() -> Self {
        Self {
            device: OffloadDevice::None,
            nvme_path: None,
            buffer_count: 5,
            buffer_size: 100_000_000,
            max_in_cpu: 1_000_000_000,
            pin_memory: false,
        }
    }
}

/// The top-level `aio` section: how ZeRO-Infinity's swap files are read and written
/// (DeepSpeed's `swap_tensor/constants.py` defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AioConfig {
    /// Bytes per read or write request.
    #[serde(deserialize_with = "count")]
    pub block_size: u64,
    /// Requests in flight per thread.
    #[serde(deserialize_with = "count")]
    pub queue_depth: u64,
    /// Threads a transfer is split across (`thread_count` before DeepSpeed 0.14).
    #[serde(deserialize_with = "count", alias = "thread_count")]
    pub intra_op_parallelism: u64,
    /// Submit requests one at a time.
    pub single_submit: bool,
    /// Refill the queue as each request completes.
    pub overlap_events: bool,
    /// NVIDIA GPUDirect Storage.
    pub use_gds: bool,
}

impl AioConfig {
    /// Refuses sizes the swapper cannot run with, naming the key: a block from 1 byte to 1 GiB
    /// (rounded up to 4 KiB), 1 to 4096 requests in flight, 1 to 256 threads.
    pub fn validate(&self) -> crate::Result<()> {
        for (key, value, most) in [
            ("block_size", self.block_size, 1 << 30),
            ("queue_depth", self.queue_depth, 4096),
            ("intra_op_parallelism", self.intra_op_parallelism, 256),
        ] {
            if !(1..=most).contains(&value) {
                return Err(crate::DeepSpeedError::InvalidValue {
                    path: format!("aio.{key}"),
                    message: format!("must be from 1 to {most}, found {value}"),
                });
            }
        }
        Ok(())
    }
}

impl Default for AioConfig {
    fn default() -> Self {
        let o = burn_deepspeed_strategies::swap::AioOptions::default();
        Self {
            block_size: o.block_size as u64,
            queue_depth: o.queue_depth as u64,
            intra_op_parallelism: o.intra_op_parallelism as u64,
            single_submit: o.single_submit,
            overlap_events: o.overlap_events,
            use_gds: false,
        }
    }
}

/// The `zero_optimization` section. Sizes and thresholds count elements, not bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ZeroConfig {
    /// Which states are partitioned.
    pub stage: ZeroStage,
    /// Copy gradients into a contiguous buffer as they are produced.
    pub contiguous_gradients: bool,
    /// Reduce gradients with reduce-scatter rather than all-reduce.
    pub reduce_scatter: bool,
    /// Elements reduced per collective: bigger buckets mean fewer, faster collectives and
    /// more staging memory.
    #[serde(deserialize_with = "count")]
    pub reduce_bucket_size: u64,
    /// All-gather updated partitions (stages 1-2).
    pub allgather_partitions: bool,
    /// Elements all-gathered per collective.
    #[serde(deserialize_with = "count")]
    pub allgather_bucket_size: u64,
    /// Overlap reduction with backward; unset means true for stage 3 only.
    pub overlap_comm: Option<bool>,
    /// Load from fp32 master weights when resuming.
    pub load_from_fp32_weights: bool,
    /// Elastic checkpoints (DeepSpeed, deprecated).
    pub elastic_checkpoint: bool,
    /// Optimizer-state offload.
    pub offload_optimizer: Option<OffloadOptimizerConfig>,
    /// Parameter offload (stage 3).
    pub offload_param: Option<OffloadParamConfig>,
    /// Deprecated alias of `offload_optimizer.device = "cpu"`.
    pub cpu_offload: Option<bool>,
    /// Elements per tile of the optimizer step.
    #[serde(deserialize_with = "count")]
    pub sub_group_size: u64,
    /// Stage 3: elements prefetched ahead of use.
    #[serde(
        deserialize_with = "count",
        rename = "stage3_prefetch_bucket_size",
        alias = "prefetch_bucket_size"
    )]
    pub prefetch_bucket_size: u64,
    /// Stage 3: parameters this small are never partitioned.
    #[serde(
        deserialize_with = "count",
        rename = "stage3_param_persistence_threshold",
        alias = "param_persistence_threshold"
    )]
    pub param_persistence_threshold: u64,
    /// Stage 3: cap on persisted elements in the model.
    #[serde(
        deserialize_with = "count",
        rename = "stage3_model_persistence_threshold",
        alias = "model_persistence_threshold"
    )]
    pub model_persistence_threshold: u64,
    /// Stage 3: cap on gathered elements alive at once.
    #[serde(
        deserialize_with = "count",
        rename = "stage3_max_live_parameters",
        alias = "max_live_parameters"
    )]
    pub max_live_parameters: u64,
    /// Stage 3: keep a parameter gathered if it is reused within this many elements.
    #[serde(
        deserialize_with = "count",
        rename = "stage3_max_reuse_distance",
        alias = "max_reuse_distance"
    )]
    pub max_reuse_distance: u64,
    /// Stage 3: gather 16-bit weights when saving.
    #[serde(
        rename = "stage3_gather_16bit_weights_on_model_save",
        alias = "stage3_gather_fp16_weights_on_model_save"
    )]
    pub gather_16bit_weights_on_model_save: bool,
    /// Stage 3: fetch parameters with all-reduce instead of all-gather.
    pub stage3_use_all_reduce_for_fetch_params: bool,
    /// Stage 3: fetch modules below this parameter count as one unit.
    #[serde(deserialize_with = "count")]
    pub stage3_module_granularity_threshold: u64,
    /// Round-robin gradient partitioning (stages 1-2).
    pub round_robin_gradients: bool,
    /// Tolerate parameters without gradients.
    pub ignore_unused_parameters: bool,
    /// All-reduce whole buckets and let owners copy their slice.
    pub use_multi_rank_bucket_allreduce: bool,
    /// Stage 3 memory-efficient linear.
    pub memory_efficient_linear: bool,
    /// ZeRO++ hierarchical partition size.
    #[serde(deserialize_with = "count")]
    pub zero_hpz_partition_size: u64,
    /// ZeRO++ quantized weights.
    pub zero_quantized_weights: bool,
    /// ZeRO++ quantized non-trainable weights.
    pub zero_quantized_nontrainable_weights: bool,
    /// ZeRO++ quantized gradients.
    pub zero_quantized_gradients: bool,
    /// MiCS shard size (−1: off).
    pub mics_shard_size: i64,
    /// MiCS hierarchical gather.
    pub mics_hierarchical_params_gather: bool,
    /// Load pipeline checkpoints per stage.
    pub pipeline_loading_checkpoint: bool,
    /// Stage 3: wrap `module.apply`.
    pub override_module_apply: bool,
    /// Stage 3: log trace-cache warnings.
    pub log_trace_cache_warnings: bool,
}

impl Default for ZeroConfig {
    fn default() -> Self {
        Self {
            stage: ZeroStage::Disabled,
            contiguous_gradients: true,
            reduce_scatter: true,
            reduce_bucket_size: 500_000_000,
            allgather_partitions: true,
            allgather_bucket_size: 500_000_000,
            overlap_comm: None,
            load_from_fp32_weights: true,
            elastic_checkpoint: false,
            offload_optimizer: None,
            offload_param: None,
            cpu_offload: None,
            sub_group_size: 1_000_000_000,
            prefetch_bucket_size: 50_000_000,
            param_persistence_threshold: 100_000,
            model_persistence_threshold: u64::MAX,
            max_live_parameters: 1_000_000_000,
            max_reuse_distance: 1_000_000_000,
            gather_16bit_weights_on_model_save: false,
            stage3_use_all_reduce_for_fetch_params: false,
            stage3_module_granularity_threshold: 0,
            round_robin_gradients: false,
            ignore_unused_parameters: true,
            use_multi_rank_bucket_allreduce: true,
            memory_efficient_linear: true,
            zero_hpz_partition_size: 1,
            zero_quantized_weights: false,
            zero_quantized_nontrainable_weights: false,
            zero_quantized_gradients: false,
            mics_shard_size: -1,
            mics_hierarchical_params_gather: false,
            pipeline_loading_checkpoint: false,
            override_module_apply: true,
            log_trace_cache_warnings: false,
        }
    }
}

impl ZeroConfig {
    /// Where the optimizer state lives: `offload_optimizer.device`, or `cpu` under the
    /// deprecated `cpu_offload: true`.
    pub fn optimizer_offload(&self) -> OffloadDevice {
        match &self.offload_optimizer {
            Some(o) if o.device != OffloadDevice::None => o.device,
            _ if self.cpu_offload == Some(true) => OffloadDevice::Cpu,
            _ => OffloadDevice::None,
        }
    }

    /// `overlap_comm` as DeepSpeed resolves it: unset means true for stage 3 only.
    pub fn overlap_comm(&self) -> bool {
        self.overlap_comm
            .unwrap_or(self.stage == ZeroStage::Parameters)
    }
}

#[cfg(test)]
mod tests {
    use crate::DeepSpeedConfig;

    /// `aio` sizes that would wrap the swapper's block arithmetic to 0 or spawn a thread per
    /// block are refused by key when the config is resolved; DeepSpeed's values pass.
    #[test]
    fn aio_sizes_are_bounded() {
        let resolve = |aio: &str| {
            let (mut c, _) = DeepSpeedConfig::from_json_str(&format!(
                r#"{{"train_batch_size": 2, "aio": {{{aio}}}}}"#
            ))
            .expect("parses");
            c.resolve(1).err().map(|e| e.to_string())
        };
        for (aio, key) in [
            (r#""block_size": 18446744073709551615"#, "aio.block_size"),
            (r#""block_size": 0"#, "aio.block_size"),
            (r#""queue_depth": 0"#, "aio.queue_depth"),
            (
                r#""intra_op_parallelism": 1000000000"#,
                "aio.intra_op_parallelism",
            ),
            (r#""thread_count": 0"#, "aio.intra_op_parallelism"),
        ] {
            let e = resolve(aio).unwrap_or_else(|| panic!("{aio} was accepted"));
            assert!(e.contains(key), "{aio}: {e}");
        }
        let deepspeed = r#""block_size": 1048576, "queue_depth": 8, "thread_count": 1,
            "single_submit": false, "overlap_events": true"#;
        assert_eq!(resolve(deepspeed), None);
    }
}
