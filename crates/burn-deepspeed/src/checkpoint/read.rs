//! Reading a checkpoint from disk, trusting nothing on it: `latest`, the tag and every file
//! name must be plain names inside `DIR`; the tag directory and the files must be a real
//! directory and regular files (no symbolic links, FIFOs or devices, checked on the open
//! descriptor); `meta.json` is read only up to [`MAX_META_BYTES`] and must match
//! `meta.sha256`; the files are the ones the metadata's stage and world size call for, found
//! by name, each with a length its shapes allow, compared with `meta.json` before it is read,
//! and its SHA-256 after.

use std::fs::{self, File};
use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::Result;
use crate::progress::TaskProgress;

use super::files::{PIECE, check_tag, hex, io_bar, io_err, name_problem, refuse, sha256_hex};
use super::meta::*;

/// The tag `dir/latest` names, checked to be a plain name.
pub fn read_latest(dir: &Path) -> Result<String> {
    let latest = dir.join("latest");
    let bytes = read_capped(&latest, MAX_LATEST_BYTES)?;
    let tag = String::from_utf8(bytes)
        .map_err(|_| refuse(&latest, "is not UTF-8"))?
        .trim()
        .to_string();
    match name_problem("the tag it names", &tag) {
        Some(why) => Err(refuse(&latest, why)),
        None => Ok(tag),
    }
}

/// Opens `path` for reading when it is a regular file (not a symbolic link, a directory or a
/// device) and returns it with its length.
pub(crate) fn open_regular(path: &Path) -> Result<(File, u64)> {
    // Opened without following a link (`O_NOFOLLOW`) and without waiting on a FIFO
    // (`O_NONBLOCK`), then checked on the open descriptor: no check-then-open race in which the
    // path is swapped for a link or a device between the two.
    let mut options = fs::OpenOptions::new();
    options.read(true);
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let file = match options.open(path) {
        Ok(f) => f,
        #[cfg(target_os = "linux")]
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(refuse(path, "is not a regular file (a symbolic link)"));
        }
        Err(e) => return Err(io_err(path, e)),
    };
    let info = file.metadata().map_err(|e| io_err(path, e))?;
    if !info.file_type().is_file() {
        return Err(refuse(path, "is not a regular file"));
    }
    Ok((file, info.len()))
}

/// The contents of the regular file `path`, refused when longer than `cap` bytes.
fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>> {
    let (file, len) = open_regular(path)?;
    if len > cap {
        return Err(refuse(path, format!("{len} bytes; at most {cap} are read")));
    }
    let mut out = Vec::with_capacity(len as usize);
    file.take(cap + 1)
        .read_to_end(&mut out)
        .map_err(|e| io_err(path, e))?;
    if out.len() as u64 > cap {
        return Err(refuse(path, format!("grew past {cap} bytes while read")));
    }
    Ok(out)
}

/// At most `len` bytes of `file`, read piece by piece and hashed as they arrive (one pass),
/// with the hex SHA-256 of what was read; each piece is counted on `bar`. With `keep` the
/// bytes are returned, taken piece by piece as they arrive (and refused cleanly when memory is
/// short); without, only one piece is held at a time and the bytes returned are empty, with
/// their count.
pub(crate) fn read_hashed(
    file: File,
    len: u64,
    bar: &TaskProgress,
    keep: bool,
) -> std::io::Result<(Vec<u8>, u64, String)> {
    let mut bytes = Vec::new();
    let mut hasher = Sha256::new();
    let mut file = file.take(len);
    let mut total = 0u64;
    loop {
        if !keep {
            bytes.clear();
        }
        let at = bytes.len();
        let room = usize::try_from(len.saturating_sub(total).min(PIECE as u64))
            .map_err(std::io::Error::other)?;
        bytes
            .try_reserve_exact(room)
            .map_err(std::io::Error::other)?;
        let read = (&mut file).take(PIECE as u64).read_to_end(&mut bytes)?;
        if read == 0 {
            break;
        }
        hasher.update(&bytes[at..]);
        total += read as u64;
        bar.inc(read as u64);
    }
    if !keep {
        bytes = Vec::new();
    }
    Ok((bytes, total, hex(&hasher.finalize())))
}

/// Reads checkpoint `tag` under `dir`: its metadata (checked against `meta.sha256`) and all
/// its files, `model.bin` first, then the optimizer's (see [`read_files`]). With `show`
/// (rank 0) a large checkpoint shows a progress bar on a terminal.
pub fn read_checkpoint(
    dir: &Path,
    tag: &str,
    show: bool,
) -> Result<(CheckpointMeta, Vec<Vec<u8>>)> {
    let meta = read_meta(dir, tag)?;
    let files = read_files(dir, tag, &meta, usize::MAX, show)?;
    Ok((meta, files))
}

/// Reads and checks the metadata of checkpoint `tag` under `dir` (against `meta.sha256`,
/// the format, and `check_meta`: names, ids, shapes, and the files the stage and world
/// size call for, with lengths their shapes allow), before any state file is opened.
pub fn read_meta(dir: &Path, tag: &str) -> Result<CheckpointMeta> {
    check_tag(tag)?;
    let root = dir.join(tag);
    let info = fs::symlink_metadata(&root).map_err(|e| io_err(&root, e))?;
    if !info.file_type().is_dir() {
        return Err(refuse(&root, "is not a directory"));
    }
    let meta_path = root.join("meta.json");
    let text = read_capped(&meta_path, MAX_META_BYTES)?;
    let sum_path = root.join("meta.sha256");
    let recorded = read_capped(&sum_path, 128)?;
    let sum = sha256_hex(&text);
    if String::from_utf8_lossy(&recorded).trim() != sum {
        return Err(refuse(
            &meta_path,
            format!("is corrupt: its SHA-256 {sum} differs from the one in meta.sha256"),
        ));
    }
    let meta: CheckpointMeta = serde_json::from_slice(&text)
        .map_err(|e| refuse(&meta_path, format!("is not valid metadata: {e}")))?;
    if meta.format != CHECKPOINT_FORMAT || meta.version != CHECKPOINT_VERSION {
        return Err(refuse(
            &meta_path,
            format!(
                "format `{}` version {}; this build reads `{CHECKPOINT_FORMAT}` version \
                 {CHECKPOINT_VERSION}",
                meta.format, meta.version
            ),
        ));
    }
    check_meta(&meta).map_err(|e| refuse(&meta_path, e))?;
    Ok(meta)
}

/// The first `count` state files of checkpoint `tag` (whose checked metadata is `meta`) in
/// the order a load uses them (`model.bin`, then `optim.bin` or each rank's slice in rank
/// order), each found by its name, never by its position in `meta.json`, and checked for its
/// recorded length (before it is read) and its SHA-256. Memory is taken as the file is read,
/// in pieces, and a length the system cannot provide is an error, not an abort.
pub fn read_files(
    dir: &Path,
    tag: &str,
    meta: &CheckpointMeta,
    count: usize,
    show: bool,
) -> Result<Vec<Vec<u8>>> {
    check_files(dir, tag, meta, &|i| i < count, true, show)
}

/// Checks the state files of checkpoint `tag` (whose checked metadata is `meta`) whose index
/// in the load order (`model.bin` first, see [`read_files`]) `mine` selects: each one's
/// length and SHA-256, read piece by piece and never held whole. The ranks of a load share
/// this work, each checking some of the files, and read afterwards only the byte ranges they
/// need (`Loaded`).
pub fn verify_files(
    dir: &Path,
    tag: &str,
    meta: &CheckpointMeta,
    mine: &dyn Fn(usize) -> bool,
    show: bool,
) -> Result<()> {
    check_files(dir, tag, meta, mine, false, show).map(drop)
}

/// The files of the load order that `mine` selects, checked; their bytes with `keep`.
fn check_files(
    dir: &Path,
    tag: &str,
    meta: &CheckpointMeta,
    mine: &dyn Fn(usize) -> bool,
    keep: bool,
    show: bool,
) -> Result<Vec<Vec<u8>>> {
    let root = dir.join(tag);
    let wanted: Vec<&CheckpointFile> = load_order(&root, meta)?
        .into_iter()
        .enumerate()
        .filter(|(i, _)| mine(*i))
        .map(|(_, f)| f)
        .collect();
    let total = wanted.iter().map(|f| f.bytes).sum();
    let bar = io_bar(
        if keep {
            "checkpoint load"
        } else {
            "checkpoint check"
        },
        total,
        show,
    );
    let mut out = Vec::with_capacity(wanted.len());
    for f in wanted {
        let path = root.join(&f.name);
        let file = open_recorded(&path, f.bytes)?;
        bar.set_message(f.name.clone());
        let (bytes, read, sum) =
            read_hashed(file, f.bytes, &bar, keep).map_err(|e| io_err(&path, e))?;
        if read != f.bytes || sum != f.sha256 {
            return Err(refuse(
                &path,
                format!(
                    "is corrupt: {read} bytes with SHA-256 {sum}, the metadata records {} bytes \
                     with SHA-256 {}",
                    f.bytes, f.sha256
                ),
            ));
        }
        out.push(bytes);
    }
    bar.finish();
    Ok(out)
}

/// The state files of a checkpoint whose checked metadata is `meta`, as `meta.json` lists
/// them, in the order a load uses them (`model.bin`, then `optim.bin` or each rank's slice in
/// rank order), found by name; a missing one is refused.
pub(crate) fn load_order<'m>(
    root: &Path,
    meta: &'m CheckpointMeta,
) -> Result<Vec<&'m CheckpointFile>> {
    let expected = expected_files(meta).map_err(|e| refuse(&root.join("meta.json"), e))?;
    let listed = |name: &str| meta.files.iter().find(|f| f.name == name);
    expected
        .iter()
        .map(|e| listed(&e.name).ok_or_else(|| refuse(root, format!("has no {}", e.name))))
        .collect()
}

/// Opens the regular file `path` and checks that its length is the `recorded` one, before
/// anything is read from it.
pub(crate) fn open_recorded(path: &Path, recorded: u64) -> Result<File> {
    let (file, len) = open_regular(path)?;
    if len != recorded {
        return Err(refuse(
            path,
            format!(
                "is corrupt: {len} bytes, the metadata records {recorded} (truncated or \
                 replaced)"
            ),
        ));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::files::tests::meta;
    use crate::checkpoint::files::write_checkpoint;
    use crate::checkpoint::state::f32_bytes;

    /// Files are found by name whatever the order `meta.json` lists them in (taken by
    /// position, a reordered list swapped the ranks' optimizer slices), and a listed length
    /// the shapes cannot explain, a missing file or a foreign one is refused before any state
    /// file is read.
    #[test]
    fn files_are_found_by_name_and_bounded_by_the_shapes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let partitioned = CheckpointMeta {
            zero_stage: 2,
            ..meta()
        };
        let (slice0, slice1) = (vec![0u8; 20], vec![1u8; 24]);
        let files = [
            ("model.bin", f32_bytes(&[1.0, 2.0, 3.0])),
            ("zero_pp_rank_0_optim_states.bin", slice0.clone()),
            ("zero_pp_rank_1_optim_states.bin", slice1.clone()),
        ];
        let root = write_checkpoint(dir.path(), "t", partitioned, &files).expect("write");
        let rewrite = |edit: &dyn Fn(&mut CheckpointMeta)| {
            let path = root.join("meta.json");
            let mut m: CheckpointMeta =
                serde_json::from_slice(&fs::read(&path).expect("read")).expect("json");
            edit(&mut m);
            let text = serde_json::to_vec_pretty(&m).expect("json");
            fs::write(&path, &text).expect("write");
            fs::write(root.join("meta.sha256"), sha256_hex(&text)).expect("write");
        };
        rewrite(&|m| m.files.reverse());
        let (_, data) = read_checkpoint(dir.path(), "t", false).expect("read");
        assert_eq!(data[0], f32_bytes(&[1.0, 2.0, 3.0]));
        assert_eq!((&data[1], &data[2]), (&slice0, &slice1), "by name");
        // A huge (sparse) slice listed with its true length: refused by its bound.
        let entry = |m: &mut CheckpointMeta, name: &str| {
            m.files.iter().position(|f| f.name == name).expect("listed")
        };
        let slice = "zero_pp_rank_1_optim_states.bin";
        rewrite(&|m| {
            let at = entry(m, slice);
            m.files[at].bytes = 1 << 40;
        });
        let e = read_checkpoint(dir.path(), "t", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("meta.json") && e.contains("at most 44 bytes"),
            "{e}"
        );
        rewrite(&|m| {
            let at = entry(m, slice);
            m.files[at].bytes = 24;
            let at = entry(m, "model.bin");
            m.files[at].bytes = 16;
        });
        let e = read_checkpoint(dir.path(), "t", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("records 16 bytes for `model.bin`") && e.contains("exactly 12"),
            "{e}"
        );
        rewrite(&|m| {
            let at = entry(m, "model.bin");
            m.files[at].bytes = 12;
            let at = entry(m, slice);
            m.files[at].name = "zero_pp_rank_2_optim_states.bin".into();
        });
        let e = read_checkpoint(dir.path(), "t", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`zero_pp_rank_2_optim_states.bin`") && e.contains("does not have"),
            "{e}"
        );
        rewrite(&|m| {
            let at = entry(m, "zero_pp_rank_2_optim_states.bin");
            m.files.remove(at);
        });
        let e = read_checkpoint(dir.path(), "t", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("does not list the file `zero_pp_rank_1_optim_states.bin`"),
            "{e}"
        );
        // More steps skipped than taken (the step core subtracted them).
        rewrite(&|m| m.skipped_steps = m.global_step + 1);
        let e = read_checkpoint(dir.path(), "t", false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("8 skipped steps of 7 steps taken"), "{e}");
    }
}
