//! What a config that loads is told: DeepSpeed keys this version does not implement (removed
//! before parsing, each with a warning) and settings that load but are not acted on.

use std::fmt;

use serde_json::{Map, Value};

use super::DeepSpeedConfig;

/// A note about a config that loaded: a DeepSpeed key that is ignored, or a setting that has
/// no effect (yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigWarning {
    /// Dotted path of the key.
    pub key: String,
    /// What happens to it.
    pub message: String,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {}", self.key, self.message)
    }
}

/// Top-level DeepSpeed keys that this version does not implement: they load, are ignored, and
/// produce a [`ConfigWarning`].
pub(super) const UNIMPLEMENTED_KEYS: &[&str] = &[
    "amp",
    "autotuning",
    "checkpoint",
    "communication_data_type",
    "compile",
    "curriculum_learning",
    "data_efficiency",
    "data_types",
    "disable_allgather",
    "dump_state",
    "eigenvalue",
    "elasticity",
    "gradient_accumulation_dtype",
    "graph_harvesting",
    "hybrid_engine",
    "memory_breakdown",
    "nebula",
    "seq_parallel_communication_data_type",
    "sparse_attention",
    "sparse_gradients",
    "timers",
    "torch_autocast",
    "use_data_before_expert_parallel_",
    "wandb",
    "weight_quantization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
];

/// Removes the [`UNIMPLEMENTED_KEYS`] from a config's top-level object, with a warning for each.
pub(super) fn remove_unimplemented(obj: &mut Map<String, Value>) -> Vec<ConfigWarning> {
    UNIMPLEMENTED_KEYS
        .iter()
        .filter(|key| obj.remove(**key).is_some())
        .map(|key| ConfigWarning {
            key: (*key).into(),
            message: "DeepSpeed key not implemented by burn-deepspeed yet; ignored".into(),
        })
        .collect()
}

impl DeepSpeedConfig {
    /// Warnings for settings that load but that this version does not act on (yet).
    pub(super) fn feature_warnings(&self) -> Vec<ConfigWarning> {
        let mut w = Vec::new();
        let mut add = |key: &str, message: &str| {
            w.push(ConfigWarning {
                key: key.into(),
                message: message.into(),
            })
        };
        if let Some(o) = &self.optimizer {
            if o.kind.is_one_bit() && o.params.bias_correction == Some(true) {
                add(
                    "optimizer.params.bias_correction",
                    "the 1-bit optimizers apply no bias correction (as in DeepSpeed, which \
                     accepts the flag and ignores it); ignored",
                );
            }
            for (k, v) in [
                ("torch_adam", o.params.torch_adam.is_some()),
                ("cuda_aware", o.params.cuda_aware.is_some()),
                ("comm_backend_name", o.params.comm_backend_name.is_some()),
            ] {
                if v {
                    add(
                        &format!("optimizer.params.{k}"),
                        "accepted for compatibility; has no effect here",
                    );
                }
            }
        }
        if let Some(c) = &self.compression_training {
            for key in c.other.keys() {
                add(
                    &format!("compression_training.{key}"),
                    "not implemented (only weight_quantization is); ignored",
                );
            }
        }
        w
    }
}
