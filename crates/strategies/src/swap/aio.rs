//! [`AioOptions`] (DeepSpeed's `aio` section) and the [`IoEngine`] that carries it out.

use std::sync::OnceLock;

use crate::{CommError, Result};

/// Alignment of every swap buffer, file offset and transfer length: `O_DIRECT` needs the
/// device's logical block size, and 4 KiB covers every disk in use.
pub const ALIGN: usize = 4096;

/// The environment variable that forces an [`IoEngine`]: `pread` (the fallback) or `uring`.
pub const IO_ENGINE_ENV: &str = "BURN_DEEPSPEED_AIO";

/// DeepSpeed's `aio` section: how swap transfers are cut and queued. The defaults are
/// DeepSpeed's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AioOptions {
    /// Bytes per request (`block_size`, 1 MiB); rounded up to [`ALIGN`].
    pub block_size: usize,
    /// Requests in flight per thread (`queue_depth`, 8).
    pub queue_depth: usize,
    /// Threads a transfer is split across (`intra_op_parallelism`, formerly `thread_count`;
    /// 1), each with its own queue.
    pub intra_op_parallelism: usize,
    /// Submit requests one system call at a time instead of in batches (`single_submit`).
    pub single_submit: bool,
    /// Refill the queue as each request completes rather than when the whole batch has
    /// (`overlap_events`).
    pub overlap_events: bool,
}

impl Default for AioOptions {
    fn default() -> Self {
        Self {
            block_size: 1 << 20,
            queue_depth: 8,
            intra_op_parallelism: 1,
            single_submit: false,
            overlap_events: true,
        }
    }
}

impl AioOptions {
    /// The block size in bytes, at least [`ALIGN`] and a multiple of it.
    pub fn block_bytes(&self) -> usize {
        self.block_size.max(1).div_ceil(ALIGN) * ALIGN
    }
}

/// The system calls that move swap bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEngine {
    /// Linux io_uring: `queue_depth` reads or writes in flight per thread, one system call
    /// per batch.
    Uring,
    /// `pread`/`pwrite`, one block at a time per thread: works wherever files do (seccomp
    /// profiles that block io_uring, old kernels, other systems).
    Pread,
}

impl IoEngine {
    /// The engine of this process: what [`IO_ENGINE_ENV`] names, else io_uring where a ring
    /// can be created, else `pread`. Chosen once.
    pub fn select() -> Result<Self> {
        static CHOSEN: OnceLock<std::result::Result<IoEngine, String>> = OnceLock::new();
        CHOSEN
            .get_or_init(|| {
                let forced = std::env::var(IO_ENGINE_ENV).ok();
                Self::choose(forced.as_deref(), io_uring_available())
            })
            .clone()
            .map_err(|detail| CommError::InvalidArgument {
                rank: 0,
                op: "aio",
                detail,
            })
    }

    /// The engine that `forced` (the environment variable's value) names, or io_uring when
    /// `uring` (it works here), else `pread`.
    pub fn choose(forced: Option<&str>, uring: bool) -> std::result::Result<Self, String> {
        match forced.map(str::trim) {
            None | Some("") | Some("auto") => Ok(if uring { Self::Uring } else { Self::Pread }),
            Some("pread") => Ok(Self::Pread),
            Some("uring") | Some("io_uring") if uring => Ok(Self::Uring),
            Some("uring") | Some("io_uring") => Err(format!(
                "{IO_ENGINE_ENV}=uring, but io_uring is not available here (kernel or seccomp); \
                 unset it to fall back to pread"
            )),
            Some(other) => Err(format!(
                "{IO_ENGINE_ENV}={other:?}: expected `uring`, `pread` or `auto`"
            )),
        }
    }

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Uring => "io_uring",
            Self::Pread => "pread",
        }
    }
}

/// Whether an io_uring ring can be created in this process (kernel support, and no seccomp
/// profile blocking it).
#[cfg(target_os = "linux")]
pub fn io_uring_available() -> bool {
    io_uring::IoUring::new(2).is_ok()
}

#[cfg(not(target_os = "linux"))]
pub fn io_uring_available() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_deepspeeds() {
        let o = AioOptions::default();
        assert_eq!(
            (o.block_size, o.queue_depth, o.intra_op_parallelism),
            (1 << 20, 8, 1)
        );
        assert!(!o.single_submit && o.overlap_events);
        assert_eq!(
            AioOptions {
                block_size: 5000,
                ..o
            }
            .block_bytes(),
            8192
        );
    }

    #[test]
    fn the_environment_forces_an_engine_and_typos_are_refused() {
        assert_eq!(IoEngine::choose(None, true), Ok(IoEngine::Uring));
        assert_eq!(IoEngine::choose(None, false), Ok(IoEngine::Pread));
        assert_eq!(IoEngine::choose(Some("pread"), true), Ok(IoEngine::Pread));
        assert_eq!(IoEngine::choose(Some("uring"), true), Ok(IoEngine::Uring));
        let no_ring = IoEngine::choose(Some("uring"), false).unwrap_err();
        assert!(no_ring.contains("not available"), "{no_ring}");
        let typo = IoEngine::choose(Some("prad"), true).unwrap_err();
        assert!(
            typo.contains("prad") && typo.contains(IO_ENGINE_ENV),
            "{typo}"
        );
    }
}
