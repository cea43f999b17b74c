//! The checkpoint format on disk: one directory per tag with a `meta.json` and the state files
//! it lists, each with its length and checksum, written atomically. The protocol that decides
//! which rank writes and reads what is in `protocol.rs` beside this file; what `meta.json`
//! holds is in `meta.rs`, and how the state files encode their values in `state.rs`.
//!
//! Layout of `DIR`:
//! - `DIR/TAG/meta.json`: format, version, step, world size, ZeRO stage, optimizer, the
//!   parameter ids and shapes, and for each file its length and SHA-256;
//! - `DIR/TAG/meta.sha256`: the SHA-256 of `meta.json` itself;
//! - `DIR/TAG/model.bin`: the parameters, f32 little-endian, in layout order;
//! - `DIR/TAG/optim.bin`: the optimizer state (Burn's burnpack bytes, or the 1-bit state);
//! - `DIR/latest`: the tag of the newest complete checkpoint (DeepSpeed's `latest` file).
//!
//! At ZeRO stage 0 every rank holds the same state, so rank 0 writes it and any world size can
//! load it. At stages 1 and 2 each rank also writes its slice of the optimizer state,
//! `DIR/TAG/zero_pp_rank_R_optim_states.bin` (DeepSpeed's name); the slices are contiguous
//! pieces of one flat state, so a load at another world size re-cuts them.
//!
//! Saving is atomic under a crash at any point (`kill -9` included): a checkpoint is written
//! into a hidden staging directory with a name no other job uses, every file and the
//! directory are synced, and it is moved into place in one step: a rename, or, when the tag
//! exists already, an atomic exchange of the two directories (Linux `renameat2`
//! `RENAME_EXCHANGE`), so `DIR/TAG` is always either the old or the new complete checkpoint.
//! `latest` is replaced by a rename afterwards (`commit.rs` beside this file). A crash leaves
//! at most a hidden staging directory behind, which no load reads.
//!
//! Reading, which trusts nothing on disk, is `read.rs` beside this file.

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::progress::TaskProgress;
use crate::{DeepSpeedError, Result};

use super::commit::{check_target, commit_checkpoint, discard_staging};
use super::meta::*;
use super::state::SliceState;

/// SHA-256 of `bytes`, as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

pub(crate) fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn refuse(path: &Path, why: impl std::fmt::Display) -> DeepSpeedError {
    DeepSpeedError::Checkpoint(format!("{}: {why}", path.display()))
}

pub(crate) fn io_err(path: &Path, e: std::io::Error) -> DeepSpeedError {
    DeepSpeedError::Checkpoint(format!("{}: {e}", path.display()))
}

/// Checkpoints of at least this many bytes show a progress bar while written or read (on a
/// terminal, and on rank 0 only).
pub const PROGRESS_MIN_BYTES: u64 = 64 << 20;

/// Files are written, read and hashed in pieces of this size, each one counted on the bar.
pub(crate) const PIECE: usize = 8 << 20;

/// A bar over `total` bytes of checkpoint I/O, shown when `show` and the checkpoint is large.
pub(crate) fn io_bar(label: &str, total: u64, show: bool) -> TaskProgress {
    TaskProgress::bytes(label, total, show && total >= PROGRESS_MIN_BYTES)
}

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))
}

/// Syncs a directory, so that the entries created or renamed in it survive a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, e))
}

/// Why `name` is not a plain, visible name of an entry of one directory: empty, `.` or
/// `..`-like (hidden), with a path separator or a drive colon, with a NUL or other control
/// character, or longer than 255 bytes. Tags and file names must pass, so that nothing is
/// read or written outside the checkpoint directory.
pub(crate) fn name_problem(what: &str, name: &str) -> Option<String> {
    let bad = name.is_empty()
        || name.len() > 255
        || name.starts_with('.')
        || name
            .chars()
            .any(|c| c.is_control() || matches!(c, '/' | '\\' | ':'));
    bad.then(|| {
        format!(
            "{what} `{}` must be a plain, non-hidden name inside the checkpoint directory",
            name.escape_debug()
        )
    })
}

/// Refuses a name that is not a plain, visible directory entry (see `name_problem`).
pub fn check_name(what: &str, name: &str) -> Result<()> {
    name_problem(what, name).map_or(Ok(()), |why| Err(DeepSpeedError::Checkpoint(why)))
}

/// Refuses a tag that is not a plain directory name (see [`check_name`]), and `latest`, the
/// name of the file that names the newest checkpoint.
pub fn check_tag(tag: &str) -> Result<()> {
    check_name("tag", tag)?;
    match tag == "latest" {
        true => Err(DeepSpeedError::Checkpoint(
            "tag `latest` is reserved: DIR/latest is the file naming the newest checkpoint; \
             choose another tag"
                .into(),
        )),
        false => Ok(()),
    }
}

/// A name for a staging directory that no other writer uses: this process's id, the time and
/// a counter. Ranks that write one checkpoint together use rank 0's.
pub fn unique_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    (u64::from(std::process::id()) << 32) ^ nanos ^ n.rotate_left(48)
}

/// The hidden directory checkpoint `tag` is staged in before it is moved into place;
/// `suffix` (see [`unique_suffix`]) keeps concurrent writers apart.
pub fn staging_dir(dir: &Path, tag: &str, suffix: u64) -> PathBuf {
    dir.join(format!(".{tag}.partial-{suffix:016x}"))
}

/// Creates an empty staging directory (removing a stale one).
pub fn create_staging(staging: &Path) -> Result<()> {
    if let Some(parent) = staging.parent() {
        fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
    }
    if staging.exists() {
        fs::remove_dir_all(staging).map_err(|e| io_err(staging, e))?;
    }
    fs::create_dir(staging).map_err(|e| io_err(staging, e))
}

/// Writes a rank's optimizer slice into the staging directory as file `name`, synced, and
/// describes it; with `show` (rank 0) a large file shows a progress bar on a terminal. The
/// slice's pieces are written where they belong as they come, so an offloaded slice is read
/// from its swap file and written tile by tile.
pub fn write_slice_file(
    staging: &Path,
    name: &str,
    slice: SliceState,
    show: bool,
) -> Result<CheckpointFile> {
    let declared = slice.bytes;
    let bar = io_bar(&format!("checkpoint save {name}"), declared, show);
    let written = (|| {
        let mut file = StateFileWriter::create(staging, name, &bar)?;
        slice.write_to(&mut |at, piece| file.write_at(at, piece))?;
        file.finish()
    })();
    bar.finish();
    let written = written?;
    if written.bytes != declared {
        return Err(DeepSpeedError::Checkpoint(format!(
            "{name}: {} bytes written of a slice of {declared}",
            written.bytes
        )));
    }
    Ok(written)
}

/// [`StateFileWriter`] for `bytes`, counting them on `bar`.
fn write_state_file_counted(
    staging: &Path,
    name: &str,
    bytes: &[u8],
    bar: &TaskProgress,
) -> Result<CheckpointFile> {
    let mut file = StateFileWriter::create(staging, name, bar)?;
    file.write(bytes)?;
    file.finish()
}

/// A state file written into the staging directory piece by piece as its bytes arrive (the
/// parameters gathered tensor by tensor, the moments of a swapped slice tile by tile), and
/// synced when finished: the writer never holds the whole file. Pieces written in order are
/// hashed on the way; a file written out of order is hashed by reading it back once.
pub struct StateFileWriter<'b> {
    file: File,
    path: PathBuf,
    name: String,
    hasher: Sha256,
    /// How far the file is hashed, while its pieces arrive in order.
    hashed: u64,
    in_order: bool,
    /// The end of the furthest piece written.
    end: u64,
    bar: &'b TaskProgress,
}

impl<'b> StateFileWriter<'b> {
    /// Creates file `name` in `staging`, counting the bytes written on `bar`.
    pub fn create(staging: &Path, name: &str, bar: &'b TaskProgress) -> Result<Self> {
        let path = staging.join(name);
        // Readable too: a file written out of order is hashed by reading it back.
        let file = (fs::OpenOptions::new().read(true).write(true).create(true))
            .truncate(true)
            .open(&path)
            .map_err(|e| io_err(&path, e))?;
        bar.set_message(name.to_string());
        Ok(Self {
            file,
            path,
            name: name.to_string(),
            hasher: Sha256::new(),
            hashed: 0,
            in_order: true,
            end: 0,
            bar,
        })
    }

    /// Appends `bytes`.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.write_at(self.end, bytes)
    }

    /// Writes `bytes` at byte `offset`.
    pub fn write_at(&mut self, offset: u64, bytes: &[u8]) -> Result<()> {
        let mut at = offset;
        for piece in bytes.chunks(PIECE) {
            (self.file)
                .write_all_at(piece, at)
                .map_err(|e| io_err(&self.path, e))?;
            if self.in_order && at == self.hashed {
                self.hasher.update(piece);
                self.hashed += piece.len() as u64;
            } else {
                self.in_order = false;
            }
            at += piece.len() as u64;
            self.end = self.end.max(at);
            self.bar.inc(piece.len() as u64);
        }
        Ok(())
    }

    /// Syncs the file and describes it.
    pub fn finish(mut self) -> Result<CheckpointFile> {
        self.file.sync_all().map_err(|e| io_err(&self.path, e))?;
        if !self.in_order || self.hashed != self.end {
            self.hasher = Sha256::new();
            let mut buf = vec![0u8; PIECE];
            let mut at = 0;
            while at < self.end {
                let n = PIECE.min((self.end - at) as usize);
                (self.file)
                    .read_exact_at(&mut buf[..n], at)
                    .map_err(|e| io_err(&self.path, e))?;
                self.hasher.update(&buf[..n]);
                at += n as u64;
            }
        }
        Ok(CheckpointFile {
            name: self.name,
            bytes: self.end,
            sha256: hex(&self.hasher.finalize()),
        })
    }
}

/// Writes `files` and `meta` as checkpoint `tag` under `dir` and points `latest` at it (one
/// writer; a large checkpoint shows a progress bar on a terminal).
pub fn write_checkpoint(
    dir: &Path,
    tag: &str,
    mut meta: CheckpointMeta,
    files: &[(&str, Vec<u8>)],
) -> Result<PathBuf> {
    check_tag(tag)?;
    check_target(dir, tag)?;
    let staging = staging_dir(dir, tag, unique_suffix());
    create_staging(&staging)?;
    let written = (|| {
        meta.files.clear();
        let total = files.iter().map(|(_, b)| b.len() as u64).sum();
        let bar = io_bar("checkpoint save", total, true);
        for (name, bytes) in files {
            meta.files
                .push(write_state_file_counted(&staging, name, bytes, &bar)?);
        }
        bar.finish();
        commit_checkpoint(dir, tag, &staging, &meta)
    })();
    if written.is_err() {
        discard_staging(&staging);
    }
    written
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::checkpoint::commit::replace_dir;
    use crate::checkpoint::read::{read_checkpoint, read_hashed, read_latest};
    use crate::checkpoint::state::{f32_bytes, f32_values};

    #[test]
    fn large_files_are_written_and_read_piece_by_piece_with_one_hash() {
        // Two and a half pieces: the last one short.
        let len = 2 * PIECE + PIECE / 2;
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let dir = tempfile::tempdir().expect("tempdir");
        let saved = io_bar("save", len as u64, false);
        let file = write_state_file_counted(dir.path(), "big.bin", &bytes, &saved).expect("write");
        assert_eq!(saved.position(), len as u64);
        assert_eq!(file.sha256, sha256_hex(&bytes));
        let loaded = io_bar("load", len as u64, false);
        let open = File::open(dir.path().join("big.bin")).expect("open");
        let (back, read, sum) = read_hashed(open, len as u64, &loaded, true).expect("read");
        assert_eq!(
            (back == bytes, read, &sum),
            (true, len as u64, &file.sha256)
        );
        assert_eq!(loaded.position(), len as u64);
        // Checked without being kept: the same hash, nothing held.
        let open = File::open(dir.path().join("big.bin")).expect("open");
        let (none, read, same) = read_hashed(open, len as u64, &loaded, false).expect("read");
        assert_eq!((none.len(), read, same), (0, len as u64, file.sha256));
        // A file longer than recorded is read only up to its record.
        let open = File::open(dir.path().join("big.bin")).expect("open");
        let (head, _, sum) = read_hashed(open, 100, &loaded, true).expect("read");
        assert_eq!((head.len(), sum), (100, sha256_hex(&bytes[..100])));
    }

    #[test]
    fn slices_written_out_of_order_are_whole_and_hashed() {
        let len = 2 * PIECE + 77;
        let bytes: Vec<u8> = (0..len).map(|i| (i * 17 % 253) as u8).collect();
        let dir = tempfile::tempdir().expect("tempdir");
        // The pieces arrive as an offloaded slice's tiles do: m and v of each tile in turn.
        let (a, b) = (PIECE / 3, PIECE + PIECE / 2);
        let order = [0..a, b..b + 1000, a..b, b + 1000..len];
        let slice = SliceState::streamed(len as u64, |sink| {
            order
                .iter()
                .try_for_each(|r| sink(r.start as u64, &bytes[r.clone()]))
        });
        let file = write_slice_file(dir.path(), "slice.bin", slice, false).expect("write");
        let back = fs::read(dir.path().join("slice.bin")).expect("read");
        assert!(back == bytes, "the file holds the pieces where they belong");
        assert_eq!((file.bytes, file.sha256), (len as u64, sha256_hex(&bytes)));
        // In order, the hash is taken on the way: the same result.
        let held = SliceState::held(bytes.clone());
        let file = write_slice_file(dir.path(), "held.bin", held, false).expect("write");
        assert_eq!(file.sha256, sha256_hex(&bytes));
        // A slice that writes less than it declared is refused, naming the file.
        let short = SliceState::streamed(len as u64, |sink| sink(0, &bytes[..10]));
        let err = write_slice_file(dir.path(), "short.bin", short, false).unwrap_err();
        assert!(err.to_string().contains("short.bin"), "{err}");
    }

    /// A stage-0 checkpoint's metadata of two tensors (3 elements) on 2 ranks.
    pub(crate) fn meta() -> CheckpointMeta {
        CheckpointMeta {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            global_step: 7,
            skipped_steps: 0,
            world_size: 2,
            zero_stage: 0,
            optimizer: "AdamW".into(),
            compressing: None,
            param_ids: vec![1, 2],
            shapes: vec![vec![2], vec![1]],
            paths: vec!["layer.weight".into(), "layer.bias".into()],
            loss_scaler: None,
            dtype: None,
            ep_size: None,
            files: Vec::new(),
        }
    }

    /// A whole checkpoint of [`meta`]'s stage-0 model of 3 elements.
    fn whole(values: [f32; 3]) -> [(&'static str, Vec<u8>); 2] {
        [
            ("model.bin", f32_bytes(&values)),
            ("optim.bin", vec![7; 16]),
        ]
    }

    #[test]
    fn round_trip_and_latest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = whole([1.0, 2.0, 3.0]);
        write_checkpoint(dir.path(), "step_7", meta(), &files).expect("write");
        let (m, data) =
            read_checkpoint(dir.path(), &read_latest(dir.path()).expect("latest"), false)
                .expect("read");
        assert_eq!(m.global_step, 7);
        assert_eq!(m.files[0].bytes, 12);
        assert_eq!(
            f32_values(&data[0], "model").expect("f32"),
            vec![1.0, 2.0, 3.0]
        );
        // Overwriting a tag replaces it whole; no partial directories remain.
        write_checkpoint(dir.path(), "step_7", meta(), &files).expect("rewrite");
        let names: Vec<String> = fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn corrupt_or_foreign_checkpoints_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = whole([1.0, 2.0, 3.0]);
        let root = write_checkpoint(dir.path(), "a", meta(), &files).expect("write");
        let mut bytes = fs::read(root.join("model.bin")).expect("read");
        bytes[3] ^= 0x40;
        fs::write(root.join("model.bin"), &bytes).expect("corrupt");
        let err = read_checkpoint(dir.path(), "a", false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("model.bin: is corrupt"), "{err}");

        let mut other = meta();
        other.version = 99;
        write_checkpoint(dir.path(), "b", other, &files).expect("write");
        let err = read_checkpoint(dir.path(), "b", false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("version 99"), "{err}");
        let err = read_checkpoint(dir.path(), "missing", false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
        assert!(write_checkpoint(dir.path(), "../x", meta(), &files).is_err());
    }

    /// The tag `latest` and a folder that is not a checkpoint are refused, and what stands
    /// there keeps its contents; a checkpoint of the same tag is still replaced.
    #[test]
    fn saving_never_destroys_what_is_not_a_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = [("model.bin", f32_bytes(&[1.0, 2.0]))];
        write_checkpoint(dir.path(), "step_1", meta(), &files).expect("write");
        let e = write_checkpoint(dir.path(), "latest", meta(), &files).unwrap_err();
        assert!(e.to_string().contains("reserved"), "{e}");
        assert_eq!(read_latest(dir.path()).expect("latest"), "step_1");
        let logs = dir.path().join("tensorboard");
        fs::create_dir(&logs).expect("mkdir");
        fs::write(logs.join("events.out"), b"a job's log").expect("write");
        let e = write_checkpoint(dir.path(), "tensorboard", meta(), &files).unwrap_err();
        assert!(e.to_string().contains("is not a checkpoint"), "{e}");
        assert_eq!(
            fs::read(logs.join("events.out")).expect("kept"),
            b"a job's log"
        );
        fs::write(dir.path().join("notes"), b"x").expect("write");
        assert!(write_checkpoint(dir.path(), "notes", meta(), &files).is_err());
        write_checkpoint(dir.path(), "step_1", meta(), &files).expect("replace a checkpoint");
    }

    /// A save that fails after staging leaves no staging folder behind, and the fallback
    /// replace (no atomic exchange) leaves only the new checkpoint.
    #[test]
    fn failed_saves_leave_nothing_behind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = [("no/such/folder.bin", f32_bytes(&[1.0]))];
        assert!(write_checkpoint(dir.path(), "t", meta(), &files).is_err());
        let left: Vec<_> = fs::read_dir(dir.path()).expect("list").collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        let files = [("model.bin", f32_bytes(&[1.0, 2.0]))];
        let old = write_checkpoint(dir.path(), "t", meta(), &files).expect("write");
        let new = dir.path().join(".t.partial-new");
        fs::create_dir(&new).expect("mkdir");
        fs::write(new.join("meta.json"), b"{}").expect("write");
        replace_dir(&new, &old).expect("replace");
        let names: Vec<String> = fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert_eq!(fs::read(old.join("meta.json")).expect("new one"), b"{}");
    }
}
