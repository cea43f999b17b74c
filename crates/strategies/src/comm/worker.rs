//! [`CommWorker`]: a rank's communication thread, which runs collectives in the order they
//! were submitted while the rank's own thread goes on computing: DeepSpeed's `overlap_comm`
//! (ZeRO, arXiv 1910.02054 §5: the gradient of one micro-batch is reduced while the next one
//! runs its forward and backward).
//!
//! Ranks stay SPMD: every rank submits the same collectives in the same order, so the
//! workers meet in the same collectives as the rank threads would have. While a worker has
//! work queued, its rank must not call a collective of the same communicator itself:
//! [`CommWorker::quiesce`] waits until the queue is empty.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;

use super::Communicator;
use crate::{CommError, Result};

/// One queued collective: run with the communicator, or told that the queue is poisoned;
/// returns its failure, if any.
type Job = Box<dyn FnOnce(&dyn Communicator, Option<&str>) -> Option<String> + Send>;

/// A thread that runs one rank's collectives on `comm`, first submitted, first run.
///
/// A collective that fails poisons the queue: the ones queued after it are not run (their
/// peers fail in the same collective, or time out on it, as they would have without the
/// worker), and each reports the first failure. A collective that panics aborts the
/// communicator ([`Communicator::abort`]), so that the peers fail at once instead of waiting
/// for a rank that is gone. Dropping the worker runs the collective in progress to its end,
/// drops the rest unrun, and joins the thread.
#[derive(Debug)]
pub struct CommWorker {
    queue: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    /// Set by `drop`: queued collectives are skipped.
    cancelled: Arc<AtomicBool>,
    rank: usize,
}

/// A submitted collective's result, to [`wait`](Pending::wait) for.
#[derive(Debug)]
#[must_use = "a submitted collective's failure is only seen by waiting for it"]
pub struct Pending<R> {
    result: Receiver<Result<R>>,
    rank: usize,
}

impl CommWorker {
    /// Starts the communication thread of `comm`'s rank (named `rank-<r>-comm`, so that a
    /// trace shows it as its own track).
    pub fn spawn(comm: Arc<dyn Communicator>) -> Result<Self> {
        let rank = comm.rank();
        let (queue, jobs) = mpsc::channel::<Job>();
        let cancelled = Arc::new(AtomicBool::new(false));
        let stop = cancelled.clone();
        let thread = std::thread::Builder::new()
            .name(format!("rank-{rank}-comm"))
            .spawn(move || run(comm.as_ref(), &jobs, &stop))
            .map_err(|e| CommError::Worker {
                rank,
                detail: format!("cannot start the communication thread: {e}"),
            })?;
        Ok(Self {
            queue: Some(queue),
            thread: Some(thread),
            cancelled,
            rank,
        })
    }

    /// Queues `op` behind every collective submitted before it and returns at once.
    pub fn submit<R, F>(&self, op: F) -> Pending<R>
    where
        R: Send + 'static,
        F: FnOnce(&dyn Communicator) -> Result<R> + Send + 'static,
    {
        let (tx, result) = mpsc::channel();
        let rank = self.rank;
        let job: Job = Box::new(move |comm, poisoned| {
            let out = match poisoned {
                Some(first) => Err(CommError::Worker {
                    rank,
                    detail: format!("not run: an earlier overlapped collective failed: {first}"),
                }),
                None => op(comm),
            };
            let failure = out.as_ref().err().map(ToString::to_string);
            // The waiter may be gone (its owner was dropped): nothing is left to tell.
            let _ = tx.send(out);
            failure
        });
        if let Some(queue) = &self.queue {
            // A send fails only when the thread has ended, which `Pending::wait` reports.
            let _ = queue.send(job);
        }
        Pending { result, rank }
    }

    /// Waits until every collective submitted so far has run, after which this rank may call
    /// collectives of the same communicator itself. Their results stay with their
    /// [`Pending`]s.
    pub fn quiesce(&self) -> Result<()> {
        self.submit(|_| Ok(())).wait()
    }
}

impl<R> Pending<R> {
    /// Blocks until the collective has run, and returns its result.
    pub fn wait(self) -> Result<R> {
        self.result.recv().unwrap_or_else(|_| {
            Err(CommError::Worker {
                rank: self.rank,
                detail: "the communication thread ended before running this collective".into(),
            })
        })
    }
}

impl Drop for CommWorker {
    fn drop(&mut self) {
        self.cancelled.store(true, Ordering::Release);
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            // The thread catches its jobs' panics; a join error has nothing left to report.
            let _ = thread.join();
        }
    }
}

/// The worker's loop: runs jobs until the queue closes.
fn run(comm: &dyn Communicator, jobs: &Receiver<Job>, cancelled: &AtomicBool) {
    let mut poisoned: Option<String> = None;
    for job in jobs {
        if cancelled.load(Ordering::Acquire) {
            continue;
        }
        match super::catch_panic(|| job(comm, poisoned.as_deref())) {
            Ok(failure) => {
                if let Some(first) = failure {
                    poisoned.get_or_insert(first);
                }
            }
            Err(payload) => {
                let reason = format!(
                    "rank {}'s communication thread panicked: {}",
                    comm.rank(),
                    panic_message(payload.as_ref())
                );
                poisoned.get_or_insert(reason.clone());
                comm.abort(&reason);
            }
        }
    }
}

/// The text of a panic payload.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::comm::{CommunicatorExt, ReduceOp, ThreadWorld, ThreadWorldOptions};

    fn world<R: Send>(n: usize, f: impl Fn(Arc<dyn Communicator>) -> R + Sync) -> Vec<R> {
        let options = ThreadWorldOptions {
            timeout: Duration::from_secs(20),
        };
        ThreadWorld::run(n, options, |c| f(Arc::new(c)))
            .into_iter()
            .map(|r| r.expect("rank panicked"))
            .collect()
    }

    #[test]
    fn collectives_run_in_submission_order_beside_the_rank() {
        let results = world(3, |comm| {
            let worker = CommWorker::spawn(comm.clone()).unwrap();
            let rank = comm.rank() as f32;
            // Different lengths: a collective paired with the wrong one would fail.
            let pending: Vec<_> = (1..=5usize)
                .map(|k| {
                    worker.submit(move |c| {
                        let mut buf = vec![rank * k as f32; k];
                        c.all_reduce(&mut buf, ReduceOp::Sum)?;
                        Ok(buf)
                    })
                })
                .collect();
            // The rank thread works meanwhile, then calls a collective of its own.
            let busy: f32 = (0..10_000).map(|i| i as f32).sum();
            worker.quiesce().unwrap();
            let mut own = [rank];
            comm.all_reduce(&mut own, ReduceOp::Max).unwrap();
            let sums: Vec<Vec<f32>> = pending.into_iter().map(|p| p.wait().unwrap()).collect();
            (sums, own[0], busy)
        });
        for (sums, max, _) in results {
            assert_eq!(max, 2.0);
            for (i, sum) in sums.iter().enumerate() {
                let k = i + 1;
                // Ranks 0 + 1 + 2, times k, in each of k elements.
                assert_eq!(sum, &vec![3.0 * k as f32; k]);
            }
        }
    }

    #[test]
    fn a_failed_collective_skips_the_ones_queued_after_it() {
        let results = world(2, |comm| {
            let worker = CommWorker::spawn(comm).unwrap();
            let bad = worker.submit(|c| {
                let mut out = vec![0.0f32; 1];
                // Counts that do not cover the input: refused on every rank.
                c.reduce_scatter(&[1.0f32; 4], &mut out, &[1, 1], ReduceOp::Sum)
            });
            let after = worker.submit(|c| c.barrier());
            (bad.wait(), after.wait())
        });
        for (bad, after) in results {
            assert!(
                matches!(bad, Err(CommError::InvalidArgument { .. })),
                "{bad:?}"
            );
            let after = after.unwrap_err();
            assert!(
                matches!(after, CommError::Worker { .. })
                    && after
                        .to_string()
                        .contains("earlier overlapped collective failed"),
                "{after}"
            );
        }
    }

    #[test]
    fn a_panicking_collective_fails_the_peers_at_once() {
        let start = Instant::now();
        let results = world(2, |comm| {
            let worker = CommWorker::spawn(comm.clone()).unwrap();
            let rank = comm.rank();
            worker
                .submit(move |c| {
                    assert!(rank != 0, "rank 0's gradient bucket is corrupt");
                    c.barrier()
                })
                .wait()
        });
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        let panicked = results[0].as_ref().unwrap_err().to_string();
        assert!(panicked.contains("ended before running"), "{panicked}");
        let peer = results[1].as_ref().unwrap_err();
        assert!(
            matches!(peer, CommError::PeerFailed { rank: 0, .. })
                && peer.to_string().contains("gradient bucket is corrupt"),
            "{peer}"
        );
    }

    #[test]
    fn dropping_the_worker_skips_what_is_queued() {
        let start = Instant::now();
        let results = world(2, |comm| {
            let worker = CommWorker::spawn(comm.clone()).unwrap();
            let rank = comm.rank();
            // Rank 0 queues a collective its peer never calls, then is dropped.
            let pending = (rank == 0).then(|| worker.submit(|c| c.barrier()));
            std::thread::sleep(Duration::from_millis(50));
            drop(worker);
            pending.map(|p| p.wait().is_err())
        });
        // Rank 0's barrier either failed when its peer left the world or was skipped; either
        // way rank 0 learned that it did not run, and nothing waited for the world's timeout.
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(results, [Some(true), None]);
    }
}
