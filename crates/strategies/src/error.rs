//! The error type of the strategies crate.

use std::time::Duration;

/// Errors raised by communicators and parallel strategies.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Another rank panicked, timed out or left the world while this rank waited on it.
    #[error("rank {rank} failed during `{op}`: {reason}")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
        /// The operation this rank was running when it learned of the failure.
        op: &'static str,
        /// What happened to the failed rank.
        reason: String,
    },
    /// This rank waited longer than the world's timeout for its peers.
    #[error(
        "rank {rank} timed out after {waited:?} in `{op}` waiting for rank(s) {missing:?} \
         (a rank stalled or diverged; raise the timeout if this is a slow step)"
    )]
    Timeout {
        /// This rank.
        rank: usize,
        /// The operation that timed out.
        op: &'static str,
        /// How long this rank waited.
        waited: Duration,
        /// The ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// Ranks called different collectives, or the same one with incompatible arguments.
    #[error("rank {rank}: collective mismatch in `{op}`: {detail}")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The operation this rank called.
        op: &'static str,
        /// What differed between the ranks.
        detail: String,
    },
    /// A buffer length or rank argument is invalid for the operation.
    #[error("invalid argument to `{op}` on rank {rank}: {detail}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A pipeline layout (stages, partition, topology) cannot be built as asked.
    #[error("pipeline: {0}")]
    Pipeline(String),
    /// A 1-bit optimizer was given buffers, or a saved state, that do not fit it.
    #[error("{optimizer}: {detail}")]
    Optimizer {
        /// Which optimizer.
        optimizer: &'static str,
        /// What does not fit.
        detail: String,
    },
    /// A swap file (ZeRO-Infinity's NVMe offload) could not be created, read or written.
    #[error("swap file {path}: {op} failed: {source}")]
    Swap {
        /// The file (or its folder).
        path: std::path::PathBuf,
        /// What was being done.
        op: &'static str,
        /// The system's error.
        source: std::io::Error,
    },
    /// A collective failed, and the flight recorder found where the group's ranks parted
    /// ways: the first collective some rank never called, or called differently.
    #[error("{source}; flight recorder on rank {rank}: {report} (rank(s) {lagging:?} out of step)")]
    Diverged {
        /// This rank.
        rank: usize,
        /// The ranks out of step.
        lagging: Vec<usize>,
        /// The first divergence, in words.
        report: String,
        /// The collective's own error.
        source: Box<CommError>,
    },
    /// A swapped state that a failed pass left part stepped, part not: it is refused from then
    /// on, until a checkpoint is loaded into it.
    #[error(
        "swap file {path}: the state in it is inconsistent since an earlier pass over it \
         failed ({cause}): some tiles were updated and the rest were not, so it is refused \
         from now on; load the last checkpoint to go on (load_checkpoint rewrites it whole)"
    )]
    SwapInconsistent {
        /// The file.
        path: std::path::PathBuf,
        /// The error that stopped the pass.
        cause: String,
    },
    /// A rank's communication thread ([`CommWorker`](crate::comm::CommWorker)) could not
    /// start, panicked, or skipped a collective after an earlier one failed.
    #[error("rank {rank}'s communication thread: {detail}")]
    Worker {
        /// This rank.
        rank: usize,
        /// What happened.
        detail: String,
    },
    /// The MPI backend could not be used.
    #[error("MPI: {0}")]
    Mpi(String),
    /// A device collective could not read, write or reach a device buffer (a tensor on a
    /// backend it cannot serve, a failed device read, NCCL absent or failing).
    #[error("device collective `{op}` on rank {rank}: {detail}")]
    Device {
        /// This rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What went wrong.
        detail: String,
    },
}

impl CommError {
    /// The error beneath what the flight recorder added ([`CommError::Diverged`]).
    pub fn root_cause(&self) -> &CommError {
        match self {
            CommError::Diverged { source, .. } => source.root_cause(),
            e => e,
        }
    }
}

/// Result type of the strategies crate.
pub type Result<T> = std::result::Result<T, CommError>;
