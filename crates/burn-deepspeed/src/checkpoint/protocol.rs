//! The checkpoint protocol: which rank writes what, how the ranks agree that a save
//! succeeded, and how a checkpoint written at one world size (and ZeRO stage) is read back and
//! cut for another.
//!
//! - A replicated state (ZeRO stage 0, Burn's or a 1-bit optimizer) is the same on every rank:
//!   rank 0 writes `model.bin` and `optim.bin`.
//! - Partitioned states (stages 1-3) are written by every rank into one staging directory
//!   (which every rank must see): rank 0 creates it and says so, each rank writes its slice
//!   `zero_pp_rank_R_optim_states.bin` and reports its length and checksum (one all-gather),
//!   and rank 0 adds `model.bin`, writing each tensor as it arrives (at stage 3 gathered one
//!   tensor at a time), and commits.
//! - Every rank learns whether rank 0's commit succeeded (one broadcast). Every fallible
//!   local phase (serializing the state, creating the staging directory, writing a slice)
//!   ends in an agreement before the next collective, so a rank's failure fails every rank.
//! - On load, rank 0 decides the tag (the one asked for, or the one `latest` names) and
//!   broadcasts it; the ranks share the checking of the files (each file's length and SHA-256
//!   by one rank) and agree that every check passed before anything changes; then each rank
//!   reads only the byte ranges of the files that its own partition covers ([`Loaded`]),
//!   whatever the world size that saved them (contiguous slices at stages 1-2, each rank's
//!   pieces of every tensor at stage 3).

use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, agree_on_digest};
use burn_deepspeed_strategies::zero::PartitionState;
use sha2::Digest;

use super::files::io_bar;
use super::{
    CheckpointFile, CheckpointMeta, Loaded, SliceState, StateFileWriter, check_tag, check_target,
    commit_checkpoint, common_steps, create_staging, discard_staging, f32_bytes, numel_of,
    partition_state_bytes, partition_state_from_bytes, read_latest, read_meta, saved_spans,
    staging_dir, unique_suffix, verify_files, write_checkpoint, write_slice_file,
};
use crate::sync::{GradSync, ParamSink, SavedState};
use crate::{DeepSpeedError, Result, agreed};

/// The name of rank `rank`'s optimizer slice in a partitioned checkpoint.
pub fn partition_file(rank: usize) -> String {
    format!("zero_pp_rank_{rank}_optim_states.bin")
}

/// Saves checkpoint `tag` under `dir` (see the module docs). Collective: every rank calls it
/// with its `sync` and `model`; `meta` describes the engine (its files are filled in here).
pub fn save<M: Module>(
    dir: &Path,
    tag: &str,
    comm: &dyn Communicator,
    sync: &dyn GradSync<M>,
    model: &M,
    meta: CheckpointMeta,
) -> Result<PathBuf> {
    let root = comm.rank() == 0;
    // Rank 0 writes `dir/tag`: it checks what stands there now, before any work.
    let checked = check_tag(tag).and_then(|()| match root {
        true => check_target(dir, tag),
        false => Ok(()),
    });
    agreed(comm, "checkpoint tag", checked)?;
    let state = agreed(comm, "checkpoint state", sync.save(root))?;
    // Every rank takes part in gathering the whole parameters (at stage 3, and with expert
    // parallelism, a collective); rank 0 writes them.
    let stream = |sink: Option<ParamSink>| sync.stream_params(model, sink);
    let written = match state {
        SavedState::Replicated(optim) => {
            let mut params = Vec::new();
            let mut collect = |p: &[f32]| params.extend_from_slice(p);
            stream(root.then_some(&mut collect as ParamSink))?;
            match optim {
                Some(optim) => {
                    let files = [("model.bin", f32_bytes(&params)), ("optim.bin", optim)];
                    // Rank 0 writes alone: the others wait for it past the collective timeout.
                    comm.solo("checkpoint write", || {
                        write_checkpoint(dir, tag, meta, &files)
                    })
                }
                None => Ok(dir.join(tag)),
            }
        }
        SavedState::Slice(state) => write_slices(dir, tag, comm, state, &stream, meta),
    };
    // Every rank learns whether rank 0's commit succeeded.
    let mut ok = [u8::from(written.is_ok())];
    comm.broadcast(&mut ok, 0)?;
    if ok[0] == 0 && written.is_ok() {
        return Err(DeepSpeedError::Checkpoint(format!(
            "rank 0 could not write {}",
            dir.join(tag).display()
        )));
    }
    written
}

/// The whole parameters handed to a sink where one is given (a collective; see
/// [`GradSync::stream_params`]).
type ParamStream<'a> = dyn Fn(Option<ParamSink>) -> Result<()> + 'a;

/// Every rank stages its optimizer slice; rank 0 adds the model (from `params`) and commits.
fn write_slices(
    dir: &Path,
    tag: &str,
    comm: &dyn Communicator,
    state: SliceState,
    params: &ParamStream,
    meta: CheckpointMeta,
) -> Result<PathBuf> {
    // Rank 0's name for the staging directory, unique to this save.
    let mut suffix = unique_suffix().to_le_bytes();
    comm.broadcast(&mut suffix, 0)?;
    let staging = staging_dir(dir, tag, u64::from_le_bytes(suffix));
    let created = if comm.rank() == 0 {
        create_staging(&staging)
    } else {
        Ok(())
    };
    agreed(comm, "checkpoint staging", created)?;
    let written = write_staged(dir, tag, comm, &staging, state, params, meta);
    // A failed save's files are of no use: rank 0 removes them once every rank is past them.
    if written.is_err() && comm.rank() == 0 {
        discard_staging(&staging);
    }
    written
}

/// [`write_slices`] once the staging directory is made.
fn write_staged(
    dir: &Path,
    tag: &str,
    comm: &dyn Communicator,
    staging: &Path,
    state: SliceState,
    params: &ParamStream,
    mut meta: CheckpointMeta,
) -> Result<PathBuf> {
    let mine = agreed(
        comm,
        "checkpoint slice",
        comm.solo("checkpoint write", || {
            write_slice_file(
                staging,
                &partition_file(comm.rank()),
                state,
                comm.rank() == 0,
            )
        }),
    )?;
    // Each rank reports its file's length and SHA-256 so that rank 0 can list every file.
    const RECORD: usize = 8 + 64;
    let mut record = [0u8; RECORD];
    record[..8].copy_from_slice(&mine.bytes.to_le_bytes());
    record[8..].copy_from_slice(mine.sha256.as_bytes());
    let mut all = vec![0u8; RECORD * comm.world_size()];
    comm.all_gather_equal(&record, &mut all)?;
    // The parameters arrive tensor by tensor (gathered at stage 3) and rank 0 writes each
    // as it comes, so that no rank holds the whole model; a failed write is reported after
    // the gathers, which every rank finishes.
    let root = comm.rank() == 0;
    let total = numel_of(&meta.shapes).map_or(0, |n| 4 * n as u64);
    let bar = io_bar("checkpoint save model.bin", total, root);
    let mut writer = root.then(|| StateFileWriter::create(staging, "model.bin", &bar));
    let mut failed = None;
    let mut sink = |p: &[f32]| {
        if let Some(Ok(w)) = writer.as_mut()
            && failed.is_none()
        {
            failed = w.write(&f32_bytes(p)).err();
        }
    };
    params(root.then_some(&mut sink as ParamSink))?;
    let Some(writer) = writer else {
        return Ok(dir.join(tag));
    };
    // Rank 0 finishes the model and commits alone: the others wait for it in the broadcast
    // that says how it went, past the collective timeout.
    let committed = comm.solo("checkpoint write", || {
        if let Some(e) = failed {
            return Err(e);
        }
        meta.files = vec![writer?.finish()?];
        for (r, c) in all.chunks(RECORD).enumerate() {
            meta.files.push(CheckpointFile {
                name: partition_file(r),
                bytes: u64::from_le_bytes(c[..8].try_into().expect("8 bytes")),
                sha256: String::from_utf8_lossy(&c[8..]).into_owned(),
            });
        }
        commit_checkpoint(dir, tag, staging, &meta)
    });
    bar.finish();
    committed
}

/// Opens checkpoint `tag` (default: the one `dir/latest` names, read by rank 0 and broadcast)
/// and checks it against the engine `expected` describes: a ZeRO stage it can load (stages
/// 1-3 load each other's), the same optimizer, and the same parameter shapes. A collective:
/// the ranks share the checking of the files' lengths and SHA-256 (file `i` of the load order
/// by rank `i mod N`, read piece by piece and not kept; the files must be visible to every
/// rank), and every rank fails when one rank's check fails. The regime then reads only the
/// byte ranges it needs ([`Loaded`]).
pub fn load(
    dir: &Path,
    tag: Option<&str>,
    expected: &CheckpointMeta,
    comm: &dyn Communicator,
) -> Result<Loaded> {
    let tag = decide_tag(dir, tag, comm)?;
    let show = comm.rank() == 0;
    let loaded = agreed(
        comm,
        "checkpoint read",
        comm.solo("checkpoint read", || {
            read_and_check(dir, &tag, expected, comm, show)
        }),
    )?;
    // Every rank read the files itself: they must have read the same checkpoint (a
    // directory replaced during the load, or a host that sees another copy, would not).
    let text = serde_json::to_vec(&loaded.meta)
        .map_err(|e| DeepSpeedError::Checkpoint(format!("meta.json does not serialize: {e}")))?;
    let digest = sha2::Sha256::digest(&text);
    agree_on_digest(comm, "checkpoint metadata (meta.json)", &digest)?;
    Ok(loaded)
}

/// Rank 0's tag: `tag`, or the one `dir/latest` names; every rank gets it.
fn decide_tag(dir: &Path, tag: Option<&str>, comm: &dyn Communicator) -> Result<String> {
    let mine = if comm.rank() == 0 {
        match tag {
            Some(t) => check_tag(t).map(|()| t.to_string()),
            None => read_latest(dir),
        }
    } else {
        Ok(String::new())
    };
    let mine = agreed(comm, "checkpoint tag", mine)?;
    if comm.world_size() == 1 {
        return Ok(mine);
    }
    let mut len = (mine.len() as u64).to_le_bytes();
    comm.broadcast(&mut len, 0)?;
    let mut bytes = mine.into_bytes();
    bytes.resize(u64::from_le_bytes(len) as usize, 0);
    comm.broadcast(&mut bytes, 0)?;
    String::from_utf8(bytes)
        .map_err(|_| DeepSpeedError::Checkpoint("rank 0 sent a tag that is not UTF-8".into()))
}

/// Checkpoint `tag` checked against `expected`, and this rank's share of its files checked.
fn read_and_check(
    dir: &Path,
    tag: &str,
    expected: &CheckpointMeta,
    comm: &dyn Communicator,
    show: bool,
) -> Result<Loaded> {
    // The metadata is checked against the engine before any state file is opened, so that
    // every file's length is bounded by this model's shapes.
    let meta = read_meta(dir, tag)?;
    let refuse = |what: String| Err(DeepSpeedError::Checkpoint(what));
    let stage = expected.zero_stage;
    let partitioned = |s: u8| (1..=3).contains(&s);
    if meta.zero_stage != stage && !(partitioned(meta.zero_stage) && partitioned(stage)) {
        return refuse(format!(
            "written at ZeRO stage {}; this engine runs stage {stage}",
            meta.zero_stage
        ));
    }
    // At stage 0 an fp32 run keeps Burn's optimizer record, and a 16-bit or an
    // expert-parallel run the flat state of its fp32 masters: neither reads the other's. The
    // partitioned stages share one format. (1-bit optimizers step flat buffers in both, so
    // theirs load either way.)
    let flat = |m: &CheckpointMeta| m.dtype.is_some() || m.ep_size.is_some_and(|n| n > 1);
    if stage == 0 && meta.compressing.is_none() && flat(&meta) != flat(expected) {
        let name = |m: &CheckpointMeta| match (&m.dtype, m.ep_size) {
            (Some(d), _) => d.clone(),
            (None, Some(ep)) if ep > 1 => format!("fp32 with expert parallelism (ep_size {ep})"),
            (None, _) => "fp32".into(),
        };
        return refuse(format!(
            "written at ZeRO stage 0 by a run in {}; this engine trains in {}, and at stage 0 \
             the two keep different optimizer states (Burn's optimizer record, or the flat \
             state of fp32 masters; load it at ZeRO stage 1, 2 or 3, where all of them load \
             into each other)",
            name(&meta),
            name(expected)
        ));
    }
    if meta.optimizer != expected.optimizer {
        return refuse(format!(
            "written by optimizer {}; the config names {}",
            meta.optimizer, expected.optimizer
        ));
    }
    let shapes = &expected.shapes;
    if &meta.shapes != shapes || meta.param_ids.len() != shapes.len() {
        let count = |s: &[Vec<usize>]| numel_of(s).map_or("too many".into(), |n| n.to_string());
        return refuse(format!(
            "it holds {} parameters in {} tensors; this model has {} in {} (or the shapes \
             differ)",
            count(&meta.shapes),
            meta.shapes.len(),
            count(shapes),
            shapes.len()
        ));
    }
    let (rank, world) = (comm.rank(), comm.world_size());
    verify_files(dir, tag, &meta, &|i| i % world == rank, show)?;
    Ok(Loaded::on_disk(meta, dir.join(tag)))
}

/// The refusal of a rank that steps with its caller's optimizer and so keeps no state.
pub fn no_state_to_restore() -> DeepSpeedError {
    DeepSpeedError::Checkpoint(
        "this rank steps with its caller's optimizer and keeps no optimizer state to save or \
         restore"
            .into(),
    )
}

/// Every rank's optimizer slice `state` joined into the whole state (steps, and m and v in
/// layout order) on every rank: a collective (two all-gathers). `stage` says how the slices
/// were cut (see [`join_slices`]).
pub fn gather_state(
    comm: &dyn Communicator,
    state: &PartitionState,
    sizes: &[usize],
    stage: u8,
) -> Result<PartitionState> {
    let world = comm.world_size();
    let slices = all_gather_bytes(comm, &partition_state_bytes(state))?
        .iter()
        .enumerate()
        .map(|(r, bytes)| partition_state_from_bytes(bytes, &partition_file(r)))
        .collect::<Result<Vec<_>>>()?;
    join_slices(slices, sizes, stage, world)
}

/// Every rank's `mine` (any length, empty included), in rank order: a collective (two
/// all-gathers: the lengths as u64 little-endian bytes, then the bytes themselves).
pub fn all_gather_bytes(comm: &dyn Communicator, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let mut lengths = vec![0u8; 8 * comm.world_size()];
    comm.all_gather_equal(&(mine.len() as u64).to_le_bytes(), &mut lengths)?;
    let counts: Vec<usize> = lengths
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
        .collect();
    let mut all = vec![0u8; counts.iter().sum()];
    comm.all_gather(mine, &mut all, &counts)?;
    let mut at = 0;
    Ok(counts
        .iter()
        .map(|&n| {
            at += n;
            all[at - n..at].to_vec()
        })
        .collect())
}

/// Every rank's `mine` at rank 0, in rank order (`None` on the other ranks): a collective of
/// point-to-point messages (each rank's length as u64 little-endian bytes, then its bytes),
/// so that only rank 0 holds them all.
pub fn gather_bytes(comm: &dyn Communicator, mine: &[u8]) -> Result<Option<Vec<Vec<u8>>>> {
    const TAG: u16 = 0x6761;
    if comm.rank() != 0 {
        comm.send(&(mine.len() as u64).to_le_bytes(), 0, TAG)?;
        comm.send(mine, 0, TAG)?;
        return Ok(None);
    }
    let mut parts = vec![mine.to_vec()];
    for rank in 1..comm.world_size() {
        let mut len = [0u8; 8];
        comm.recv(&mut len, rank, TAG)?;
        let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
        comm.recv(&mut bytes, rank, TAG)?;
        parts.push(bytes);
    }
    Ok(Some(parts))
}

/// The whole optimizer state (steps, and m and v in layout order) from the slices that
/// `world` ranks saved at ZeRO stage `stage`: contiguous slices at stages 1 and 2, each
/// rank's pieces of every tensor at stage 3.
pub fn join_slices(
    slices: Vec<PartitionState>,
    sizes: &[usize],
    stage: u8,
    world: usize,
) -> Result<PartitionState> {
    let numel: usize = sizes.iter().sum();
    if let Some((r, s)) = slices
        .iter()
        .enumerate()
        .find(|(_, s)| s.steps.len() != sizes.len())
    {
        return Err(DeepSpeedError::Checkpoint(format!(
            "{} holds the state of {} tensors; this model has {} (a slice of another model?)",
            partition_file(r),
            s.steps.len(),
            sizes.len()
        )));
    }
    let steps = common_steps(slices.iter().map(|s| s.steps.as_slice()), sizes.len())?;
    if slices.len() != world {
        return Err(DeepSpeedError::Checkpoint(format!(
            "{} optimizer slices; expected {world}",
            slices.len()
        )));
    }
    let lens: Vec<usize> = slices.iter().map(|s| s.m.len()).collect();
    let spans = saved_spans(&lens, sizes, stage)?;
    let (mut m, mut v) = (vec![0.0f32; numel], vec![0.0f32; numel]);
    for (s, segments) in slices.iter().zip(&spans) {
        for seg in segments {
            m[seg.global.clone()].copy_from_slice(&s.m[seg.local.clone()]);
            v[seg.global.clone()].copy_from_slice(&s.v[seg.local.clone()]);
        }
    }
    Ok(PartitionState { steps, m, v })
}

/// The state of a rank that owns the flat element `ranges` (back to back) of the whole state.
pub fn cut_state(whole: &PartitionState, ranges: &[Range<usize>]) -> PartitionState {
    let len = ranges.iter().map(|r| r.len()).sum();
    let (mut m, mut v) = (Vec::with_capacity(len), Vec::with_capacity(len));
    for r in ranges {
        m.extend_from_slice(&whole.m[r.clone()]);
        v.extend_from_slice(&whole.v[r.clone()]);
    }
    PartitionState {
        steps: whole.steps.clone(),
        m,
        v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(steps: u32, m: Vec<f32>) -> PartitionState {
        let v = m.iter().map(|x| 2.0 * x).collect();
        PartitionState {
            steps: vec![steps; 2],
            m,
            v,
        }
    }

    /// Rank 0 receives every rank's bytes (of any length) in rank order; the others none.
    #[test]
    fn bytes_gather_at_rank_0() {
        use burn_deepspeed_strategies::comm::{ThreadWorld, ThreadWorldOptions};
        let out = ThreadWorld::run(3, ThreadWorldOptions::default(), |c| {
            let mine = vec![c.rank() as u8; 2 * c.rank()];
            gather_bytes(&c, &mine).expect("gathered")
        });
        let out: Vec<_> = out.into_iter().map(|r| r.expect("no panic")).collect();
        assert_eq!(out[0], Some(vec![vec![], vec![1, 1], vec![2, 2, 2, 2]]));
        assert_eq!(out[1..], [None, None]);
    }

    /// Contiguous slices of two ranks join into the whole state and cut again for three.
    #[test]
    fn slices_join_and_cut_at_another_world_size() {
        let sizes = [3, 2];
        let slices = vec![state(4, vec![0.0, 1.0, 2.0]), state(4, vec![3.0, 4.0])];
        let whole = join_slices(slices, &sizes, 1, 2).expect("join");
        assert_eq!(whole.m, vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(whole.v, vec![0.0, 2.0, 4.0, 6.0, 8.0]);
        let cut = cut_state(&whole, &[1..2, 3..5]);
        assert_eq!(cut.m, vec![1.0, 3.0, 4.0]);
        assert_eq!(cut.steps, vec![4, 4]);
    }

    /// Slices that disagree on the steps, or do not add up to the model, are refused.
    #[test]
    fn mismatched_slices_are_refused() {
        let sizes = [3, 2];
        let err = join_slices(
            vec![state(4, vec![0.0; 3]), state(5, vec![0.0; 2])],
            &sizes,
            1,
            2,
        )
        .unwrap_err();
        assert!(err.to_string().contains("disagree"), "{err}");
        let err = join_slices(vec![state(4, vec![0.0; 5])], &[5], 1, 1).unwrap_err();
        assert!(err.to_string().contains("state of 2 tensors"), "{err}");
        let err = join_slices(vec![state(4, vec![0.0; 4])], &sizes, 1, 1).unwrap_err();
        assert!(err.to_string().contains("hold 4 elements"), "{err}");
    }
}
