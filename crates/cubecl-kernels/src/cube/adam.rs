//! Fused Adam / AdamW as CubeCL kernels: one unit per element reads p, g, m and v once and
//! writes p, m and v, with fp32 moments and fp32, bf16 or fp16 parameters and gradients
//! (ZeRO, arXiv 1910.02054, keeps fp32 optimizer state beside half-precision weights).
//!
//! The math is [`crate::adam`]'s, in the same operation order, so the two paths agree to
//! rounding (a device may contract `a·b + c` into one fused multiply-add).

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::grid::{UNITS, arg, cover, holds};
use crate::KernelError;
use crate::adam::{AdamParams, Coefficients};

/// One Adam update of element `i`: moments in f32, the parameter in its own type.
#[cube]
#[allow(clippy::too_many_arguments)]
fn adam_update<P: Float>(
    p: &mut [P],
    g: &[P],
    m: &mut [f32],
    v: &mut [f32],
    i: usize,
    h: &AdamScalars,
    bc1: f32,
    bc2: f32,
) {
    let pi = f32::cast_from(p[i]);
    p[i] = P::cast_from(adam_next(pi, f32::cast_from(g[i]), m, v, i, h, bc1, bc2));
}

/// The Adam math of element `i` in f32: updates the moments from the gradient `gi` and
/// returns the parameter `pi` after the step.
#[cube]
#[allow(clippy::too_many_arguments)]
fn adam_next(
    pi: f32,
    gi: f32,
    m: &mut [f32],
    v: &mut [f32],
    i: usize,
    h: &AdamScalars,
    bc1: f32,
    bc2: f32,
) -> f32 {
    let gi = gi + pi * h.l2;
    let mi = m[i] * h.beta1 + gi * (1.0 - h.beta1);
    let vi = v[i] * h.beta2 + (gi * gi) * (1.0 - h.beta2);
    m[i] = mi;
    v[i] = vi;
    let delta = (mi / bc1) / (f32::sqrt(vi / bc2) + h.eps);
    pi * h.decay - delta * h.lr
}

/// The step's scalars.
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub(crate) struct AdamScalars {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    /// Multiplies p: `1 − lr·wd` with decoupled weight decay, else 1.
    decay: f32,
    /// Added to g as `wd·p` without decoupled weight decay, else 0.
    l2: f32,
}

/// One tensor: unit `i` updates element `i`.
#[cube(launch_unchecked)]
fn adam_kernel<P: Float>(
    p: &mut [P],
    g: &[P],
    m: &mut [f32],
    v: &mut [f32],
    h: AdamScalars,
    bc1: f32,
    bc2: f32,
) {
    if ABSOLUTE_POS < p.len() {
        adam_update::<P>(p, g, m, v, ABSOLUTE_POS, &h, bc1, bc2);
    }
}

/// One mixed-precision element: the scaled gradient in `P` times `inv_scale`, an Adam step on
/// the f32 master, and the working copy rounded from the new master (as [`crate::adam`]'s
/// `adam_step_mixed`).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adam_mixed_kernel<P: Float>(
    p: &mut [f32],
    g: &[P],
    m: &mut [f32],
    v: &mut [f32],
    working: &mut [P],
    h: AdamScalars,
    bc1: f32,
    bc2: f32,
    inv_scale: f32,
) {
    let i = ABSOLUTE_POS;
    if i < p.len() {
        let gi = f32::cast_from(g[i]) * inv_scale;
        let next = adam_next(p[i], gi, m, v, i, &h, bc1, bc2);
        p[i] = next;
        working[i] = P::cast_from(next);
    }
}

/// Many tensors laid end to end in one buffer (a ZeRO flat partition): `ends[s]` is where
/// segment `s` ends, and `corrections[2s..2s+2]` its bias corrections (each tensor has its
/// own step). A unit finds its segment by binary search.
#[cube(launch_unchecked)]
fn adam_multi_kernel<P: Float>(
    p: &mut [P],
    g: &[P],
    m: &mut [f32],
    v: &mut [f32],
    ends: &[u32],
    corrections: &[f32],
    h: AdamScalars,
) {
    let i = ABSOLUTE_POS;
    if i < p.len() {
        let mut lo = 0usize;
        let mut hi = ends.len();
        while lo < hi {
            let mid = (lo + hi) / 2;
            if (ends[mid] as usize) <= i {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let bc1 = corrections[2 * lo];
        let bc2 = corrections[2 * lo + 1];
        adam_update::<P>(p, g, m, v, i, &h, bc1, bc2);
    }
}

impl AdamParams {
    /// The kernel's scalars, from a step's coefficients (weight decay's part of them does not
    /// depend on the step).
    fn scalars(&self, c: &Coefficients) -> AdamScalarsLaunch {
        AdamScalarsLaunch::new(self.lr, self.beta1, self.beta2, self.eps, c.decay, c.l2)
    }
}

/// One fused Adam step (the `step`-th, from 1) on `n` elements: `p` and `g` hold `P`
/// (f32, `half::bf16` or `half::f16`), `m` and `v` hold f32; all four are updated in place.
///
/// # Errors
/// [`KernelError::Arguments`] when a buffer holds fewer than `n` values of its type (a
/// handle is untyped bytes: reading f32 bytes as `P` gives wrong values, never an access
/// outside the buffers).
pub fn adam_step<P: Float + CubeElement>(
    client: &Client,
    h: &AdamParams,
    step: u32,
    n: usize,
    [p, g, m, v]: [&Handle; 4],
) -> Result<(), KernelError> {
    params_and_moments::<P>("adam_step", n, [p, g, m, v])?;
    if n == 0 {
        return Ok(());
    }
    let c = h.coefficients(step);
    let (count, dim, _) = cover(client, n, UNITS);
    // SAFETY: the kernel guards every index against the buffers' length `n`.
    unsafe {
        adam_kernel::launch_unchecked::<P>(
            client,
            count,
            dim,
            arg(p, n),
            arg(g, n),
            arg(m, n),
            arg(v, n),
            h.scalars(&c),
            c.bc1,
            c.bc2,
        );
    }
    Ok(())
}

/// One fused mixed-precision Adam step (the `step`-th, from 1) on `n` elements, as
/// [`crate::adam::adam_step_mixed`]: `g` and `working` hold `P` (f32, `half::bf16` or
/// `half::f16`); the master `p` and the moments `m`, `v` hold f32. The gradient is multiplied
/// by `inv_scale` (1 / the loss scale, or 1 / the combined unscale-and-clip divisor).
///
/// # Errors
/// [`KernelError::Arguments`] when a buffer holds fewer than `n` values of its type.
#[allow(clippy::too_many_arguments)]
pub fn adam_step_mixed<P: Float + CubeElement>(
    client: &Client,
    h: &AdamParams,
    step: u32,
    inv_scale: f32,
    n: usize,
    [p, g, m, v, working]: [&Handle; 5],
) -> Result<(), KernelError> {
    params_and_moments::<f32>("adam_step_mixed", n, [p, p, m, v])?;
    holds::<P>("adam_step_mixed", "g", g, n)?;
    holds::<P>("adam_step_mixed", "working", working, n)?;
    if n == 0 {
        return Ok(());
    }
    let c = h.coefficients(step);
    let (count, dim, _) = cover(client, n, UNITS);
    // SAFETY: the kernel guards every index against `n`, and every buffer holds `n` values.
    unsafe {
        adam_mixed_kernel::launch_unchecked::<P>(
            client,
            count,
            dim,
            arg(p, n),
            arg(g, n),
            arg(m, n),
            arg(v, n),
            arg(working, n),
            h.scalars(&c),
            c.bc1,
            c.bc2,
            inv_scale,
        );
    }
    Ok(())
}

/// Refuses `p` and `g` with fewer than `n` values of `P`, or `m` and `v` with fewer than `n`
/// f32 values.
pub(crate) fn params_and_moments<P>(
    op: &'static str,
    n: usize,
    [p, g, m, v]: [&Handle; 4],
) -> Result<(), KernelError> {
    holds::<P>(op, "p", p, n)?;
    holds::<P>(op, "g", g, n)?;
    holds::<f32>(op, "m", m, n)?;
    holds::<f32>(op, "v", v, n)
}

/// One fused Adam step over many tensors stored end to end in one buffer, in a single
/// launch: `segments` lists each tensor's length and step number, in order.
///
/// # Errors
/// [`KernelError::Arguments`] when the segments do not add up to `n`, `n` does not fit in 32
/// bits, or a buffer is too small (as [`adam_step`]).
pub fn adam_step_multi<P: Float + CubeElement>(
    client: &Client,
    h: &AdamParams,
    segments: &[(usize, u32)],
    n: usize,
    [p, g, m, v]: [&Handle; 4],
) -> Result<(), KernelError> {
    let total = segments
        .iter()
        .try_fold(0usize, |acc, s| acc.checked_add(s.0));
    if total != Some(n) || u32::try_from(n).is_err() {
        return Err(KernelError::Arguments {
            op: "adam_step_multi",
            detail: format!(
                "the segments must cover the {n} values exactly, in fewer than 2^32 values; \
                 they cover {}",
                total.map_or("more than usize::MAX".to_string(), |t| t.to_string())
            ),
        });
    }
    params_and_moments::<P>("adam_step_multi", n, [p, g, m, v])?;
    if n == 0 {
        return Ok(());
    }
    let mut ends = Vec::with_capacity(segments.len());
    let mut corrections = Vec::with_capacity(2 * segments.len());
    let mut end = 0usize;
    let mut first = None;
    for &(len, step) in segments {
        end += len;
        ends.push(end as u32);
        let c = h.coefficients(step);
        corrections.extend([c.bc1, c.bc2]);
        first.get_or_insert(c);
    }
    let Some(first) = first else {
        return Ok(());
    };
    let scalars = h.scalars(&first);
    let ends_handle = super::grid::upload(client, &ends);
    let corrections_handle = super::grid::upload(client, &corrections);
    let (count, dim, _) = cover(client, n, UNITS);
    // SAFETY: the kernel guards every index against `n`; the search stays within `ends`.
    unsafe {
        adam_multi_kernel::launch_unchecked::<P>(
            client,
            count,
            dim,
            arg(p, n),
            arg(g, n),
            arg(m, n),
            arg(v, n),
            arg(&ends_handle, ends.len()),
            arg(&corrections_handle, corrections.len()),
            scalars,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::super::grid::{download, upload};
    use super::super::tests::{clients, supports};
    use super::*;
    use crate::adam::tests::{reference_in, rel_l2, tolerance, values};
    use crate::adam::{self as cpu, AdamTensor, ParamElement};

    const SIZES: [usize; 6] = [1, 7, 22, 64, 1000, 65537];

    fn params(decoupled: bool, bias_correction: bool) -> AdamParams {
        AdamParams {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled,
            bias_correction,
        }
    }

    /// Ten steps on the device against ten of the CPU path (same dtype) and of the f64
    /// reference (its parameters rounded to the dtype after each step, as stored).
    fn ten_steps<P: Float + CubeElement + ParamElement>(client: &Client, name: &str) {
        for n in SIZES {
            for (decoupled, bc) in [(true, true), (false, true), (true, false), (false, false)] {
                let h = params(decoupled, bc);
                let p0: Vec<P> = values(n, 1).into_iter().map(P::from_f32).collect();
                let handles = [
                    upload(client, &p0),
                    upload(client, &p0),
                    upload(client, &vec![0.0f32; n]),
                    upload(client, &vec![0.0f32; n]),
                ];
                let (mut cp, mut cm, mut cv) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
                let mut rp: Vec<f64> = p0.iter().map(|x| ParamElement::to_f32(*x) as f64).collect();
                let (mut rm, mut rv) = (vec![0.0; n], vec![0.0; n]);
                for step in 1..=10 {
                    let g: Vec<P> = values(n, 100 + step as u64)
                        .into_iter()
                        .map(P::from_f32)
                        .collect();
                    let gh = upload(client, &g);
                    adam_step::<P>(
                        client,
                        &h,
                        step,
                        n,
                        [&handles[0], &gh, &handles[2], &handles[3]],
                    )
                    .expect("buffers of n values");
                    cpu::adam_step(&h, step, &mut cp, &g, &mut cm, &mut cv);
                    let gr: Vec<f64> = g.iter().map(|x| ParamElement::to_f32(*x) as f64).collect();
                    reference_in::<P>(&h, step, &mut rp, &gr, &mut rm, &mut rv);
                }
                let dp: Vec<P> = download(client, &handles[0]);
                let dm: Vec<f32> = download(client, &handles[2]);
                let ctx = format!(
                    "{name} {} n {n} decoupled {decoupled} bc {bc}",
                    std::any::type_name::<P>()
                );
                let as_f32 = |x: &[P]| {
                    x.iter()
                        .map(|v| ParamElement::to_f32(*v))
                        .collect::<Vec<_>>()
                };
                let cpu: Vec<f64> = cp.iter().map(|x| ParamElement::to_f32(*x) as f64).collect();
                // Against the CPU path in the same dtype: rounding apart (an FMA may round a
                // half-precision result to the neighbouring value).
                let vs_cpu = rel_l2(&as_f32(&dp), &cpu);
                assert!(vs_cpu <= tolerance::<P>(), "{ctx}: device vs CPU {vs_cpu}");
                let cm64: Vec<f64> = cm.iter().map(|&x| x as f64).collect();
                assert!(rel_l2(&dm, &cm64) <= 1e-6, "{ctx}: m");
                // Against the f64 reference (which keeps p in f64 throughout).
                let vs_ref = rel_l2(&as_f32(&dp), &rp);
                assert!(vs_ref <= tolerance::<P>(), "{ctx}: device vs f64 {vs_ref}");
            }
        }
    }

    #[test]
    fn fused_adam_matches_the_cpu_path_and_the_f64_reference() {
        for (name, client) in clients() {
            ten_steps::<f32>(&client, &name);
            if supports::<f16>(&client) {
                ten_steps::<f16>(&client, &name);
            } else {
                println!("{name}: no f16 in this runtime; f16 parameters are not offered");
            }
            if supports::<bf16>(&client) {
                ten_steps::<bf16>(&client, &name);
            } else {
                println!("{name}: no bf16 in this runtime; bf16 parameters are not offered");
            }
        }
    }

    /// Ten mixed steps on the device against ten of the CPU path: the fp32 masters and moments
    /// agree to f32 rounding, and each working copy is its master rounded to `P`.
    fn ten_mixed_steps<P: Float + CubeElement + ParamElement>(client: &Client, name: &str) {
        let h = params(true, true);
        let scale = 4096.0f32;
        for n in SIZES {
            let p0 = values(n, 1);
            let w0: Vec<P> = p0.iter().map(|&x| P::from_f32(x)).collect();
            let zeros = vec![0.0f32; n];
            let (p, m, v) = (
                upload(client, &p0),
                upload(client, &zeros),
                upload(client, &zeros),
            );
            let w = upload(client, &w0);
            let (mut cp, mut cm, mut cv, mut cw) = (p0.clone(), zeros.clone(), zeros.clone(), w0);
            for step in 1..=10 {
                let g: Vec<P> = values(n, 100 + step as u64)
                    .into_iter()
                    .map(|x| P::from_f32(x * scale))
                    .collect();
                let gh = upload(client, &g);
                adam_step_mixed::<P>(client, &h, step, 1.0 / scale, n, [&p, &gh, &m, &v, &w])
                    .expect("buffers of n values");
                cpu::adam_step_mixed(
                    &h,
                    step,
                    1.0 / scale,
                    &mut cp,
                    &g,
                    &mut cm,
                    &mut cv,
                    &mut cw,
                )
                .expect("equal lengths");
            }
            let ctx = format!("{name} {} n {n}", std::any::type_name::<P>());
            let dp: Vec<f32> = download(client, &p);
            let dw: Vec<P> = download(client, &w);
            let cp64: Vec<f64> = cp.iter().map(|&x| x as f64).collect();
            let rel = rel_l2(&dp, &cp64);
            assert!(rel <= 1e-6, "{ctx}: master device vs CPU {rel}");
            assert!(
                dp.iter()
                    .zip(&dw)
                    .all(|(&a, b)| P::from_f32(a).to_f32() == ParamElement::to_f32(*b)),
                "{ctx}: the working copy is the rounded master"
            );
        }
        // An undersized working copy is refused.
        let small = upload(client, &[P::from_f32(0.0)]);
        let full = upload(client, &[0.0f32; 4]);
        let e = adam_step_mixed::<P>(client, &h, 1, 1.0, 4, [&full, &full, &full, &full, &small])
            .expect_err("too small");
        assert!(e.to_string().contains("`working` holds"), "{e}");
    }

    #[test]
    fn fused_mixed_adam_matches_the_cpu_path() {
        for (name, client) in clients() {
            ten_mixed_steps::<f32>(&client, &name);
            if supports::<f16>(&client) {
                ten_mixed_steps::<f16>(&client, &name);
            }
            if supports::<bf16>(&client) {
                ten_mixed_steps::<bf16>(&client, &name);
            }
        }
    }

    #[test]
    fn one_launch_over_many_tensors_equals_the_cpu_multi_tensor_step() {
        let h = params(true, true);
        let sizes = [3usize, 70_000, 1, 1000];
        for (name, client) in clients() {
            let n: usize = sizes.iter().sum();
            let p0 = values(n, 5);
            let g = values(n, 6);
            let m0: Vec<f32> = values(n, 7).iter().map(|x| x * 0.1).collect();
            let v0: Vec<f32> = values(n, 8).iter().map(|x| x * x).collect();
            let handles = [&p0, &g, &m0, &v0].map(|x| upload(&client, x));
            let segments: Vec<(usize, u32)> = sizes
                .iter()
                .enumerate()
                .map(|(i, &s)| (s, 3 * i as u32 + 1))
                .collect();
            adam_step_multi::<f32>(
                &client,
                &h,
                &segments,
                n,
                [&handles[0], &handles[1], &handles[2], &handles[3]],
            )
            .expect("buffers of n values");
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let mut tensors = Vec::new();
            let (mut pr, mut gr, mut mr, mut vr) = (&mut p[..], &g[..], &mut m[..], &mut v[..]);
            for &(len, step) in &segments {
                let (p1, p2) = pr.split_at_mut(len);
                let (g1, g2) = gr.split_at(len);
                let (m1, m2) = mr.split_at_mut(len);
                let (v1, v2) = vr.split_at_mut(len);
                tensors.push(AdamTensor {
                    p: p1,
                    g: g1,
                    m: m1,
                    v: v1,
                    step,
                });
                (pr, gr, mr, vr) = (p2, g2, m2, v2);
            }
            cpu::adam_step_multi(&h, &mut tensors);
            let dp: Vec<f32> = download(&client, &handles[0]);
            let p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            let rel = rel_l2(&dp, &p64);
            assert!(rel <= 1e-6, "{name}: multi-tensor launch vs CPU {rel}");
        }
    }
}
