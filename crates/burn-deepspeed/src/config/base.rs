//! [`DeepSpeedConfig`]: a typed `ds_config.json`, with DeepSpeed's defaults and clear errors.
//!
//! The sections are plain serde structs rather than Burn `#[derive(Config)]` types, because the
//! format is DeepSpeed's: `{"type", "params"}` objects, keys with aliases, counts written as
//! floats (`5e8`), and errors that must name the offending key.

use std::path::Path;

use burn::tensor::FloatDType;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::serde_util::{count, opt_count};
use super::warnings::{ConfigWarning, remove_unimplemented};
use super::{
    ActivationCheckpointingConfig, AioConfig, BatchSizes, Bf16Config, CommsLoggerConfig,
    CompressionTrainingConfig, FlopsProfilerConfig, Fp16Config, MonitorConfig, OptimizerConfig,
    OptimizerKind, PipelineConfig, PldConfig, QuantizeTrainingConfig, SchedulerConfig,
    TensorParallelConfig, ZeroConfig, ZeroStage, resolve_batch,
};
use crate::{DeepSpeedError, Result};

/// A DeepSpeed configuration (`ds_config.json`).
///
/// Build one in Rust (`DeepSpeedConfig { zero_optimization: ..., ..Default::default() }`) or
/// load one with [`DeepSpeedConfig::from_json_str`] / [`DeepSpeedConfig::from_file`]; then
/// [`DeepSpeedConfig::resolve`] fills every default for a world size.
///
/// ```
/// use burn_deepspeed::config::{DeepSpeedConfig, ZeroConfig, ZeroStage};
///
/// let (mut loaded, warnings) = DeepSpeedConfig::from_json_str(
///     r#"{"train_batch_size": 16, "zero_optimization": {"stage": 2}, "wandb": {}}"#,
/// )?;
/// assert_eq!(warnings[0].key, "wandb"); // a DeepSpeed key not implemented here
/// let built = DeepSpeedConfig {
///     train_batch_size: Some(16),
///     zero_optimization: ZeroConfig { stage: ZeroStage::Gradients, ..Default::default() },
///     ..Default::default()
/// };
/// assert_eq!(loaded, built);
/// let batch = loaded.resolve(4)?; // over 4 data-parallel ranks
/// assert_eq!(batch.train_micro_batch_size_per_gpu * batch.gradient_accumulation_steps, 4);
/// # Ok::<(), burn_deepspeed::DeepSpeedError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeepSpeedConfig {
    /// Samples per optimizer step over all data-parallel ranks.
    #[serde(
        deserialize_with = "opt_count",
        skip_serializing_if = "Option::is_none"
    )]
    pub train_batch_size: Option<u64>,
    /// Samples per forward/backward on one rank.
    #[serde(
        deserialize_with = "opt_count",
        skip_serializing_if = "Option::is_none"
    )]
    pub train_micro_batch_size_per_gpu: Option<u64>,
    /// Micro-batches accumulated per optimizer step.
    #[serde(
        deserialize_with = "opt_count",
        skip_serializing_if = "Option::is_none"
    )]
    pub gradient_accumulation_steps: Option<u64>,
    /// The optimizer; AdamW with DeepSpeed's defaults when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerConfig>,
    /// The learning-rate schedule; constant when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<SchedulerConfig>,
    /// Largest global L2 norm of the gradient (0: no clipping).
    pub gradient_clipping: f64,
    /// Divide gradients before the all-reduce (by `gradient_predivide_factor`) rather than
    /// after it (by the world size).
    pub prescale_gradients: bool,
    /// Pre-division factor of `prescale_gradients`.
    pub gradient_predivide_factor: f64,
    /// Stop with an error after this many optimizer steps in a row are skipped for a
    /// non-finite gradient (0: never). Not a DeepSpeed key: DeepSpeed stops only at the fp16
    /// minimum scale, and otherwise skips for ever.
    pub max_consecutive_skipped_steps: u64,
    /// fp16 mixed precision.
    pub fp16: Fp16Config,
    /// bf16 mixed precision.
    #[serde(alias = "bfloat16")]
    pub bf16: Bf16Config,
    /// ZeRO.
    pub zero_optimization: ZeroConfig,
    /// Pipeline parallelism.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineConfig>,
    /// Tensor slicing.
    pub tensor_parallel: TensorParallelConfig,
    /// DeepSpeed-Ulysses sequence parallelism: ranks that share each sequence (1: none).
    #[serde(deserialize_with = "count")]
    pub sequence_parallel_size: u64,
    /// Progressive layer dropping.
    pub progressive_layer_drop: PldConfig,
    /// Flops profiler.
    pub flops_profiler: FlopsProfilerConfig,
    /// Activation checkpointing.
    pub activation_checkpointing: Option<ActivationCheckpointingConfig>,
    /// Swap-file transfers (ZeRO-Infinity).
    pub aio: AioConfig,
    /// Print progress every this many optimizer steps.
    #[serde(deserialize_with = "count")]
    pub steps_per_print: u64,
    /// Print the time spent in forward, backward, reduction and step.
    pub wall_clock_breakdown: bool,
    /// Time and size every collective.
    pub comms_logger: CommsLoggerConfig,
    /// Write the step's scalars as TensorBoard event files.
    pub tensorboard: MonitorConfig,
    /// Write the step's scalars as CSV.
    pub csv_monitor: MonitorConfig,
    /// MoQ, the older form (the MoQ tutorial's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quantize_training: Option<QuantizeTrainingConfig>,
    /// DeepSpeed's compression library: its `weight_quantization` (MoQ).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compression_training: Option<CompressionTrainingConfig>,
}

impl Default for DeepSpeedConfig {
    fn default() -> Self {
        Self {
            train_batch_size: None,
            train_micro_batch_size_per_gpu: None,
            gradient_accumulation_steps: None,
            optimizer: None,
            scheduler: None,
            gradient_clipping: 0.0,
            prescale_gradients: false,
            gradient_predivide_factor: 1.0,
            max_consecutive_skipped_steps: 100,
            fp16: Fp16Config::default(),
            bf16: Bf16Config::default(),
            zero_optimization: ZeroConfig::default(),
            pipeline: None,
            tensor_parallel: TensorParallelConfig::default(),
            sequence_parallel_size: 1,
            progressive_layer_drop: PldConfig::default(),
            flops_profiler: FlopsProfilerConfig::default(),
            activation_checkpointing: None,
            aio: AioConfig::default(),
            steps_per_print: 10,
            wall_clock_breakdown: false,
            comms_logger: CommsLoggerConfig::default(),
            tensorboard: MonitorConfig::default(),
            csv_monitor: MonitorConfig::default(),
            quantize_training: None,
            compression_training: None,
        }
    }
}

impl DeepSpeedConfig {
    /// Learning rate of optimizer step `step` (0-based): the scheduler's, from the optimizer's
    /// `lr` (1e-3 when unset).
    pub fn lr_at(&self, step: u64) -> f64 {
        let base = self
            .optimizer
            .as_ref()
            .and_then(|o| o.params.lr)
            .unwrap_or(1e-3);
        match &self.scheduler {
            Some(s) => s.lr_at(step, base),
            None => base,
        }
    }

    /// The 16-bit dtype parameters and gradients train in (`fp16` or `bf16` enabled), with
    /// fp32 masters; `None` for fp32 training.
    pub fn working_dtype(&self) -> Option<FloatDType> {
        if self.fp16.enabled {
            Some(FloatDType::F16)
        } else if self.bf16.enabled {
            Some(FloatDType::BF16)
        } else {
            None
        }
    }

    /// Ranks per tensor-parallel group (`tensor_parallel.tp_size`; 1 without slicing).
    pub fn tp_size(&self) -> usize {
        usize::try_from(self.tensor_parallel.tp_size).unwrap_or(usize::MAX)
    }

    /// Ranks per sequence-parallel group (`sequence_parallel_size`; 1 without).
    pub fn sp_size(&self) -> usize {
        usize::try_from(self.sequence_parallel_size).unwrap_or(usize::MAX)
    }

    /// Pipeline stages (`pipeline.stages`; 1 without a pipeline or with `"auto"`).
    pub fn pipeline_stages(&self) -> usize {
        self.pipeline
            .as_ref()
            .and_then(|p| p.stage_count())
            .map_or(1, |n| n as usize)
    }

    /// The precision's name as the config spells its section: `fp16`, `bf16` or `fp32`.
    pub fn precision_name(&self) -> &'static str {
        match self.working_dtype() {
            Some(FloatDType::F16) => "fp16",
            Some(_) => "bf16",
            None => "fp32",
        }
    }

    /// The optimizer type (AdamW when the config has no optimizer section).
    pub fn optimizer_kind(&self) -> OptimizerKind {
        self.optimizer
            .as_ref()
            .map_or(OptimizerKind::AdamW, |o| o.kind)
    }

    /// Parses a `ds_config.json` text. Unknown keys are errors that name the key and the
    /// closest known one; DeepSpeed keys not implemented here load with a warning.
    pub fn from_json_str(text: &str) -> Result<(Self, Vec<ConfigWarning>)> {
        let mut value: Value =
            serde_json::from_str(text).map_err(|e| DeepSpeedError::ConfigSyntax {
                line: e.line(),
                column: e.column(),
                message: e.to_string(),
            })?;
        let mut warnings = match value.as_object_mut() {
            Some(obj) => remove_unimplemented(obj),
            None => {
                return Err(DeepSpeedError::InvalidValue {
                    path: "(root)".into(),
                    message: "a DeepSpeed config is a JSON object".into(),
                });
            }
        };
        let config: DeepSpeedConfig =
            serde_path_to_error::deserialize(value).map_err(map_serde_error)?;
        warnings.extend(config.feature_warnings());
        Ok((config, warnings))
    }

    /// Reads and parses a `ds_config.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<(Self, Vec<ConfigWarning>)> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| DeepSpeedError::ConfigIo {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// Fills every default for `world_size` data-parallel ranks: the three batch numbers, the
    /// optimizer (AdamW when absent) and its parameters; and validates the values.
    pub fn resolve(&mut self, world_size: usize) -> Result<BatchSizes> {
        let batch = resolve_batch(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            world_size as u64,
        )?;
        self.train_batch_size = Some(batch.train_batch_size);
        self.train_micro_batch_size_per_gpu = Some(batch.train_micro_batch_size_per_gpu);
        self.gradient_accumulation_steps = Some(batch.gradient_accumulation_steps);
        self.optimizer.get_or_insert_with(OptimizerConfig::default);
        self.resolve_values()?;
        Ok(batch)
    }

    /// [`resolve`](Self::resolve) without the batch numbers: fills the optimizer's defaults
    /// (when it has a section) and validates every other value.
    pub(crate) fn resolve_values(&mut self) -> Result<()> {
        if let Some(o) = &mut self.optimizer {
            o.resolve()?;
        }
        if self.fp16.enabled {
            crate::precision::validate(&self.fp16)?;
        }
        if let Some(s) = &self.scheduler {
            s.validate()?;
        }
        self.aio.validate()?;
        if !(self.gradient_clipping >= 0.0 && self.gradient_clipping.is_finite()) {
            return Err(DeepSpeedError::InvalidValue {
                path: "gradient_clipping".into(),
                message: format!("must be ≥ 0, found {}", self.gradient_clipping),
            });
        }
        // The factor divides f32 gradients: it and its inverse must be finite in f32.
        let f = self.gradient_predivide_factor;
        let f32_factor = f as f32;
        if !(f32_factor.is_finite() && f32_factor > 0.0 && (1.0 / f32_factor).is_finite()) {
            return Err(DeepSpeedError::InvalidValue {
                path: "gradient_predivide_factor".into(),
                message: format!(
                    "must be a number > 0 that it and its inverse fit an f32 (from about \
                     3e-38 to 3e38), found {f}"
                ),
            });
        }
        if self.sequence_parallel_size == 0 {
            return Err(DeepSpeedError::InvalidValue {
                path: "sequence_parallel_size".into(),
                message: "must be at least 1".into(),
            });
        }
        if self.tensor_parallel.tp_size == 0 {
            return Err(DeepSpeedError::InvalidValue {
                path: "tensor_parallel.tp_size".into(),
                message: "must be at least 1".into(),
            });
        }
        let pld = &self.progressive_layer_drop;
        if !(0.0..=1.0).contains(&pld.theta) {
            return Err(DeepSpeedError::InvalidValue {
                path: "progressive_layer_drop.theta".into(),
                message: format!("must be in [0, 1], found {}", pld.theta),
            });
        }
        if !(pld.gamma >= 0.0 && pld.gamma.is_finite()) {
            return Err(DeepSpeedError::InvalidValue {
                path: "progressive_layer_drop.gamma".into(),
                message: format!("must be a finite number ≥ 0, found {}", pld.gamma),
            });
        }
        let kind = self.optimizer_kind();
        if kind.is_one_bit() && self.zero_optimization.stage != ZeroStage::Disabled {
            return Err(DeepSpeedError::Unsupported {
                key: "zero_optimization.stage".into(),
                reason: format!(
                    "{kind:?} compresses the data-parallel momentum exchange and needs ZeRO \
                     stage 0 (DeepSpeed refuses the combination too); set the stage to 0 or \
                     use Adam/AdamW/Lamb"
                ),
            });
        }
        self.comms_logger.options()?;
        self.tensorboard.validate("tensorboard")?;
        self.csv_monitor.validate("csv_monitor")?;
        if self.fp16.enabled && self.bf16.enabled {
            return Err(DeepSpeedError::InvalidValue {
                path: "fp16.enabled".into(),
                message: "fp16 and bf16 cannot both be enabled".into(),
            });
        }
        Ok(())
    }

    /// The config as pretty JSON, in DeepSpeed's key names.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("a config always serializes")
    }
}

fn map_serde_error(e: serde_path_to_error::Error<serde_json::Error>) -> DeepSpeedError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    let message = inner.to_string();
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let key = rest.split('`').next().unwrap_or_default().to_string();
        let expected: Vec<&str> = rest
            .split_once("expected ")
            .map(|(_, list)| list.split('`').skip(1).step_by(2).collect())
            .unwrap_or_default();
        let parent = path
            .rsplit_once('.')
            .map(|(p, _)| format!("{p}."))
            .unwrap_or_default();
        let full = if path.ends_with(&key) {
            path.clone()
        } else {
            format!("{parent}{key}")
        };
        return DeepSpeedError::UnknownKey {
            path: full,
            suggestion: closest(&key, &expected).map(|s| format!("{parent}{s}")),
        };
    }
    // serde_json appends " at line L column C"; keep it, it helps find the value.
    DeepSpeedError::InvalidValue {
        path: if path == "." { "(root)".into() } else { path },
        message,
    }
}

/// The known key closest to `key` by edit distance, if it is close enough to be a typo.
fn closest(key: &str, known: &[&str]) -> Option<String> {
    let key_l = key.to_ascii_lowercase();
    known
        .iter()
        .map(|k| (strsim::levenshtein(&key_l, &k.to_ascii_lowercase()), *k))
        .filter(|(d, k)| *d <= (k.len().max(key.len()) / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OptimizerKind;

    #[test]
    fn empty_config_gets_deepspeeds_defaults() {
        let (mut c, w) = DeepSpeedConfig::from_json_str(r#"{"train_batch_size": 8}"#).unwrap();
        assert!(w.is_empty());
        let b = c.resolve(2).unwrap();
        assert_eq!(b.train_micro_batch_size_per_gpu, 4);
        assert_eq!(c.zero_optimization.reduce_bucket_size, 500_000_000);
        assert_eq!(c.steps_per_print, 10);
        let o = c.optimizer.unwrap();
        assert_eq!(o.kind, OptimizerKind::AdamW);
        assert_eq!(o.params.betas, Some((0.9, 0.999)));
    }

    #[test]
    fn misspelled_key_names_the_key_and_the_closest() {
        let e = DeepSpeedConfig::from_json_str(r#"{"zero_optimization": {"stgae": 2}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("zero_optimization.stgae"), "{e}");
        assert!(e.contains("did you mean `zero_optimization.stage`"), "{e}");
        let e = DeepSpeedConfig::from_json_str(r#"{"train_batch_szie": 2}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`train_batch_size`"), "{e}");
        let e = DeepSpeedConfig::from_json_str(r#"{"completely_else": 2}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("completely_else") && !e.contains("did you mean"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_names_the_key_and_the_expected_type() {
        let e = DeepSpeedConfig::from_json_str(r#"{"zero_optimization": {"stage": "two"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("zero_optimization.stage"), "{e}");
        assert!(e.contains("expected u8"), "{e}");
        let e = DeepSpeedConfig::from_json_str(r#"{"gradient_clipping": true}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gradient_clipping") && e.contains("expected f64"),
            "{e}"
        );
        let e = DeepSpeedConfig::from_json_str(r#"{"zero_optimization": {"stage": 5}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("0, 1, 2 or 3"), "{e}");
    }

    #[test]
    fn float_counts_and_aliases_load() {
        let (c, _) = DeepSpeedConfig::from_json_str(
            r#"{"zero_optimization": {"reduce_bucket_size": 5e7,
                "stage3_prefetch_bucket_size": 1e6},
                "bfloat16": {"enabled": false}}"#,
        )
        .unwrap();
        assert_eq!(c.zero_optimization.reduce_bucket_size, 50_000_000);
        assert_eq!(c.zero_optimization.prefetch_bucket_size, 1_000_000);
        assert!(
            DeepSpeedConfig::from_json_str(r#"{"zero_optimization": {"reduce_bucket_size": 1.5}}"#)
                .is_err()
        );
    }

    #[test]
    fn unimplemented_deepspeed_keys_warn() {
        let (_, w) = DeepSpeedConfig::from_json_str(
            r#"{"wandb": {"enabled": true}, "tensorboard": {"enabled": true},
                "fp16": {"enabled": true}}"#,
        )
        .unwrap();
        let keys: Vec<&str> = w.iter().map(|w| w.key.as_str()).collect();
        // fp16 and the TensorBoard monitor work; Weights & Biases does not.
        assert!(
            keys.contains(&"wandb")
                && !keys.contains(&"tensorboard")
                && !keys.contains(&"fp16.enabled"),
            "{keys:?}"
        );
    }

    #[test]
    fn optimizer_names_are_case_insensitive_and_params_checked() {
        let (mut c, _) = DeepSpeedConfig::from_json_str(
            r#"{"train_batch_size": 4, "optimizer": {"type": "lamb", "params": {"lr": 0.01}}}"#,
        )
        .unwrap();
        c.resolve(1).unwrap();
        let o = c.optimizer.unwrap();
        assert_eq!(o.kind, OptimizerKind::Lamb);
        assert_eq!(o.params.max_coeff, Some(10.0));
        let (mut c, _) = DeepSpeedConfig::from_json_str(
            r#"{"train_batch_size": 4, "optimizer": {"type": "AdamW",
                "params": {"freeze_step": 10}}}"#,
        )
        .unwrap();
        let e = c.resolve(1).unwrap_err().to_string();
        assert!(e.contains("optimizer.params.freeze_step"), "{e}");
        let e = DeepSpeedConfig::from_json_str(r#"{"optimizer": {"type": "Adagrad"}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("optimizer.type") && e.contains("Adagrad"), "{e}");
    }

    #[test]
    fn published_deepspeed_configs_load() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/deepspeed-examples"
        );
        let mut n = 0;
        for entry in std::fs::read_dir(dir).expect("configs folder") {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "json") {
                let (mut c, _) = DeepSpeedConfig::from_file(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                c.resolve(16)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                n += 1;
            }
        }
        assert!(n >= 3, "only {n} configs found");
    }

    #[test]
    fn resolved_config_round_trips() {
        let (mut c, _) = DeepSpeedConfig::from_json_str(r#"{"train_batch_size": 8}"#).unwrap();
        c.resolve(2).unwrap();
        let (back, _) = DeepSpeedConfig::from_json_str(&c.to_json_pretty()).unwrap();
        assert_eq!(back, c);
    }
}
