//! The CSV monitor: one row per optimizer step.
//!
//! DeepSpeed's `csv_monitor` writes one two-column file per tag; this one writes a single
//! `metrics.csv` whose columns are the step, the samples seen and every scalar of
//! [`MonitorRecord`](super::MonitorRecord) (an empty cell where a step has no value, as the
//! loss scale outside fp16), which is what a spreadsheet or `pandas.read_csv` wants.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::MonitorRecord;
use crate::{DeepSpeedError, Result};

/// Appends one row per step to `metrics.csv`.
#[derive(Debug)]
pub struct CsvWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl CsvWriter {
    /// Creates `dir` if needed and `dir/metrics.csv` (replacing an older one) with its header.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| DeepSpeedError::io(dir, e))?;
        let path = dir.join("metrics.csv");
        let file = File::create(&path).map_err(|e| DeepSpeedError::io(&path, e))?;
        let mut w = Self {
            path,
            out: BufWriter::new(file),
        };
        let mut header = vec!["step", "samples"];
        header.extend(MonitorRecord::NAMES);
        w.line(&header.join(","))?;
        Ok(w)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `record`'s row.
    pub fn write(&mut self, record: &MonitorRecord) -> Result<()> {
        let mut cells = vec![record.step.to_string(), record.samples.to_string()];
        cells.extend(
            record
                .values()
                .into_iter()
                .map(|v| v.map_or(String::new(), |v| format!("{v}"))),
        );
        self.line(&cells.join(","))
    }

    /// Writes what is buffered to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(|e| DeepSpeedError::io(&self.path, e))
    }

    fn line(&mut self, line: &str) -> Result<()> {
        writeln!(self.out, "{line}").map_err(|e| DeepSpeedError::io(&self.path, e))
    }
}

impl Drop for CsvWriter {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}
