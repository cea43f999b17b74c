//! The CSV monitor: one row per optimizer step.
//!
//! DeepSpeed's `csv_monitor` writes one two-column file per tag; this one writes a single
//! `metrics.csv` whose columns are the step, the samples seen and every scalar of
//! [`MonitorRecord`](super::MonitorRecord) (an empty cell where a step has no value, as the
//! loss scale outside fp16), which is what a spreadsheet or `pandas.read_csv` wants.
//! A resumed run appends to the file of the run it continues, as DeepSpeed's monitor does.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
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
    /// Creates `dir` if needed and opens `dir/metrics.csv` to append to, writing its header
    /// when the file is new. A file with other columns (an older version's) is kept, and the
    /// rows go to `metrics.1.csv` (or the next free number) instead.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| DeepSpeedError::io(dir, e))?;
        let mut header = vec!["step", "samples"];
        header.extend(MonitorRecord::NAMES);
        let header = header.join(",");
        for n in 0..1024 {
            let path = match n {
                0 => dir.join("metrics.csv"),
                n => dir.join(format!("metrics.{n}.csv")),
            };
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .read(true)
                .open(&path)
                .map_err(|e| DeepSpeedError::io(&path, e))?;
            let mut first = String::new();
            BufReader::new(&file)
                .read_line(&mut first)
                .map_err(|e| DeepSpeedError::io(&path, e))?;
            let fresh = first.is_empty();
            if !fresh && first.trim_end() != header {
                continue;
            }
            let mut w = Self {
                path,
                out: BufWriter::new(file),
            };
            if fresh {
                w.line(&header)?;
            }
            return Ok(w);
        }
        let taken = std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "1024 files with other columns",
        );
        Err(DeepSpeedError::io(&dir.join("metrics.N.csv"), taken))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A resumed run appends its rows under the one header; a file with other columns is
    /// left as it is.
    #[test]
    fn a_resumed_run_appends() {
        let dir = tempfile::tempdir().unwrap();
        let record = |step| MonitorRecord {
            step,
            ..MonitorRecord::default()
        };
        for step in [1, 2] {
            let mut w = CsvWriter::create(dir.path()).unwrap();
            w.write(&record(step)).unwrap();
        }
        let text = std::fs::read_to_string(dir.path().join("metrics.csv")).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("step,samples"));
        assert!(
            lines[1].starts_with("1,") && lines[2].starts_with("2,"),
            "{text}"
        );
        let other = tempfile::tempdir().unwrap();
        std::fs::write(other.path().join("metrics.csv"), "step,loss\n1,2.0\n").unwrap();
        let w = CsvWriter::create(other.path()).unwrap();
        assert!(w.path().ends_with("metrics.1.csv"));
        let kept = std::fs::read_to_string(other.path().join("metrics.csv")).unwrap();
        assert_eq!(kept, "step,loss\n1,2.0\n");
    }
}
