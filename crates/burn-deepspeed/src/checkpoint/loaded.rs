//! A checkpoint whose metadata and files have been checked, read on demand: a rank reads only
//! the byte ranges of the files it needs, so a resume at stage 3 holds this rank's pieces of
//! the parameters and of the optimizer state, not the whole model and every rank's moments
//! (ZeRO, arXiv 1910.02054 §5: partitioned state is only ever needed where it is owned).
//!
//! Which bytes of which saved slice hold a range of the whole flat state is plain data
//! ([`SliceRead`], [`slice_reads`]), tested without files.

use std::fs::File;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::OnceLock;

use burn_deepspeed_strategies::zero::{PartitionState, Segment, ShardPlan};

use super::files::{PIECE, io_err, refuse};
use super::meta::{CheckpointMeta, numel_of};
use super::protocol::partition_file;
use super::read::{load_order, open_recorded};
use crate::{DeepSpeedError, Result};

/// A checkpoint read from disk and checked against the engine that loads it: its metadata,
/// and its files, read as the regime asks for them (see the module docs).
#[derive(Debug)]
pub struct Loaded {
    /// Its metadata.
    pub meta: CheckpointMeta,
    source: Source,
    /// The whole parameters, once read.
    params: OnceLock<Vec<f32>>,
}

#[derive(Debug)]
enum Source {
    /// The checkpoint's directory (`DIR/TAG`), whose files the ranks have checked.
    Disk(PathBuf),
    /// The optimizer files in load order, in memory (a pipeline stage's part of a checkpoint).
    Memory(Vec<Vec<u8>>),
}

/// One state file, open for reads at offsets.
enum Opened<'a> {
    File(File, PathBuf),
    Bytes(&'a [u8]),
}

impl Opened<'_> {
    /// Fills `buf` from byte `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        match self {
            Opened::File(file, path) => {
                use std::os::unix::fs::FileExt;
                file.read_exact_at(buf, offset).map_err(|e| io_err(path, e))
            }
            Opened::Bytes(bytes) => {
                let at = usize::try_from(offset).unwrap_or(usize::MAX);
                let src = at
                    .checked_add(buf.len())
                    .and_then(|end| bytes.get(at..end))
                    .ok_or_else(|| truncated("an optimizer slice"))?;
                buf.copy_from_slice(src);
                Ok(())
            }
        }
    }

    /// `count` f32 values from byte `offset`, appended to `out`, read in pieces.
    fn read_values(&self, offset: u64, count: usize, out: &mut Vec<f32>) -> Result<()> {
        let mut scratch = vec![0u8; (4 * count).min(PIECE)];
        let mut done = 0;
        while done < count {
            let n = (count - done).min(PIECE / 4);
            let bytes = &mut scratch[..4 * n];
            self.read_at(offset + 4 * done as u64, bytes)?;
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
            done += n;
        }
        Ok(())
    }
}

fn truncated(what: &str) -> DeepSpeedError {
    DeepSpeedError::Checkpoint(format!("{what} is truncated"))
}

impl Loaded {
    /// The checkpoint in directory `root` (`DIR/TAG`), whose metadata `meta` has been checked
    /// and whose files the ranks have checked (`verify_files`).
    pub fn on_disk(meta: CheckpointMeta, root: PathBuf) -> Self {
        Self {
            meta,
            source: Source::Disk(root),
            params: OnceLock::new(),
        }
    }

    /// A checkpoint held in memory: the whole `params` and the optimizer `files` in load order
    /// (`optim.bin`, or each rank's slice in rank order).
    pub fn in_memory(meta: CheckpointMeta, params: Vec<f32>, files: Vec<Vec<u8>>) -> Self {
        Self {
            meta,
            source: Source::Memory(files),
            params: OnceLock::from(params),
        }
    }

    /// File `index` of the load order (`model.bin` is 0), opened and checked for its length.
    fn open(&self, index: usize) -> Result<Opened<'_>> {
        match &self.source {
            Source::Disk(root) => {
                let files = load_order(root, &self.meta)?;
                let f = files.get(index).ok_or_else(|| {
                    refuse(
                        root,
                        format!("has no state file number {index} in load order"),
                    )
                })?;
                let path = root.join(&f.name);
                let file = open_recorded(&path, f.bytes)?;
                Ok(Opened::File(file, path))
            }
            Source::Memory(files) => (index.checked_sub(1))
                .and_then(|i| files.get(i))
                .map(|b| Opened::Bytes(b))
                .ok_or_else(|| {
                    DeepSpeedError::Checkpoint(format!(
                        "the checkpoint held in memory has no state file number {index}"
                    ))
                }),
        }
    }

    /// The length of file `index` of the load order, as recorded.
    fn file_len(&self, index: usize) -> Result<u64> {
        match &self.source {
            Source::Disk(root) => Ok(load_order(root, &self.meta)?
                .get(index)
                .map_or(0, |f| f.bytes)),
            Source::Memory(files) => Ok((index.checked_sub(1))
                .and_then(|i| files.get(i))
                .map_or(0, |b| b.len() as u64)),
        }
    }

    fn numel(&self) -> Result<usize> {
        numel_of(&self.meta.shapes)
            .ok_or_else(|| DeepSpeedError::Checkpoint("its shapes overflow".into()))
    }

    /// The whole parameters, flat in layout order (read once, then kept).
    pub fn params(&self) -> Result<&[f32]> {
        if let Some(p) = self.params.get() {
            return Ok(p);
        }
        let numel = self.numel()?;
        let mut values = Vec::new();
        values
            .try_reserve_exact(numel)
            .map_err(|e| DeepSpeedError::Checkpoint(format!("model.bin: {e}")))?;
        self.open(0)?.read_values(0, numel, &mut values)?;
        Ok(self.params.get_or_init(|| values))
    }

    /// The parameters' flat element `ranges`, back to back, read without the rest.
    pub fn params_in(&self, ranges: &[Range<usize>]) -> Result<Vec<f32>> {
        let numel = self.numel()?;
        if let Some(r) = ranges.iter().find(|r| r.end > numel) {
            return Err(DeepSpeedError::Checkpoint(format!(
                "elements {r:?} of a model of {numel} were asked of model.bin"
            )));
        }
        if let Some(p) = self.params.get() {
            return Ok(ranges.iter().flat_map(|r| &p[r.clone()]).copied().collect());
        }
        let file = self.open(0)?;
        let mut out = Vec::with_capacity(ranges.iter().map(|r| r.len()).sum());
        for r in ranges {
            file.read_values(4 * r.start as u64, r.len(), &mut out)?;
        }
        Ok(out)
    }

    /// The replicated optimizer state (`optim.bin`), whole.
    pub fn replicated_state(&self) -> Result<Vec<u8>> {
        let len = usize::try_from(self.file_len(1)?)
            .map_err(|_| DeepSpeedError::Checkpoint("optim.bin is too large".into()))?;
        let mut bytes = vec![0u8; len];
        self.open(1)?.read_at(0, &mut bytes)?;
        Ok(bytes)
    }

    /// The optimizer state of the flat element `ranges` (back to back) of the whole state of
    /// tensors of `sizes` elements, read from the saved slices' overlapping byte ranges only:
    /// the slices' step counts must agree and their lengths add up to the model.
    pub fn slice_state(&self, sizes: &[usize], ranges: &[Range<usize>]) -> Result<PartitionState> {
        let world = match &self.source {
            Source::Disk(_) => self.meta.world_size,
            Source::Memory(files) => files.len(),
        };
        let files = (0..world)
            .map(|r| self.open(1 + r))
            .collect::<Result<Vec<_>>>()?;
        let mut heads = Vec::with_capacity(world);
        for (r, file) in files.iter().enumerate() {
            heads.push(SliceHead::read(
                file,
                self.file_len(1 + r)?,
                sizes.len(),
                r,
            )?);
        }
        let steps = common_steps(heads.iter().map(|h| h.steps.as_slice()), sizes.len())?;
        let lens: Vec<usize> = heads.iter().map(|h| h.len).collect();
        let spans = saved_spans(&lens, sizes, self.meta.zero_stage)?;
        let numel: usize = sizes.iter().sum();
        if let Some(r) = ranges.iter().find(|r| r.end > numel) {
            return Err(DeepSpeedError::Checkpoint(format!(
                "elements {r:?} of a state of {numel} were asked of the optimizer slices"
            )));
        }
        let len: usize = ranges.iter().map(|r| r.len()).sum();
        let (mut m, mut v) = (Vec::with_capacity(len), Vec::with_capacity(len));
        for read in slice_reads(&spans, ranges) {
            let (file, head) = (&files[read.file], &heads[read.file]);
            let at = head.bytes + 4 * read.local.start as u64;
            file.read_values(at, read.local.len(), &mut m)?;
            file.read_values(at + 4 * head.len as u64, read.local.len(), &mut v)?;
        }
        Ok(PartitionState { steps, m, v })
    }
}

/// The step counts every saved slice (in rank order) holds, refused when two disagree.
pub fn common_steps<'a>(
    mut slices: impl Iterator<Item = &'a [u32]>,
    tensors: usize,
) -> Result<Vec<u32>> {
    let first = slices.next().unwrap_or_default();
    match slices.position(|s| s != first) {
        None => Ok(first.to_vec()),
        Some(r) => Err(DeepSpeedError::Checkpoint(format!(
            "{} and {} disagree on the step counts of {tensors} tensors",
            partition_file(0),
            partition_file(r + 1),
        ))),
    }
}

/// A saved slice's header: its tensors' step counts, its length, and where its moments start.
struct SliceHead {
    steps: Vec<u32>,
    len: usize,
    /// Bytes before m.
    bytes: u64,
}

impl SliceHead {
    /// The header of rank `rank`'s slice `file` (of `file_len` bytes) of a model of `tensors`
    /// tensors, checked against the file's length.
    fn read(file: &Opened, file_len: u64, tensors: usize, rank: usize) -> Result<Self> {
        let name = partition_file(rank);
        let bad = |detail: String| DeepSpeedError::Checkpoint(format!("{name}: {detail}"));
        let mut count = [0u8; 4];
        file.read_at(0, &mut count)?;
        let count = u32::from_le_bytes(count) as usize;
        if count != tensors {
            return Err(bad(format!(
                "holds the state of {count} tensors; this model has {tensors} (a slice of \
                 another model?)"
            )));
        }
        let mut head = vec![0u8; 4 * count + 8];
        file.read_at(4, &mut head)?;
        let steps = head[..4 * count]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let len = u64::from_le_bytes(head[4 * count..].try_into().expect("8 bytes"));
        let bytes = 12 + 4 * count as u64;
        let body = len.checked_mul(8).and_then(|b| b.checked_add(bytes));
        if body != Some(file_len) {
            return Err(bad(format!(
                "{file_len} bytes for a slice of {len} elements of {tensors} tensors"
            )));
        }
        let len = usize::try_from(len).map_err(|_| bad("the slice length overflows".into()))?;
        Ok(Self { steps, len, bytes })
    }
}

/// Where each saved slice's elements sit in the whole flat state, per slice: contiguous
/// slices at ZeRO stages 1 and 2 (of lengths `lens`, in rank order), each rank's pieces of
/// every tensor at stage 3 (of a [`ShardPlan`] over `lens.len()` ranks). Refused when the
/// lengths do not cut a state of tensors of `sizes` elements that way.
pub fn saved_spans(lens: &[usize], sizes: &[usize], stage: u8) -> Result<Vec<Vec<Segment>>> {
    let numel: usize = sizes.iter().sum();
    let world = lens.len();
    let total: usize = lens.iter().sum();
    if total != numel || world == 0 {
        return Err(DeepSpeedError::Checkpoint(format!(
            "{world} optimizer slices hold {total} elements; expected slices of a model of \
             {numel}"
        )));
    }
    if stage == 3 {
        let plan = ShardPlan::new(sizes, world, 0, 0);
        return (0..world)
            .map(|r| match lens[r] == plan.own_len(r) {
                true => Ok(plan.segments(r)),
                false => Err(DeepSpeedError::Checkpoint(format!(
                    "{} holds {} elements; rank {r} of {world} owns {} at stage 3",
                    partition_file(r),
                    lens[r],
                    plan.own_len(r)
                ))),
            })
            .collect();
    }
    let mut at = 0;
    Ok(lens
        .iter()
        .map(|&n| {
            at += n;
            vec![Segment {
                tensor: 0,
                global: at - n..at,
                local: 0..n,
            }]
        })
        .collect())
}

/// One read from a saved slice: its elements `local` (counted from the slice's start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceRead {
    /// The slice (its rank).
    pub file: usize,
    /// Its elements.
    pub local: Range<usize>,
}

/// The reads, in order, that fill the flat element `ranges` (back to back) from slices laid
/// out as `spans` (see [`saved_spans`]): each read's elements follow the previous one's in
/// the output.
pub fn slice_reads(spans: &[Vec<Segment>], ranges: &[Range<usize>]) -> Vec<SliceRead> {
    // Every span, by where it starts in the whole state.
    let mut all: Vec<(usize, &Segment)> = spans
        .iter()
        .enumerate()
        .flat_map(|(file, s)| s.iter().map(move |seg| (file, seg)))
        .filter(|(_, seg)| !seg.global.is_empty())
        .collect();
    all.sort_by_key(|(_, seg)| seg.global.start);
    let mut out = Vec::new();
    for want in ranges {
        let first = all.partition_point(|(_, seg)| seg.global.end <= want.start);
        for (file, seg) in &all[first..] {
            if seg.global.start >= want.end {
                break;
            }
            let (start, end) = (
                want.start.max(seg.global.start),
                want.end.min(seg.global.end),
            );
            let local = seg.local.start + (start - seg.global.start);
            out.push(SliceRead {
                file: *file,
                local: local..local + (end - start),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The read of elements `local` of slice `file`.
    fn read(file: usize, local: Range<usize>) -> SliceRead {
        SliceRead { file, local }
    }

    /// Stage 1-2 slices are contiguous: a range across two slices reads the end of one and
    /// the start of the next.
    #[test]
    fn contiguous_slices_are_read_where_they_overlap() {
        let spans = saved_spans(&[3, 2], &[3, 2], 2).expect("spans");
        let reads = slice_reads(&spans, &[1..2, 2..5]);
        assert_eq!(reads, [read(0, 1..2), read(0, 2..3), read(1, 0..2)]);
        let err = saved_spans(&[3, 1], &[3, 2], 1).unwrap_err().to_string();
        assert!(err.contains("hold 4 elements"), "{err}");
    }

    /// Stage 3 slices hold each rank's chunk of every tensor: a tensor's range reads each
    /// rank's piece of it, in order.
    #[test]
    fn stage_3_slices_are_read_by_chunk() {
        // Tensors of 5 and 3 over 2 ranks: chunks of 3 and 2; rank 0 holds 0..3 and 5..7,
        // rank 1 holds 3..5 and 7..8 (locally 0..2 and 2..3).
        let spans = saved_spans(&[5, 3], &[5, 3], 3).expect("spans");
        let reads = slice_reads(&spans, &[2..5, 5..8]);
        let want = [read(0, 2..3), read(1, 0..2), read(0, 3..5), read(1, 2..3)];
        assert_eq!(reads, want);
        let err = saved_spans(&[4, 4], &[5, 3], 3).unwrap_err().to_string();
        assert!(err.contains("owns 5 at stage 3"), "{err}");
    }

    /// Two saved slices of [`meta`](crate::checkpoint::files::tests::meta)'s model (tensors
    /// of 2 and 1 elements) as a stage-2 checkpoint in memory: ranges are read across them,
    /// and slices that disagree on the steps, or whose length does not fit their header, are
    /// refused naming the slice.
    #[test]
    fn saved_slices_are_read_by_range_and_checked() {
        use crate::checkpoint::files::tests::meta;
        use crate::checkpoint::state::partition_state_bytes;
        let slice = |steps: u32, m: Vec<f32>| {
            let v = m.iter().map(|x| -x).collect();
            partition_state_bytes(&PartitionState {
                steps: vec![steps; 2],
                m,
                v,
            })
        };
        let meta = CheckpointMeta {
            zero_stage: 2,
            ..meta()
        };
        let loaded = |files| Loaded::in_memory(meta.clone(), vec![0.5, 1.5, 2.5], files);
        let (all, tail) = ([0..2, 2..3], [1..2, 2..3]);
        let good = loaded(vec![slice(3, vec![1.0, 2.0]), slice(3, vec![3.0])]);
        let state = good.slice_state(&[2, 1], &tail).expect("read");
        assert_eq!((state.m, state.v), (vec![2.0, 3.0], vec![-2.0, -3.0]));
        assert_eq!(state.steps, vec![3, 3]);
        assert_eq!(
            good.params_in(&[2..3, 0..1]).expect("params"),
            vec![2.5, 0.5]
        );
        let e = loaded(vec![slice(3, vec![1.0, 2.0]), slice(4, vec![3.0])])
            .slice_state(&[2, 1], &all)
            .unwrap_err()
            .to_string();
        assert!(e.contains("disagree on the step counts"), "{e}");
        let mut short = slice(3, vec![3.0]);
        short.truncate(short.len() - 4);
        let e = loaded(vec![slice(3, vec![1.0, 2.0]), short])
            .slice_state(&[2, 1], &all)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("zero_pp_rank_1_optim_states.bin") && e.contains("for a slice of 1"),
            "{e}"
        );
    }

    /// Every element of every range is read exactly once, at any pair of world sizes.
    #[test]
    fn reads_cover_each_range_once() {
        let sizes = [7, 1, 12, 5];
        for stage in [1, 3] {
            for saved in 1..=4 {
                let lens: Vec<usize> = match stage {
                    3 => {
                        let plan = ShardPlan::new(&sizes, saved, 0, 0);
                        (0..saved).map(|r| plan.own_len(r)).collect()
                    }
                    _ => {
                        let n: usize = sizes.iter().sum();
                        (0..saved)
                            .map(|r| n * (r + 1) / saved - n * r / saved)
                            .collect()
                    }
                };
                let spans = saved_spans(&lens, &sizes, stage).expect("spans");
                // The whole state, element i holding i, through the reads.
                let slices: Vec<Vec<usize>> = spans
                    .iter()
                    .map(|s| {
                        let mut v =
                            vec![usize::MAX; s.iter().map(|g| g.local.end).max().unwrap_or(0)];
                        for g in s {
                            for (l, x) in g.local.clone().zip(g.global.clone()) {
                                v[l] = x;
                            }
                        }
                        v
                    })
                    .collect();
                for ranges in [
                    vec![0..9, 9..25],
                    vec![3..9, 20..25],
                    vec![],
                    vec![8..8, 0..1],
                ] {
                    let got: Vec<usize> = slice_reads(&spans, &ranges)
                        .into_iter()
                        .flat_map(|r| slices[r.file][r.local].to_vec())
                        .collect();
                    let want: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
                    assert_eq!(got, want, "stage {stage}, saved by {saved}, {ranges:?}");
                }
            }
        }
    }
}
