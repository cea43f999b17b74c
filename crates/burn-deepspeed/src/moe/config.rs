//! [`MoeConfig`]: DeepSpeed's MoE layer arguments (`deepspeed.moe.layer.MoE`), and the noisy
//! gating policies.

use super::expert::{Expert, Residual};
use std::sync::{Arc, Mutex};

use burn::config::Config;
use burn::nn::LinearConfig;
use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use super::group::ExpertParallel;
use super::layer::MoE;
use crate::DeepSpeedError;
use crate::tensor_parallel::TensorParallel;

/// DeepSpeed's `noisy_gate_policy`: noise in the gate while training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NoisyGatePolicy {
    /// The gate's input multiplied by uniform noise in [1 − 10⁻², 1 + 10⁻²]
    /// (`multiplicative_jitter`).
    Jitter,
    /// Top-1's expert chosen by the logits plus Gumbel noise.
    RSample,
}

/// The settings of an [`MoE`] layer, DeepSpeed's `MoE(...)` arguments and defaults.
#[derive(Config, Debug, PartialEq)]
pub struct MoeConfig {
    /// Model width.
    pub d_model: usize,
    /// Experts in the layer (over every rank of the expert-parallel group).
    pub num_experts: usize,
    /// Experts per token: 1 or 2.
    #[config(default = 1)]
    pub k: usize,
    /// Slots per expert while training, as a multiple of an even share of the tokens.
    #[config(default = 1.0)]
    pub capacity_factor: f64,
    /// The same at evaluation (the input has no autodiff).
    #[config(default = 1.0)]
    pub eval_capacity_factor: f64,
    /// The fewest slots per expert.
    #[config(default = 4)]
    pub min_capacity: usize,
    /// PR-MoE's residual: a dense MLP beside the experts, mixed by a learned coefficient.
    #[config(default = false)]
    pub use_residual: bool,
    /// Noise in the gate while training (`None`: none).
    #[config(default = "None")]
    pub noisy_gate_policy: Option<NoisyGatePolicy>,
    /// Drop the tokens past an expert's capacity (false: the capacity grows to the busiest
    /// expert's count, the maximum over the expert-parallel group).
    #[config(default = true)]
    pub drop_tokens: bool,
    /// Random token selection: an expert over capacity keeps random tokens rather than the
    /// earliest.
    #[config(default = true)]
    pub use_rts: bool,
    /// Top-2's second expert chosen with Gumbel noise.
    #[config(default = true)]
    pub top2_2nd_expert_sampling: bool,
    /// Seed of the layer's draws (RTS, noise); give each data-parallel rank its own.
    #[config(default = 0)]
    pub seed: u64,
}

impl MoeConfig {
    /// The whole layer (every expert, `ep_size` 1) with `experts` (`num_experts` of them) and,
    /// with `use_residual`, `residual` as the dense MLP. The gate is `Linear(d, experts)`
    /// without bias, Burn's default initialisation. Cut it over a group with
    /// [`MoE::expert_parallel`].
    pub fn init<E: Expert>(
        &self,
        experts: Vec<E>,
        residual: Option<E>,
        device: &Device,
    ) -> crate::Result<MoE<E>> {
        let invalid = |key: &str, reason: String| DeepSpeedError::Unsupported {
            key: format!("moe.{key}"),
            reason,
        };
        if experts.len() != self.num_experts || self.num_experts == 0 {
            return Err(invalid(
                "num_experts",
                format!(
                    "num_experts is {} but {} experts were given",
                    self.num_experts,
                    experts.len()
                ),
            ));
        }
        if !(1..=2).contains(&self.k) {
            return Err(invalid("k", format!("k is {}: only 1 and 2", self.k)));
        }
        // The capacity is the factor times an even share of the tokens, rounded up: a factor
        // that is not a finite number > 0 gives no slot or an endless count.
        for (key, factor) in [
            ("capacity_factor", self.capacity_factor),
            ("eval_capacity_factor", self.eval_capacity_factor),
        ] {
            if !(factor.is_finite() && factor > 0.0 && factor <= 1e6) {
                return Err(invalid(
                    key,
                    format!("{key} is {factor}: it must be a number > 0 and at most 1e6"),
                ));
            }
        }
        let residual = match (self.use_residual, residual) {
            (true, Some(mlp)) => Some(Residual {
                mlp,
                coefficient: LinearConfig::new(self.d_model, 2).init(device),
            }),
            (false, None) => None,
            (on, _) => {
                return Err(invalid(
                    "use_residual",
                    format!("use_residual is {on}: give the residual MLP exactly when it is on"),
                ));
            }
        };
        Ok(MoE {
            gate: LinearConfig::new(self.d_model, self.num_experts)
                .with_bias(false)
                .init(device),
            experts,
            residual,
            settings: self.clone(),
            ep: ExpertParallel::none(),
            slices: TensorParallel::none(),
            rng: Arc::new(Mutex::new(self.seed)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::ExpertMlp;

    /// A capacity factor that is not a number > 0 (or is absurdly large) is refused by key
    /// when the layer is built.
    #[test]
    fn capacity_factors_are_checked() {
        let device = Device::flex();
        let build = |config: MoeConfig| {
            let experts = (0..2).map(|_| ExpertMlp::new(4, 8, &device)).collect();
            config
                .init(experts, None, &device)
                .err()
                .map(|e| e.to_string())
        };
        for (factor, key) in [(f64::INFINITY, "capacity_factor"), (0.0, "capacity_factor")] {
            let e = build(MoeConfig::new(4, 2).with_capacity_factor(factor)).expect("refused");
            assert!(e.contains(&format!("moe.{key}")), "{e}");
        }
        for factor in [f64::NAN, -1.0, 1e300] {
            let e = build(MoeConfig::new(4, 2).with_eval_capacity_factor(factor)).expect("refused");
            assert!(e.contains("moe.eval_capacity_factor"), "{e}");
        }
        assert_eq!(build(MoeConfig::new(4, 2).with_capacity_factor(1.25)), None);
    }
}
