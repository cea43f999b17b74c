//! The flight recorder: a [`Communicator`] that keeps, for each rank and each group, a ring of
//! its last collectives (number, kind, dtype, size, start and end), so that a hang or a
//! desync names the rank out of step and the first collective where the ranks parted ways.
//!
//! - **On by default and cheap**: [`FlightRecorder::world`] wraps every rank of a world
//!   (`burn_deepspeed::launch::launch` does); a call costs two short locked writes (two
//!   `pwrite`s more when the ring is kept in a file). [`FLIGHT_ENTRIES_ENV`] sizes the ring
//!   (2,000 entries by default, as PyTorch's; 0 turns it off).
//! - **Errors explain themselves**: when a collective fails (a timeout, a mismatch, a peer
//!   that failed), the error gains the first divergence of the group's rings
//!   ([`CommError::Diverged`]). The thread world reads every rank's ring in memory.
//! - **Rings that outlive the process**: with [`FLIGHT_DIR_ENV`] set (`burn-deepspeed launch
//!   --mpi` sets it), each ring is written through to `DIR/rank{R}-{group}.ring` as it
//!   changes, so that a rank killed with SIGKILL leaves its last collectives on disk, and the
//!   launcher, once `mpirun` has ended the job, reads every rank's ring and names the rank
//!   out of step ([`read_rings`](super::read_rings)).

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use super::flight::{
    FlightEntry, GroupRings, RingHeader, UNKNOWN_RANK, first_divergence, read_rings,
};
use super::{Buf, BufMut, CommStats, CommsLog, Communicator, DType, OpKind};
use super::{ReduceOp, write_slot};
use crate::{CommError, Result};

/// The environment variable that sizes each ring (entries; 0 turns the recorder off).
pub const FLIGHT_ENTRIES_ENV: &str = "BURN_DEEPSPEED_FLIGHT_ENTRIES";
/// The environment variable naming a folder where each ring is kept as a file.
pub const FLIGHT_DIR_ENV: &str = "BURN_DEEPSPEED_FLIGHT_DIR";
/// Entries per ring unless [`FLIGHT_ENTRIES_ENV`] says otherwise (PyTorch's default).
pub const DEFAULT_FLIGHT_ENTRIES: usize = 2000;

/// How the recorder keeps its rings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightOptions {
    /// Entries per ring (0: no recorder).
    pub entries: usize,
    /// A folder for the rings' files.
    pub dir: Option<PathBuf>,
}

impl FlightOptions {
    /// The options the environment sets ([`FLIGHT_ENTRIES_ENV`], [`FLIGHT_DIR_ENV`]); a
    /// value that is not a count is an error naming the variable.
    pub fn from_env() -> Result<Self> {
        let entries = match std::env::var(FLIGHT_ENTRIES_ENV) {
            Err(_) => DEFAULT_FLIGHT_ENTRIES,
            Ok(v) => v.trim().parse().map_err(|_| CommError::InvalidArgument {
                rank: 0,
                op: "flight recorder",
                detail: format!(
                    "{FLIGHT_ENTRIES_ENV}={v:?} is not a number of entries (0 turns the \
                     recorder off)"
                ),
            })?,
        };
        let dir = std::env::var_os(FLIGHT_DIR_ENV).map(PathBuf::from);
        Ok(Self { entries, dir })
    }
}

/// One rank's ring in one group.
#[derive(Debug)]
struct Ring {
    capacity: usize,
    entries: Mutex<VecDeque<FlightEntry>>,
    file: Option<File>,
}

impl Ring {
    fn push(&self, entry: FlightEntry) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if entries.len() == self.capacity {
            entries.pop_front();
        }
        entries.push_back(entry);
        self.write(&entry);
    }

    fn finish(&self, seq: u64, failed: bool) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(e) = entries.iter_mut().rev().find(|e| e.seq == seq) {
            e.end_us = now_us().max(1);
            e.failed = failed;
            let e = *e;
            self.write(&e);
        }
    }

    /// A ring file is a record for later: one that cannot be written is given up, never a
    /// reason to fail the collective.
    fn write(&self, entry: &FlightEntry) {
        if let Some(f) = &self.file {
            let _ = write_slot(f, self.capacity, entry);
        }
    }

    fn snapshot(&self) -> Vec<FlightEntry> {
        let entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries.iter().copied().collect()
    }
}

/// A group's rings that this process holds (every rank's in the thread world, its own under
/// MPI), and who the members are.
#[derive(Debug)]
struct GroupLog {
    id: u64,
    desc: String,
    members: Mutex<Vec<usize>>,
    rings: Mutex<Vec<Option<Arc<Ring>>>>,
}

impl GroupLog {
    fn new(desc: String, size: usize) -> Arc<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Arc::new(Self {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            desc,
            members: Mutex::new(vec![UNKNOWN_RANK; size]),
            rings: Mutex::new(vec![None; size]),
        })
    }
}

/// The groups split in this process, by (parent group, split number, colour), so that the
/// thread ranks of one new group share one log.
type Splits = HashMap<(u64, u64, usize), Weak<GroupLog>>;
static SPLITS: LazyLock<Mutex<Splits>> = LazyLock::new(Mutex::default);

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A rank's communicator with a flight recorder in front (see the module docs).
#[derive(Debug)]
pub struct FlightRecorder {
    inner: Arc<dyn Communicator>,
    group: Arc<GroupLog>,
    ring: Arc<Ring>,
    next_seq: AtomicU64,
    splits: AtomicU64,
    global_rank: usize,
    options: FlightOptions,
}

impl FlightRecorder {
    /// Every rank of one world (all of its ranks that live in this process, in rank order:
    /// every rank of a thread world, the one rank of an MPI process), each behind a recorder
    /// of `options` (none with 0 entries).
    pub fn world(
        comms: Vec<Arc<dyn Communicator>>,
        options: &FlightOptions,
    ) -> Vec<Arc<dyn Communicator>> {
        let Some(size) = comms.first().map(|c| c.world_size()) else {
            return comms;
        };
        if options.entries == 0 {
            return comms;
        }
        let group = GroupLog::new("world".into(), size);
        *group.members.lock().unwrap_or_else(PoisonError::into_inner) = (0..size).collect();
        comms
            .into_iter()
            .map(|c| {
                let rank = c.rank();
                Arc::new(Self::in_group(c, group.clone(), rank, options.clone()))
                    as Arc<dyn Communicator>
            })
            .collect()
    }

    fn in_group(
        inner: Arc<dyn Communicator>,
        group: Arc<GroupLog>,
        global_rank: usize,
        options: FlightOptions,
    ) -> Self {
        let (group_rank, group_size) = (inner.rank(), inner.world_size());
        if let Some(slot) =
            (group.members.lock().unwrap_or_else(PoisonError::into_inner)).get_mut(group_rank)
        {
            *slot = global_rank;
        }
        let header = RingHeader {
            rank: global_rank,
            group: group.desc.clone(),
            group_rank,
            group_size,
            capacity: options.entries,
        };
        let file = (options.dir.as_deref()).and_then(|dir| ring_file(dir, &header));
        let ring = Arc::new(Ring {
            capacity: options.entries,
            entries: Mutex::new(VecDeque::new()),
            file,
        });
        if let Some(slot) =
            (group.rings.lock().unwrap_or_else(PoisonError::into_inner)).get_mut(inner.rank())
        {
            *slot = Some(ring.clone());
        }
        Self {
            inner,
            group,
            ring,
            next_seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            global_rank,
            options,
        }
    }

    /// Runs one collective through the ring.
    fn record(
        &self,
        kind: OpKind,
        dtype: Option<DType>,
        elems: usize,
        call: impl FnOnce(&dyn Communicator) -> Result<()>,
    ) -> Result<()> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        self.ring.push(FlightEntry {
            seq,
            kind,
            dtype,
            elems: elems as u64,
            start_us: now_us(),
            end_us: 0,
            failed: false,
        });
        let result = call(self.inner.as_ref());
        self.ring.finish(seq, result.is_err());
        result.map_err(|e| self.explain(e))
    }

    /// `error` with the first divergence of this group's rings, when there is one.
    fn explain(&self, error: CommError) -> CommError {
        if matches!(error, CommError::Diverged { .. }) {
            return error;
        }
        match first_divergence(&self.rings()) {
            Some(d) => CommError::Diverged {
                rank: self.inner.rank(),
                lagging: d.lagging(),
                report: d.report(),
                source: Box::new(error),
            },
            None => error,
        }
    }

    /// The group's rings: the ones in memory, and for the others, their files.
    fn rings(&self) -> GroupRings {
        let members = (self.group.members.lock())
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let held = (self.group.rings.lock())
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let on_disk = match (&self.options.dir, held.iter().any(Option::is_none)) {
            (Some(dir), true) => read_rings(dir).unwrap_or_default(),
            _ => Vec::new(),
        };
        let disk = on_disk.iter().find(|g| g.desc == self.group.desc);
        GroupRings {
            desc: self.group.desc.clone(),
            members: (members.iter().zip(&held).enumerate())
                .map(|(i, (&rank, ring))| match ring {
                    Some(r) => (rank, Some(r.snapshot())),
                    None => (disk.and_then(|g| g.members.get(i).cloned())).unwrap_or((rank, None)),
                })
                .collect(),
        }
    }
}

/// Creates the ring file `header` describes in `dir` (`None` when it cannot: the ring then
/// lives in memory only).
fn ring_file(dir: &Path, header: &RingHeader) -> Option<File> {
    let (rank, group) = (header.rank, &header.group);
    let name: String = group
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    std::fs::create_dir_all(dir).ok()?;
    let path = dir.join(format!("rank{rank}-{name}.ring"));
    std::fs::write(&path, header.to_bytes()?).ok()?;
    File::options().write(true).open(&path).ok()
}

impl Communicator for FlightRecorder {
    delegate_to_inner!();

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let (dtype, n) = (buf.dtype(), buf.len());
        self.record(OpKind::AllReduce, Some(dtype), n, |c| {
            c.all_reduce_buf(buf, op)
        })
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let (dtype, n) = (input.dtype(), input.len());
        self.record(OpKind::ReduceScatter, Some(dtype), n, |c| {
            c.reduce_scatter_buf(input, output, counts, op)
        })
    }

    fn all_gather_buf(&self, input: Buf<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()> {
        let (dtype, n) = (output.dtype(), output.len());
        self.record(OpKind::AllGather, Some(dtype), n, |c| {
            c.all_gather_buf(input, output, counts)
        })
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let (dtype, n) = (buf.dtype(), buf.len());
        self.record(OpKind::Broadcast, Some(dtype), n, |c| {
            c.broadcast_buf(buf, root)
        })
    }

    fn all_to_all_buf(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
        let (dtype, n) = (input.dtype(), input.len());
        self.record(OpKind::AllToAll, Some(dtype), n, |c| {
            c.all_to_all_buf(input, output)
        })
    }

    // Sends and receives pair two ranks, not the group: they are not in the sequence.
    fn send_buf(&self, buf: Buf<'_>, dst: usize, tag: u16) -> Result<()> {
        self.inner.send_buf(buf, dst, tag)
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize, tag: u16) -> Result<()> {
        self.inner.recv_buf(buf, src, tag)
    }

    fn barrier(&self) -> Result<()> {
        self.record(OpKind::Barrier, None, 0, |c| c.barrier())
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let inner = self.inner.split(color)?;
        let group = {
            let mut splits = SPLITS.lock().unwrap_or_else(PoisonError::into_inner);
            splits.retain(|_, g| g.strong_count() > 0);
            let key = (self.group.id, n, color);
            match splits.get(&key).and_then(Weak::upgrade) {
                Some(g) => g,
                None => {
                    let desc = format!("{}/{n}:{color}", self.group.desc);
                    let g = GroupLog::new(desc, inner.world_size());
                    splits.insert(key, Arc::downgrade(&g));
                    g
                }
            }
        };
        let options = self.options.clone();
        Ok(Arc::new(Self::in_group(
            inner,
            group,
            self.global_rank,
            options,
        )))
    }

    fn comms_log(&self) -> Option<Arc<CommsLog>> {
        self.inner.comms_log()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::comm::{CommunicatorExt, ThreadWorld, ThreadWorldOptions};

    /// A thread world of `n` ranks with `timeout`, each rank behind a recorder of `options`.
    fn recorded(
        n: usize,
        timeout: Duration,
        options: &FlightOptions,
    ) -> Vec<Arc<dyn Communicator>> {
        let world = ThreadWorld::new(n, ThreadWorldOptions { timeout }).unwrap();
        let comms = (world.communicators().into_iter())
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        FlightRecorder::world(comms, options)
    }

    /// Every rank's error when ranks run `body` on a recorded thread world of 4 ranks with a
    /// timeout of 1 s (`None` for a rank that returned).
    fn run4(body: impl Fn(&dyn Communicator) -> Result<()> + Sync) -> Vec<Option<String>> {
        let options = FlightOptions {
            entries: 16,
            dir: None,
        };
        let comms = recorded(4, Duration::from_secs(1), &options);
        std::thread::scope(|s| {
            let handles: Vec<_> = (comms.iter())
                .map(|c| s.spawn(|| body(c.as_ref()).err().map(|e| e.to_string())))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Rank 2 of 4 skips one all-gather and goes on with the all-reduce after it: every rank
    /// fails at once, and every error names rank 2 and collective #6 (the fourth step's
    /// all-gather), with what each side called.
    #[test]
    fn a_rank_that_skips_a_collective_is_named() {
        let errors = run4(|c| {
            for step in 0..5 {
                if !(c.rank() == 2 && step == 3) {
                    c.all_gather_equal(&[c.rank() as f32; 16], &mut [0f32; 64])?;
                }
                c.all_reduce(&mut [1f32; 8], ReduceOp::Sum)?;
            }
            Ok(())
        });
        for e in errors {
            let e = e.expect("every rank fails");
            assert!(
                e.contains("is #6, all_gather of 64 f32") && e.contains("0, 1, 3"),
                "{e}"
            );
            assert!(e.contains("rank 2 called all_reduce of 8 f32"), "{e}");
        }
    }

    /// Rank 2 stops one all-gather early: the others time out, naming rank 2 and the
    /// all-gather it never called.
    #[test]
    fn a_rank_that_stops_early_is_named_when_the_others_time_out() {
        let errors = run4(|c| {
            let steps = if c.rank() == 2 { 2 } else { 3 };
            for _ in 0..steps {
                c.all_gather_equal(&[c.rank() as f32; 16], &mut [0f32; 64])?;
            }
            Ok(())
        });
        assert!(errors[2].is_none(), "rank 2 returned");
        for e in [&errors[0], &errors[1], &errors[3]] {
            let e = e.as_deref().expect("the others time out");
            assert!(
                e.contains("timed out") && e.contains("is #2, all_gather"),
                "{e}"
            );
            assert!(e.contains("rank 2 never called it"), "{e}");
        }
    }

    #[test]
    fn rings_keep_the_last_entries_in_memory_and_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let options = FlightOptions {
            entries: 4,
            dir: Some(dir.path().to_path_buf()),
        };
        let comms = recorded(2, Duration::from_secs(10), &options);
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    for _ in 0..6 {
                        c.all_reduce(&mut [1f32; 8], ReduceOp::Sum).unwrap();
                    }
                    let sub = c.split(0).unwrap();
                    sub.barrier().unwrap();
                });
            }
        });
        let groups = read_rings(dir.path()).unwrap();
        let descs: Vec<&str> = groups.iter().map(|g| g.desc.as_str()).collect();
        assert_eq!(descs, ["world", "world/0:0"]);
        for (rank, entries) in &groups[0].members {
            let entries = entries.as_ref().expect("a file per rank");
            let seqs: Vec<u64> = entries.iter().map(|e| e.seq).collect();
            assert_eq!(seqs, [2, 3, 4, 5], "rank {rank}");
            assert!(entries.iter().all(|e| e.end_us > 0 && !e.failed));
        }
        assert_eq!(groups[1].members.len(), 2);
        assert_eq!(first_divergence(&groups[0]), None);
    }

    #[test]
    fn no_entries_means_no_recorder() {
        let options = FlightOptions {
            entries: 0,
            dir: None,
        };
        let comms = recorded(1, Duration::from_secs(10), &options);
        assert_eq!(comms[0].backend(), "threads");
        let e = format!("{:?}", comms[0]);
        assert!(!e.contains("FlightRecorder"), "{e}");
    }
}
