//! Every collective of the thread world against a serial reference, at world sizes 1-4.

use std::time::{Duration, Instant};

use super::*;
use crate::CommError;

const WORLDS: [usize; 4] = [1, 2, 3, 4];

fn run<R: Send>(world: usize, f: impl Fn(ThreadCommunicator) -> R + Sync) -> Vec<R> {
    ThreadWorld::run(world, ThreadWorldOptions::default(), f)
        .into_iter()
        .map(|r| r.expect("rank panicked"))
        .collect()
}

#[test]
fn every_op_and_dtype_matches_the_serial_reference() {
    for world in WORLDS {
        for (rank, result) in run(world, |c| conformance::check_all(&c))
            .into_iter()
            .enumerate()
        {
            let checks = result.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
            assert!(checks >= 90, "only {checks} checks ran");
        }
    }
}

#[test]
fn barrier_and_counters_follow_the_cost_model() {
    let stats = run(4, |c| {
        let mut buf = vec![1.0f32; 400];
        c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        let mut out = vec![0.0f32; 100];
        c.reduce_scatter_equal(&buf, &mut out, ReduceOp::Sum)
            .unwrap();
        c.stats()
    });
    for s in stats {
        // Ring model: all-reduce moves 2 (N-1)/N n elements each way; reduce-scatter sends
        // the (N-1) chunks it does not own and receives (N-1) contributions to its own.
        let (ar, rs) = (s.get(OpKind::AllReduce), s.get(OpKind::ReduceScatter));
        assert_eq!(ar.model_bytes_sent, 2 * 3 * 100 * 4);
        assert_eq!(rs.model_bytes_sent, 300 * 4);
        assert_eq!(rs.model_bytes_received, 300 * 4);
        assert_eq!(s.total_model_sent(), 2400 + 1200);
        // Measured in the thread world: each rank copies its whole buffer into the round and
        // its result out of it (all-reduce: 400 each way; reduce-scatter: 400 out, 100 in).
        assert_eq!((ar.bytes_sent, ar.bytes_received), (400 * 4, 400 * 4));
        assert_eq!((rs.bytes_sent, rs.bytes_received), (400 * 4, 100 * 4));
        assert_eq!(s.get(OpKind::Barrier).calls, 1);
        assert_eq!(s.total_sent(), 1600 + 1600);
    }
}

#[test]
fn a_panicking_rank_makes_the_others_fail_fast() {
    let start = Instant::now();
    let options = ThreadWorldOptions {
        timeout: Duration::from_secs(60),
    };
    let results = ThreadWorld::run(3, options, |c| {
        if c.rank() == 1 {
            panic!("rank 1 dies");
        }
        let mut buf = vec![1.0f32; 8];
        c.all_reduce(&mut buf, ReduceOp::Sum)
    });
    assert!(results[1].is_err(), "rank 1 panicked");
    for r in [0, 2] {
        match results[r].as_ref().expect("no panic") {
            Err(CommError::PeerFailed { rank: 1, .. }) => {}
            other => panic!("rank {r}: expected PeerFailed from rank 1, got {other:?}"),
        }
    }
    // Long before the 60 s timeout.
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_stalled_rank_makes_the_others_time_out() {
    let options = ThreadWorldOptions {
        timeout: Duration::from_millis(300),
    };
    let start = Instant::now();
    let results = ThreadWorld::run(3, options, |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        c.barrier()
    });
    let errors: Vec<_> = results[..2]
        .iter()
        .map(|r| {
            r.as_ref()
                .expect("no panic")
                .as_ref()
                .unwrap_err()
                .to_string()
        })
        .collect();
    assert!(
        errors
            .iter()
            .all(|e| e.contains("timed out") || e.contains("failed")),
        "{errors:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
}

/// A rank busy on its own (rank 0 writing a checkpoint) for five timeouts, in a solo phase,
/// is waited for by the others, in the world and in a group split from it; once the phase
/// ends, a late rank times them out again.
#[test]
fn a_solo_phase_is_waited_for_past_the_timeout() {
    let options = ThreadWorldOptions {
        timeout: Duration::from_millis(200),
    };
    let results = ThreadWorld::run(3, options, |c| {
        let pair = c.split(usize::from(c.rank() == 2))?;
        if c.rank() == 0 {
            c.solo("checkpoint write", || {
                std::thread::sleep(Duration::from_millis(1000))
            });
        }
        if c.rank() < 2 {
            pair.barrier()?;
        }
        c.barrier()?;
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(1000));
        }
        c.barrier()
    });
    for (rank, r) in results.into_iter().enumerate() {
        let r = r.expect("no panic");
        match rank {
            2 => assert!(r.is_err(), "the others gave up on rank 2"),
            _ => {
                let e = r
                    .expect_err("rank 2 was late outside a solo phase")
                    .to_string();
                assert!(e.contains("timed out") && e.contains("[2]"), "{e}");
            }
        }
    }
}

#[test]
fn a_rank_that_left_early_is_reported() {
    let results = run(2, |c| {
        if c.rank() == 0 {
            return Ok(());
        }
        let mut buf = [0.0f32; 2];
        c.recv(&mut buf, 0, 0)
    });
    assert!(matches!(
        results[1],
        Err(CommError::PeerFailed { rank: 0, .. })
    ));
}

#[test]
fn mismatched_collectives_are_refused() {
    let results = run(2, |c| {
        let mut buf = vec![0.0f32; 4 + c.rank()];
        c.all_reduce(&mut buf, ReduceOp::Sum)
    });
    for r in results {
        assert!(matches!(r, Err(CommError::Mismatch { .. })), "{r:?}");
    }
}

#[test]
fn bad_arguments_name_the_problem() {
    let results = run(2, |c| {
        let mut out = vec![0.0f32; 3];
        c.reduce_scatter(&[1.0f32; 4], &mut out, &[2, 2], ReduceOp::Sum)
    });
    let msg = results[0].as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("reduce_scatter") && msg.contains("counts"),
        "{msg}"
    );
}

#[test]
fn an_abort_reaches_every_group_of_the_world_at_once() {
    // Ranks {0, 1} and {2, 3} form groups. Rank 0 gives up (and keeps its communicators, so
    // only the abort can tell the others); rank 1 waits for it in their group, rank 3 for
    // rank 1 in the world, rank 2 for rank 3 in theirs.
    let start = Instant::now();
    let options = ThreadWorldOptions {
        timeout: Duration::from_secs(300),
    };
    let results = ThreadWorld::run(4, options, |c| {
        let group = c.split(c.rank() / 2).expect("split");
        let mut buf = vec![1.0f32; 4];
        let outcome = match c.rank() {
            0 => {
                std::thread::sleep(Duration::from_millis(200));
                c.abort("the disk is on fire");
                std::thread::sleep(Duration::from_secs(4));
                Ok(())
            }
            1 => group.all_reduce(&mut buf, ReduceOp::Sum),
            2 => group.all_reduce(&mut buf, ReduceOp::Sum),
            _ => c.recv(&mut buf, 1, 7),
        };
        outcome
            .map(|()| start.elapsed())
            .map_err(|e| (e, start.elapsed()))
    });
    for (rank, r) in results.into_iter().enumerate().skip(1) {
        match r.expect("no panic") {
            Err((
                CommError::PeerFailed {
                    rank: 0, reason, ..
                },
                waited,
            )) => {
                assert_eq!(reason, "the disk is on fire", "rank {rank}");
                // Long before rank 0 wakes up (4 s) or the timeout (300 s).
                assert!(waited < Duration::from_secs(2), "rank {rank}: {waited:?}");
            }
            other => panic!("rank {rank}: expected PeerFailed from rank 0, got {other:?}"),
        }
    }
}

#[test]
fn ranks_pairing_differently_labelled_collectives_are_refused() {
    let results = run(2, |c| {
        c.label_next(10 + c.rank() as u64);
        let mut buf = vec![1.0f32; 4];
        c.all_reduce(&mut buf, ReduceOp::Sum)
    });
    for r in results {
        match r {
            Err(CommError::Mismatch { detail, .. }) => {
                assert!(
                    detail.contains("label 0xa") && detail.contains("label 0xb"),
                    "{detail}"
                )
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
    // A label applies to one collective only.
    let results = run(2, |c| {
        c.label_next(5);
        let mut buf = vec![1.0f32; 4];
        c.all_reduce(&mut buf, ReduceOp::Sum)?;
        c.all_reduce(&mut buf, ReduceOp::Sum)
    });
    assert!(results.into_iter().all(|r| r.is_ok()));
}

/// A world of no ranks is an error, not a panic; running one runs nothing.
#[test]
fn a_world_of_zero_ranks_is_refused() {
    let e = ThreadWorld::new(0, ThreadWorldOptions::default()).expect_err("0 ranks");
    assert!(e.to_string().contains("at least one rank"), "{e}");
    assert!(ThreadWorld::run(0, ThreadWorldOptions::default(), |c| c.rank()).is_empty());
}
