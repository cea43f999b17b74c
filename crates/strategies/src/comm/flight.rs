//! The flight recorder's records and their analysis, as plain data: what one collective
//! leaves in a rank's ring, how a ring is kept in a file that outlives its process, and how
//! the rings of a group's ranks show the first collective where the ranks parted ways.
//!
//! After PyTorch's c10d flight recorder (`torch/csrc/distributed/c10d/FlightRecorder.hpp` and
//! its analyzer `fr_trace`): each collective gets a sequence number per group; the analysis
//! lines the ranks' sequences up and finds the first number that some member never reached,
//! or reached with another collective. Point-to-point sends and receives are not in the
//! sequence (they pair one rank with one other, not the whole group).

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::{DType, OpKind};

/// One collective as a rank's ring holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlightEntry {
    /// Its number in the group's sequence of collectives, from 0.
    pub seq: u64,
    /// What it was.
    pub kind: OpKind,
    /// The buffer's element type (`None` for a barrier).
    pub dtype: Option<DType>,
    /// Elements of the whole buffer the operation is about (the same on every rank).
    pub elems: u64,
    /// When the rank called it, in microseconds since the Unix epoch.
    pub start_us: u64,
    /// When it returned (0 while it has not).
    pub end_us: u64,
    /// Whether it returned an error.
    pub failed: bool,
}

impl FlightEntry {
    /// Whether two ranks' entries describe the same call.
    pub fn same_call(&self, other: &FlightEntry) -> bool {
        (self.kind, self.dtype, self.elems) == (other.kind, other.dtype, other.elems)
    }

    /// `all_gather of 64 f32 (completed)`: what it was and how it ended.
    pub fn describe(&self) -> String {
        let what = match self.dtype {
            Some(d) => format!("{} of {} {d:?}", self.kind, self.elems),
            None => self.kind.to_string(),
        };
        let state = match (self.end_us, self.failed) {
            (0, _) => "still waiting",
            (_, true) => "failed",
            (_, false) => "completed",
        };
        format!("{} ({state})", what.to_lowercase())
    }
}

/// A group's rings: for each member (by global rank), its entries in sequence order, or `None`
/// when its ring could not be read.
#[derive(Debug, Clone, Default)]
pub struct GroupRings {
    /// What the group is (`world`, `world/0:1` for colour 1 of the world's first split).
    pub desc: String,
    /// The members' global ranks and their rings, in group-rank order.
    pub members: Vec<(usize, Option<Vec<FlightEntry>>)>,
}

/// Where a group's ranks parted ways.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// The group.
    pub desc: String,
    /// The first collective number some member did not take part in as the others did.
    pub seq: u64,
    /// The global ranks out of step there, and what they did instead (`None`: nothing yet).
    pub odd: Vec<(usize, Option<FlightEntry>)>,
    /// The call the others made, and their global ranks.
    pub common: (FlightEntry, Vec<usize>),
    /// Members whose ring could not be read.
    pub unknown: Vec<usize>,
}

impl Divergence {
    /// One line for an error message.
    pub fn report(&self) -> String {
        let (call, ranks) = &self.common;
        let mut s = format!(
            "the first collective where the ranks of `{}` disagree is #{}, {} on rank(s) {}",
            self.desc,
            self.seq,
            call.describe(),
            list(ranks)
        );
        for (rank, entry) in &self.odd {
            match entry {
                Some(e) => write!(s, "; rank {rank} called {} instead", e.describe()),
                None => write!(s, "; rank {rank} never called it"),
            }
            .expect("a String takes writes");
        }
        if !self.unknown.is_empty() {
            write!(s, " (no record from rank(s) {})", list(&self.unknown)).expect("writes");
        }
        s
    }

    /// The ranks to blame: those out of step.
    pub fn lagging(&self) -> Vec<usize> {
        self.odd.iter().map(|(r, _)| *r).collect()
    }
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|&r| match r {
            UNKNOWN_RANK => "?".to_string(),
            r => r.to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The first collective where a group's members disagree: some member's sequence ends before
/// it (it never called it) or holds another call at that number. History that some ring has
/// already dropped is skipped. `None` when every member that has a ring agrees on every
/// number some member reached.
pub fn first_divergence(group: &GroupRings) -> Option<Divergence> {
    let known: Vec<(usize, &[FlightEntry])> = (group.members.iter())
        .filter_map(|(r, e)| e.as_deref().map(|e| (*r, e)))
        .collect();
    let unknown: Vec<usize> = (group.members.iter())
        .filter(|(_, e)| e.is_none())
        .map(|(r, _)| *r)
        .collect();
    if known.len() < 2 && unknown.is_empty() {
        return None;
    }
    // The ring of a rank keeps its last entries: start where every ring still has history
    // (a rank with an empty ring has called nothing).
    let start = (known.iter())
        .filter_map(|(_, e)| e.first().map(|f| f.seq))
        .max()?;
    let end = known
        .iter()
        .filter_map(|(_, e)| e.last().map(|l| l.seq))
        .max()?;
    let at = |entries: &[FlightEntry], seq: u64| entries.iter().find(|e| e.seq == seq).copied();
    for seq in start..=end {
        let calls: Vec<(usize, Option<FlightEntry>)> =
            known.iter().map(|(r, e)| (*r, at(e, seq))).collect();
        // The call most members made is the common one; the others are out of step.
        let mut tally: Vec<(FlightEntry, Vec<usize>)> = Vec::new();
        for (rank, call) in &calls {
            if let Some(c) = call {
                match tally.iter_mut().find(|(t, _)| t.same_call(c)) {
                    Some((_, ranks)) => ranks.push(*rank),
                    None => tally.push((*c, vec![*rank])),
                }
            }
        }
        tally.sort_by_key(|(_, ranks)| std::cmp::Reverse(ranks.len()));
        let Some(common) = tally.first().cloned() else {
            continue;
        };
        let odd: Vec<(usize, Option<FlightEntry>)> = calls
            .into_iter()
            .filter(|(r, _)| !common.1.contains(r))
            .collect();
        if !odd.is_empty() || (!unknown.is_empty() && seq == end) {
            return Some(Divergence {
                desc: group.desc.clone(),
                seq,
                odd,
                common,
                unknown,
            });
        }
    }
    None
}

/// The bytes of a ring file's header: a JSON line (`rank`, `group`, `group_rank`,
/// `group_size`, `capacity`), padded with spaces.
pub const HEADER_BYTES: usize = 4096;
/// The global rank of a group member whose ring is missing (and with it, who it was).
pub const UNKNOWN_RANK: usize = usize::MAX;

/// The bytes of one entry in a ring file.
pub const SLOT_BYTES: usize = 40;

/// What a ring file says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingHeader {
    /// The global rank that wrote it.
    pub rank: usize,
    /// Its group's description.
    pub group: String,
    /// The writer's rank in the group.
    pub group_rank: usize,
    /// The group's size.
    pub group_size: usize,
    /// Its slots.
    pub capacity: usize,
}

impl RingHeader {
    /// The header's bytes (`None` when its JSON does not fit [`HEADER_BYTES`]).
    pub fn to_bytes(&self) -> Option<Vec<u8>> {
        let mut text = format!(
            "{{\"rank\": {}, \"group\": {:?}, \"group_rank\": {}, \"group_size\": {}, \
             \"capacity\": {}}}\n",
            self.rank, self.group, self.group_rank, self.group_size, self.capacity
        )
        .into_bytes();
        (text.len() <= HEADER_BYTES).then(|| {
            text.resize(HEADER_BYTES, b' ');
            text
        })
    }

    fn parse(bytes: &[u8]) -> Option<Self> {
        let line = std::str::from_utf8(bytes).ok()?.lines().next()?;
        let field = |name: &str| {
            let at = line.find(&format!("\"{name}\": "))? + name.len() + 4;
            Some(&line[at..])
        };
        let number = |name: &str| -> Option<usize> {
            let rest = field(name)?;
            let end = rest.find(|c: char| !c.is_ascii_digit())?;
            rest[..end].parse().ok()
        };
        let group = field("group")?.strip_prefix('"')?;
        let group = &group[..group.find('"')?];
        Some(Self {
            rank: number("rank")?,
            group: group.to_string(),
            group_rank: number("group_rank")?,
            group_size: number("group_size")?,
            capacity: number("capacity")?,
        })
    }
}

/// One slot's bytes: the sequence number plus one (0: empty), start, end, elements, then the
/// kind, the dtype and the failure flag.
pub fn slot_bytes(e: &FlightEntry) -> [u8; SLOT_BYTES] {
    let mut b = [0u8; SLOT_BYTES];
    b[0..8].copy_from_slice(&(e.seq + 1).to_le_bytes());
    b[8..16].copy_from_slice(&e.start_us.to_le_bytes());
    b[16..24].copy_from_slice(&e.end_us.to_le_bytes());
    b[24..32].copy_from_slice(&e.elems.to_le_bytes());
    b[32] = OpKind::ALL.iter().position(|k| *k == e.kind).unwrap_or(0) as u8;
    b[33] = match e.dtype {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::F16) => 2,
        Some(DType::BF16) => 3,
        Some(DType::U8) => 4,
    };
    b[34] = u8::from(e.failed);
    b
}

fn parse_slot(b: &[u8]) -> Option<FlightEntry> {
    let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let seq = word(0).checked_sub(1)?;
    Some(FlightEntry {
        seq,
        start_us: word(8),
        end_us: word(16),
        elems: word(24),
        kind: *OpKind::ALL.get(usize::from(b[32]))?,
        dtype: match b[33] {
            0 => None,
            1 => Some(DType::F32),
            2 => Some(DType::F16),
            3 => Some(DType::BF16),
            4 => Some(DType::U8),
            _ => return None,
        },
        failed: b[34] != 0,
    })
}

/// Writes `entry` into its slot of the ring file `file` of `capacity` slots.
pub fn write_slot(file: &File, capacity: usize, entry: &FlightEntry) -> io::Result<()> {
    let slot = (entry.seq % capacity.max(1) as u64) as usize;
    let at = (HEADER_BYTES + slot * SLOT_BYTES) as u64;
    file.write_all_at(&slot_bytes(entry), at)
}

/// Reads a ring file: its header and its entries in sequence order.
pub fn read_ring(path: &Path) -> io::Result<(RingHeader, Vec<FlightEntry>)> {
    let mut bytes = Vec::new();
    // A ring holds at most a few hundred thousand slots.
    File::open(path)?
        .take((HEADER_BYTES + (1 << 20) * SLOT_BYTES) as u64)
        .read_to_end(&mut bytes)?;
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "not a flight-recorder ring");
    let header = RingHeader::parse(bytes.get(..HEADER_BYTES).ok_or_else(bad)?).ok_or_else(bad)?;
    let mut entries: Vec<FlightEntry> = bytes[HEADER_BYTES..]
        .chunks_exact(SLOT_BYTES)
        .filter_map(parse_slot)
        .collect();
    entries.sort_by_key(|e| e.seq);
    Ok((header, entries))
}

/// The rings of every group found in `dir` (the files `*.ring`), each group's members with
/// the rings they wrote (a member that left no file: [`UNKNOWN_RANK`] and `None`).
pub fn read_rings(dir: &Path) -> io::Result<Vec<GroupRings>> {
    let mut groups: Vec<GroupRings> = Vec::new();
    for item in std::fs::read_dir(dir)? {
        let path = item?.path();
        if path.extension().is_none_or(|e| e != "ring") {
            continue;
        }
        let Ok((header, entries)) = read_ring(&path) else {
            continue;
        };
        let at = match groups.iter().position(|g| g.desc == header.group) {
            Some(at) => at,
            None => {
                let size = header.group_size.min(1 << 20);
                groups.push(GroupRings {
                    desc: header.group.clone(),
                    members: vec![(UNKNOWN_RANK, None); size],
                });
                groups.len() - 1
            }
        };
        if let Some(slot) = groups[at].members.get_mut(header.group_rank) {
            *slot = (header.rank, Some(entries));
        }
    }
    groups.sort_by(|a, b| a.desc.cmp(&b.desc));
    Ok(groups)
}

/// The first divergence over several groups: the one whose collective started first.
pub fn earliest_divergence(groups: &[GroupRings]) -> Option<Divergence> {
    groups
        .iter()
        .filter_map(first_divergence)
        .min_by_key(|d| d.common.0.start_us)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(seq: u64, kind: OpKind, elems: u64, done: bool) -> FlightEntry {
        FlightEntry {
            seq,
            kind,
            dtype: Some(DType::F32),
            elems,
            start_us: 1000 + seq,
            end_us: if done { 2000 + seq } else { 0 },
            failed: false,
        }
    }

    /// `n` all-reduces, then (unless `skip`) an all-gather that is still waiting.
    fn ring(n: u64, skip: bool) -> Vec<FlightEntry> {
        let mut r: Vec<_> = (0..n)
            .map(|s| call(s, OpKind::AllReduce, 8, true))
            .collect();
        if !skip {
            r.push(call(n, OpKind::AllGather, 64, false));
        }
        r
    }

    fn group(members: Vec<(usize, Option<Vec<FlightEntry>>)>) -> GroupRings {
        GroupRings {
            desc: "world".into(),
            members,
        }
    }

    #[test]
    fn a_rank_that_never_called_a_collective_is_named() {
        let g = group(vec![
            (0, Some(ring(5, false))),
            (1, Some(ring(5, false))),
            (2, Some(ring(5, true))),
            (3, Some(ring(5, false))),
        ]);
        let d = first_divergence(&g).expect("diverged");
        assert_eq!((d.seq, d.lagging()), (5, vec![2]));
        assert_eq!(d.common.1, vec![0, 1, 3]);
        let r = d.report();
        assert!(r.contains("is #5, all_gather of 64 f32"), "{r}");
        assert!(r.contains("rank 2 never called it"), "{r}");
    }

    #[test]
    fn another_call_at_the_same_number_is_named() {
        let mut odd = ring(5, true);
        odd.push(call(5, OpKind::AllReduce, 8, false));
        let g = group(vec![
            (0, Some(ring(5, false))),
            (1, Some(odd)),
            (2, Some(ring(5, false))),
        ]);
        let d = first_divergence(&g).expect("diverged");
        assert_eq!(d.lagging(), vec![1]);
        assert!(
            d.report().contains("rank 1 called all_reduce of 8 f32"),
            "{}",
            d.report()
        );
    }

    #[test]
    fn agreeing_rings_and_dropped_history_show_nothing() {
        let full = ring(9, false);
        let g = group(vec![(0, Some(full.clone())), (1, Some(full[4..].to_vec()))]);
        assert_eq!(first_divergence(&g), None);
        assert_eq!(first_divergence(&group(vec![])), None);
    }

    #[test]
    fn a_member_without_a_ring_is_reported_as_unknown() {
        let g = group(vec![
            (0, Some(ring(3, false))),
            (1, Some(ring(3, false))),
            (2, None),
        ]);
        let d = first_divergence(&g).expect("reported");
        assert_eq!(d.unknown, vec![2]);
        assert!(
            d.report().contains("no record from rank(s) 2"),
            "{}",
            d.report()
        );
    }

    #[test]
    fn ring_files_round_trip_and_wrap() {
        let dir = tempfile::tempdir().unwrap();
        let header = RingHeader {
            rank: 2,
            group: "world/0:1".into(),
            group_rank: 1,
            group_size: 2,
            capacity: 4,
        };
        let path = dir.path().join("rank2.ring");
        std::fs::write(&path, header.to_bytes().unwrap()).unwrap();
        let file = File::options().write(true).open(&path).unwrap();
        let entries = ring(6, false);
        for e in &entries {
            write_slot(&file, 4, e).unwrap();
        }
        let (h, read) = read_ring(&path).unwrap();
        assert_eq!(h, header);
        assert_eq!(read, entries[3..], "the last 4 in order");
        let groups = read_rings(dir.path()).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].members[0], (UNKNOWN_RANK, None));
        assert_eq!(groups[0].members[1].0, 2);
        assert_eq!(groups[0].members[1].1.as_deref(), Some(&entries[3..]));
    }
}
