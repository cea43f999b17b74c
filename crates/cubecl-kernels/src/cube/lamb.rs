//! Fused LAMB (arXiv 1904.00962) as CubeCL kernels, in [`crate::lamb`]'s three phases: the
//! moments kernel updates m and v and leaves each cube's partial ‖p‖² and ‖u‖²; the host
//! adds them (in f64, and across ranks when ZeRO cut the tensor) into the trust ratio; the
//! apply kernel recomputes u from the moments and writes p. No buffer the size of the tensor
//! is allocated. Parameters and moments are f32.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::adam::params_and_moments;
use super::grid::{UNITS, arg, cover, download, reduce_units};
use super::reduce::cube_sum;
use crate::KernelError;
use crate::lamb::{LambNorms, LambParams, trust_ratio};

/// The LAMB update direction of one element.
#[cube]
fn direction(p: f32, m: f32, v: f32, bc1: f32, bc2: f32, eps: f32, wd: f32) -> f32 {
    (m / bc1) / (f32::sqrt(v / bc2) + eps) + p * wd
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn lamb_moments_kernel(
    p: &[f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    partial: &mut [f32],
    beta1: f32,
    beta2: f32,
    eps: f32,
    wd: f32,
    bc1: f32,
    bc2: f32,
    #[comptime] units: usize,
) {
    let mut shared = Shared::<[f32]>::new_slice(units);
    let i = ABSOLUTE_POS;
    let mut p_sq = 0.0f32;
    let mut u_sq = 0.0f32;
    if i < p.len() {
        let gi = g[i];
        let mi = m[i] * beta1 + gi * (1.0 - beta1);
        let vi = v[i] * beta2 + (gi * gi) * (1.0 - beta2);
        m[i] = mi;
        v[i] = vi;
        let u = direction(p[i], mi, vi, bc1, bc2, eps, wd);
        p_sq = p[i] * p[i];
        u_sq = u * u;
    }
    // Every unit takes part in both sums, in bounds or not.
    let p_total = cube_sum(&mut shared, p_sq);
    sync_cube();
    let u_total = cube_sum(&mut shared, u_sq);
    if UNIT_POS == 0 {
        partial[2 * CUBE_POS] = p_total;
        partial[2 * CUBE_POS + 1] = u_total;
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn lamb_apply_kernel(
    p: &mut [f32],
    m: &[f32],
    v: &[f32],
    ratio: f32,
    lr: f32,
    eps: f32,
    wd: f32,
    bc1: f32,
    bc2: f32,
) {
    let i = ABSOLUTE_POS;
    if i < p.len() {
        let u = direction(p[i], m[i], v[i], bc1, bc2, eps, wd);
        p[i] -= (u * ratio) * lr;
    }
}

/// Phase 1 on the device: updates `m` and `v` from `g` and returns the tensor's squared
/// norms (each cube's partial sums, added on the host in f64). All four buffers hold f32.
///
/// # Errors
/// [`KernelError::Arguments`] when a buffer holds fewer than `n` f32 values.
pub fn lamb_moments(
    client: &Client,
    h: &LambParams,
    step: u32,
    n: usize,
    [p, g, m, v]: [&Handle; 4],
) -> Result<LambNorms, KernelError> {
    params_and_moments::<f32>("lamb_moments", n, [p, g, m, v])?;
    if n == 0 {
        return Ok(LambNorms::default());
    }
    let (bc1, bc2) = h.corrections(step);
    let units = reduce_units(client);
    let (count, dim, cubes) = cover(client, n, units);
    let partial = client.empty(2 * cubes * size_of::<f32>());
    // SAFETY: indices are guarded against `n`; cube `c` writes partial[2c..2c+2].
    unsafe {
        lamb_moments_kernel::launch_unchecked(
            client,
            count,
            dim,
            arg(p, n),
            arg(g, n),
            arg(m, n),
            arg(v, n),
            arg(&partial, 2 * cubes),
            h.beta1,
            h.beta2,
            h.eps,
            h.weight_decay,
            bc1,
            bc2,
            units as usize,
        );
    }
    let sums: Vec<f32> = download(client, &partial);
    Ok(sums[..2 * cubes]
        .chunks(2)
        .fold(LambNorms::default(), |acc, pair| {
            acc + LambNorms {
                param_sq: pair[0] as f64,
                update_sq: pair[1] as f64,
            }
        }))
}

/// Phase 3 on the device: `p ← p − lr·(ratio·u)`, u recomputed from the moments.
///
/// # Errors
/// [`KernelError::Arguments`] when a buffer holds fewer than `n` f32 values.
pub fn lamb_apply(
    client: &Client,
    h: &LambParams,
    step: u32,
    ratio: f32,
    n: usize,
    [p, m, v]: [&Handle; 3],
) -> Result<(), KernelError> {
    params_and_moments::<f32>("lamb_apply", n, [p, p, m, v])?;
    if n == 0 {
        return Ok(());
    }
    let (bc1, bc2) = h.corrections(step);
    let (count, dim, _) = cover(client, n, UNITS);
    // SAFETY: the kernel guards every index against `n`.
    unsafe {
        lamb_apply_kernel::launch_unchecked(
            client,
            count,
            dim,
            arg(p, n),
            arg(m, n),
            arg(v, n),
            ratio,
            h.lr,
            h.eps,
            h.weight_decay,
            bc1,
            bc2,
        );
    }
    Ok(())
}

/// One whole-tensor LAMB step on the device; returns the trust ratio.
///
/// # Errors
/// [`KernelError::Arguments`] when a buffer holds fewer than `n` f32 values.
pub fn lamb_step(
    client: &Client,
    h: &LambParams,
    step: u32,
    n: usize,
    [p, g, m, v]: [&Handle; 4],
) -> Result<f32, KernelError> {
    let norms = lamb_moments(client, h, step, n, [p, g, m, v])?;
    let ratio = trust_ratio(h, norms);
    lamb_apply(client, h, step, ratio, n, [p, m, v])?;
    Ok(ratio)
}

#[cfg(test)]
mod tests {
    use super::super::grid::upload;
    use super::super::tests::clients;
    use super::*;
    use crate::adam::tests::{rel_l2, values};
    use crate::lamb::{self as cpu, lamb_reference};

    #[test]
    fn fused_lamb_matches_the_cpu_path_and_the_f64_reference() {
        for (name, client) in clients() {
            for n in [1usize, 7, 22, 64, 1000, 65537] {
                for clip in [None, Some((0.5, 0.6))] {
                    let h = LambParams {
                        lr: 1e-2,
                        beta1: 0.9,
                        beta2: 0.999,
                        eps: 1e-6,
                        weight_decay: 0.01,
                        bias_correction: true,
                        trust_clip: clip,
                    };
                    let p0 = values(n, 3);
                    let handles =
                        [&p0, &p0, &vec![0.0; n], &vec![0.0; n]].map(|x| upload(&client, x));
                    let (mut cp, mut cm, mut cv) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
                    let mut rp: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
                    let (mut rm, mut rv) = (vec![0.0; n], vec![0.0; n]);
                    let ctx = format!("{name} n {n} clip {clip:?}");
                    for step in 1..=10 {
                        let g = values(n, 50 + step as u64);
                        let gh = upload(&client, &g);
                        let hs = [&handles[0], &gh, &handles[2], &handles[3]];
                        let r = lamb_step(&client, &h, step, n, hs).expect("buffers of n values");
                        let rc = cpu::lamb_step(&h, step, &mut cp, &g, &mut cm, &mut cv);
                        let gr: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                        let rr = lamb_reference(&h, step, &mut rp, &gr, &mut rm, &mut rv);
                        assert!(
                            (r - rc).abs() <= 1e-5 * rc.abs().max(1.0),
                            "{ctx} step {step}: ratio {r} vs CPU {rc}"
                        );
                        assert!(
                            (r as f64 - rr).abs() <= 1e-5 * rr.abs().max(1.0),
                            "{ctx} step {step}: ratio {r} vs f64 {rr}"
                        );
                    }
                    let dp: Vec<f32> = download(&client, &handles[0]);
                    let cpu64: Vec<f64> = cp.iter().map(|&x| x as f64).collect();
                    let vs_cpu = rel_l2(&dp, &cpu64);
                    let vs_ref = rel_l2(&dp, &rp);
                    assert!(vs_cpu <= 1e-6, "{ctx}: device vs CPU {vs_cpu}");
                    assert!(vs_ref <= 1e-6, "{ctx}: device vs f64 {vs_ref}");
                }
            }
        }
    }
}
