//! The error type of the burn-deepspeed crate.

use burn_deepspeed_strategies::CommError;

/// Errors from configuration, the engine and the launcher.
#[derive(Debug, thiserror::Error)]
pub enum DeepSpeedError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    ConfigIo {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The text is not JSON.
    #[error("config is not valid JSON (line {line}, column {column}): {message}")]
    ConfigSyntax {
        /// Line of the error.
        line: usize,
        /// Column of the error.
        column: usize,
        /// What the parser said.
        message: String,
    },
    /// A key no DeepSpeed config has.
    #[error("unknown config key `{path}`{}", suggestion.as_ref().map(|s| format!(" (did you mean `{s}`?)")).unwrap_or_default())]
    UnknownKey {
        /// Dotted path of the key.
        path: String,
        /// The closest known key at that level, if one is close.
        suggestion: Option<String>,
    },
    /// A value of the wrong type or out of range.
    #[error("config key `{path}`: {message}")]
    InvalidValue {
        /// Dotted path of the key.
        path: String,
        /// What was expected and what was found.
        message: String,
    },
    /// The batch-size keys do not agree with each other and the world size.
    #[error("inconsistent batch size: {0}")]
    BatchSize(String),
    /// A configured feature that this version cannot run yet.
    #[error("`{key}` is not supported yet: {reason}")]
    Unsupported {
        /// The config key.
        key: String,
        /// Why, and what to do instead.
        reason: String,
    },
    /// A communication failure.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A layer cannot be cut across the tensor-parallel group (its features or heads do not
    /// split evenly, or it is a slice already).
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),
    /// A checkpoint cannot be written, or cannot be loaded into this engine.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The Learner strategy was used in a way it cannot run.
    #[error("Learner strategy: {0}")]
    LearnerStrategy(String),
    /// A gradient regime was asked for what it does not do (a caller's misuse of
    /// [`GradSync`](crate::sync::GradSync), or a layout that does not fit the model).
    #[error("gradient regime: {0}")]
    Regime(String),
    /// The training data cannot feed the configured batch.
    #[error("data: {0}")]
    Data(String),
    /// fp16 training cannot go on: the loss scale cannot shrink below its minimum, or a saved
    /// scaler state is not valid.
    #[error("loss scale: {0}")]
    LossScale(String),
    /// A file the monitor, the trace or the profiler writes (or a tool reads back) failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: String,
        /// What the operating system said.
        source: std::io::Error,
    },
}

impl DeepSpeedError {
    /// [`DeepSpeedError::Io`] on `path`.
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// Result type of the burn-deepspeed crate.
pub type Result<T> = std::result::Result<T, DeepSpeedError>;

/// Agrees across ranks on the outcome of a rank-local phase (see
/// [`agree`](burn_deepspeed_strategies::comm::agree)): returns `local` when every rank
/// succeeded; otherwise this rank's own error, or, on the ranks that succeeded, an error naming
/// the failed rank and its reason. A collective: every rank calls it before the next
/// collective, so that one rank's failure fails all of them instead of leaving them blocked.
pub fn agreed<T>(
    comm: &dyn burn_deepspeed_strategies::comm::Communicator,
    phase: &'static str,
    local: Result<T>,
) -> Result<T> {
    let reason = local.as_ref().err().map(|e| e.to_string());
    let verdict = burn_deepspeed_strategies::comm::agree(comm, phase, reason.as_deref());
    match (local, verdict) {
        (Err(mine), _) => Err(mine),
        (Ok(_), Err(peer)) => Err(peer.into()),
        (Ok(v), Ok(())) => Ok(v),
    }
}
