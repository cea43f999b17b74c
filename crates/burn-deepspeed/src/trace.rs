//! Timeline traces: the `tracing` spans of the engines and the communicator written as a
//! Chrome trace (the JSON `chrome://tracing` and <https://ui.perfetto.dev> open).
//!
//! Every rank thread is a track (named after the thread: `rank-0`, `rank-1`, … in the thread
//! world), and each span a slice on it: the pipeline's schedule instructions
//! (`ForwardPass`, `SendActivation`, …), the forward and backward passes, bucket reductions
//! (`reduce_scatter_bucket`, `reduce_bucket`), ZeRO-3 gathers (`zero3_all_gather`), the
//! optimizer step, and each collective (`all_reduce`, `send`, …) with its element count.
//! Under MPI each process writes its own file (the GPT example appends `.rank<r>`).
//!
//! The layer is [`tracing_chrome`]'s; only spans of the `burn_deepspeed*` crates are
//! recorded, at every level.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{Layer, Registry};

use crate::{DeepSpeedError, Result};

/// The trace being written; the file is complete once this is dropped.
pub struct ChromeTrace {
    guard: Option<tracing_chrome::FlushGuard>,
    path: PathBuf,
}

impl std::fmt::Debug for ChromeTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChromeTrace")
            .field("path", &self.path)
            .finish()
    }
}

impl ChromeTrace {
    /// Starts recording this process's spans into `path` (created, or replaced), as the
    /// process's global `tracing` subscriber. Fails when the file cannot be created or when
    /// another global subscriber is already installed.
    pub fn start(path: &Path) -> Result<Self> {
        let file = File::create(path).map_err(|e| DeepSpeedError::io(path, e))?;
        let (layer, guard) = tracing_chrome::ChromeLayerBuilder::new()
            .writer(BufWriter::new(file))
            .include_args(true)
            .include_locations(false)
            .trace_style(tracing_chrome::TraceStyle::Threaded)
            .build();
        let ours = Targets::new().with_target("burn_deepspeed", LevelFilter::TRACE);
        let subscriber = Registry::default().with(layer.with_filter(ours));
        tracing::subscriber::set_global_default(subscriber).map_err(|e| DeepSpeedError::Io {
            path: path.display().to_string(),
            source: std::io::Error::other(format!("cannot install the trace's subscriber: {e}")),
        })?;
        Ok(Self {
            guard: Some(guard),
            path: path.to_path_buf(),
        })
    }

    /// The trace file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes out what is recorded so far and closes the file (spans recorded later are
    /// dropped).
    pub fn finish(mut self) -> PathBuf {
        drop(self.guard.take());
        self.path.clone()
    }
}
