//! [`Monitor`]: the step's scalars, written to the sinks the config enables.

use std::path::PathBuf;
use std::time::Duration;

use burn_deepspeed_strategies::comm::Communicator;

use super::{CsvWriter, EventWriter};
use crate::{DeepSpeedConfig, Result};

/// What the monitor records of one optimizer step. Every value is measured by the engine
/// (the throughputs from the step's wall-clock time) or given by the caller
/// ([`tokens_per_s`](Self::tokens_per_s)).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MonitorRecord {
    /// Optimizer steps taken (this one included).
    pub step: u64,
    /// Samples seen by every rank together after this step (DeepSpeed's monitor x-axis).
    pub samples: u64,
    /// The step's mean loss.
    pub train_loss: f64,
    /// The learning rate the step used.
    pub lr: f64,
    /// fp16's loss scale (`None` otherwise).
    pub loss_scale: Option<f64>,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Samples per second over the step's wall-clock time (first forward to the end of the
    /// optimizer step), every rank's samples counted.
    pub samples_per_s: Option<f64>,
    /// Tokens per second: `samples_per_s` times the tokens per sample the caller declared
    /// ([`DeepSpeedEngine::set_tokens_per_sample`](crate::DeepSpeedEngine::set_tokens_per_sample)).
    pub tokens_per_s: Option<f64>,
    /// Bytes of model state (parameters, gradients, optimizer state) this rank holds.
    pub model_state_bytes: Option<f64>,
    /// The process's peak resident set (Linux `VmHWM`).
    pub peak_rss_bytes: Option<f64>,
    /// Milliseconds in forward passes this step (when the step's backward went through
    /// [`precision::backward`](crate::precision::backward), which times it).
    pub forward_ms: Option<f64>,
    /// Milliseconds in backward passes this step (see `forward_ms`).
    pub backward_ms: Option<f64>,
    /// Milliseconds handing gradients to the regime (copies, and stage 2-3 bucket
    /// reductions in backward).
    pub accumulate_ms: Option<f64>,
    /// Milliseconds in the gradient reduction.
    pub reduce_ms: Option<f64>,
    /// Milliseconds in the optimizer step.
    pub optimizer_ms: Option<f64>,
}

impl MonitorRecord {
    /// The record of step `step` of `batch` samples (every rank's) that took `step_time`:
    /// the samples seen, the throughputs (tokens/s when `tokens_per_sample` is known) and
    /// the process's peak resident set; the caller fills the step's other figures.
    pub fn timed(
        step: u64,
        batch: u64,
        step_time: Duration,
        tokens_per_sample: Option<u64>,
    ) -> Self {
        let secs = step_time.as_secs_f64();
        let samples_per_s = (secs > 0.0).then(|| batch as f64 / secs);
        Self {
            step,
            samples: step * batch,
            samples_per_s,
            tokens_per_s: tokens_per_sample
                .zip(samples_per_s)
                .map(|(t, s)| t as f64 * s),
            peak_rss_bytes: peak_rss_bytes().map(|b| b as f64),
            ..Self::default()
        }
    }

    /// The scalars' names, in the order of [`values`](Self::values): the CSV's columns after
    /// `step` and `samples`, and the TensorBoard tags after `Train/Samples/`.
    pub const NAMES: [&'static str; 13] = [
        "train_loss",
        "lr",
        "loss_scale",
        "grad_norm",
        "samples_per_s",
        "tokens_per_s",
        "model_state_bytes",
        "peak_rss_bytes",
        "forward_ms",
        "backward_ms",
        "accumulate_ms",
        "reduce_ms",
        "optimizer_ms",
    ];

    /// The scalars, in the order of [`NAMES`](Self::NAMES).
    pub fn values(&self) -> [Option<f64>; 13] {
        [
            Some(self.train_loss),
            Some(self.lr),
            self.loss_scale,
            Some(self.grad_norm),
            self.samples_per_s,
            self.tokens_per_s,
            self.model_state_bytes,
            self.peak_rss_bytes,
            self.forward_ms,
            self.backward_ms,
            self.accumulate_ms,
            self.reduce_ms,
            self.optimizer_ms,
        ]
    }
}

/// The process's peak resident set in bytes (Linux's `VmHWM`); `None` where
/// `/proc/self/status` does not say.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The TensorBoard tag of a [`MonitorRecord`] scalar (DeepSpeed's `Train/Samples/` prefix).
pub fn tensorboard_tag(name: &str) -> String {
    format!("Train/Samples/{name}")
}

/// DeepSpeed's monitor: the step's scalars written as TensorBoard event files
/// (`tensorboard`) and as CSV (`csv_monitor`), by global rank 0 only, under each section's
/// `output_path/job_name`.
#[derive(Debug)]
pub struct Monitor {
    tensorboard: Option<EventWriter>,
    csv: Option<CsvWriter>,
}

impl Monitor {
    /// The monitor `config` enables on `global_rank` (`None` on other ranks, or when neither
    /// section is enabled). Creates the folders and files.
    pub fn from_config(config: &DeepSpeedConfig, global_rank: usize) -> Result<Option<Self>> {
        let (tb, csv) = (&config.tensorboard, &config.csv_monitor);
        if global_rank != 0 || !(tb.enabled || csv.enabled) {
            return Ok(None);
        }
        Ok(Some(Self {
            tensorboard: match tb.enabled {
                true => Some(EventWriter::create(&tb.dir())?),
                false => None,
            },
            csv: match csv.enabled {
                true => Some(CsvWriter::create(&csv.dir())?),
                false => None,
            },
        }))
    }

    /// [`from_config`](Self::from_config) on `world`'s rank, agreed with every rank of it
    /// (rank 0 failing to create its files fails all of them). A collective.
    pub fn agreed(config: &DeepSpeedConfig, world: &dyn Communicator) -> Result<Option<Self>> {
        crate::agreed(world, "monitor", Self::from_config(config, world.rank()))
    }

    /// The files written: the event file, then the CSV, those enabled.
    pub fn paths(&self) -> Vec<PathBuf> {
        let tb = self.tensorboard.as_ref().map(|w| w.path().to_path_buf());
        let csv = self.csv.as_ref().map(|w| w.path().to_path_buf());
        tb.into_iter().chain(csv).collect()
    }

    /// Writes `record` to every sink and flushes it (a run that dies keeps every step
    /// written so far).
    pub fn write(&mut self, record: &MonitorRecord) -> Result<()> {
        if let Some(tb) = &mut self.tensorboard {
            let tags: Vec<(String, f32)> = MonitorRecord::NAMES
                .iter()
                .zip(record.values())
                .filter_map(|(name, v)| v.map(|v| (tensorboard_tag(name), v as f32)))
                .collect();
            let scalars: Vec<(&str, f32)> = tags.iter().map(|(t, v)| (t.as_str(), *v)).collect();
            tb.write_scalars(record.samples as i64, &scalars)?;
            tb.flush()?;
        }
        if let Some(csv) = &mut self.csv {
            csv.write(record)?;
            csv.flush()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::read_scalars;

    #[test]
    fn both_sinks_get_every_step() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().to_str().unwrap();
        let (config, _) = DeepSpeedConfig::from_json_str(&format!(
            r#"{{"tensorboard": {{"enabled": true, "output_path": "{out}", "job_name": "tb"}},
                "csv_monitor": {{"enabled": true, "output_path": "{out}", "job_name": "csv"}}}}"#
        ))
        .unwrap();
        assert!(Monitor::from_config(&config, 1).unwrap().is_none());
        let mut m = Monitor::from_config(&config, 0).unwrap().unwrap();
        for step in 1..=3u64 {
            let record = MonitorRecord {
                step,
                samples: step * 8,
                train_loss: 4.0 / step as f64,
                lr: 1e-3,
                grad_norm: 0.5,
                samples_per_s: Some(100.0),
                ..MonitorRecord::default()
            };
            m.write(&record).unwrap();
        }
        let paths = m.paths();
        assert!(paths[0].starts_with(dir.path().join("tb")));
        let events = read_scalars(&paths[0]).unwrap();
        // Four scalars a step (loss, lr, grad norm, samples/s): the others were `None`.
        assert_eq!(events.len(), 12);
        let loss: Vec<(i64, f32)> = events
            .iter()
            .filter(|e| e.tag == "Train/Samples/train_loss")
            .map(|e| (e.step, e.value))
            .collect();
        assert_eq!(loss, vec![(8, 4.0), (16, 2.0), (24, 4.0 / 3.0)]);
        let csv = std::fs::read_to_string(&paths[1]).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 4, "{csv}");
        assert!(lines[0].starts_with("step,samples,train_loss,lr,loss_scale,grad_norm"));
        assert!(
            lines[2].starts_with("2,16,2,0.001,,0.5,100,"),
            "{}",
            lines[2]
        );
        assert_eq!(lines[1].split(',').count(), 2 + MonitorRecord::NAMES.len());
    }
}
