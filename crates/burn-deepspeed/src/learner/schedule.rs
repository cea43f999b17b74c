//! The config's learning-rate schedule as a Burn `LrScheduler`, so that a `Learner` steps the
//! same rates as [`DeepSpeedEngine`](crate::DeepSpeedEngine): step `n` (0-based) uses
//! [`DeepSpeedConfig::lr_at`]`(n)`.

use burn::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::optim::{RecordState, StateSink, StateSource};
use burn::tensor::Device;

use crate::DeepSpeedConfig;

/// The schedule of a config's `scheduler` section (constant at the optimizer's `lr` without one).
#[derive(Debug, Clone)]
pub struct ConfigSchedule {
    config: DeepSpeedConfig,
    steps: u64,
}

impl ConfigSchedule {
    /// The schedule of `config`, before its first step.
    pub fn new(config: DeepSpeedConfig) -> Self {
        Self { config, steps: 0 }
    }
}

/// The schedule's position, as a checkpoint record holds it.
struct Position {
    steps: u64,
}

impl RecordState for Position {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "steps", self.steps.into());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, _device: &Device) -> Option<Self> {
        let steps = u64::try_from(src.take_scalar(prefix, "steps")?).ok()?;
        Some(Self { steps })
    }
}

impl LrScheduler for ConfigSchedule {
    fn step(&mut self) -> f64 {
        let lr = self.config.lr_at(self.steps);
        self.steps += 1;
        lr
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::from_state(&Position { steps: self.steps })
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        if let Some(p) = record.into_state::<Position>() {
            self.steps = p.steps;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_the_engines_rates_and_resumes_from_its_record() {
        let (config, _) = DeepSpeedConfig::from_json_str(
            r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0,
                  "warmup_max_lr": 0.01, "warmup_num_steps": 4, "total_num_steps": 10}}}"#,
        )
        .expect("valid");
        let mut schedule = ConfigSchedule::new(config.clone());
        let rates: Vec<f64> = (0..6).map(|_| schedule.step()).collect();
        let want: Vec<f64> = (0..6).map(|n| config.lr_at(n)).collect();
        assert_eq!(rates, want);
        assert!(rates[0] < rates[3] && rates[5] < rates[3], "{rates:?}");
        let mut resumed = ConfigSchedule::new(config.clone());
        resumed.load_record(schedule.to_record());
        assert_eq!(resumed.step(), config.lr_at(6));
    }
}
