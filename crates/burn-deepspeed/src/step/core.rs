//! [`StepCore`]: the part of an optimizer step every driver shares — the loss scale, the
//! learning-rate index, the decision to skip a step whose gradient overflowed, the step
//! counters, `wall_clock_breakdown` and the monitor. The data-parallel engine, the pipeline
//! engine and the Learner strategy each hold one and call it at the same points of their
//! step, so that the three agree on what a skipped step changes (DeepSpeed: the loss scale
//! and `skipped_steps`, not the schedule).

use std::path::PathBuf;
use std::time::Duration;

use burn_deepspeed_strategies::comm::Communicator;

use super::BreakdownWindow;
use crate::Result;
use crate::config::DeepSpeedConfig;
use crate::monitor::{Monitor, MonitorRecord};
use crate::precision::{DynamicLossScaler, LossScalerState};

/// Where a run stands: what a checkpoint stores of the step protocol and restores.
#[derive(Debug, Clone, Default)]
pub(crate) struct StepPosition {
    /// Optimizer steps taken, skipped ones included (DeepSpeed's `global_steps`).
    pub global_step: u64,
    /// Steps skipped because the gradient norm was not finite (DeepSpeed's `skipped_steps`).
    pub skipped_steps: u64,
    /// fp16: the dynamic loss scaler's position.
    pub loss_scaler: Option<LossScalerState>,
}

/// The step protocol's state, one per rank (see the module's documentation).
pub(crate) struct StepCore {
    /// fp16: the loss scaler (`None` in fp32 and bf16).
    scaler: Option<DynamicLossScaler>,
    global_step: u64,
    skipped_steps: u64,
    /// Steps skipped in a row, up to the last decision.
    skipped_in_a_row: u64,
    /// `max_consecutive_skipped_steps` (0: never stop).
    max_skipped_in_a_row: u64,
    /// `wall_clock_breakdown`: the phases' sums since the last print (`None` when off).
    breakdown: Option<BreakdownWindow>,
    /// `steps_per_print` (at least 1).
    every: u64,
    /// `tensorboard` / `csv_monitor` (global rank 0).
    monitor: Option<Monitor>,
    /// A monitor write that failed, refused at the next step on every rank.
    monitor_failure: Option<String>,
    /// Tokens per sample, for the monitor's tokens/s.
    tokens_per_sample: Option<u64>,
    /// Samples per optimizer step over every rank, for the monitor's throughput.
    train_batch_size: u64,
}

impl StepCore {
    /// The protocol for `config` (resolved: its batch sizes are known), without a monitor.
    pub fn new(config: &DeepSpeedConfig) -> Result<Self> {
        let scaler = match config.fp16.enabled {
            true => Some(DynamicLossScaler::new(&config.fp16)?),
            false => None,
        };
        Ok(Self {
            scaler,
            global_step: 0,
            skipped_steps: 0,
            skipped_in_a_row: 0,
            max_skipped_in_a_row: config.max_consecutive_skipped_steps,
            breakdown: config.wall_clock_breakdown.then(BreakdownWindow::default),
            every: config.steps_per_print.max(1),
            monitor: None,
            monitor_failure: None,
            tokens_per_sample: None,
            train_batch_size: config.train_batch_size.unwrap_or(0),
        })
    }

    /// [`new`](Self::new) with the config's monitor on global rank 0 of `world` (every rank
    /// learns whether rank 0 could open its files).
    pub fn with_monitor(config: &DeepSpeedConfig, world: &dyn Communicator) -> Result<Self> {
        let mut core = Self::new(config)?;
        core.monitor = Monitor::agreed(config, world)?;
        Ok(core)
    }

    /// fp16: the scale this step's loss is multiplied by; `None` otherwise.
    pub fn loss_scale(&self) -> Option<f32> {
        self.scaler.as_ref().map(DynamicLossScaler::scale)
    }

    /// The learning rate of the next step: a skipped step does not advance the schedule.
    pub fn lr(&self, config: &DeepSpeedConfig) -> f64 {
        config.lr_at(self.global_step - self.skipped_steps)
    }

    /// Optimizer steps taken, skipped ones included.
    pub fn global_step(&self) -> u64 {
        self.global_step
    }

    /// Steps skipped because the gradient overflowed.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// The last monitor write's failure, as the reason this rank refuses the next step.
    pub fn take_monitor_failure(&mut self) -> Option<String> {
        self.monitor_failure
            .take()
            .map(|e| format!("the monitor could not write the last step: {e}"))
    }

    /// After the reduction, once every rank knows whether the gradient overflowed: updates
    /// the loss scale (at the minimum scale an overflow fails, on every rank alike, before
    /// anything is stepped) and counts a skipped step. Returns whether to step.
    pub fn decide(&mut self, overflow: bool, grad_norm: f64) -> Result<bool> {
        if let Some(scaler) = &mut self.scaler {
            scaler.update(overflow)?;
        }
        if !overflow {
            self.skipped_in_a_row = 0;
            return Ok(true);
        }
        self.skipped_steps += 1;
        self.skipped_in_a_row += 1;
        tracing::warn!(
            step = self.global_step + 1,
            grad_norm,
            skipped_steps = self.skipped_steps,
            "the gradient norm is not finite: step skipped on every rank"
        );
        let limit = self.max_skipped_in_a_row;
        if limit > 0 && self.skipped_in_a_row >= limit {
            return Err(crate::DeepSpeedError::LossScale(format!(
                "{limit} optimizer steps in a row were skipped for a non-finite gradient \
                 (the last at step {}): the run is not training. Check the loss and the \
                 learning rate, lower fp16.initial_scale_power or train in bf16, and resume \
                 from the last checkpoint (max_consecutive_skipped_steps sets this limit; 0 \
                 never stops)",
                self.global_step + 1
            )));
        }
        Ok(false)
    }

    /// Ends the step: counts it, adds its phase times to the breakdown, writes `record` to
    /// the monitor (its throughput figures are filled from `step_time`), and, every
    /// `steps_per_print` steps on the rank that passes `print_as` (its rank and a suffix),
    /// logs the step's line (see [`step_line`]) and prints the breakdown's. Returns the step's
    /// number.
    pub fn finish(
        &mut self,
        phases: &[(&'static str, Duration)],
        print_as: Option<(usize, &str)>,
        step_time: Duration,
        record: impl FnOnce(MonitorRecord) -> MonitorRecord,
    ) -> u64 {
        self.global_step += 1;
        let step = self.global_step;
        let print = print_as.filter(|_| step.is_multiple_of(self.every));
        if let Some(breakdown) = &mut self.breakdown {
            breakdown.add(phases);
            if let Some((rank, suffix)) = print {
                eprintln!("{}{suffix}", breakdown.take_line(rank, step));
            }
        }
        if self.monitor.is_none() && print.is_none() {
            return step;
        }
        let timed = MonitorRecord::timed(
            step,
            self.train_batch_size,
            step_time,
            self.tokens_per_sample,
        );
        let record = record(timed);
        if let Some((_, suffix)) = print {
            tracing::info!(
                target: "burn_deepspeed::step",
                "{}{suffix}",
                step_line(&record, self.skipped_steps)
            );
        }
        if let Some(monitor) = &mut self.monitor
            && let Err(e) = monitor.write(&record)
        {
            self.monitor_failure = Some(e.to_string());
        }
        step
    }

    /// Whether a monitor writes this rank's steps (global rank 0 with one configured).
    pub fn monitoring(&self) -> bool {
        self.monitor.is_some()
    }

    /// Declares how many tokens one sample holds, for the monitor's tokens/s.
    pub fn set_tokens_per_sample(&mut self, tokens: u64) {
        self.tokens_per_sample = Some(tokens);
    }

    /// The files the monitor writes on this rank (empty when it has none).
    pub fn monitor_paths(&self) -> Vec<PathBuf> {
        self.monitor
            .as_ref()
            .map(Monitor::paths)
            .unwrap_or_default()
    }

    /// fp16: the loss scaler's position (`None` without fp16).
    pub fn loss_scaler_state(&self) -> Option<LossScalerState> {
        self.scaler.as_ref().map(DynamicLossScaler::state)
    }

    /// What a checkpoint stores of this protocol.
    pub fn position(&self) -> StepPosition {
        StepPosition {
            global_step: self.global_step,
            skipped_steps: self.skipped_steps,
            loss_scaler: self.loss_scaler_state(),
        }
    }

    /// Checks that `position` can be restored here, without changing anything: the scaler
    /// it would continue with (a static scale is the config's; a dynamic one continues where
    /// the checkpoint left it). [`restore`](Self::restore) then cannot fail.
    pub fn restorable(&self, position: &StepPosition) -> Result<RestoredPosition> {
        let mut scaler = self.scaler.clone();
        if let (Some(scaler), Some(state)) = (&mut scaler, position.loss_scaler)
            && scaler.is_dynamic()
        {
            scaler.restore(state)?;
        }
        Ok(RestoredPosition {
            global_step: position.global_step,
            skipped_steps: position.skipped_steps,
            scaler,
        })
    }

    /// Continues from a checked position.
    pub fn restore(&mut self, restored: RestoredPosition) {
        self.global_step = restored.global_step;
        self.skipped_steps = restored.skipped_steps;
        self.scaler = restored.scaler;
    }
}

/// A checkpoint's position, checked against this run's loss-scale settings by
/// [`StepCore::restorable`].
pub(crate) struct RestoredPosition {
    global_step: u64,
    skipped_steps: u64,
    scaler: Option<DynamicLossScaler>,
}

/// A step's line, as DeepSpeed logs one every `steps_per_print` steps: the step, its loss and
/// learning rate, the loss scale (fp16), the steps skipped so far, the throughput, and the
/// model state and peak resident memory of the rank.
pub fn step_line(r: &MonitorRecord, skipped_steps: u64) -> String {
    let mut line = format!(
        "step {}: loss {:.4}, lr {:.3e}, grad norm {:.3}",
        r.step, r.train_loss, r.lr, r.grad_norm
    );
    if let Some(scale) = r.loss_scale {
        line += &format!(", loss scale {scale}");
    }
    line += &format!(", skipped {skipped_steps}");
    match (r.tokens_per_s, r.samples_per_s) {
        (Some(t), _) => line += &format!(", {t:.0} tokens/s"),
        (None, Some(s)) => line += &format!(", {s:.1} samples/s"),
        (None, None) => {}
    }
    if let Some(b) = r.model_state_bytes {
        line += &format!(", model state {}", crate::comm::human_bytes(b as u64));
    }
    if let Some(b) = r.peak_rss_bytes {
        line += &format!(", peak RSS {}", crate::comm::human_bytes(b as u64));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_line_names_what_the_step_reports() {
        let record = MonitorRecord {
            step: 20,
            train_loss: 2.34567,
            lr: 1e-3,
            loss_scale: Some(65536.0),
            grad_norm: 0.5,
            tokens_per_s: Some(1234.4),
            model_state_bytes: Some(3.0 * 1024.0 * 1024.0),
            ..MonitorRecord::default()
        };
        assert_eq!(
            step_line(&record, 2),
            "step 20: loss 2.3457, lr 1.000e-3, grad norm 0.500, loss scale 65536, skipped 2, \
             1234 tokens/s, model state 3.00 MB"
        );
    }

    fn config(json: &str) -> DeepSpeedConfig {
        let (mut config, _) = DeepSpeedConfig::from_json_str(json).unwrap();
        config.resolve(1).unwrap();
        config
    }

    #[test]
    fn a_skipped_step_halves_the_scale_and_holds_the_schedule() {
        let c = config(
            r#"{"train_batch_size": 2, "fp16": {"enabled": true, "initial_scale_power": 4,
                "hysteresis": 1},
                "optimizer": {"type": "Adam", "params": {"lr": 1.0}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                    "warmup_max_lr": 1.0, "warmup_num_steps": 10}}}"#,
        );
        let mut core = StepCore::new(&c).unwrap();
        assert_eq!(core.loss_scale(), Some(16.0));
        let lr0 = core.lr(&c);
        assert!(!core.decide(true, f64::INFINITY).unwrap());
        core.finish(&[], None, Duration::ZERO, |r| r);
        assert_eq!((core.global_step(), core.skipped_steps()), (1, 1));
        assert_eq!(core.loss_scale(), Some(8.0));
        assert_eq!(
            core.lr(&c),
            lr0,
            "a skipped step does not advance the schedule"
        );
        assert!(core.decide(false, 1.0).unwrap());
        core.finish(&[], None, Duration::ZERO, |r| r);
        assert!(core.lr(&c) > lr0);
    }

    /// A run whose gradient stays non-finite stops with an error after
    /// `max_consecutive_skipped_steps` skips in a row (100 by default); a clean step starts
    /// the count again, and 0 never stops.
    #[test]
    fn a_run_that_only_skips_stops() {
        let c = config(r#"{"train_batch_size": 2, "max_consecutive_skipped_steps": 3}"#);
        let mut core = StepCore::new(&c).unwrap();
        for _ in 0..2 {
            assert!(!core.decide(true, f64::NAN).unwrap());
        }
        assert!(core.decide(false, 1.0).unwrap());
        for _ in 0..2 {
            assert!(!core.decide(true, f64::NAN).unwrap());
        }
        let e = core.decide(true, f64::NAN).unwrap_err().to_string();
        assert!(
            e.contains("3 optimizer steps in a row") && e.contains("max_consecutive_skipped_steps"),
            "{e}"
        );
        let c = config(r#"{"train_batch_size": 2, "max_consecutive_skipped_steps": 0}"#);
        let mut core = StepCore::new(&c).unwrap();
        for _ in 0..1000 {
            assert!(!core.decide(true, f64::INFINITY).unwrap());
        }
        assert_eq!(
            config(r#"{"train_batch_size": 2}"#).max_consecutive_skipped_steps,
            100
        );
    }

    /// A factor or a scale that is finite in f64 but not in the f32 it scales is refused by
    /// name when the config is resolved (it used to skip every step).
    #[test]
    fn values_that_do_not_fit_f32_are_refused() {
        for (json, key) in [
            (
                r#""gradient_predivide_factor": 1e39"#,
                "gradient_predivide_factor",
            ),
            (
                r#""gradient_predivide_factor": 1e-50"#,
                "gradient_predivide_factor",
            ),
            (
                r#""gradient_predivide_factor": 1e-39"#,
                "gradient_predivide_factor",
            ),
            (
                r#""fp16": {"enabled": true, "loss_scale": 1e39}"#,
                "fp16.loss_scale",
            ),
        ] {
            let (mut c, _) =
                DeepSpeedConfig::from_json_str(&format!(r#"{{"train_batch_size": 2, {json}}}"#))
                    .unwrap();
            let e = c
                .resolve(1)
                .and_then(|_| StepCore::new(&c).map(|_| ()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{json}: {e}");
        }
    }

    #[test]
    fn a_position_round_trips_and_one_that_does_not_fit_changes_nothing() {
        let c = config(r#"{"train_batch_size": 2, "fp16": {"enabled": true, "hysteresis": 2}}"#);
        let mut core = StepCore::new(&c).unwrap();
        assert!(core.decide(false, 1.0).unwrap());
        core.finish(&[], None, Duration::ZERO, |r| r);
        let saved = core.position();
        let mut other = StepCore::new(&c).unwrap();
        let restored = other.restorable(&saved).unwrap();
        other.restore(restored);
        assert_eq!(other.position().global_step, 1);
        assert_eq!(other.loss_scaler_state(), core.loss_scaler_state());
        // Hysteresis lowered from 2 to 1: the saved scaler does not fit, and nothing moves.
        let lower =
            config(r#"{"train_batch_size": 2, "fp16": {"enabled": true, "hysteresis": 1}}"#);
        let fresh = StepCore::new(&lower).unwrap();
        assert!(fresh.restorable(&saved).is_err());
        assert_eq!(fresh.position().global_step, 0);
    }
}
