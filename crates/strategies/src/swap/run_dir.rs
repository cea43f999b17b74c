//! [`fresh_dir`]: a folder of its own for one store's swap files. Stores that share an
//! `nvme_path` (the tensor-parallel ranks of one job, whose data-parallel ranks have the same
//! numbers, or two jobs launched with one config) then never share a file, and one store's
//! end never removes another's file.

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};

use crate::{CommError, Result};

/// The folders this process made with [`fresh_dir`] and has not removed yet.
fn made() -> MutexGuard<'static, HashSet<PathBuf>> {
    static MADE: LazyLock<Mutex<HashSet<PathBuf>>> = LazyLock::new(Mutex::default);
    MADE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Makes a new, empty folder `parent/{name}-{pid}-{n}` (`parent` is created if missing): never
/// an existing folder, whoever made it. A [`SwapFile`](super::SwapFile) in it removes it
/// when the last file in it is removed.
pub fn fresh_dir(parent: &Path, name: &str) -> Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let error = |path: &Path, source| CommError::Swap {
        path: path.to_path_buf(),
        op: "create",
        source,
    };
    std::fs::create_dir_all(parent).map_err(|e| error(parent, e))?;
    let pid = std::process::id();
    // A folder of that name exists only when another process of the same id made it (the id
    // was reused): the next number is free.
    for _ in 0..1024 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = parent.join(format!("{name}-{pid}-{n}"));
        match std::fs::create_dir(&dir) {
            Ok(()) => {
                made().insert(dir.clone());
                return Ok(dir);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(error(&dir, e)),
        }
    }
    let taken = io::Error::new(io::ErrorKind::AlreadyExists, "1024 names were taken");
    Err(error(&parent.join(format!("{name}-{pid}-*")), taken))
}

/// Removes `dir` if this process made it with [`fresh_dir`] and it is empty now.
pub(super) fn release_dir(dir: &Path) {
    let mut made = made();
    if made.contains(dir) && std::fs::remove_dir(dir).is_ok() {
        made.remove(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each call makes a folder no one had; only this process's folders are removed, and only
    /// when empty.
    #[test]
    fn fresh_folders_are_new_and_removed_when_empty() {
        let parent = tempfile::tempdir().unwrap();
        let base = parent.path().join("zero_stage_2/optimizer");
        let a = fresh_dir(&base, "rank0").unwrap();
        let b = fresh_dir(&base, "rank0").unwrap();
        assert_ne!(a, b);
        assert!(a.is_dir() && b.is_dir());
        std::fs::write(a.join("keep"), b"x").unwrap();
        release_dir(&a);
        assert!(a.is_dir(), "a folder with a file stays");
        release_dir(&b);
        assert!(!b.exists(), "an empty folder this process made goes");
        let theirs = base.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        release_dir(&theirs);
        assert!(theirs.is_dir(), "a folder made by someone else stays");
    }
}
