//! Moving a staged checkpoint into place: `meta.json`, then one atomic rename or exchange,
//! then `latest`; what stands at the tag is replaced only when it is a complete checkpoint,
//! and a failed save's staging directory is removed (see [`super::files`] for the layout).

use std::fs;
use std::path::{Path, PathBuf};

use super::CheckpointMeta;
use super::files::{check_tag, io_err, refuse, sha256_hex, sync_dir, unique_suffix, write_synced};
use crate::{DeepSpeedError, Result};

/// Refuses to save as `dir/tag` where something other than a complete checkpoint stands (a
/// file, a link, or a folder without `meta.json`, such as a log folder): saving replaces what
/// is there.
pub fn check_target(dir: &Path, tag: &str) -> Result<()> {
    let target = dir.join(tag);
    let Ok(m) = fs::symlink_metadata(&target) else {
        return Ok(());
    };
    match m.is_dir() && target.join("meta.json").is_file() {
        true => Ok(()),
        false => Err(refuse(
            &target,
            "exists and is not a checkpoint (no meta.json), so it is not replaced; choose \
             another tag or move it away",
        )),
    }
}

/// Writes `meta.json` and `meta.sha256` into the staging directory, syncs it, moves it to
/// `dir/tag` in one atomic step (replacing an older checkpoint of that tag), and points
/// `latest` at it.
pub fn commit_checkpoint(
    dir: &Path,
    tag: &str,
    staging: &Path,
    meta: &CheckpointMeta,
) -> Result<PathBuf> {
    check_tag(tag)?;
    let json = serde_json::to_vec_pretty(meta)
        .map_err(|e| DeepSpeedError::Checkpoint(format!("metadata: {e}")))?;
    write_synced(&staging.join("meta.json"), &json)?;
    write_synced(&staging.join("meta.sha256"), sha256_hex(&json).as_bytes())?;
    sync_dir(staging)?;
    check_target(dir, tag)?;
    let target = dir.join(tag);
    if fs::symlink_metadata(&target).is_ok() {
        replace_dir(staging, &target)?;
    } else {
        fs::rename(staging, &target).map_err(|e| io_err(staging, e))?;
    }
    sync_dir(dir)?;
    let latest_tmp = dir.join(format!(".latest.partial-{:016x}", unique_suffix()));
    write_synced(&latest_tmp, tag.as_bytes())?;
    let latest = dir.join("latest");
    fs::rename(&latest_tmp, &latest).map_err(|e| io_err(&latest, e))?;
    sync_dir(dir)?;
    Ok(target)
}

/// Puts the complete directory `new` at `target`, which holds an older one, so that `target`
/// is at every instant one of the two: an atomic exchange, then the old one (now at `new`'s
/// path) is removed. Where the file system cannot exchange (shared file systems), the old one
/// is first moved aside under a hidden name of its own, synced, then replaced (a crash
/// between the two renames leaves `target` missing and the old checkpoint under that name).
pub(crate) fn replace_dir(new: &Path, target: &Path) -> Result<()> {
    let parent = target.parent().unwrap_or(Path::new("."));
    if exchange(new, target).is_ok() {
        sync_dir(parent)?;
        return fs::remove_dir_all(new).map_err(|e| io_err(new, e));
    }
    let name = target
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into());
    let old = parent.join(format!(".{name}.old-{:016x}", unique_suffix()));
    fs::rename(target, &old).map_err(|e| io_err(target, e))?;
    sync_dir(parent)?;
    fs::rename(new, target).map_err(|e| io_err(new, e))?;
    sync_dir(parent)?;
    fs::remove_dir_all(&old).map_err(|e| io_err(&old, e))
}

/// Removes the staging directory of a save that failed (its files are of no use).
pub(crate) fn discard_staging(staging: &Path) {
    if let Err(e) = fs::remove_dir_all(staging)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %staging.display(), error = %e, "could not remove a failed save's staging folder");
    }
}

/// Atomically exchanges two directory entries (Linux `renameat2` with `RENAME_EXCHANGE`).
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both paths are valid NUL-terminated strings that outlive the call; the call
    // only reads them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Elsewhere there is no atomic exchange: [`replace_dir`] falls back to two renames.
#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}
