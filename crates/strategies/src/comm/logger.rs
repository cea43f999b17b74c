//! The communication logger: DeepSpeed's `comms_logger`, as a [`Communicator`] that wraps
//! another one and times every call.
//!
//! [`CommsLogger::wrap`] puts a logging layer in front of any world (threads, MPI). Every
//! group later [`split`](Communicator::split) from it is wrapped too and records into the same
//! [`CommsLog`], so one log holds a rank's whole traffic: data-parallel reductions, pipeline
//! sends, tensor-parallel and expert all-to-alls. Each call is recorded under its kind and
//! its message size with:
//! - its latency (wall-clock time from the call to its return on this rank, waiting for the
//!   slowest peer included, as DeepSpeed's blocking-op timings are);
//! - the bytes the transport moved for this rank, read from the wrapped communicator's own
//!   counters ([`Communicator::stats`]) before and after the call: **measured**, so the log's
//!   totals equal those counters;
//! - the algorithmic and bus bandwidths of nccl-tests, which DeepSpeed's table also reports:
//!   `algbw = size / latency`, `busbw = algbw · f` with `f = 2(n−1)/n` for an all-reduce,
//!   `(n−1)/n` for all-gather, reduce-scatter and all-to-all, and 1 for broadcast and
//!   point-to-point, `n` the group's size.
//!
//! The message size is the bytes of the whole buffer the operation is about: the all-reduced
//! or broadcast buffer, the reduce-scatter's input, the all-gather's output, the all-to-all's
//! input, the message sent or received. (DeepSpeed sizes an all-gather by one rank's input and
//! multiplies by `n` in the bandwidths; the bandwidths come out the same.)

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Buf, BufMut, CommStats, Communicator, OpKind, ReduceOp};
use crate::Result;

/// What a [`CommsLogger`] records (DeepSpeed's `comms_logger` section, less `enabled`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommsLoggerOptions {
    /// Print every call as it completes (on global rank 0).
    pub verbose: bool,
    /// Record every kind of operation; when false, only those in `prof_ops`.
    pub prof_all: bool,
    /// The kinds recorded when `prof_all` is false.
    pub prof_ops: Vec<OpKind>,
    /// Record each call under the function that made it as well (slower: it walks the
    /// stack on every call).
    pub debug: bool,
}

impl Default for CommsLoggerOptions {
    fn default() -> Self {
        Self {
            verbose: false,
            prof_all: true,
            prof_ops: Vec::new(),
            debug: false,
        }
    }
}

impl CommsLoggerOptions {
    fn records(&self, kind: OpKind) -> bool {
        self.prof_all || self.prof_ops.contains(&kind)
    }
}

impl OpKind {
    /// The kind a DeepSpeed op name (`all_reduce`, `all_gather_into_tensor`,
    /// `reduce_scatter_tensor`, `all_to_all_single`, `isend`, …) or one of ours names.
    pub fn from_name(name: &str) -> Option<OpKind> {
        Some(match name {
            "all_reduce" | "all_reduce_coalesced" | "inference_all_reduce" => OpKind::AllReduce,
            "reduce_scatter" | "reduce_scatter_tensor" | "reduce_scatter_fn" => {
                OpKind::ReduceScatter
            }
            "all_gather" | "all_gather_into_tensor" | "allgather_fn" => OpKind::AllGather,
            "broadcast" => OpKind::Broadcast,
            "all_to_all" | "all_to_all_single" => OpKind::AllToAll,
            "send" | "isend" => OpKind::Send,
            "recv" | "irecv" => OpKind::Recv,
            "barrier" => OpKind::Barrier,
            _ => return None,
        })
    }

    /// nccl-tests' bus-bandwidth factor for this kind on a group of `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            OpKind::AllReduce => 2.0 * (n - 1.0) / n,
            OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll => (n - 1.0) / n,
            OpKind::Broadcast | OpKind::Send | OpKind::Recv | OpKind::Barrier => 1.0,
        }
    }
}

/// The calls of one kind and message size (and, under `debug`, one caller).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommsEntry {
    /// Number of calls.
    pub count: u64,
    /// Sum of the calls' latencies.
    pub total_latency: Duration,
    /// Bytes the transport sent for this rank (measured).
    pub bytes_sent: u64,
    /// Bytes the transport received for this rank (measured).
    pub bytes_received: u64,
    /// Sum over the calls of `size / latency`, in bytes per second (for the mean).
    algbw_sum: f64,
    /// Sum over the calls of the bus bandwidth, in bytes per second.
    busbw_sum: f64,
}

impl CommsEntry {
    /// Mean latency of a call.
    pub fn avg_latency(&self) -> Duration {
        self.total_latency / self.count.max(1) as u32
    }
    /// Mean algorithmic bandwidth of a call, in Gbit/s.
    pub fn algbw_gbps(&self) -> f64 {
        self.algbw_sum / self.count.max(1) as f64 * 8e-9
    }
    /// Mean bus bandwidth of a call, in Gbit/s.
    pub fn busbw_gbps(&self) -> f64 {
        self.busbw_sum / self.count.max(1) as f64 * 8e-9
    }
}

impl std::ops::AddAssign<&CommsEntry> for CommsEntry {
    fn add_assign(&mut self, o: &CommsEntry) {
        self.count += o.count;
        self.total_latency += o.total_latency;
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
        self.algbw_sum += o.algbw_sum;
        self.busbw_sum += o.busbw_sum;
    }
}

/// Where a [`CommsEntry`] is filed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommsKey {
    /// The kind of operation.
    pub op: OpKind,
    /// Bytes of the buffer the operation is about (see the module docs).
    pub msg_bytes: u64,
    /// Under `debug`, the function that made the call.
    pub caller: Option<String>,
}

/// One rank's communication log, shared by every communicator wrapped from the same world.
#[derive(Debug)]
pub struct CommsLog {
    options: CommsLoggerOptions,
    global_rank: usize,
    entries: Mutex<BTreeMap<CommsKey, CommsEntry>>,
}

impl CommsLog {
    /// The options this log records under.
    pub fn options(&self) -> &CommsLoggerOptions {
        &self.options
    }

    /// The rank, in the world the logger wrapped, whose calls this log holds.
    pub fn global_rank(&self) -> usize {
        self.global_rank
    }

    /// Every entry so far, by kind, message size and caller.
    pub fn entries(&self) -> BTreeMap<CommsKey, CommsEntry> {
        self.lock().clone()
    }

    /// Totals by kind: calls, measured bytes sent and received (each entry summed).
    pub fn totals(&self) -> BTreeMap<OpKind, CommsEntry> {
        let mut out: BTreeMap<OpKind, CommsEntry> = BTreeMap::new();
        for (k, e) in self.lock().iter() {
            *out.entry(k.op).or_default() += e;
        }
        out
    }

    /// Forgets every entry (e.g. after warm-up steps).
    pub fn reset(&self) {
        self.lock().clear();
    }

    /// The summary table (DeepSpeed's `log_summary` layout): one block per kind of operation,
    /// one row per message size, with the count, total and mean latency, mean algorithmic and
    /// bus bandwidth, and the bytes this rank's transport sent for those calls.
    pub fn summary(&self) -> String {
        let entries = self.entries();
        let mut s = String::new();
        let head = [
            "Comm. Op",
            "Message Size",
            "Count",
            "Total Latency(ms)",
            "Avg Latency(ms)",
            "tput_avg (Gbps)",
            "busbw_avg (Gbps)",
            "Sent (measured)",
        ];
        for h in head {
            let _ = write!(s, "{h:<20}");
        }
        s.truncate(s.trim_end().len());
        s.push('\n');
        let mut last: Option<(OpKind, Option<String>)> = None;
        for (k, e) in &entries {
            let group = (k.op, k.caller.clone());
            if last.as_ref() != Some(&group) {
                match &k.caller {
                    Some(c) => {
                        let _ = writeln!(s, "{} [{c}]", k.op);
                    }
                    None => {
                        let _ = writeln!(s, "{}", k.op);
                    }
                }
                last = Some(group);
            }
            let cells = [
                String::new(),
                human_bytes(k.msg_bytes),
                e.count.to_string(),
                format!("{:.2}", e.total_latency.as_secs_f64() * 1e3),
                format!("{:.2}", e.avg_latency().as_secs_f64() * 1e3),
                format!("{:.2}", e.algbw_gbps()),
                format!("{:.2}", e.busbw_gbps()),
                human_bytes(e.bytes_sent),
            ];
            let mut line = String::new();
            for c in cells {
                let _ = write!(line, "{c:<20}");
            }
            s.push_str(line.trim_end());
            s.push('\n');
        }
        s
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<CommsKey, CommsEntry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, call: Call, group: usize, latency: Duration, moved: (u64, u64)) {
        let secs = latency.as_secs_f64().max(1e-9);
        let algbw = call.msg_bytes as f64 / secs;
        let busbw = algbw * call.op.bus_factor(group);
        if self.options.verbose && self.global_rank == 0 {
            eprintln!(
                "comm op: {} | time (ms): {:.2} | msg size: {} | algbw (Gbps): {:.2} | \
                 busbw (Gbps): {:.2}",
                call.op,
                latency.as_secs_f64() * 1e3,
                human_bytes(call.msg_bytes),
                algbw * 8e-9,
                busbw * 8e-9
            );
        }
        let key = CommsKey {
            op: call.op,
            msg_bytes: call.msg_bytes,
            caller: self.options.debug.then(caller_outside_comm),
        };
        self.add(
            key,
            &CommsEntry {
                count: 1,
                total_latency: latency,
                bytes_sent: moved.0,
                bytes_received: moved.1,
                algbw_sum: algbw,
                busbw_sum: busbw,
            },
        );
    }

    /// Files `calls` under `key`.
    fn add(&self, key: CommsKey, calls: &CommsEntry) {
        *self.lock().entry(key).or_default() += calls;
    }
}

impl fmt::Display for CommsLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary())
    }
}

/// Bytes in DeepSpeed's `convert_size` style: `0B`, `4.0 KB`, `1.5 MB` (powers of 1024).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KB", "MB", "GB", "TB", "PB"];
    if bytes == 0 {
        return "0B".into();
    }
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{:.2} {}", v, UNITS[i])
}

/// The first function on the stack outside the logger, the communicator traits, the
/// standard library and the backtrace machinery (`debug`'s caller name).
fn caller_outside_comm() -> String {
    let trace = std::backtrace::Backtrace::force_capture().to_string();
    let inside = |sym: &str| {
        [
            "std::", "core::", "alloc::", "<std::", "<core::", "<alloc::", "__rust",
        ]
        .iter()
        .any(|p| sym.starts_with(p))
            || [
                "backtrace",
                "comm::logger::CommsLog",
                "comm::logger::caller_outside_comm",
                "comm::communicator::",
                "CommunicatorExt",
            ]
            .iter()
            .any(|p| sym.contains(p))
    };
    let lines: Vec<&str> = trace.lines().map(str::trim).collect();
    lines
        .iter()
        .enumerate()
        .filter_map(|(i, l)| {
            let (_, sym) = l.split_once(": ")?;
            // The frame's source line, when the binary has line tables.
            let at = lines.get(i + 1).and_then(|n| n.strip_prefix("at "));
            Some((sym.trim(), at))
        })
        .find(|(sym, at)| !inside(sym) && !at.is_some_and(|a| a.starts_with("/rustc/")))
        .map(|(sym, at)| {
            // Drop the hash a legacy-mangled symbol ends with (`::h0123456789abcdef`).
            let sym = match sym.rsplit_once("::h") {
                Some((head, hash))
                    if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) =>
                {
                    head
                }
                _ => sym,
            };
            // Inlined frames carry a short name: the source line says where they are.
            match at {
                Some(at) => format!("{sym} ({at})"),
                None => sym.to_string(),
            }
        })
        .unwrap_or_else(|| "unknown".into())
}

/// One call's kind and message size.
#[derive(Debug, Clone, Copy)]
struct Call {
    op: OpKind,
    msg_bytes: u64,
}

/// A [`Communicator`] that records every call of the one it wraps into a [`CommsLog`].
#[derive(Debug)]
pub struct CommsLogger {
    inner: Arc<dyn Communicator>,
    log: Arc<CommsLog>,
}

impl CommsLogger {
    /// Wraps `world` (already wrapped: returned as it is). Every group split from the result
    /// records into the same log, which [`Communicator::comms_log`] returns.
    pub fn wrap(
        world: Arc<dyn Communicator>,
        options: CommsLoggerOptions,
    ) -> Arc<dyn Communicator> {
        if world.comms_log().is_some() {
            return world;
        }
        let log = Arc::new(CommsLog {
            options,
            global_rank: world.rank(),
            entries: Mutex::new(BTreeMap::new()),
        });
        Arc::new(Self { inner: world, log })
    }

    /// Runs `f` on the wrapped communicator and records it as `call`.
    fn timed(&self, call: Call, f: impl FnOnce(&dyn Communicator) -> Result<()>) -> Result<()> {
        if !self.log.options.records(call.op) {
            return f(self.inner.as_ref());
        }
        let before = self.inner.stats().get(call.op);
        let start = Instant::now();
        let result = f(self.inner.as_ref());
        let latency = start.elapsed();
        if result.is_ok() {
            let after = self.inner.stats().get(call.op);
            let moved = (
                after.bytes_sent - before.bytes_sent,
                after.bytes_received - before.bytes_received,
            );
            self.log
                .record(call, self.inner.world_size(), latency, moved);
        }
        result
    }
}

fn bytes_of(len: usize, elem: usize) -> u64 {
    (len * elem) as u64
}

impl Communicator for CommsLogger {
    delegate_to_inner!();

    fn all_reduce_buf(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let msg_bytes = bytes_of(buf.len(), buf.dtype().size());
        let call = Call {
            op: OpKind::AllReduce,
            msg_bytes,
        };
        self.timed(call, |c| c.all_reduce_buf(buf, op))
    }

    fn reduce_scatter_buf(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let call = Call {
            op: OpKind::ReduceScatter,
            msg_bytes: bytes_of(input.len(), input.dtype().size()),
        };
        self.timed(call, |c| c.reduce_scatter_buf(input, output, counts, op))
    }

    fn all_gather_buf(&self, input: Buf<'_>, output: BufMut<'_>, counts: &[usize]) -> Result<()> {
        let call = Call {
            op: OpKind::AllGather,
            msg_bytes: bytes_of(output.len(), output.dtype().size()),
        };
        self.timed(call, |c| c.all_gather_buf(input, output, counts))
    }

    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let call = Call {
            op: OpKind::Broadcast,
            msg_bytes: bytes_of(buf.len(), buf.dtype().size()),
        };
        self.timed(call, |c| c.broadcast_buf(buf, root))
    }

    fn all_to_all_buf(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
        let call = Call {
            op: OpKind::AllToAll,
            msg_bytes: bytes_of(input.len(), input.dtype().size()),
        };
        self.timed(call, |c| c.all_to_all_buf(input, output))
    }

    fn send_buf(&self, buf: Buf<'_>, dst: usize, tag: u16) -> Result<()> {
        let call = Call {
            op: OpKind::Send,
            msg_bytes: bytes_of(buf.len(), buf.dtype().size()),
        };
        self.timed(call, |c| c.send_buf(buf, dst, tag))
    }

    fn recv_buf(&self, buf: BufMut<'_>, src: usize, tag: u16) -> Result<()> {
        let call = Call {
            op: OpKind::Recv,
            msg_bytes: bytes_of(buf.len(), buf.dtype().size()),
        };
        self.timed(call, |c| c.recv_buf(buf, src, tag))
    }

    fn barrier(&self) -> Result<()> {
        let call = Call {
            op: OpKind::Barrier,
            msg_bytes: 0,
        };
        self.timed(call, |c| c.barrier())
    }

    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        // A split agrees on the colours with collectives of its own, which the wrapped
        // communicator counts: file them too, under the caller `split`, with the bytes they
        // moved per call as their size.
        let before = self.inner.stats();
        let start = Instant::now();
        let inner = self.inner.split(color)?;
        let latency = start.elapsed();
        let moved = self.inner.stats().since(&before);
        for op in OpKind::ALL {
            let s = moved.get(op);
            if s.calls == 0 || !self.log.options.records(op) {
                continue;
            }
            let key = CommsKey {
                op,
                msg_bytes: (s.bytes_sent + s.bytes_received) / s.calls,
                caller: Some("split".into()),
            };
            let calls = CommsEntry {
                count: s.calls,
                total_latency: latency,
                bytes_sent: s.bytes_sent,
                bytes_received: s.bytes_received,
                ..CommsEntry::default()
            };
            self.log.add(key, &calls);
        }
        Ok(Arc::new(Self {
            inner,
            log: self.log.clone(),
        }))
    }

    fn comms_log(&self) -> Option<Arc<CommsLog>> {
        Some(self.log.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{CommunicatorExt, ThreadWorld, ThreadWorldOptions};

    fn run_logged<T: Send>(
        world: usize,
        options: CommsLoggerOptions,
        f: impl Fn(Arc<dyn Communicator>) -> T + Sync,
    ) -> Vec<T> {
        ThreadWorld::run(world, ThreadWorldOptions::default(), |comm| {
            f(CommsLogger::wrap(Arc::new(comm), options.clone()))
        })
        .into_iter()
        .map(|r| r.expect("rank panicked"))
        .collect()
    }

    /// Every collective on the world and on a split group, logged and compared with the
    /// transports' own counters.
    #[test]
    fn totals_equal_the_measured_counters_across_groups() {
        let out = run_logged(4, CommsLoggerOptions::default(), |comm| {
            let mut a = vec![1.0f32; 1000];
            comm.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            comm.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            let mut out = vec![0.0f32; 250];
            comm.reduce_scatter_equal(&a, &mut out, ReduceOp::Sum)
                .unwrap();
            let mut whole = vec![0.0f32; 1000];
            comm.all_gather_equal(&out, &mut whole).unwrap();
            comm.broadcast(&mut whole[..10], 1).unwrap();
            let mut mixed = vec![0.0f32; 16];
            comm.all_to_all(&whole[..16], &mut mixed).unwrap();
            comm.barrier().unwrap();
            let pair = comm.split(comm.rank() / 2).unwrap();
            let mut b = vec![half::f16::ONE; 64];
            pair.all_reduce(&mut b, ReduceOp::Sum).unwrap();
            if pair.rank() == 0 {
                pair.send(&b, 1, 7).unwrap();
            } else {
                pair.recv(&mut b, 0, 7).unwrap();
            }
            let log = comm.comms_log().unwrap();
            // The world's counters plus the pair's: every byte this rank moved.
            let (world, group) = (comm.stats(), pair.stats());
            let measured: BTreeMap<OpKind, (u64, u64, u64)> = OpKind::ALL
                .into_iter()
                .map(|kind| {
                    let (w, g) = (world.get(kind), group.get(kind));
                    let moved = (
                        w.calls + g.calls,
                        w.bytes_sent + g.bytes_sent,
                        w.bytes_received + g.bytes_received,
                    );
                    (kind, moved)
                })
                .collect();
            (log.totals(), log.entries(), log.summary(), measured)
        });
        for (rank, (totals, entries, summary, measured)) in out.into_iter().enumerate() {
            for (kind, (calls, sent, received)) in measured {
                let t = totals.get(&kind).cloned().unwrap_or_default();
                assert_eq!(t.count, calls, "rank {rank} {kind}: calls");
                assert_eq!(t.bytes_sent, sent, "rank {rank} {kind}: sent");
                assert_eq!(t.bytes_received, received, "rank {rank} {kind}: received");
                if calls > 0 {
                    assert!(
                        summary.contains(&format!("\n{kind}\n")),
                        "{kind} in\n{summary}"
                    );
                }
            }
            // Two all-reduces of 4,000 bytes on the world, one of 128 on the pair: two rows.
            let ar: Vec<_> = entries
                .iter()
                .filter(|(k, _)| k.op == OpKind::AllReduce)
                .map(|(k, e)| (k.msg_bytes, e.count))
                .collect();
            assert_eq!(ar, vec![(128, 1), (4000, 2)], "rank {rank}");
            // The send or the receive of the pair: one of them per rank.
            assert_eq!(
                totals.get(&OpKind::Send).map_or(0, |e| e.count)
                    + totals.get(&OpKind::Recv).map_or(0, |e| e.count),
                1
            );
        }
    }

    #[test]
    fn prof_ops_limits_what_is_recorded_and_debug_names_the_caller() {
        let options = CommsLoggerOptions {
            prof_all: false,
            prof_ops: vec![OpKind::AllGather],
            debug: true,
            ..CommsLoggerOptions::default()
        };
        let out = run_logged(2, options, |comm| {
            let mut a = vec![1.0f32; 8];
            comm.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            let mut whole = vec![0.0f32; 16];
            comm.all_gather_equal(&a, &mut whole).unwrap();
            comm.comms_log().unwrap().entries()
        });
        for entries in out {
            let keys: Vec<_> = entries.keys().collect();
            assert_eq!(keys.len(), 1, "{keys:?}");
            assert_eq!(keys[0].op, OpKind::AllGather);
            assert_eq!(keys[0].msg_bytes, 64);
            let caller = keys[0].caller.as_deref().unwrap();
            assert!(caller.contains("logger.rs"), "caller {caller}");
        }
    }

    #[test]
    fn names_sizes_and_bus_factors() {
        assert_eq!(
            OpKind::from_name("all_gather_into_tensor"),
            Some(OpKind::AllGather)
        );
        assert_eq!(
            OpKind::from_name("all_to_all_single"),
            Some(OpKind::AllToAll)
        );
        assert_eq!(OpKind::from_name("allreduce"), None);
        for kind in OpKind::ALL {
            assert_eq!(OpKind::from_name(kind.name()), Some(kind));
        }
        assert_eq!(OpKind::AllReduce.bus_factor(4), 1.5);
        assert_eq!(OpKind::AllGather.bus_factor(4), 0.75);
        assert_eq!(OpKind::Send.bus_factor(2), 1.0);
        assert_eq!(human_bytes(0), "0B");
        assert_eq!(human_bytes(4000), "3.91 KB");
        assert_eq!(human_bytes(3 << 20), "3.00 MB");
    }

    #[test]
    fn wrapping_twice_keeps_one_log() {
        let out = run_logged(1, CommsLoggerOptions::default(), |comm| {
            let again = CommsLogger::wrap(comm.clone(), CommsLoggerOptions::default());
            Arc::ptr_eq(&comm.comms_log().unwrap(), &again.comms_log().unwrap())
        });
        assert!(out[0]);
    }
}
