//! The checkpoint format on disk: one directory per tag with a `meta.json` and the state files
//! it lists, each with its length and checksum, written atomically. The protocol that decides
//! which rank writes and reads what is in `protocol.rs` beside this file.
//!
//! Layout of `DIR`:
//! - `DIR/TAG/meta.json`: format, version, step, world size, ZeRO stage, optimizer, the
//!   parameter ids and shapes, and for each file its length and FNV-1a 64 checksum;
//! - `DIR/TAG/model.bin`: the parameters, f32 little-endian, in layout order;
//! - `DIR/TAG/optim.bin`: the optimizer state (Burn's burnpack bytes, or the 1-bit state);
//! - `DIR/latest`: the tag of the newest complete checkpoint (DeepSpeed's `latest` file).
//!
//! At ZeRO stage 0 every rank holds the same state, so rank 0 writes it and any world size can
//! load it. At stages 1 and 2 each rank also writes its slice of the optimizer state,
//! `DIR/TAG/zero_pp_rank_R_optim_states.bin` (DeepSpeed's name); the slices are contiguous
//! pieces of one flat state, so a load at another world size re-cuts them. A checkpoint is
//! first written to a hidden directory and renamed into place, and
//! `latest` is replaced by a rename too: a crash leaves the previous checkpoint intact.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use burn_deepspeed_strategies::onebit::OneBitState;
use burn_deepspeed_strategies::zero::PartitionState;
use serde::{Deserialize, Serialize};

use crate::{DeepSpeedError, Result};

/// Name of the format in `meta.json`.
pub const CHECKPOINT_FORMAT: &str = "burn-deepspeed-checkpoint";
/// Version of the format written.
pub const CHECKPOINT_VERSION: u32 = 1;

/// One state file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointFile {
    /// File name inside the tag directory.
    pub name: String,
    /// Length in bytes.
    pub bytes: u64,
    /// FNV-1a 64 checksum, hex.
    pub fnv64: String,
}

/// `meta.json`: what a checkpoint holds and what it needs to be loaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Always [`CHECKPOINT_FORMAT`].
    pub format: String,
    /// [`CHECKPOINT_VERSION`] when written.
    pub version: u32,
    /// Optimizer steps taken.
    pub global_step: u64,
    /// World size that wrote it.
    pub world_size: usize,
    /// ZeRO stage that wrote it.
    pub zero_stage: u8,
    /// The optimizer type, as in the config.
    pub optimizer: String,
    /// For 1-bit optimizers: whether the compression stage had begun.
    pub compressing: Option<bool>,
    /// Parameter ids in layout order (restored into the model, so the optimizer state, which
    /// Burn keys by id, finds its parameters).
    pub param_ids: Vec<u64>,
    /// Parameter shapes in layout order.
    pub shapes: Vec<Vec<usize>>,
    /// The state files.
    pub files: Vec<CheckpointFile>,
}

/// FNV-1a, 64 bits.
pub fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn io_err(path: &Path, e: std::io::Error) -> DeepSpeedError {
    DeepSpeedError::Checkpoint(format!("{}: {e}", path.display()))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))
}

/// Refuses a tag that is not a plain directory name.
pub fn check_tag(tag: &str) -> Result<()> {
    if tag.is_empty() || tag.starts_with('.') || tag.contains(['/', '\\']) {
        return Err(DeepSpeedError::Checkpoint(format!(
            "tag `{tag}` must be a plain, non-hidden directory name"
        )));
    }
    Ok(())
}

/// The hidden directory checkpoint `tag` is staged in before it is renamed into place.
/// `writer` tells concurrent writers apart (one process: its id; ranks that write together
/// must agree on it).
pub fn staging_dir(dir: &Path, tag: &str, writer: &str) -> PathBuf {
    dir.join(format!(".{tag}.partial-{writer}"))
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

/// Writes one state file into the staging directory, synced, and describes it.
pub fn write_state_file(staging: &Path, name: &str, bytes: &[u8]) -> Result<CheckpointFile> {
    write_synced(&staging.join(name), bytes)?;
    Ok(CheckpointFile {
        name: name.to_string(),
        bytes: bytes.len() as u64,
        fnv64: format!("{:016x}", fnv64(bytes)),
    })
}

/// Writes `meta.json` into the staging directory, renames it to `dir/tag` (replacing an older
/// checkpoint of that tag) and points `latest` at it.
pub fn commit_checkpoint(
    dir: &Path,
    tag: &str,
    staging: &Path,
    meta: &CheckpointMeta,
) -> Result<PathBuf> {
    let json = serde_json::to_vec_pretty(meta).expect("metadata serializes");
    write_synced(&staging.join("meta.json"), &json)?;
    let target = dir.join(tag);
    if target.exists() {
        let old = dir.join(format!(".{tag}.old-{}", std::process::id()));
        fs::rename(&target, &old).map_err(|e| io_err(&target, e))?;
        fs::rename(staging, &target).map_err(|e| io_err(staging, e))?;
        fs::remove_dir_all(&old).map_err(|e| io_err(&old, e))?;
    } else {
        fs::rename(staging, &target).map_err(|e| io_err(staging, e))?;
    }
    let latest_tmp = dir.join(format!(".latest.partial-{}", std::process::id()));
    write_synced(&latest_tmp, tag.as_bytes())?;
    let latest = dir.join("latest");
    fs::rename(&latest_tmp, &latest).map_err(|e| io_err(&latest, e))?;
    if let Ok(d) = File::open(dir) {
        // Make the renames durable where the platform allows syncing a directory.
        let _ = d.sync_all();
    }
    Ok(target)
}

/// Writes `files` and `meta` as checkpoint `tag` under `dir` and points `latest` at it (one
/// writer).
pub fn write_checkpoint(
    dir: &Path,
    tag: &str,
    mut meta: CheckpointMeta,
    files: &[(&str, Vec<u8>)],
) -> Result<PathBuf> {
    check_tag(tag)?;
    let staging = staging_dir(dir, tag, &std::process::id().to_string());
    create_staging(&staging)?;
    meta.files.clear();
    for (name, bytes) in files {
        meta.files.push(write_state_file(&staging, name, bytes)?);
    }
    commit_checkpoint(dir, tag, &staging, &meta)
}

/// Reads checkpoint `tag` (or the one `latest` names) under `dir`: its metadata and its files
/// in the order listed, each checked against its recorded length and checksum.
pub fn read_checkpoint(dir: &Path, tag: Option<&str>) -> Result<(CheckpointMeta, Vec<Vec<u8>>)> {
    let tag = match tag {
        Some(t) => t.to_string(),
        None => {
            let latest = dir.join("latest");
            fs::read_to_string(&latest)
                .map_err(|e| io_err(&latest, e))?
                .trim()
                .to_string()
        }
    };
    let root = dir.join(&tag);
    let meta_path = root.join("meta.json");
    let text = fs::read(&meta_path).map_err(|e| io_err(&meta_path, e))?;
    let meta: CheckpointMeta = serde_json::from_slice(&text).map_err(|e| {
        DeepSpeedError::Checkpoint(format!(
            "{} is not valid metadata: {e}",
            meta_path.display()
        ))
    })?;
    if meta.format != CHECKPOINT_FORMAT || meta.version != CHECKPOINT_VERSION {
        return Err(DeepSpeedError::Checkpoint(format!(
            "{}: format `{}` version {}; this build reads `{CHECKPOINT_FORMAT}` version \
             {CHECKPOINT_VERSION}",
            meta_path.display(),
            meta.format,
            meta.version
        )));
    }
    let mut out = Vec::with_capacity(meta.files.len());
    for f in &meta.files {
        let path = root.join(&f.name);
        let bytes = fs::read(&path).map_err(|e| io_err(&path, e))?;
        let sum = format!("{:016x}", fnv64(&bytes));
        if bytes.len() as u64 != f.bytes || sum != f.fnv64 {
            return Err(DeepSpeedError::Checkpoint(format!(
                "{} is corrupt: {} bytes with checksum {sum}, the metadata records {} bytes \
                 with checksum {}",
                path.display(),
                bytes.len(),
                f.bytes,
                f.fnv64
            )));
        }
        out.push(bytes);
    }
    Ok((meta, out))
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Little-endian bytes as f32 values (the length must be a multiple of 4).
pub fn f32_values(bytes: &[u8], what: &str) -> Result<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(DeepSpeedError::Checkpoint(format!(
            "{what}: {} bytes is not a whole number of f32 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A 1-bit optimizer state as bytes: step (u64), buffer count (u32), then per buffer its name
/// length (u32), name, element count (u64) and f32 values; all little-endian.
pub fn one_bit_state_bytes(state: &OneBitState) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(state.step.to_le_bytes());
    out.extend((state.buffers.len() as u32).to_le_bytes());
    for (name, values) in &state.buffers {
        out.extend((name.len() as u32).to_le_bytes());
        out.extend(name.as_bytes());
        out.extend((values.len() as u64).to_le_bytes());
        out.extend(f32_bytes(values));
    }
    out
}

/// Parses [`one_bit_state_bytes`].
pub fn one_bit_state_from_bytes(bytes: &[u8]) -> Result<OneBitState> {
    let truncated = || DeepSpeedError::Checkpoint("1-bit optimizer state is truncated".into());
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let s = bytes.get(at..at + n).ok_or_else(truncated)?;
        at += n;
        Ok(s)
    };
    let u64_of = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let u32_of = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
    let step = u64_of(take(8)?);
    let count = u32_of(take(4)?) as usize;
    let mut buffers = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let len = u32_of(take(4)?) as usize;
        let name = String::from_utf8(take(len)?.to_vec())
            .map_err(|_| DeepSpeedError::Checkpoint("1-bit state: a name is not UTF-8".into()))?;
        let n = u64_of(take(8)?) as usize;
        let values = f32_values(take(n.checked_mul(4).ok_or_else(truncated)?)?, &name)?;
        buffers.push((name, values));
    }
    Ok(OneBitState { step, buffers })
}

/// A ZeRO stage 1/2 slice's state as bytes: tensor count (u32), per-tensor steps (u32), slice
/// length (u64), then m and v (f32); all little-endian.
pub fn partition_state_bytes(state: &PartitionState) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + 4 * state.steps.len() + 8 * state.m.len());
    out.extend((state.steps.len() as u32).to_le_bytes());
    state.steps.iter().for_each(|s| out.extend(s.to_le_bytes()));
    out.extend((state.m.len() as u64).to_le_bytes());
    out.extend(f32_bytes(&state.m));
    out.extend(f32_bytes(&state.v));
    out
}

/// Parses [`partition_state_bytes`].
pub fn partition_state_from_bytes(bytes: &[u8], what: &str) -> Result<PartitionState> {
    let bad = |detail: &str| DeepSpeedError::Checkpoint(format!("{what}: {detail}"));
    let count = u32::from_le_bytes(
        bytes
            .get(..4)
            .ok_or_else(|| bad("truncated"))?
            .try_into()
            .expect("4 bytes"),
    ) as usize;
    let steps_end = 4 + 4 * count;
    let steps: Vec<u32> = bytes
        .get(4..steps_end)
        .ok_or_else(|| bad("truncated step counts"))?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let len = u64::from_le_bytes(
        bytes
            .get(steps_end..steps_end + 8)
            .ok_or_else(|| bad("truncated"))?
            .try_into()
            .expect("8 bytes"),
    ) as usize;
    let body = &bytes[steps_end + 8..];
    if body.len() != 8 * len {
        return Err(bad(&format!(
            "{} bytes of moments for a slice of {len} elements",
            body.len()
        )));
    }
    Ok(PartitionState {
        steps,
        m: f32_values(&body[..4 * len], what)?,
        v: f32_values(&body[4 * len..], what)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> CheckpointMeta {
        CheckpointMeta {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            global_step: 7,
            world_size: 2,
            zero_stage: 0,
            optimizer: "AdamW".into(),
            compressing: None,
            param_ids: vec![1, 2],
            shapes: vec![vec![2], vec![1]],
            files: Vec::new(),
        }
    }

    #[test]
    fn round_trip_and_latest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = [("model.bin", f32_bytes(&[1.0, 2.0, 3.0]))];
        write_checkpoint(dir.path(), "step_7", meta(), &files).expect("write");
        let (m, data) = read_checkpoint(dir.path(), None).expect("read");
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
        let files = [("model.bin", f32_bytes(&[1.0, 2.0]))];
        let root = write_checkpoint(dir.path(), "a", meta(), &files).expect("write");
        let mut bytes = fs::read(root.join("model.bin")).expect("read");
        bytes[3] ^= 0x40;
        fs::write(root.join("model.bin"), &bytes).expect("corrupt");
        let err = read_checkpoint(dir.path(), Some("a"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("model.bin is corrupt"), "{err}");

        let mut other = meta();
        other.version = 99;
        write_checkpoint(dir.path(), "b", other, &files).expect("write");
        let err = read_checkpoint(dir.path(), Some("b"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("version 99"), "{err}");
        let err = read_checkpoint(dir.path(), Some("missing"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing"), "{err}");
        assert!(write_checkpoint(dir.path(), "../x", meta(), &files).is_err());
    }

    #[test]
    fn one_bit_state_round_trips() {
        let state = OneBitState {
            step: 42,
            buffers: vec![("m".into(), vec![0.5, -1.0]), ("scaling".into(), vec![])],
        };
        let bytes = one_bit_state_bytes(&state);
        assert_eq!(one_bit_state_from_bytes(&bytes).expect("parse"), state);
        let err = one_bit_state_from_bytes(&bytes[..bytes.len() - 1]).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}
