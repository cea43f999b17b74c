//! I/O fault injection for tests (the `fault-injection` feature): the k-th read or write of a
//! swap file fails with `EIO` or `ENOSPC`, as a failing disk or a full one would, so that the
//! tests can check that nothing is lost or silently half-written.
//!
//! Two ways to arm it:
//! - the environment variable [`SWAP_FAULT_ENV`], `<read|write>:<k>:<EIO|ENOSPC>`, read once
//!   per process and applied to every swap file it creates, for a run in a child process
//!   (counted per file: `write:3:ENOSPC` fails each file's third write);
//! - [`inject_swap_fault`], for the swap files under one folder, counted together from the
//!   moment it is armed (for tests that share a process, each with its own folder).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, PoisonError};

/// The environment variable that arms a fault for every swap file of the process.
pub const SWAP_FAULT_ENV: &str = "BURN_DEEPSPEED_SWAP_FAULT";

/// Which transfers a fault counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOn {
    /// Reads from the file.
    Read,
    /// Writes to the file.
    Write,
}

/// One armed fault: the `nth` transfer of kind `on` (from 1) fails with `errno`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapFault {
    /// The transfers counted.
    pub on: FaultOn,
    /// Which of them fails (1 = the first).
    pub nth: u64,
    /// The error (`libc::EIO`, `libc::ENOSPC`).
    pub errno: i32,
}

impl SwapFault {
    /// Parses `<read|write>:<k>:<EIO|ENOSPC>`.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let bad = || {
            format!(
                "{SWAP_FAULT_ENV}={text:?}: expected <read|write>:<k>:<EIO|ENOSPC>, k from 1, \
                 for example write:3:ENOSPC"
            )
        };
        let mut parts = text.split(':');
        let on = match parts.next() {
            Some("read") => FaultOn::Read,
            Some("write") => FaultOn::Write,
            _ => return Err(bad()),
        };
        let nth = parts
            .next()
            .and_then(|k| k.parse::<u64>().ok())
            .filter(|&k| k >= 1)
            .ok_or_else(bad)?;
        let errno = match parts.next() {
            Some("EIO") => libc::EIO,
            Some("ENOSPC") => libc::ENOSPC,
            _ => return Err(bad()),
        };
        match parts.next() {
            None => Ok(Self { on, nth, errno }),
            Some(_) => Err(bad()),
        }
    }
}

/// A fault armed for a folder, with the transfers counted under it since it was armed.
#[derive(Debug)]
struct Armed {
    dir: PathBuf,
    fault: SwapFault,
    reads: AtomicU64,
    writes: AtomicU64,
}

/// The faults armed for folders.
static ARMED: LazyLock<Mutex<Vec<Armed>>> = LazyLock::new(Mutex::default);

fn from_env() -> Option<SwapFault> {
    static ENV: LazyLock<Option<SwapFault>> = LazyLock::new(|| {
        let text = std::env::var(SWAP_FAULT_ENV).ok()?;
        match SwapFault::parse(&text) {
            Ok(f) => Some(f),
            // A test that asked for a fault and got none would pass for the wrong reason.
            Err(e) => panic!("{e}"),
        }
    });
    *ENV
}

/// Arms `fault` for the swap files under `dir`, existing or made later: the transfers of
/// all of them are counted together from now on (`write:3:EIO`: the third write under `dir`
/// from now fails).
pub fn inject_swap_fault(dir: &Path, fault: SwapFault) {
    let mut armed = ARMED.lock().unwrap_or_else(PoisonError::into_inner);
    armed.push(Armed {
        dir: dir.to_path_buf(),
        fault,
        reads: AtomicU64::new(0),
        writes: AtomicU64::new(0),
    });
}

/// Counts one transfer of kind `on`; `Err` when it is the `nth`.
fn hit(fault: SwapFault, on: FaultOn, reads: &AtomicU64, writes: &AtomicU64) -> io::Result<()> {
    let n = match on {
        FaultOn::Read => reads.fetch_add(1, Ordering::Relaxed),
        FaultOn::Write => writes.fetch_add(1, Ordering::Relaxed),
    } + 1;
    match fault.on == on && fault.nth == n {
        true => Err(io::Error::from_raw_os_error(fault.errno)),
        false => Ok(()),
    }
}

/// A swap file's faults: the environment's, counted per file, and its folders'.
#[derive(Debug)]
pub(crate) struct FaultCounter {
    path: PathBuf,
    env: Option<SwapFault>,
    reads: AtomicU64,
    writes: AtomicU64,
}

impl FaultCounter {
    /// The faults of a file at `path`.
    pub(crate) fn for_path(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            env: from_env(),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
        }
    }

    /// Counts one transfer; the armed one fails.
    pub(crate) fn count(&self, on: FaultOn) -> io::Result<()> {
        if let Some(fault) = self.env {
            hit(fault, on, &self.reads, &self.writes)?;
        }
        let armed = ARMED.lock().unwrap_or_else(PoisonError::into_inner);
        (armed.iter())
            .filter(|a| self.path.starts_with(&a.dir))
            .try_for_each(|a| hit(a.fault, on, &a.reads, &a.writes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_is_parsed_and_typos_are_refused() {
        let f = SwapFault::parse("write:3:ENOSPC").unwrap();
        assert_eq!((f.on, f.nth, f.errno), (FaultOn::Write, 3, libc::ENOSPC));
        let f = SwapFault::parse("read:1:EIO").unwrap();
        assert_eq!((f.on, f.nth, f.errno), (FaultOn::Read, 1, libc::EIO));
        for bad in [
            "",
            "write",
            "write:0:EIO",
            "write:3",
            "wrte:3:EIO",
            "read:2:EPERM",
            "read:2:EIO:x",
        ] {
            let e = SwapFault::parse(bad).unwrap_err();
            assert!(
                e.contains(SWAP_FAULT_ENV) && e.contains("write:3:ENOSPC"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_kth_transfer_of_a_file_under_the_folder_fails() {
        let dir = tempfile::tempdir().unwrap();
        let fault = SwapFault::parse("write:2:EIO").unwrap();
        inject_swap_fault(dir.path(), fault);
        let a = FaultCounter::for_path(&dir.path().join("a/b.swp"));
        let b = FaultCounter::for_path(&dir.path().join("c.swp"));
        assert!(a.count(FaultOn::Read).is_ok());
        assert!(a.count(FaultOn::Write).is_ok());
        // The files under the folder are counted together.
        let e = b.count(FaultOn::Write).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        assert!(a.count(FaultOn::Write).is_ok(), "only the k-th fails");
        let other = FaultCounter::for_path(Path::new("/elsewhere/c.swp"));
        assert!((0..5).all(|_| other.count(FaultOn::Write).is_ok()));
    }
}
