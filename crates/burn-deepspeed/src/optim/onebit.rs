//! The communication-compressed optimizers (`OneBitAdam`, `OneBitLamb`, `ZeroOneAdam`) as the
//! engine runs them: on the flat parameter and gradient buffers of a [`ParamLayout`].

use burn_deepspeed_strategies::onebit::{
    OneBitAdam, OneBitAdamConfig, OneBitLamb, OneBitLambConfig, OneBitOptimizer, ZeroOneAdam,
    ZeroOneAdamConfig,
};
use burn_deepspeed_strategies::place::Place;

use crate::config::{OptimizerConfig, OptimizerKind};
use crate::flat::ParamLayout;
use crate::{DeepSpeedError, Result};

/// The 1-bit optimizer a resolved `optimizer` section names, over the flat buffers of
/// `layout` in `place` (host memory or the model's device), or `None` for the other
/// optimizers.
///
/// During warm-up the engine averages the gradients with its usual all-reduce (and clips
/// them) before [`OneBitOptimizer::apply`]; once
/// [`compressing`](burn_deepspeed_strategies::onebit::OneBitPhase::compressing), it skips
/// that all-reduce (DeepSpeed's `enable_backward_allreduce = False`) and hands over this
/// rank's own gradient, and the optimizer exchanges momenta through the 1-bit all-reduce.
/// 1-bit LAMB's trust ratios are per parameter tensor of the layout. 0/1 Adam asks for the
/// all-reduce only on its variance steps.
pub fn build_one_bit<P: Place + 'static>(
    cfg: &OptimizerConfig,
    layout: &ParamLayout,
    place: &P,
) -> Result<Option<Box<dyn OneBitOptimizer<P>>>> {
    let Some(config) = one_bit_config(cfg)? else {
        return Ok(None);
    };
    Ok(Some(match config {
        OneBitConfig::Adam(config) => Box::new(OneBitAdam::new(place, layout.numel, config)),
        OneBitConfig::Lamb(config) => {
            Box::new(OneBitLamb::new(place, &tensor_lengths(layout), config))
        }
        OneBitConfig::ZeroOne(config) => Box::new(ZeroOneAdam::new(place, layout.numel, config)?),
    }))
}

fn tensor_lengths(layout: &ParamLayout) -> Vec<usize> {
    layout.slots.iter().map(|s| s.numel).collect()
}

/// A 1-bit optimizer's hyper-parameters.
enum OneBitConfig {
    Adam(OneBitAdamConfig),
    Lamb(OneBitLambConfig),
    ZeroOne(ZeroOneAdamConfig),
}

/// The hyper-parameters of the 1-bit optimizer a resolved `optimizer` section names.
fn one_bit_config(cfg: &OptimizerConfig) -> Result<Option<OneBitConfig>> {
    if !cfg.kind.is_one_bit() {
        return Ok(None);
    }
    let p = &cfg.params;
    let missing = |key: &str| DeepSpeedError::InvalidValue {
        path: format!("optimizer.params.{key}"),
        message: "missing after resolve".into(),
    };
    let get = |v: Option<f64>, key: &str| v.ok_or_else(|| missing(key));
    let betas = p.betas.ok_or_else(|| missing("betas"))?;
    let eps = get(p.eps, "eps")?;
    let weight_decay = get(p.weight_decay, "weight_decay")?;
    let count = |v: Option<u64>, key: &str| v.ok_or_else(|| missing(key));
    if cfg.kind == OptimizerKind::ZeroOneAdam {
        return Ok(Some(OneBitConfig::ZeroOne(ZeroOneAdamConfig {
            betas,
            eps,
            weight_decay,
            var_freeze_step: count(p.var_freeze_step, "var_freeze_step")?,
            var_update_scaler: count(p.var_update_scaler, "var_update_scaler")?,
            local_step_scaler: count(p.local_step_scaler, "local_step_scaler")?,
            local_step_clipper: count(p.local_step_clipper, "local_step_clipper")?,
        })));
    }
    let freeze_step = count(p.freeze_step, "freeze_step")?;
    if cfg.kind == OptimizerKind::OneBitAdam {
        return Ok(Some(OneBitConfig::Adam(OneBitAdamConfig {
            betas,
            eps,
            weight_decay,
            freeze_step,
        })));
    }
    Ok(Some(OneBitConfig::Lamb(OneBitLambConfig {
        betas,
        eps,
        weight_decay,
        freeze_step,
        max_coeff: get(p.max_coeff, "max_coeff")?,
        min_coeff: get(p.min_coeff, "min_coeff")?,
        coeff_beta: get(p.coeff_beta, "coeff_beta")?,
        factor_max: get(p.factor_max, "factor_max")?,
        factor_min: get(p.factor_min, "factor_min")?,
        factor_threshold: get(p.factor_threshold, "factor_threshold")?,
    })))
}
