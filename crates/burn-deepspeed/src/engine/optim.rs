//! Builds Burn's optimizers from the `optimizer` section.

use burn::optim::decay::WeightDecayConfig;
use burn::optim::{AdamConfig, AdamWConfig, LambConfig, ModuleOptimizer};

use crate::config::{OptimizerConfig, OptimizerKind};
use crate::{DeepSpeedError, Result};

/// Number of f32 state tensors per parameter that the optimizer keeps (m and v for the Adam
/// family and LAMB), used for model-state accounting.
pub fn state_tensors_per_param(kind: OptimizerKind) -> usize {
    match kind {
        OptimizerKind::Adam
        | OptimizerKind::AdamW
        | OptimizerKind::Lamb
        | OptimizerKind::OneBitAdam
        | OptimizerKind::OneBitLamb
        | OptimizerKind::ZeroOneAdam => 2,
    }
}

/// The hyper-parameters Adam, AdamW and LAMB share, with DeepSpeed's defaults, as every
/// ZeRO stage reads them (stage 0 for Burn's optimizers, stages 1-2 for the partitioned one).
pub(crate) struct AdamFamily {
    pub b1: f64,
    pub b2: f64,
    pub eps: f32,
    pub wd: f32,
}

impl AdamFamily {
    /// Reads them; refuses `bias_correction: false`, which Burn's optimizers cannot honour
    /// (so no stage may, or the stages would follow different trajectories).
    pub(crate) fn of(cfg: &OptimizerConfig) -> Result<Self> {
        let p = &cfg.params;
        if p.bias_correction == Some(false) {
            return Err(DeepSpeedError::Unsupported {
                key: "optimizer.params.bias_correction".into(),
                reason: "Burn's Adam, AdamW and LAMB always correct the bias; remove the key or \
                         set it to true"
                    .into(),
            });
        }
        let (b1, b2) = p.betas.unwrap_or((0.9, 0.999));
        Ok(Self {
            b1,
            b2,
            eps: p.eps.unwrap_or(1e-8) as f32,
            wd: p.weight_decay.unwrap_or(0.0) as f32,
        })
    }
}

/// Burn's optimizer for a resolved `optimizer` section.
///
/// Differences from DeepSpeed, refused or documented:
/// * Burn's Adam/AdamW/LAMB always apply bias correction: `bias_correction: false` is refused.
/// * Burn's LAMB does not clip the trust ratio: `max_coeff`/`min_coeff` have no effect, and
///   the partitioned LAMB of stages 1-2 leaves it unclipped too so that every stage follows
///   the same trajectory (the fused LAMB of `burn-deepspeed-cubecl-kernels` can clip).
/// * The 1-bit optimizers are not Burn optimizers: `DeepSpeedEngine` runs them on its flat
///   buffers ([`OneBitOptimizer`](super::OneBitOptimizer)); elsewhere they are refused.
pub fn build_optimizer(cfg: &OptimizerConfig) -> Result<ModuleOptimizer> {
    let AdamFamily { b1, b2, eps, wd } = AdamFamily::of(cfg)?;
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
        OptimizerKind::ZeroOneAdam => {
            return Err(DeepSpeedError::Unsupported {
                key: "optimizer.type".into(),
                reason: "ZeroOneAdam is not implemented yet; use OneBitAdam, Adam, AdamW or Lamb"
                    .into(),
            });
        }
        kind => {
            return Err(DeepSpeedError::Unsupported {
                key: "optimizer.type".into(),
                reason: format!(
                    "{kind:?} compresses the data-parallel exchange and runs in \
                     `DeepSpeedEngine` (ZeRO stage 0, no pipeline); use Adam, AdamW or Lamb here"
                ),
            });
        }
    })
}
