//! Every device collective against a serial reference computed on the host, for any
//! [`DeviceCollectives`] on any device: the thread world's tests run it on Flex (and on wgpu
//! with feature `wgpu`), and the GPU tests run it through NCCL.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use super::DeviceCollectives;
use crate::comm::{ReduceOp, even_split};

/// Small integers, exact in f16 and bf16 and in their sums over a few ranks.
fn input(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((rank * 7 + i * 3 + salt) % 11) as f32 - 5.0)
        .collect()
}

fn tensor(values: Vec<f32>, device: &Device, dtype: DType) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, dtype))
}

fn values(t: Tensor<1>) -> Result<Vec<f32>, String> {
    t.cast(DType::F32)
        .try_into_data()
        .map_err(|e| format!("{e:?}"))?
        .try_into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}

fn expect(
    what: &str,
    got: Result<Tensor<1>, crate::CommError>,
    want: &[f64],
    dtype: DType,
    device: &Device,
) -> Result<(), String> {
    let t = got.map_err(|e| format!("{what}: {e}"))?;
    if t.dtype() != dtype || t.device() != *device {
        return Err(format!(
            "{what}: result is {:?} on {:?}, the input was {dtype:?} on {device:?}",
            t.dtype(),
            t.device()
        ));
    }
    let got = values(t).map_err(|e| format!("{what}: {e}"))?;
    let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if (g as f64 - w).abs() > tol * w.abs().max(1.0) {
            return Err(format!("{what}: element {i} is {g}, expected {w}"));
        }
    }
    Ok(())
}

/// u32 words with every bit position used (the high bit included), distinct per rank.
fn words(rank: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| 0x8000_0001u32 ^ ((rank as u32) << 24) ^ (i as u32).wrapping_mul(0x9E37_79B9))
        .collect()
}

fn word_tensor(values: Vec<u32>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::U32))
}

fn expect_words(
    what: &str,
    got: Result<Tensor<1, Int>, crate::CommError>,
    want: &[u32],
    device: &Device,
) -> Result<(), String> {
    let t = got.map_err(|e| format!("{what}: {e}"))?;
    if t.dtype() != DType::U32 || t.device() != *device {
        return Err(format!(
            "{what}: result is {:?} on {:?}, the input was U32 on {device:?}",
            t.dtype(),
            t.device()
        ));
    }
    let got = t
        .try_into_data()
        .map_err(|e| format!("{what}: {e:?}"))?
        .try_into_vec::<u32>()
        .map_err(|e| format!("{what}: {e:?}"))?;
    match got == want {
        true => Ok(()),
        false => Err(format!("{what}: got {got:x?}, expected {want:x?}")),
    }
}

/// The word collectives (the 1-bit all-reduce's packed signs) against the serial reference,
/// bit for bit; returns the number of checks.
fn check_words(c: &dyn DeviceCollectives, device: &Device) -> Result<usize, String> {
    let (rank, world) = (c.rank(), c.world_size());
    let tag = |op: &str| format!("{op} (u32, rank {rank} of {world})");
    let chunk = 3;
    let got = c.all_to_all_words(word_tensor(words(rank, chunk * world), device));
    let want: Vec<u32> = (0..world)
        .flat_map(|r| words(r, chunk * world)[rank * chunk..(rank + 1) * chunk].to_vec())
        .collect();
    expect_words(&tag("all_to_all_words"), got, &want, device)?;
    let got = c.all_gather_words(word_tensor(words(rank, 5), device));
    let want: Vec<u32> = (0..world).flat_map(|r| words(r, 5)).collect();
    expect_words(&tag("all_gather_words"), got, &want, device)?;
    Ok(2)
}

/// Runs every collective of `c` on tensors of `device` in each of `dtypes`, and the word
/// collectives on u32 tensors, and compares the results (values, dtype, device) with the
/// serial reference. Every rank of the world calls it; returns the number of checks.
pub fn check_all(
    c: &dyn DeviceCollectives,
    device: &Device,
    dtypes: &[DType],
) -> Result<usize, String> {
    let (rank, world) = (c.rank(), c.world_size());
    let mut checks = check_words(c, device)?;
    for &dtype in dtypes {
        let tag = |op: &str| format!("{op} ({dtype:?}, rank {rank} of {world})");
        // Lengths that do not split evenly, so that the uneven counts are exercised.
        let n = 7 * world + 1;
        let all: Vec<Vec<f32>> = (0..world).map(|r| input(r, n, 1)).collect();
        let sum: Vec<f64> = (0..n)
            .map(|i| all.iter().map(|v| v[i] as f64).sum())
            .collect();
        for (op, want) in [
            (ReduceOp::Sum, sum.clone()),
            (
                ReduceOp::Mean,
                sum.iter().map(|s| s / world as f64).collect(),
            ),
            (
                ReduceOp::Max,
                (0..n)
                    .map(|i| all.iter().map(|v| v[i] as f64).fold(f64::MIN, f64::max))
                    .collect(),
            ),
        ] {
            let got = c.all_reduce(tensor(all[rank].clone(), device, dtype), op);
            expect(
                &tag(&format!("all_reduce {op:?}")),
                got,
                &want,
                dtype,
                device,
            )?;
            checks += 1;
        }

        let counts = even_split(n, world);
        let start: usize = counts[..rank].iter().sum();
        let got = c.reduce_scatter(tensor(all[rank].clone(), device, dtype), &counts);
        let want = &sum[start..start + counts[rank]];
        expect(&tag("reduce_scatter"), got, want, dtype, device)?;
        checks += 1;

        let mine: Vec<f32> = all[rank][start..start + counts[rank]].to_vec();
        let got = c.all_gather(tensor(mine, device, dtype), &counts);
        let want: Vec<f64> = (0..world)
            .flat_map(|r| {
                let s: usize = counts[..r].iter().sum();
                all[r][s..s + counts[r]].iter().map(|&x| x as f64)
            })
            .collect();
        expect(&tag("all_gather"), got, &want, dtype, device)?;
        checks += 1;

        let root = world - 1;
        let got = c.broadcast(tensor(all[rank].clone(), device, dtype), root);
        let want: Vec<f64> = all[root].iter().map(|&x| x as f64).collect();
        expect(&tag("broadcast"), got, &want, dtype, device)?;
        checks += 1;

        let chunk = 3;
        let a2a: Vec<Vec<f32>> = (0..world).map(|r| input(r, chunk * world, 2)).collect();
        let got = c.all_to_all(tensor(a2a[rank].clone(), device, dtype));
        let want: Vec<f64> = (0..world)
            .flat_map(|r| {
                a2a[r][rank * chunk..(rank + 1) * chunk]
                    .iter()
                    .map(|&x| x as f64)
            })
            .collect();
        expect(&tag("all_to_all"), got, &want, dtype, device)?;
        checks += 1;

        // Pairs (0, 1), (2, 3), ...: the even rank sends first, the odd one receives first,
        // so that a transport without buffering (NCCL) pairs them too.
        let peer = rank ^ 1;
        if peer < world {
            let mine = tensor(input(rank, 5, 3), device, dtype);
            let like = tensor(vec![0.0; 5], device, dtype);
            let got = if rank % 2 == 0 {
                c.send(mine, peer, 7)
                    .map_err(|e| tag(&format!("send: {e}")))?;
                c.recv(like, peer, 7)
            } else {
                let got = c.recv(like, peer, 7);
                c.send(mine, peer, 7)
                    .map_err(|e| tag(&format!("send: {e}")))?;
                got
            };
            let want: Vec<f64> = input(peer, 5, 3).iter().map(|&x| x as f64).collect();
            expect(&tag("send/recv"), got, &want, dtype, device)?;
            checks += 1;
        }
        c.barrier().map_err(|e| tag(&format!("barrier: {e}")))?;
        checks += 1;
    }
    Ok(checks)
}
