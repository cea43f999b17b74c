//! The observability sections: `comms_logger`, `tensorboard` and `csv_monitor`, with
//! DeepSpeed's defaults.

use std::path::PathBuf;

use burn_deepspeed_strategies::comm::{CommsLoggerOptions, OpKind};
use serde::{Deserialize, Serialize};

use crate::{DeepSpeedError, Result};

/// `comms_logger`: time and size every collective (see
/// [`CommsLogger`](burn_deepspeed_strategies::comm::CommsLogger)).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CommsLoggerConfig {
    /// Log the communication of the run.
    pub enabled: bool,
    /// Print every call as it completes (global rank 0).
    pub verbose: bool,
    /// Log every kind of operation (otherwise only those in `prof_ops`).
    pub prof_all: bool,
    /// The operations logged when `prof_all` is false: DeepSpeed's names
    /// (`all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`,
    /// `all_to_all_single`, `broadcast`, `send`, `recv`, `barrier`) or ours.
    pub prof_ops: Vec<String>,
    /// File each call under the function that made it as well.
    pub debug: bool,
}

impl Default for CommsLoggerConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            verbose: false,
            prof_all: true,
            prof_ops: Vec::new(),
            debug: false,
        }
    }
}

impl CommsLoggerConfig {
    /// The logger's options, or the key of an operation name it does not know.
    pub fn options(&self) -> Result<CommsLoggerOptions> {
        let prof_ops = self
            .prof_ops
            .iter()
            .enumerate()
            .map(|(i, name)| {
                OpKind::from_name(name).ok_or_else(|| DeepSpeedError::InvalidValue {
                    path: format!("comms_logger.prof_ops[{i}]"),
                    message: format!(
                        "unknown operation {name:?}; expected one of {}",
                        OpKind::ALL.map(OpKind::name).join(", ")
                    ),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CommsLoggerOptions {
            verbose: self.verbose,
            prof_all: self.prof_all,
            prof_ops,
            debug: self.debug,
        })
    }
}

/// `tensorboard` and `csv_monitor`: where the monitor writes (DeepSpeed's
/// `output_path/job_name`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorConfig {
    /// Write this monitor's files.
    pub enabled: bool,
    /// The folder the job's folder goes in (empty: the working directory).
    pub output_path: String,
    /// The job's folder.
    pub job_name: String,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            output_path: String::new(),
            job_name: "DeepSpeedJobName".into(),
        }
    }
}

impl MonitorConfig {
    /// The folder this monitor writes to: `output_path/job_name`.
    pub fn dir(&self) -> PathBuf {
        PathBuf::from(&self.output_path).join(&self.job_name)
    }

    pub(crate) fn validate(&self, section: &str) -> Result<()> {
        if self.enabled && self.job_name.trim().is_empty() {
            return Err(DeepSpeedError::InvalidValue {
                path: format!("{section}.job_name"),
                message: "must not be empty: it names the folder the files go in".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeepSpeedConfig;

    #[test]
    fn sections_parse_with_deepspeed_defaults() {
        let c = DeepSpeedConfig::from_json_str(
            r#"{"comms_logger": {"enabled": true, "prof_all": false,
                                 "prof_ops": ["all_reduce", "all_gather_into_tensor"]},
                "tensorboard": {"enabled": true, "output_path": "logs", "job_name": "run1"},
                "csv_monitor": {"enabled": true}}"#,
        )
        .unwrap()
        .0;
        let options = c.comms_logger.options().unwrap();
        assert!(!options.prof_all && !options.verbose && !options.debug);
        assert_eq!(options.prof_ops, vec![OpKind::AllReduce, OpKind::AllGather]);
        assert_eq!(c.tensorboard.dir(), PathBuf::from("logs/run1"));
        assert_eq!(c.csv_monitor.dir(), PathBuf::from("DeepSpeedJobName"));
        assert!(CommsLoggerConfig::default().prof_all);
    }

    #[test]
    fn bad_values_name_their_key() {
        let resolved = |json: &str| {
            let (mut c, _) = DeepSpeedConfig::from_json_str(json)?;
            c.resolve_values()
        };
        let e = resolved(
            r#"{"comms_logger": {"enabled": true, "prof_ops": ["all_reduce", "allreduce"]}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("comms_logger.prof_ops[1]") && e.contains("allreduce"),
            "{e}"
        );
        let e = DeepSpeedConfig::from_json_str(r#"{"tensorboard": {"enable": true}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tensorboard.enable"), "{e}");
        let e = resolved(r#"{"csv_monitor": {"enabled": true, "job_name": " "}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("csv_monitor.job_name"), "{e}");
    }
}
