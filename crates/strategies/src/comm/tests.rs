//! Every collective of the thread world against a serial reference, at world sizes 1-4.

use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::*;
use crate::CommError;

const WORLDS: [usize; 4] = [1, 2, 3, 4];

fn run<R: Send>(world: usize, f: impl Fn(ThreadCommunicator) -> R + Sync) -> Vec<R> {
    ThreadWorld::run(world, ThreadWorldOptions::default(), f)
        .into_iter()
        .map(|r| r.expect("rank panicked"))
        .collect()
}

/// Rank r's deterministic input of length n (mixed signs, distinct per rank).
fn input<T: CommElement>(rank: usize, n: usize) -> Vec<T> {
    (0..n)
        .map(|i| {
            let v = ((i * 7 + rank * 13) % 23) as f64 - 11.0;
            if T::DTYPE == DType::U8 {
                T::from_f64(v.abs() * 5.0)
            } else {
                T::from_f64(v / 4.0 + rank as f64)
            }
        })
        .collect()
}

fn reference_reduce<T: CommElement>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<f64> {
    let n = inputs[0].len();
    (0..n)
        .map(|i| {
            let vals = inputs.iter().map(|v| v[i].to_f64());
            match op {
                ReduceOp::Sum => vals.sum(),
                ReduceOp::Mean => vals.sum::<f64>() / inputs.len() as f64,
                ReduceOp::Max => vals.fold(f64::MIN, f64::max),
            }
        })
        .collect()
}

fn assert_close<T: CommElement>(got: &[T], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let expected = if T::DTYPE == DType::U8 {
            // u8 sums wrap and means floor.
            (w.floor() as u64 % 256) as f64
        } else {
            *w
        };
        let g = g.to_f64();
        assert!(
            (g - expected).abs() <= tol * (1.0 + expected.abs()),
            "{what}[{i}]: got {g}, want {expected}"
        );
    }
}

fn tol<T: CommElement>() -> f64 {
    match T::DTYPE {
        DType::F32 => 1e-6,
        DType::F16 => 2e-3,
        DType::BF16 => 1e-2,
        DType::U8 => 0.0,
    }
}

fn all_reduce_case<T: CommElement>() {
    for world in WORLDS {
        for n in [0, 1, 5, 37] {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, n)).collect();
                let want = reference_reduce(&inputs, op);
                let outs = run(world, |c| {
                    let mut buf = input::<T>(c.rank(), n);
                    c.all_reduce(&mut buf, op).unwrap();
                    buf
                });
                for out in &outs {
                    assert_close(out, &want, tol::<T>(), &format!("all_reduce {op:?} w{world}"));
                    // Bit-identical on every rank.
                    assert_eq!(bytemuck::cast_slice::<T, u8>(out), bytemuck::cast_slice(&outs[0]));
                }
            }
        }
    }
}

fn reduce_scatter_case<T: CommElement>() {
    for world in WORLDS {
        for total in [0, 1, 7, 30] {
            let counts = even_split(total, world);
            let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, total)).collect();
            let want = reference_reduce(&inputs, ReduceOp::Sum);
            let outs = run(world, |c| {
                let mut out = vec![T::from_f64(0.0); counts[c.rank()]];
                let inp = input::<T>(c.rank(), total);
                c.reduce_scatter(&inp, &mut out, &counts, ReduceOp::Sum)
                    .unwrap();
                out
            });
            let mut off = 0;
            for (r, out) in outs.iter().enumerate() {
                let w = &want[off..off + counts[r]];
                assert_close(out, w, tol::<T>(), &format!("reduce_scatter w{world} r{r}"));
                off += counts[r];
            }
        }
    }
}

fn all_gather_case<T: CommElement>() {
    for world in WORLDS {
        // Uneven, including an empty chunk.
        let counts: Vec<usize> = (0..world).map(|r| (r * 3 + 2) % 5).collect();
        let want: Vec<f64> = (0..world)
            .flat_map(|r| input::<T>(r, counts[r]))
            .map(|v| v.to_f64())
            .collect();
        let outs = run(world, |c| {
            let total: usize = counts.iter().sum();
            let mut out = vec![T::from_f64(0.0); total];
            c.all_gather(&input::<T>(c.rank(), counts[c.rank()]), &mut out, &counts)
                .unwrap();
            out
        });
        for out in outs {
            assert_close(&out, &want, 0.0, &format!("all_gather w{world}"));
        }
    }
}

fn broadcast_case<T: CommElement>() {
    for world in WORLDS {
        for root in 0..world {
            let want: Vec<f64> = input::<T>(root, 11).iter().map(|v| v.to_f64()).collect();
            let outs = run(world, |c| {
                let mut buf = input::<T>(c.rank(), 11);
                c.broadcast(&mut buf, root).unwrap();
                buf
            });
            for out in outs {
                assert_close(&out, &want, 0.0, &format!("broadcast w{world} root{root}"));
            }
        }
    }
}

fn all_to_all_case<T: CommElement>() {
    for world in WORLDS {
        let chunk = 3;
        let outs = run(world, |c| {
            let inp = input::<T>(c.rank(), chunk * world);
            let mut out = vec![T::from_f64(0.0); chunk * world];
            c.all_to_all(&inp, &mut out).unwrap();
            out
        });
        for (me, out) in outs.iter().enumerate() {
            let want: Vec<f64> = (0..world)
                .flat_map(|j| input::<T>(j, chunk * world)[me * chunk..(me + 1) * chunk].to_vec())
                .map(|v| v.to_f64())
                .collect();
            assert_close(out, &want, 0.0, &format!("all_to_all w{world} r{me}"));
        }
    }
}

fn send_recv_case<T: CommElement>() {
    for world in WORLDS {
        // A ring: every rank sends to the next and receives from the previous.
        let outs = run(world, |c| {
            let (r, w) = (c.rank(), c.world_size());
            c.send(&input::<T>(r, 9), (r + 1) % w, 7).unwrap();
            let mut got = vec![T::from_f64(0.0); 9];
            c.recv(&mut got, (r + w - 1) % w, 7).unwrap();
            got
        });
        for (r, out) in outs.iter().enumerate() {
            let src = (r + world - 1) % world;
            let want: Vec<f64> = input::<T>(src, 9).iter().map(|v| v.to_f64()).collect();
            assert_close(out, &want, 0.0, &format!("send/recv w{world} r{r}"));
        }
    }
}

macro_rules! every_dtype {
    ($name:ident, $case:ident) => {
        mod $name {
            use super::*;
            #[test]
            fn f32() {
                $case::<f32>();
            }
            #[test]
            fn f16() {
                $case::<f16>();
            }
            #[test]
            fn bf16() {
                $case::<bf16>();
            }
            #[test]
            fn u8() {
                $case::<u8>();
            }
        }
    };
}

every_dtype!(all_reduce, all_reduce_case);
every_dtype!(reduce_scatter, reduce_scatter_case);
every_dtype!(all_gather, all_gather_case);
every_dtype!(broadcast, broadcast_case);
every_dtype!(all_to_all, all_to_all_case);
every_dtype!(send_recv, send_recv_case);

#[test]
fn barrier_and_counters_follow_the_cost_model() {
    let stats = run(4, |c| {
        let mut buf = vec![1.0f32; 400];
        c.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        let mut out = vec![0.0f32; 100];
        c.reduce_scatter_equal(&buf, &mut out, ReduceOp::Sum).unwrap();
        c.stats()
    });
    for s in stats {
        // Ring all-reduce: 2 (N-1)/N n elements each way.
        assert_eq!(s.get(OpKind::AllReduce).bytes_sent, 2 * 3 * 100 * 4);
        assert_eq!(s.get(OpKind::ReduceScatter).bytes_sent, 300 * 4);
        assert_eq!(s.get(OpKind::ReduceScatter).bytes_received, 300 * 4);
        assert_eq!(s.get(OpKind::Barrier).calls, 1);
        assert_eq!(s.total_sent(), 2400 + 1200);
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
        .map(|r| r.as_ref().expect("no panic").as_ref().unwrap_err().to_string())
        .collect();
    assert!(
        errors.iter().all(|e| e.contains("timed out") || e.contains("failed")),
        "{errors:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
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
    assert!(matches!(results[1], Err(CommError::PeerFailed { rank: 0, .. })));
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
    assert!(msg.contains("reduce_scatter") && msg.contains("counts"), "{msg}");
}
