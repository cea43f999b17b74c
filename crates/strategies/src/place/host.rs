//! [`HostPlace`]: flat buffers as `Vec<f32>` in host memory, computed by loops on the CPU and
//! reduced over the host [`Communicator`].

use std::ops::Range;
use std::sync::Arc;

use burn_deepspeed_compress::onebit::compress;
use burn_deepspeed_cubecl_kernels::sign::unpack_signs;

use super::Place;
use crate::Result;
use crate::comm::{Communicator, CommunicatorExt, ReduceOp};

/// Host memory: buffers are `Vec<f32>`, each element-wise operation one loop, reductions
/// summed in f64, collectives through the host communicator, 1-bit signs packed in bytes
/// (the length padded to a multiple of N·lcm(N, 8) so that every rank's chunk is whole
/// bytes).
#[derive(Debug, Clone)]
pub struct HostPlace {
    comm: Arc<dyn Communicator>,
}

impl HostPlace {
    /// Host buffers reduced over `comm`.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self { comm }
    }

    /// The communicator, shared.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }
}

/// Elements after padding `n` for a world of `world` ranks: a multiple of world·lcm(world, 8),
/// so that each rank's chunk of packed signs is whole bytes.
pub fn byte_padded_len(n: usize, world: usize) -> usize {
    let world = world.max(1);
    let lcm = world * 8 / gcd(world, 8);
    n.div_ceil(world * lcm) * world * lcm
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// `a` with each element `f(a_i, b_i)`.
fn zip(mut a: Vec<f32>, b: &[f32], f: impl Fn(f32, f32) -> f32) -> Vec<f32> {
    a.iter_mut().zip(b).for_each(|(a, &b)| *a = f(*a, b));
    a
}

/// `a` with each element `f(a_i)`.
fn map(mut a: Vec<f32>, f: impl Fn(f32) -> f32) -> Vec<f32> {
    a.iter_mut().for_each(|a| *a = f(*a));
    a
}

/// `f(range of a, its value)` for each range in place.
fn per_range(
    mut a: Vec<f32>,
    ranges: &[Range<usize>],
    values: &[f32],
    f: impl Fn(&mut f32, f32),
) -> Vec<f32> {
    for (r, &v) in ranges.iter().zip(values) {
        a[r.clone()].iter_mut().for_each(|x| f(x, v));
    }
    a
}

fn norm(x: &[f32]) -> f32 {
    squared(x).sqrt() as f32
}

fn squared(x: &[f32]) -> f64 {
    x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>()
}

impl Place for HostPlace {
    type Buf = Vec<f32>;
    type Signs = Vec<u8>;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    fn zeros(&self, n: usize) -> Vec<f32> {
        vec![0.0; n]
    }

    fn upload(&self, values: Vec<f32>) -> Vec<f32> {
        values
    }

    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn slice(&self, buf: &Vec<f32>, range: Range<usize>) -> Vec<f32> {
        buf[range].to_vec()
    }

    fn cat(&self, parts: Vec<Vec<f32>>) -> Vec<f32> {
        parts.concat()
    }

    fn pad(&self, mut buf: Vec<f32>, n: usize) -> Vec<f32> {
        buf.resize(n.max(buf.len()), 0.0);
        buf
    }

    fn add(&self, a: Vec<f32>, b: &Vec<f32>) -> Vec<f32> {
        zip(a, b, |a, b| a + b)
    }

    fn sub(&self, a: Vec<f32>, b: &Vec<f32>) -> Vec<f32> {
        zip(a, b, |a, b| a - b)
    }

    fn mul(&self, a: Vec<f32>, b: &Vec<f32>) -> Vec<f32> {
        zip(a, b, |a, b| a * b)
    }

    fn div(&self, a: Vec<f32>, b: &Vec<f32>) -> Vec<f32> {
        zip(a, b, |a, b| a / b)
    }

    fn scaled(&self, a: Vec<f32>, f: f32) -> Vec<f32> {
        match f {
            1.0 => a,
            f => map(a, |a| a * f),
        }
    }

    fn div_scalar(&self, a: Vec<f32>, f: f32) -> Vec<f32> {
        map(a, |a| a / f)
    }

    fn add_scalar(&self, a: Vec<f32>, f: f32) -> Vec<f32> {
        map(a, |a| a + f)
    }

    fn sqrt(&self, a: Vec<f32>) -> Vec<f32> {
        map(a, f32::sqrt)
    }

    fn add_scaled(&self, a: Vec<f32>, b: &Vec<f32>, f: f32) -> Vec<f32> {
        zip(a, b, |a, b| a + f * b)
    }

    fn ema(&self, x: Vec<f32>, g: &Vec<f32>, beta: f32) -> Vec<f32> {
        zip(x, g, |x, g| beta * x + (1.0 - beta) * g)
    }

    fn ema_sq(&self, x: Vec<f32>, g: &Vec<f32>, beta: f32) -> Vec<f32> {
        zip(x, g, |x, g| beta * x + (1.0 - beta) * g * g)
    }

    fn squared_norm(&self, buf: &Vec<f32>) -> Result<f64> {
        Ok(squared(buf))
    }

    fn norms(&self, buf: &Vec<f32>, ranges: &[Range<usize>]) -> Result<Vec<f32>> {
        Ok(ranges.iter().map(|r| norm(&buf[r.clone()])).collect())
    }

    fn maxes(&self, buf: &Vec<f32>, ranges: &[Range<usize>]) -> Result<Vec<f32>> {
        let max = |r: &Range<usize>| buf[r.clone()].iter().fold(0.0f32, |m, &v| m.max(v));
        Ok(ranges.iter().map(max).collect())
    }

    fn scale_ranges(&self, buf: Vec<f32>, ranges: &[Range<usize>], f: &[f32]) -> Vec<f32> {
        per_range(buf, ranges, f, |x, f| *x *= f)
    }

    fn div_ranges(&self, buf: Vec<f32>, ranges: &[Range<usize>], d: &[f32]) -> Vec<f32> {
        per_range(buf, ranges, d, |x, d| *x /= d)
    }

    fn add_scaled_ranges(
        &self,
        mut a: Vec<f32>,
        b: &Vec<f32>,
        ranges: &[Range<usize>],
        f: &[f32],
    ) -> Vec<f32> {
        for (r, &f) in ranges.iter().zip(f) {
            let b = &b[r.clone()];
            a[r.clone()]
                .iter_mut()
                .zip(b)
                .for_each(|(a, &b)| *a += f * b);
        }
        a
    }

    fn host_reads(&self) -> u64 {
        0
    }

    fn all_reduce(&self, mut buf: Vec<f32>, op: ReduceOp) -> Result<Vec<f32>> {
        if self.world_size() > 1 {
            self.comm.all_reduce(&mut buf, op)?;
        }
        Ok(buf)
    }

    fn sign_padded_len(&self, n: usize) -> usize {
        byte_padded_len(n, self.world_size())
    }

    fn compress(&self, x: Vec<f32>, mut error: Vec<f32>) -> Result<(Vec<u8>, f32, Vec<f32>)> {
        let c = compress(&x, &mut error);
        Ok((c.signs, c.scale, error))
    }

    fn unpack(
        &self,
        signs: &Vec<u8>,
        j: usize,
        parts: usize,
        scale: f32,
        len: usize,
    ) -> Result<Vec<f32>> {
        let bytes = signs.len() / parts.max(1);
        let mut out = vec![0.0f32; len];
        unpack_signs(&signs[j * bytes..(j + 1) * bytes], scale, &mut out);
        Ok(out)
    }

    fn all_to_all_signs(&self, signs: Vec<u8>) -> Result<Vec<u8>> {
        let mut out = vec![0u8; signs.len()];
        self.comm.all_to_all(&signs, &mut out)?;
        Ok(out)
    }

    fn all_gather_signs(&self, signs: Vec<u8>) -> Result<Vec<u8>> {
        let mut out = vec![0u8; signs.len() * self.world_size()];
        self.comm.all_gather_equal(&signs, &mut out)?;
        Ok(out)
    }
}
