//! MoQ's two config forms: the older `quantize_training` section (the MoQ tutorial's) and
//! `compression_training.weight_quantization` (DeepSpeed's compression library), both
//! resolved into one [`MoqSettings`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::serde_util::count;
use crate::{DeepSpeedError, Result};

/// `"symmetric"` or `"asymmetric"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum QuantizationType {
    /// Around zero (the default).
    #[default]
    Symmetric,
    /// With a zero point.
    Asymmetric,
}

/// `"nearest"` or `"stochastic"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Rounding {
    /// Round half to even (the default).
    #[default]
    Nearest,
    /// Add U(−½, ½) before rounding.
    Stochastic,
}

/// `quantize_bits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizeBits {
    /// Bits at the start (16).
    #[serde(deserialize_with = "count")]
    pub start_bits: u64,
    /// Bits the schedule falls to (8).
    #[serde(deserialize_with = "count")]
    pub target_bits: u64,
}

impl Default for QuantizeBits {
    fn default() -> Self {
        Self {
            start_bits: 16,
            target_bits: 8,
        }
    }
}

/// `quantize_schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizeSchedule {
    /// Quantizing steps to the first bit drop (1000); each later drop takes twice as long.
    #[serde(deserialize_with = "count")]
    pub quantize_period: u64,
    /// Optimizer steps before quantization starts (1000).
    #[serde(deserialize_with = "count")]
    pub schedule_offset: u64,
}

impl Default for QuantizeSchedule {
    fn default() -> Self {
        Self {
            quantize_period: 1000,
            schedule_offset: 1000,
        }
    }
}

/// `fp16_mixed_quantize`: blend the weight into its quantized value gradually.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MixedQuantize {
    /// Blend.
    pub enabled: bool,
    /// The weight's share falls by this much per quantizing step (0.001).
    pub quantize_change_ratio: f64,
}

impl Default for MixedQuantize {
    fn default() -> Self {
        Self {
            enabled: false,
            quantize_change_ratio: 0.001,
        }
    }
}

/// `quantize_algo` (the tutorial spells it `quantize-algo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizeAlgo {
    /// Symmetric or asymmetric.
    pub q_type: QuantizationType,
    /// Nearest or stochastic.
    pub rounding: Rounding,
}

/// `quantize_training`: MoQ (Mixture-of-Quantization) in its older form, as the MoQ tutorial
/// writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizeTrainingConfig {
    /// Quantize during training.
    pub enabled: bool,
    /// Log each bit drop.
    pub quantize_verbose: bool,
    /// DeepSpeed's CUDA quantizer kernel (accepted; the host path here gives the same values
    /// for nearest rounding).
    pub quantizer_kernel: bool,
    /// Type and rounding.
    #[serde(alias = "quantize-algo")]
    pub quantize_algo: QuantizeAlgo,
    /// The type at the top level (as some configs write it; overrides `quantize_algo`'s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quantize_type: Option<QuantizationType>,
    /// Start and target bits.
    pub quantize_bits: QuantizeBits,
    /// Period and offset.
    pub quantize_schedule: QuantizeSchedule,
    /// Groups of each flattened weight (1).
    #[serde(deserialize_with = "count")]
    pub quantize_groups: u64,
    /// Blending.
    pub fp16_mixed_quantize: MixedQuantize,
    /// Hessian-eigenvalue-scaled periods (refused when enabled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eigenvalue: Option<Value>,
}

/// `compression_training`: DeepSpeed's compression library. Its `weight_quantization` is MoQ
/// (the other techniques are not implemented and warn).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct CompressionTrainingConfig {
    /// Quantization-aware training of the weights.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_quantization: Option<WeightQuantizationConfig>,
    /// The other techniques (`activation_quantization`, `sparse_pruning`, ...), kept as
    /// given.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// `compression_training.weight_quantization`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct WeightQuantizationConfig {
    /// Settings of every group.
    pub shared_parameters: WeightQuantizationShared,
    /// Named groups of modules with their own schedule.
    pub different_groups: std::collections::BTreeMap<String, WeightQuantizationGroup>,
}

/// `weight_quantization.shared_parameters`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WeightQuantizationShared {
    /// Quantize during training.
    pub enabled: bool,
    /// DeepSpeed's CUDA quantizer kernel (accepted).
    pub quantizer_kernel: bool,
    /// Optimizer steps before quantization starts (0).
    #[serde(deserialize_with = "count")]
    pub schedule_offset: u64,
    /// Groups of each flattened weight (1).
    #[serde(deserialize_with = "count")]
    pub quantize_groups: u64,
    /// Log each bit drop.
    pub quantize_verbose: bool,
    /// Symmetric or asymmetric.
    pub quantization_type: QuantizationType,
    /// Quantize in the forward instead of after the step (refused when true).
    pub quantize_weight_in_forward: bool,
    /// Nearest or stochastic.
    pub rounding: Rounding,
    /// Blending.
    pub fp16_mixed_quantize: MixedQuantize,
}

impl Default for WeightQuantizationShared {
    fn default() -> Self {
        Self {
            enabled: false,
            quantizer_kernel: false,
            schedule_offset: 0,
            quantize_groups: 1,
            quantize_verbose: false,
            quantization_type: QuantizationType::Symmetric,
            quantize_weight_in_forward: false,
            rounding: Rounding::Nearest,
            fp16_mixed_quantize: MixedQuantize::default(),
        }
    }
}

/// One of `weight_quantization.different_groups`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct WeightQuantizationGroup {
    /// Its schedule.
    pub params: WeightQuantizationGroupParams,
    /// Module names (a parameter is in the group when its path contains one; `*`: all).
    pub modules: Vec<String>,
    /// Accepted for compatibility (used by DeepSpeed's other techniques).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub related_modules: Option<Value>,
}

/// `different_groups.<name>.params`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WeightQuantizationGroupParams {
    /// Bits at the start.
    #[serde(deserialize_with = "count")]
    pub start_bits: u64,
    /// Bits the schedule falls to.
    #[serde(deserialize_with = "count")]
    pub target_bits: u64,
    /// Quantizing steps to the first bit drop.
    #[serde(deserialize_with = "count")]
    pub quantization_period: u64,
}

impl Default for WeightQuantizationGroupParams {
    fn default() -> Self {
        Self {
            start_bits: 8,
            target_bits: 8,
            quantization_period: 1,
        }
    }
}

/// MoQ resolved from either form of the config.
#[derive(Debug, Clone, PartialEq)]
pub struct MoqSettings {
    /// The weight groups, each with its module patterns and schedule (start bits, target
    /// bits, period).
    pub groups: Vec<MoqGroupSettings>,
    /// Optimizer steps before the first quantizing step.
    pub schedule_offset: u64,
    /// Groups of each flattened weight.
    pub quantize_groups: usize,
    /// Symmetric or asymmetric.
    pub quantization_type: QuantizationType,
    /// Nearest or stochastic.
    pub rounding: Rounding,
    /// The blend's fall per quantizing step, when blending.
    pub mixed_change_ratio: Option<f64>,
    /// Log each bit drop.
    pub verbose: bool,
}

/// One MoQ weight group.
#[derive(Debug, Clone, PartialEq)]
pub struct MoqGroupSettings {
    /// Its name (`quantize_training` for the older form).
    pub name: String,
    /// Module path patterns (`*`: every weight).
    pub modules: Vec<String>,
    /// Bits at the start.
    pub start_bits: u64,
    /// Bits the schedule falls to.
    pub target_bits: u64,
    /// Quantizing steps to the first drop.
    pub period: u64,
}

impl super::DeepSpeedConfig {
    /// MoQ's settings when either form is enabled, `None` when neither is.
    ///
    /// # Errors
    /// When both forms are enabled, a schedule's target is above its start or 0, a group
    /// count is 0, or a setting that is not implemented is on (Hessian-eigenvalue periods,
    /// quantizing in the forward): each names its key.
    pub fn moq(&self) -> Result<Option<MoqSettings>> {
        let legacy = self.quantize_training.as_ref().filter(|q| q.enabled);
        let library = self
            .compression_training
            .as_ref()
            .and_then(|c| c.weight_quantization.as_ref())
            .filter(|w| w.shared_parameters.enabled);
        let settings = match (legacy, library) {
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => {
                return invalid(
                    "quantize_training.enabled",
                    "both quantize_training and compression_training.weight_quantization are \
                     enabled; MoQ takes one of them",
                );
            }
            (Some(q), None) => legacy_settings(q)?,
            (None, Some(w)) => library_settings(w)?,
        };
        Ok(Some(settings))
    }
}

fn invalid<T>(path: &str, message: &str) -> Result<T> {
    Err(DeepSpeedError::InvalidValue {
        path: path.into(),
        message: message.into(),
    })
}

fn check_bits(path: &str, start: u64, target: u64) -> Result<()> {
    if target == 0 || start < target || start > 32 {
        return invalid(
            path,
            &format!(
                "start_bits {start} and target_bits {target}: the bits fall from start to \
                 target, so 32 >= start_bits >= target_bits >= 1"
            ),
        );
    }
    Ok(())
}

fn check_groups(path: &str, groups: u64) -> Result<usize> {
    match usize::try_from(groups) {
        Ok(g) if g > 0 => Ok(g),
        _ => invalid(path, "at least one group"),
    }
}

fn legacy_settings(q: &QuantizeTrainingConfig) -> Result<MoqSettings> {
    if q.eigenvalue
        .as_ref()
        .and_then(|e| e.get("enabled"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        return Err(DeepSpeedError::Unsupported {
            key: "quantize_training.eigenvalue.enabled".into(),
            reason: "periods scaled by Hessian eigenvalues are not implemented; the plain \
                     schedule runs without it"
                .into(),
        });
    }
    let bits = q.quantize_bits;
    check_bits(
        "quantize_training.quantize_bits",
        bits.start_bits,
        bits.target_bits,
    )?;
    Ok(MoqSettings {
        groups: vec![MoqGroupSettings {
            name: "quantize_training".into(),
            modules: vec!["*".into()],
            start_bits: bits.start_bits,
            target_bits: bits.target_bits,
            period: q.quantize_schedule.quantize_period,
        }],
        schedule_offset: q.quantize_schedule.schedule_offset,
        quantize_groups: check_groups("quantize_training.quantize_groups", q.quantize_groups)?,
        quantization_type: q.quantize_type.unwrap_or(q.quantize_algo.q_type),
        rounding: q.quantize_algo.rounding,
        mixed_change_ratio: q
            .fp16_mixed_quantize
            .enabled
            .then_some(q.fp16_mixed_quantize.quantize_change_ratio),
        verbose: q.quantize_verbose,
    })
}

fn library_settings(w: &WeightQuantizationConfig) -> Result<MoqSettings> {
    let shared = &w.shared_parameters;
    let key = "compression_training.weight_quantization";
    if shared.quantize_weight_in_forward {
        return Err(DeepSpeedError::Unsupported {
            key: format!("{key}.shared_parameters.quantize_weight_in_forward"),
            reason: "weights are quantized after each optimizer step (MoQ); quantizing in \
                     the forward is not implemented"
                .into(),
        });
    }
    if w.different_groups.is_empty() {
        return invalid(
            &format!("{key}.different_groups"),
            "no group: name at least one, with its params and modules",
        );
    }
    let mut groups = Vec::new();
    for (name, g) in &w.different_groups {
        let path = format!("{key}.different_groups.{name}");
        let p = g.params;
        check_bits(&format!("{path}.params"), p.start_bits, p.target_bits)?;
        if g.modules.is_empty() {
            return invalid(&format!("{path}.modules"), "no module pattern (`*`: all)");
        }
        groups.push(MoqGroupSettings {
            name: name.clone(),
            modules: g.modules.clone(),
            start_bits: p.start_bits,
            target_bits: p.target_bits,
            period: p.quantization_period,
        });
    }
    Ok(MoqSettings {
        groups,
        schedule_offset: shared.schedule_offset,
        quantize_groups: check_groups(
            &format!("{key}.shared_parameters.quantize_groups"),
            shared.quantize_groups,
        )?,
        quantization_type: shared.quantization_type,
        rounding: shared.rounding,
        mixed_change_ratio: shared
            .fp16_mixed_quantize
            .enabled
            .then_some(shared.fp16_mixed_quantize.quantize_change_ratio),
        verbose: shared.quantize_verbose,
    })
}

#[cfg(test)]
mod tests {
    use super::super::DeepSpeedConfig;
    use super::*;

    /// The MoQ tutorial's section (with its `quantize-algo` spelling) loads as its settings.
    #[test]
    fn the_tutorial_section_loads() {
        let (config, warnings) = DeepSpeedConfig::from_json_str(
            r#"{"quantize_training": {"enabled": true, "quantize_verbose": true,
                "quantizer_kernel": true, "quantize-algo": {"q_type": "symmetric"},
                "quantize_bits": {"start_bits": 16, "target_bits": 8},
                "quantize_schedule": {"quantize_period": 400, "schedule_offset": 0},
                "quantize_groups": 8}}"#,
        )
        .expect("loads");
        assert!(warnings.is_empty(), "{warnings:?}");
        let moq = config.moq().expect("valid").expect("enabled");
        assert_eq!(moq.schedule_offset, 0);
        assert_eq!(moq.quantize_groups, 8);
        assert_eq!(moq.quantization_type, QuantizationType::Symmetric);
        let g = &moq.groups[0];
        assert_eq!((g.start_bits, g.target_bits, g.period), (16, 8, 400));
    }

    #[test]
    fn the_compression_library_form_loads_and_other_techniques_warn() {
        let (config, warnings) = DeepSpeedConfig::from_json_str(
            r#"{"compression_training": {
                "weight_quantization": {
                  "shared_parameters": {"enabled": true, "quantization_type": "asymmetric",
                                        "schedule_offset": 10, "quantize_groups": 4},
                  "different_groups": {"wq1": {"params": {"start_bits": 12,
                      "target_bits": 8, "quantization_period": 50}, "modules": ["attn"]}}},
                "sparse_pruning": {"shared_parameters": {"enabled": false}}}}"#,
        )
        .expect("loads");
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].key, "compression_training.sparse_pruning");
        let moq = config.moq().expect("valid").expect("enabled");
        assert_eq!(moq.quantization_type, QuantizationType::Asymmetric);
        assert_eq!(moq.groups[0].modules, ["attn"]);
        assert_eq!(moq.groups[0].period, 50);
        assert_eq!((moq.schedule_offset, moq.quantize_groups), (10, 4));
    }

    #[test]
    fn bad_schedules_name_their_key() {
        let load = |json: &str| DeepSpeedConfig::from_json_str(json).expect("loads").0;
        let e = load(
            r#"{"quantize_training": {"enabled": true,
            "quantize_bits": {"start_bits": 4, "target_bits": 8}}}"#,
        )
        .moq()
        .expect_err("target above start");
        assert!(
            e.to_string().contains("quantize_training.quantize_bits"),
            "{e}"
        );
        let e = load(r#"{"quantize_training": {"enabled": true, "quantize_groups": 0}}"#)
            .moq()
            .expect_err("no group");
        assert!(e.to_string().contains("quantize_groups"), "{e}");
        let e = DeepSpeedConfig::from_json_str(
            r#"{"quantize_training": {"enabled": true, "quantize_bitz": {}}}"#,
        )
        .expect_err("a typo");
        assert!(e.to_string().contains("quantize_bitz"), "{e}");
        let off = load(r#"{"quantize_training": {"enabled": false}}"#);
        assert_eq!(off.moq().expect("valid"), None);
    }
}
