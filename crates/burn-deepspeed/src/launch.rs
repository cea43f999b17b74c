//! Starting ranks: threads in this process, or one MPI process per rank under `mpirun`.

use std::sync::Arc;
use std::time::Duration;

use burn_deepspeed_strategies::comm::{Communicator, ThreadWorld, ThreadWorldOptions};

use crate::{DeepSpeedError, Result};

/// How the ranks of a run were started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchKind {
    /// Threads of this process.
    Threads,
    /// This process is one rank of an MPI job.
    Mpi,
}

/// True when this process was started by `mpirun`/`mpiexec`.
pub fn launched_by_mpirun() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
}

/// The number of processes `mpirun` started, when this process is one of them.
pub fn mpirun_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// Runs `f` on every rank of this process and returns their results in rank order.
///
/// Under `mpirun` (and with the `mpi` feature) this process is one rank: `f` runs once with
/// the MPI communicator and `threads` is ignored. Otherwise `threads` ranks run as threads.
/// A rank that panics or fails makes the call return an error naming it.
pub fn launch<R, F>(threads: usize, timeout: Duration, f: F) -> Result<(LaunchKind, Vec<R>)>
where
    R: Send,
    F: Fn(Arc<dyn Communicator>) -> Result<R> + Sync,
{
    if launched_by_mpirun() {
        return f(mpi_world()?).map(|r| (LaunchKind::Mpi, vec![r]));
    }
    if threads == 0 {
        return Err(DeepSpeedError::Data(
            "the number of ranks must be at least 1".into(),
        ));
    }
    let results = ThreadWorld::run(threads, ThreadWorldOptions { timeout }, |comm| {
        f(Arc::new(comm))
    });
    let mut out = Vec::with_capacity(threads);
    let mut first_error = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                first_error
                    .get_or_insert(DeepSpeedError::Data(format!("rank {rank} panicked: {msg}")));
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok((LaunchKind::Threads, out)),
    }
}

/// This process's communicator in the MPI world (initializes MPI; once per process).
#[cfg(feature = "mpi")]
pub(crate) fn mpi_world() -> Result<Arc<dyn Communicator>> {
    let comm = burn_deepspeed_strategies::comm::MpiCommunicator::init()?;
    Ok(Arc::new(comm))
}

/// Without the `mpi` feature a run under `mpirun` is refused.
#[cfg(not(feature = "mpi"))]
pub(crate) fn mpi_world() -> Result<Arc<dyn Communicator>> {
    Err(DeepSpeedError::Unsupported {
        key: "mpirun".into(),
        reason: "this binary was built without the `mpi` feature; rebuild with \
                 `--features mpi`"
            .into(),
    })
}
