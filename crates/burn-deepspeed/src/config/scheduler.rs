//! The `scheduler` section and the learning-rate schedules it names: DeepSpeed's WarmupLR,
//! WarmupDecayLR and WarmupCosineLR.

use serde::{Deserialize, Serialize};

use crate::{DeepSpeedError, Result};

/// Shape of the warm-up ramp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    /// γ = ln(t + 1) / ln(warmup_num_steps) (DeepSpeed's default).
    #[default]
    Log,
    /// γ = t / warmup_num_steps.
    Linear,
}

/// Parameters of the schedules. Which fields apply depends on the type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerParams {
    /// WarmupLR/WarmupDecayLR: learning rate at step 0.
    pub warmup_min_lr: f64,
    /// WarmupLR/WarmupDecayLR: learning rate at the end of the warm-up.
    pub warmup_max_lr: f64,
    /// Steps of warm-up (DeepSpeed uses at least 2).
    #[serde(deserialize_with = "super::serde_util::count")]
    pub warmup_num_steps: u64,
    /// Ramp shape.
    pub warmup_type: WarmupType,
    /// WarmupDecayLR/WarmupCosineLR: the step at which the decay reaches its end.
    #[serde(
        skip_serializing_if = "Option::is_none",
        deserialize_with = "super::serde_util::opt_count"
    )]
    pub total_num_steps: Option<u64>,
    /// WarmupCosineLR: ratio of the optimizer's lr at step 0.
    pub warmup_min_ratio: f64,
    /// WarmupCosineLR: smallest ratio after the cosine decay.
    pub cos_min_ratio: f64,
    /// DeepSpeed's `last_batch_iteration` (resume point); accepted, -1 by default.
    pub last_batch_iteration: i64,
}

impl Default for SchedulerParams {
    fn default() -> Self {
        Self {
            warmup_min_lr: 0.0,
            warmup_max_lr: 1e-3,
            warmup_num_steps: 1000,
            warmup_type: WarmupType::Log,
            total_num_steps: None,
            warmup_min_ratio: 0.0,
            cos_min_ratio: 1e-4,
            last_batch_iteration: -1,
        }
    }
}

/// Which schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SchedulerKind {
    /// Warm up from `warmup_min_lr` to `warmup_max_lr`, then hold.
    WarmupLR,
    /// Warm up, then decay linearly to 0 at `total_num_steps`.
    WarmupDecayLR,
    /// Warm up the ratio of the optimizer's lr, then cosine-decay it to `cos_min_ratio`.
    WarmupCosineLR,
}

/// The `scheduler` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Which schedule.
    #[serde(rename = "type")]
    pub kind: SchedulerKind,
    /// Its parameters.
    #[serde(default)]
    pub params: SchedulerParams,
}

impl SchedulerConfig {
    /// Checks the parameters the chosen schedule needs.
    pub fn validate(&self) -> Result<()> {
        let p = &self.params;
        for (key, v) in [
            ("warmup_min_lr", p.warmup_min_lr),
            ("warmup_max_lr", p.warmup_max_lr),
            ("warmup_min_ratio", p.warmup_min_ratio),
            ("cos_min_ratio", p.cos_min_ratio),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(DeepSpeedError::InvalidValue {
                    path: format!("scheduler.params.{key}"),
                    message: format!("must be a finite number ≥ 0, found {v}"),
                });
            }
        }
        let needs_total = matches!(
            self.kind,
            SchedulerKind::WarmupDecayLR | SchedulerKind::WarmupCosineLR
        );
        match self.params.total_num_steps {
            None if needs_total => Err(DeepSpeedError::InvalidValue {
                path: "scheduler.params.total_num_steps".into(),
                message: format!("{:?} needs total_num_steps", self.kind),
            }),
            Some(t) if needs_total && t < self.params.warmup_num_steps => {
                Err(DeepSpeedError::InvalidValue {
                    path: "scheduler.params.total_num_steps".into(),
                    message: format!(
                        "total_num_steps ({t}) is smaller than warmup_num_steps ({})",
                        self.params.warmup_num_steps
                    ),
                })
            }
            _ => Ok(()),
        }
    }

    /// Learning rate of optimizer step `step` (0-based), given the optimizer's own `base_lr`
    /// (which only WarmupCosineLR uses).
    pub fn lr_at(&self, step: u64, base_lr: f64) -> f64 {
        let p = &self.params;
        let warmup = p.warmup_num_steps.max(2);
        let t = step as f64;
        let ramp = |t: f64| match p.warmup_type {
            WarmupType::Log => (t + 1.0).ln() / (warmup as f64).ln(),
            WarmupType::Linear => t / warmup as f64,
        };
        match self.kind {
            SchedulerKind::WarmupLR | SchedulerKind::WarmupDecayLR => {
                let gamma = if step < warmup {
                    ramp(t)
                } else if self.kind == SchedulerKind::WarmupLR {
                    1.0
                } else {
                    let total = p.total_num_steps.unwrap_or(warmup) as f64;
                    ((total - t) / (total - warmup as f64).max(1.0)).max(0.0)
                };
                p.warmup_min_lr + (p.warmup_max_lr - p.warmup_min_lr) * gamma
            }
            SchedulerKind::WarmupCosineLR => {
                let ratio = if step < warmup {
                    p.warmup_min_ratio + (1.0 - p.warmup_min_ratio) * ramp(t)
                } else {
                    let total = p.total_num_steps.unwrap_or(warmup) as f64;
                    let progress = (t - warmup as f64 + 1.0) / (total - warmup as f64).max(1.0);
                    let cos = (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos()) / 2.0;
                    (p.cos_min_ratio + (1.0 - p.cos_min_ratio) * cos).max(0.0)
                };
                base_lr * ratio
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: SchedulerKind, json: &str) -> SchedulerConfig {
        SchedulerConfig {
            kind,
            params: serde_json::from_str(json).unwrap(),
        }
    }

    #[test]
    fn warmup_lr_follows_the_log_ramp_then_holds() {
        let s = sched(
            SchedulerKind::WarmupLR,
            r#"{"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 100}"#,
        );
        assert_eq!(s.lr_at(0, 1.0), 0.0);
        let want = 0.01 * (50f64).ln() / (100f64).ln();
        assert!((s.lr_at(49, 1.0) - want).abs() < 1e-15);
        assert_eq!(s.lr_at(100, 1.0), 0.01);
        assert_eq!(s.lr_at(10_000, 1.0), 0.01);
    }

    #[test]
    fn warmup_decay_reaches_zero_at_total_steps() {
        let s = sched(
            SchedulerKind::WarmupDecayLR,
            r#"{"warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear",
                "total_num_steps": 110}"#,
        );
        assert!((s.lr_at(5, 1.0) - 0.05).abs() < 1e-15);
        assert!((s.lr_at(60, 1.0) - 0.05).abs() < 1e-15);
        assert_eq!(s.lr_at(110, 1.0), 0.0);
        assert_eq!(s.lr_at(500, 1.0), 0.0);
    }

    #[test]
    fn warmup_cosine_scales_the_base_lr() {
        let s = sched(
            SchedulerKind::WarmupCosineLR,
            r#"{"warmup_num_steps": 10, "warmup_type": "linear", "total_num_steps": 20,
                "cos_min_ratio": 0.0}"#,
        );
        assert_eq!(s.lr_at(0, 2.0), 0.0);
        assert!((s.lr_at(14, 2.0) - 1.0).abs() < 1e-12); // half-way down the cosine
        assert!(s.lr_at(19, 2.0).abs() < 1e-12);
    }

    #[test]
    fn decay_without_total_steps_is_refused() {
        let s = sched(SchedulerKind::WarmupDecayLR, "{}");
        assert!(
            s.validate()
                .unwrap_err()
                .to_string()
                .contains("total_num_steps")
        );
    }
}
