//! A conformance suite for [`Communicator`] implementations.
//!
//! [`check_all`] runs every collective on every supported dtype, with uneven lengths (and empty
//! chunks), and compares this rank's outputs with a serial f64 reference of what every rank
//! contributed (each rank can compute every rank's deterministic input). Run it on every rank of
//! a world: the thread world's unit tests do for sizes 1-4, and `tests/mpi_conformance.rs` does
//! under `mpirun -n 2` and `-n 3`.

use half::{bf16, f16};

use super::{CommElement, Communicator, CommunicatorExt, DType, ReduceOp, even_split};

/// Rank `rank`'s deterministic input of length `n` (mixed signs, distinct per rank).
pub fn input<T: CommElement>(rank: usize, n: usize) -> Vec<T> {
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
    let n = inputs.first().map_or(0, |v| v.len());
    (0..n)
        .map(|i| {
            let vals = inputs.iter().map(|v| v[i].to_f64());
            let r = match op {
                ReduceOp::Sum => vals.sum(),
                ReduceOp::Mean => vals.sum::<f64>() / inputs.len() as f64,
                ReduceOp::Max => vals.fold(f64::MIN, f64::max),
            };
            if T::DTYPE == DType::U8 {
                // u8 sums wrap and means floor.
                (r.floor() as u64 % 256) as f64
            } else {
                r
            }
        })
        .collect()
}

fn tolerance<T: CommElement>() -> f64 {
    match T::DTYPE {
        DType::F32 => 1e-6,
        DType::F16 => 2e-3,
        DType::BF16 => 1e-2,
        DType::U8 => 0.0,
    }
}

fn check_close<T: CommElement>(
    got: &[T],
    want: &[f64],
    tol: f64,
    what: &str,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, {} expected",
            got.len(),
            want.len()
        ));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        if (g - w).abs() > tol * (1.0 + w.abs()) {
            return Err(format!("{what}[{i}]: got {g}, expected {w}"));
        }
    }
    Ok(())
}

fn to_f64<T: CommElement>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

fn err(what: &str, e: crate::CommError) -> String {
    format!("{what}: {e}")
}

/// Checks every operation for one dtype on this rank. Returns the number of checks passed.
pub fn check_dtype<T: CommElement>(c: &dyn Communicator) -> Result<usize, String> {
    let (rank, world) = (c.rank(), c.world_size());
    let ty = format!("{:?}", T::DTYPE);
    let mut checks = 0;

    for n in [0, 1, 5, 37] {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            let what = format!("all_reduce {op:?} {ty} n={n} world={world}");
            let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, n)).collect();
            let mut buf = input::<T>(rank, n);
            c.all_reduce(&mut buf, op).map_err(|e| err(&what, e))?;
            check_close(
                &buf,
                &reference_reduce(&inputs, op),
                tolerance::<T>(),
                &what,
            )?;
            checks += 1;
        }
    }

    for total in [0, 1, 7, 30] {
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            let what = format!("reduce_scatter {op:?} {ty} total={total} world={world}");
            let counts = even_split(total, world);
            let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, total)).collect();
            let want = reference_reduce(&inputs, op);
            let start: usize = counts[..rank].iter().sum();
            let mut out = vec![T::from_f64(0.0); counts[rank]];
            c.reduce_scatter(&input::<T>(rank, total), &mut out, &counts, op)
                .map_err(|e| err(&what, e))?;
            check_close(
                &out,
                &want[start..start + counts[rank]],
                tolerance::<T>(),
                &what,
            )?;
            checks += 1;
        }
    }

    {
        // Uneven chunks, some empty.
        let what = format!("all_gather {ty} world={world}");
        let counts: Vec<usize> = (0..world).map(|r| (r * 3 + 2) % 5).collect();
        let want: Vec<f64> = (0..world)
            .flat_map(|r| to_f64(&input::<T>(r, counts[r])))
            .collect();
        let mut out = vec![T::from_f64(0.0); counts.iter().sum()];
        c.all_gather(&input::<T>(rank, counts[rank]), &mut out, &counts)
            .map_err(|e| err(&what, e))?;
        check_close(&out, &want, 0.0, &what)?;
        checks += 1;
    }

    for root in 0..world {
        let what = format!("broadcast {ty} root={root} world={world}");
        let mut buf = input::<T>(rank, 11);
        c.broadcast(&mut buf, root).map_err(|e| err(&what, e))?;
        check_close(&buf, &to_f64(&input::<T>(root, 11)), 0.0, &what)?;
        checks += 1;
    }

    {
        let what = format!("all_to_all {ty} world={world}");
        let chunk = 3;
        let mut out = vec![T::from_f64(0.0); chunk * world];
        c.all_to_all(&input::<T>(rank, chunk * world), &mut out)
            .map_err(|e| err(&what, e))?;
        let want: Vec<f64> = (0..world)
            .flat_map(|j| to_f64(&input::<T>(j, chunk * world)[rank * chunk..(rank + 1) * chunk]))
            .collect();
        check_close(&out, &want, 0.0, &what)?;
        checks += 1;
    }

    if world > 1 {
        // A ring; even ranks send first and odd ranks receive first, so that blocking sends
        // (MPI's rendezvous protocol) pair up without deadlock.
        let what = format!("send/recv {ty} world={world}");
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let mut got = vec![T::from_f64(0.0); 9];
        let mine = input::<T>(rank, 9);
        if rank % 2 == 0 {
            c.send(&mine, next, 7).map_err(|e| err(&what, e))?;
            c.recv(&mut got, prev, 7).map_err(|e| err(&what, e))?;
        } else {
            c.recv(&mut got, prev, 7).map_err(|e| err(&what, e))?;
            c.send(&mine, next, 7).map_err(|e| err(&what, e))?;
        }
        check_close(&got, &to_f64(&input::<T>(prev, 9)), 0.0, &what)?;
        checks += 1;
    }

    c.barrier().map_err(|e| err("barrier", e))?;
    Ok(checks + 1)
}

/// Runs [`check_dtype`] for f32, f16, bf16 and u8, then checks the byte counters of an
/// all-reduce against the ring cost model. Returns the number of checks passed.
pub fn check_all(c: &dyn Communicator) -> Result<usize, String> {
    let mut n = check_dtype::<f32>(c)?;
    n += check_dtype::<f16>(c)?;
    n += check_dtype::<bf16>(c)?;
    n += check_dtype::<u8>(c)?;

    let before = c.stats();
    let world = c.world_size();
    let mut buf = vec![1.0f32; 40 * world];
    c.all_reduce(&mut buf, ReduceOp::Sum)
        .map_err(|e| err("all_reduce for counters", e))?;
    let delta = c.stats().since(&before).get(super::OpKind::AllReduce);
    let expected = (2 * (world - 1) * 40 * 4) as u64;
    if delta.model_bytes_sent != expected {
        return Err(format!(
            "all_reduce counted {} model bytes sent, {expected} expected",
            delta.model_bytes_sent
        ));
    }
    // Measured: both transports move the whole f32 buffer each way for this rank (the thread
    // world copies it in and out of the round; MPI is handed it as send and receive buffers).
    let moved = if world > 1 {
        (40 * world * 4) as u64
    } else {
        0
    };
    if (delta.bytes_sent, delta.bytes_received) != (moved, moved) {
        return Err(format!(
            "all_reduce measured {} bytes sent and {} received, {moved} each expected",
            delta.bytes_sent, delta.bytes_received
        ));
    }
    Ok(n + 1 + check_split(c)?)
}

/// Splits the world into two interleaved groups (even and odd ranks) and into one group of
/// everybody, and checks ranks, sizes and a reduction and a gather inside each group.
pub fn check_split(c: &dyn Communicator) -> Result<usize, String> {
    let (rank, world) = (c.rank(), c.world_size());
    let color = rank % 2;
    let group = c.split(color).map_err(|e| err("split", e))?;
    let members: Vec<usize> = (0..world).filter(|r| r % 2 == color).collect();
    if group.world_size() != members.len() || members[group.rank()] != rank {
        return Err(format!(
            "split: rank {rank} became rank {} of {}, expected rank {} of {}",
            group.rank(),
            group.world_size(),
            members
                .iter()
                .position(|&r| r == rank)
                .unwrap_or(usize::MAX),
            members.len()
        ));
    }
    let mut sum = [rank as f32 + 1.0];
    group
        .all_reduce(&mut sum, ReduceOp::Sum)
        .map_err(|e| err("all_reduce in a split group", e))?;
    let want: f32 = members.iter().map(|&r| r as f32 + 1.0).sum();
    if sum[0] != want {
        return Err(format!("group all_reduce gave {}, expected {want}", sum[0]));
    }
    let mut gathered = vec![0u8; members.len()];
    group
        .all_gather_equal(&[rank as u8], &mut gathered)
        .map_err(|e| err("all_gather in a split group", e))?;
    let want: Vec<u8> = members.iter().map(|&r| r as u8).collect();
    if gathered != want {
        return Err(format!(
            "group all_gather gave {gathered:?}, expected {want:?}"
        ));
    }
    // A second split (everybody in one group) must not be confused with the first.
    let all = c.split(7).map_err(|e| err("second split", e))?;
    let mut max = [rank as f32];
    all.all_reduce(&mut max, ReduceOp::Max)
        .map_err(|e| err("all_reduce after a second split", e))?;
    if all.world_size() != world || all.rank() != rank || max[0] != (world - 1) as f32 {
        return Err(format!(
            "second split: rank {} of {}, max {}",
            all.rank(),
            all.world_size(),
            max[0]
        ));
    }
    c.barrier().map_err(|e| err("barrier after split", e))?;
    Ok(3)
}
