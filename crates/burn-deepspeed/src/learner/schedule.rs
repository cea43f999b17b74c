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

/// The scalar that marks a record as a [`ConfigSchedule`]'s.
const MARK: &str = "burn_deepspeed_config_schedule";

impl RecordState for Position {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, "steps", self.steps.into());
        out.push_scalar(prefix, MARK, 1u64.into());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, _device: &Device) -> Option<Self> {
        let steps = u64::try_from(src.take_scalar(prefix, "steps")?).ok()?;
        Some(Self { steps })
    }
}

/// The mark alone, to recognise a record.
struct Mark;

impl RecordState for Mark {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        out.push_scalar(prefix, MARK, 1u64.into());
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, _device: &Device) -> Option<Self> {
        src.take_scalar(prefix, MARK).map(|_| Self)
    }
}

/// Whether a `Learner`'s schedule record (a `ModuleLrScheduler`'s, one group) is a
/// [`ConfigSchedule`]'s: then [`DeepSpeedStrategy::learner`](super::DeepSpeedStrategy::learner)
/// built the `Learner` from the config. The mark survives a checkpoint, so a resumed `Learner`
/// is recognised too.
pub(super) fn is_config_schedule(record: LrSchedulerRecord) -> bool {
    record.record("0").into_state::<Mark>().is_some()
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
        // A Learner's schedule of one group is recognised as the config's, and no other.
        let record = |s: &dyn LrScheduler| LrSchedulerRecord::new().with_record("0", s.to_record());
        assert!(is_config_schedule(record(&resumed)));
        let constant = burn::lr_scheduler::constant::ConstantLr::new(0.1);
        assert!(!is_config_schedule(record(&constant)));
    }
}
