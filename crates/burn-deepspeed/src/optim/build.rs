//! Builds Burn's optimizers from the `optimizer` section.

use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamConfig, AdamWConfig, LambConfig, ModuleOptimizer};
use burn_deepspeed_cubecl_kernels::adam::AdamParams;
use burn_deepspeed_cubecl_kernels::lamb::LambParams;
use burn_deepspeed_strategies::zero::PartitionedKind;

use crate::config::{OptimizerConfig, OptimizerKind};
use crate::{DeepSpeedError, Result};

/// The hyper-parameters Adam, AdamW and LAMB share, with DeepSpeed's defaults, as every
/// ZeRO stage reads them (stage 0 for Burn's optimizers, stages 1-3 for the partitioned one).
pub(crate) struct AdamFamily {
    pub b1: f64,
    pub b2: f64,
    pub eps: f32,
    pub wd: f32,
}

impl AdamFamily {
    /// Reads them (`bias_correction: false`, which Burn's optimizers cannot honour, is
    /// refused by [`check_supported`](crate::config::check_supported)).
    pub(crate) fn of(cfg: &OptimizerConfig) -> Self {
        let p = &cfg.params;
        let (b1, b2) = p.betas.unwrap_or((0.9, 0.999));
        Self {
            b1,
            b2,
            eps: p.eps.unwrap_or(1e-8) as f32,
            wd: p.weight_decay.unwrap_or(0.0) as f32,
        }
    }
}

/// Burn's optimizer for a resolved `optimizer` section.
///
/// Differences from DeepSpeed, refused or documented:
/// * Burn's Adam/AdamW/LAMB always apply bias correction: `bias_correction: false` is refused.
/// * Burn's LAMB does not clip the trust ratio: `max_coeff`/`min_coeff` have no effect, and
///   the partitioned LAMB of stages 1-3 leaves it unclipped too so that every stage follows
///   the same trajectory (the fused LAMB of `burn-deepspeed-cubecl-kernels` can clip).
/// * The 1-bit optimizers are not Burn optimizers: `DeepSpeedEngine` runs them on its flat
///   buffers ([`OneBitOptimizer`](burn_deepspeed_strategies::onebit::OneBitOptimizer)); elsewhere they are refused.
pub fn build_optimizer(cfg: &OptimizerConfig) -> Result<ModuleOptimizer> {
    let AdamFamily { b1, b2, eps, wd } = AdamFamily::of(cfg);
    Ok(match cfg.kind {
        OptimizerKind::Adam if !cfg.decoupled_weight_decay() => {
            let decay = (wd != 0.0).then(|| WeightDecayConfig::new(wd));
            AdamConfig::new()
                .with_beta_1(b1 as f32)
                .with_beta_2(b2 as f32)
                .with_epsilon(eps)
                .with_weight_decay(decay)
                .init()
        }
        OptimizerKind::Adam | OptimizerKind::AdamW => AdamWConfig::new()
            .with_beta_1(b1 as f32)
            .with_beta_2(b2 as f32)
            .with_epsilon(eps)
            .with_weight_decay(wd)
            .init(),
        OptimizerKind::Lamb => LambConfig::new()
            .with_beta_1(b1 as f32)
            .with_beta_2(b2 as f32)
            .with_epsilon(eps)
            .with_weight_decay(wd)
            .init(),
        kind => return Err(not_stepped_here(kind)),
    })
}

/// The optimizer of a ZeRO stage 1-3 slice for a resolved `optimizer` section, with the same
/// math as the Burn optimizer stage 0 runs (see [`build_optimizer`]).
pub fn partitioned_kind(cfg: &OptimizerConfig) -> Result<PartitionedKind> {
    let AdamFamily { b1, b2, eps, wd } = AdamFamily::of(cfg);
    Ok(match cfg.kind {
        OptimizerKind::Adam | OptimizerKind::AdamW => PartitionedKind::Adam(AdamParams {
            lr: 0.0,
            beta1: b1 as f32,
            beta2: b2 as f32,
            eps,
            weight_decay: wd,
            decoupled: cfg.decoupled_weight_decay(),
            bias_correction: true,
        }),
        OptimizerKind::Lamb => PartitionedKind::Lamb(LambParams {
            lr: 0.0,
            beta1: b1 as f32,
            beta2: b2 as f32,
            eps,
            weight_decay: wd,
            bias_correction: true,
            trust_clip: None,
        }),
        kind => return Err(not_stepped_here(kind)),
    })
}

/// The optimizers these builders do not make (1-bit ones run in
/// [`CompressedSync`](crate::sync::CompressedSync); the rest are refused by
/// [`check_supported`](crate::config::check_supported) first).
fn not_stepped_here(kind: OptimizerKind) -> DeepSpeedError {
    DeepSpeedError::Unsupported {
        key: "optimizer.type".into(),
        reason: format!("{kind:?} is not stepped by Burn's or the partitioned optimizer"),
    }
}
