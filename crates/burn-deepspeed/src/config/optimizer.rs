//! The `optimizer` section: `{"type": ..., "params": {...}}`.

use serde::{Deserialize, Deserializer, Serialize};

use crate::{DeepSpeedError, Result};

/// Optimizer families a config can name (case-insensitive, as in DeepSpeed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum OptimizerKind {
    /// DeepSpeed's `Adam`: AdamW unless `adam_w_mode` is false, then Adam with L2 decay.
    Adam,
    /// Adam with decoupled weight decay.
    AdamW,
    /// LAMB: layer-wise trust ratios (You et al., arXiv 1904.00962).
    Lamb,
    /// 1-bit Adam (arXiv 2102.02888); data parallel at ZeRO stage 0.
    OneBitAdam,
    /// 1-bit LAMB (arXiv 2104.06069); data parallel at ZeRO stage 0.
    OneBitLamb,
    /// 0/1 Adam (arXiv 2202.06009); data parallel at ZeRO stage 0.
    ZeroOneAdam,
}

impl OptimizerKind {
    const NAMES: [(&'static str, OptimizerKind); 6] = [
        ("adam", OptimizerKind::Adam),
        ("adamw", OptimizerKind::AdamW),
        ("lamb", OptimizerKind::Lamb),
        ("onebitadam", OptimizerKind::OneBitAdam),
        ("onebitlamb", OptimizerKind::OneBitLamb),
        ("zerooneadam", OptimizerKind::ZeroOneAdam),
    ];

    /// True for the communication-compressed optimizers.
    pub fn is_one_bit(self) -> bool {
        matches!(
            self,
            OptimizerKind::OneBitAdam | OptimizerKind::OneBitLamb | OptimizerKind::ZeroOneAdam
        )
    }
}

impl<'de> Deserialize<'de> for OptimizerKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let lower = s.to_ascii_lowercase();
        OptimizerKind::NAMES
            .iter()
            .find(|(n, _)| *n == lower)
            .map(|(_, k)| *k)
            .ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "unknown optimizer type \"{s}\"; expected one of Adam, AdamW, Lamb, \
                     OneBitAdam, OneBitLamb, ZeroOneAdam"
                ))
            })
    }
}

/// The `optimizer.params` object. Fields that only some optimizers take are `Option`s; after
/// [`OptimizerConfig::resolve`] every field the chosen optimizer uses holds its value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerParams {
    /// Learning rate (DeepSpeed default 1e-3).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// (β1, β2): decay rates of the first and second moments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub betas: Option<(f64, f64)>,
    /// Term added to the denominator for stability.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    /// Weight decay (decoupled for AdamW and `Adam` in `adam_w_mode`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// Divide the moments by 1 − β^t (Adam family and LAMB, default true). The 1-bit
    /// optimizers never correct the bias, as in DeepSpeed: the key is accepted and ignored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bias_correction: Option<bool>,
    /// `Adam` only: decoupled weight decay (true, DeepSpeed's default) or L2 (false).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adam_w_mode: Option<bool>,
    /// DeepSpeed: use torch's Adam instead of the fused one. Accepted, no effect here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub torch_adam: Option<bool>,
    /// LAMB family: largest trust ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_coeff: Option<f64>,
    /// LAMB family: smallest trust ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_coeff: Option<f64>,
    /// 1-bit Adam and LAMB: step at which compression starts.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "super::serde_util::opt_count"
    )]
    pub freeze_step: Option<u64>,
    /// 0/1 Adam: steps after which the variance is frozen (DeepSpeed default 100000).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "super::serde_util::opt_count"
    )]
    pub var_freeze_step: Option<u64>,
    /// 0/1 Adam: variance updates after which their interval doubles (default 16).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "super::serde_util::opt_count"
    )]
    pub var_update_scaler: Option<u64>,
    /// 0/1 Adam: frozen steps after which the local-step interval doubles (default 32678,
    /// DeepSpeed's value).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "super::serde_util::opt_count"
    )]
    pub local_step_scaler: Option<u64>,
    /// 0/1 Adam: the largest local-step interval (default 16, at least 1).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "super::serde_util::opt_count"
    )]
    pub local_step_clipper: Option<u64>,
    /// 1-bit family (DeepSpeed: CUDA-aware MPI). Accepted, no effect here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_aware: Option<bool>,
    /// 1-bit family (DeepSpeed: "nccl" or "mpi"). Accepted; our communicator decides.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_backend_name: Option<String>,
    /// 1-bit LAMB: momentum of the frozen trust ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coeff_beta: Option<f64>,
    /// 1-bit LAMB: largest variance-correction factor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor_max: Option<f64>,
    /// 1-bit LAMB: smallest variance-correction factor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor_min: Option<f64>,
    /// 1-bit LAMB: largest change of the factor per step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor_threshold: Option<f64>,
}

/// The `optimizer` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Which optimizer.
    #[serde(rename = "type")]
    pub kind: OptimizerKind,
    /// Its parameters.
    #[serde(default)]
    pub params: OptimizerParams,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::AdamW,
            params: OptimizerParams::default(),
        }
    }
}

impl OptimizerConfig {
    /// Fills DeepSpeed's defaults for the chosen optimizer and refuses parameters it does not
    /// take (DeepSpeed passes them to the optimizer's constructor, which would reject them).
    pub fn resolve(&mut self) -> Result<()> {
        use OptimizerKind::*;
        let p = &mut self.params;
        let kind = self.kind;
        let adam_family = matches!(kind, Adam | AdamW | OneBitAdam | ZeroOneAdam);
        let lamb_family = matches!(kind, Lamb | OneBitLamb);
        let refuse = |name: &str, given: bool, allowed: bool| -> Result<()> {
            if given && !allowed {
                return Err(DeepSpeedError::InvalidValue {
                    path: format!("optimizer.params.{name}"),
                    message: format!("optimizer type {kind:?} does not take `{name}`"),
                });
            }
            Ok(())
        };
        refuse("adam_w_mode", p.adam_w_mode.is_some(), kind == Adam)?;
        refuse("max_coeff", p.max_coeff.is_some(), lamb_family)?;
        refuse("min_coeff", p.min_coeff.is_some(), lamb_family)?;
        let one_bit_warm_up = matches!(kind, OneBitAdam | OneBitLamb);
        refuse("freeze_step", p.freeze_step.is_some(), one_bit_warm_up)?;
        let zero_one = kind == ZeroOneAdam;
        refuse("var_freeze_step", p.var_freeze_step.is_some(), zero_one)?;
        refuse("var_update_scaler", p.var_update_scaler.is_some(), zero_one)?;
        refuse("local_step_scaler", p.local_step_scaler.is_some(), zero_one)?;
        refuse(
            "local_step_clipper",
            p.local_step_clipper.is_some(),
            zero_one,
        )?;
        refuse("cuda_aware", p.cuda_aware.is_some(), kind.is_one_bit())?;
        let onebit_lamb = kind == OneBitLamb;
        refuse("coeff_beta", p.coeff_beta.is_some(), onebit_lamb)?;
        refuse("factor_max", p.factor_max.is_some(), onebit_lamb)?;
        refuse("factor_min", p.factor_min.is_some(), onebit_lamb)?;
        refuse(
            "factor_threshold",
            p.factor_threshold.is_some(),
            onebit_lamb,
        )?;

        p.lr.get_or_insert(1e-3);
        p.betas.get_or_insert((0.9, 0.999));
        p.eps.get_or_insert(1e-8);
        p.weight_decay.get_or_insert(0.0);
        if (adam_family || lamb_family) && !kind.is_one_bit() {
            p.bias_correction.get_or_insert(true);
        }
        if kind == Adam {
            p.adam_w_mode.get_or_insert(true);
        }
        if lamb_family {
            p.max_coeff.get_or_insert(10.0);
            p.min_coeff.get_or_insert(0.01);
        }
        if one_bit_warm_up {
            p.freeze_step.get_or_insert(100_000);
        }
        if zero_one {
            p.var_freeze_step.get_or_insert(100_000);
            p.var_update_scaler.get_or_insert(16);
            p.local_step_scaler.get_or_insert(32_678);
            if p.local_step_clipper.get_or_insert(16) == &0 {
                return Err(DeepSpeedError::InvalidValue {
                    path: "optimizer.params.local_step_clipper".into(),
                    message: "the largest local-step interval must be at least 1, found 0".into(),
                });
            }
        }
        if kind.is_one_bit() {
            p.cuda_aware.get_or_insert(false);
            p.comm_backend_name.get_or_insert_with(|| "nccl".into());
        }
        if onebit_lamb {
            p.coeff_beta.get_or_insert(0.9);
            p.factor_max.get_or_insert(4.0);
            p.factor_min.get_or_insert(0.5);
            p.factor_threshold.get_or_insert(0.1);
        }
        let lr = p.lr.unwrap_or_default();
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(DeepSpeedError::InvalidValue {
                path: "optimizer.params.lr".into(),
                message: format!("must be a finite non-negative number, found {lr}"),
            });
        }
        // eps > 0 (a zero eps divides by zero where v is 0); the rest finite and >= 0.
        let checks: [(&str, Option<f64>, bool); 8] = [
            ("eps", p.eps, true),
            ("weight_decay", p.weight_decay, false),
            ("max_coeff", p.max_coeff, false),
            ("min_coeff", p.min_coeff, false),
            ("coeff_beta", p.coeff_beta, false),
            ("factor_max", p.factor_max, false),
            ("factor_min", p.factor_min, false),
            ("factor_threshold", p.factor_threshold, false),
        ];
        for (key, value, strictly_positive) in checks {
            let Some(v) = value else { continue };
            let ok = v.is_finite() && if strictly_positive { v > 0.0 } else { v >= 0.0 };
            if !ok {
                let want = if strictly_positive { "> 0" } else { "≥ 0" };
                return Err(DeepSpeedError::InvalidValue {
                    path: format!("optimizer.params.{key}"),
                    message: format!("must be a finite number {want}, found {v}"),
                });
            }
        }
        let (b1, b2) = p.betas.unwrap_or_default();
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            return Err(DeepSpeedError::InvalidValue {
                path: "optimizer.params.betas".into(),
                message: format!("each beta must be in [0, 1), found ({b1}, {b2})"),
            });
        }
        Ok(())
    }

    /// True when weight decay is decoupled from the gradient (AdamW semantics).
    pub fn decoupled_weight_decay(&self) -> bool {
        match self.kind {
            OptimizerKind::Adam => self.params.adam_w_mode.unwrap_or(true),
            _ => true,
        }
    }
}
