//! Fused LAMB step on the CPU (LAMB, arXiv 1904.00962), split so that a tensor cut across
//! ranks (ZeRO) can combine its norms before the update:
//!
//! 1. [`lamb_moments`] updates m and v and returns this piece's ‖p‖² and ‖u‖², with
//!    `u = (m/bc1)/(√(v/bc2) + ε) + wd·p`;
//! 2. the caller sums the pieces' norms (across ranks if needed) and takes
//!    [`trust_ratio`] = ‖p‖/‖u‖ (1 when either is 0), optionally clipped to
//!    `[min_coeff, max_coeff]` as DeepSpeed's FusedLamb does;
//! 3. [`lamb_apply`] recomputes u from the new moments and writes `p ← p − lr·(ratio·u)`.
//!
//! The moments are read twice instead of storing u: no buffer the size of the tensor.
//! Bias correction divides m and v as Burn's `Lamb` does (DeepSpeed's FusedLamb folds
//! `√bc2/bc1` into the learning rate and puts ε outside the corrected root; the two differ
//! only through ε).

use rayon::prelude::*;

use crate::adam::CHUNK;

/// Hyper-parameters of a LAMB step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambParams {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay β1.
    pub beta1: f32,
    /// Second-moment decay β2.
    pub beta2: f32,
    /// ε added to √v̂.
    pub eps: f32,
    /// Weight decay, added to the update.
    pub weight_decay: f32,
    /// Divide the moments by `1 − β^t`.
    pub bias_correction: bool,
    /// Clip the trust ratio to `[min, max]` (DeepSpeed's `min_coeff`, `max_coeff`); `None`
    /// leaves it unclipped, as Burn's `Lamb` does.
    pub trust_clip: Option<(f32, f32)>,
}

/// Squared norms of a piece of a tensor: its parameters and its update.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LambNorms {
    /// Σ p².
    pub param_sq: f64,
    /// Σ u².
    pub update_sq: f64,
}

impl std::ops::Add for LambNorms {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            param_sq: self.param_sq + o.param_sq,
            update_sq: self.update_sq + o.update_sq,
        }
    }
}

impl LambParams {
    pub(crate) fn corrections(&self, step: u32) -> (f32, f32) {
        let t = step.max(1) as i32;
        if self.bias_correction {
            (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t))
        } else {
            (1.0, 1.0)
        }
    }
}

#[inline]
fn update(h: &LambParams, bc: (f32, f32), p: f32, m: f32, v: f32) -> f32 {
    let u = (m / bc.0) / ((v / bc.1).sqrt() + h.eps);
    if h.weight_decay != 0.0 {
        u + p * h.weight_decay
    } else {
        u
    }
}

fn moments_chunk(
    h: &LambParams,
    bc: (f32, f32),
    p: &[f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> LambNorms {
    let (f1, f2) = (1.0 - h.beta1, 1.0 - h.beta2);
    let mut out = LambNorms::default();
    for (((&p, &g), m), v) in p.iter().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *m = *m * h.beta1 + g * f1;
        *v = *v * h.beta2 + (g * g) * f2;
        let u = update(h, bc, p, *m, *v);
        out.param_sq += (p as f64) * (p as f64);
        out.update_sq += (u as f64) * (u as f64);
    }
    out
}

/// Phase 1: updates `m` and `v` from `g` and returns this piece's squared norms.
///
/// # Panics
/// When the slices differ in length.
pub fn lamb_moments(
    h: &LambParams,
    step: u32,
    p: &[f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> LambNorms {
    let n = p.len();
    assert!(
        g.len() == n && m.len() == n && v.len() == n,
        "lamb_moments: slice lengths differ"
    );
    let bc = h.corrections(step);
    if n <= CHUNK {
        return moments_chunk(h, bc, p, g, m, v);
    }
    p.par_chunks(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .map(|(((p, g), m), v)| moments_chunk(h, bc, p, g, m, v))
        .reduce(LambNorms::default, |a, b| a + b)
}

/// Phase 2: the trust ratio ‖p‖/‖u‖ of a whole tensor from its summed squared norms; 1 when
/// either norm is 0.
pub fn trust_ratio(h: &LambParams, norms: LambNorms) -> f32 {
    let (wp, wu) = (norms.param_sq.sqrt(), norms.update_sq.sqrt());
    if wp > 0.0 && wu > 0.0 {
        let r = (wp / wu) as f32;
        match h.trust_clip {
            Some((lo, hi)) => r.clamp(lo, hi),
            None => r,
        }
    } else {
        1.0
    }
}

/// Phase 3: `p ← p − lr·(ratio·u)`, with u recomputed from the moments of phase 1.
///
/// # Panics
/// When the slices differ in length.
pub fn lamb_apply(h: &LambParams, step: u32, ratio: f32, p: &mut [f32], m: &[f32], v: &[f32]) {
    let n = p.len();
    assert!(
        m.len() == n && v.len() == n,
        "lamb_apply: slice lengths differ"
    );
    let bc = h.corrections(step);
    let chunk = |p: &mut [f32], m: &[f32], v: &[f32]| {
        for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
            let u = update(h, bc, *p, m, v);
            *p -= (u * ratio) * h.lr;
        }
    };
    if n <= CHUNK {
        chunk(p, m, v);
        return;
    }
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks(CHUNK))
        .zip(v.par_chunks(CHUNK))
        .for_each(|((p, m), v)| chunk(p, m, v));
}

/// One whole-tensor LAMB step: the three phases on one tensor.
pub fn lamb_step(
    h: &LambParams,
    step: u32,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> f32 {
    let norms = lamb_moments(h, step, p, g, m, v);
    let ratio = trust_ratio(h, norms);
    lamb_apply(h, step, ratio, p, m, v);
    ratio
}

/// The f64 reference of one whole-tensor step; returns the trust ratio.
pub fn lamb_reference(
    h: &LambParams,
    step: u32,
    p: &mut [f64],
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
) -> f64 {
    let t = step.max(1) as i32;
    let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
    let (bc1, bc2) = if h.bias_correction {
        (1.0 - b1.powi(t), 1.0 - b2.powi(t))
    } else {
        (1.0, 1.0)
    };
    let mut u = vec![0.0; p.len()];
    for i in 0..p.len() {
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        u[i] = (m[i] / bc1) / ((v[i] / bc2).sqrt() + h.eps as f64) + h.weight_decay as f64 * p[i];
    }
    let wp = p.iter().map(|x| x * x).sum::<f64>().sqrt();
    let wu = u.iter().map(|x| x * x).sum::<f64>().sqrt();
    let mut ratio = if wp > 0.0 && wu > 0.0 { wp / wu } else { 1.0 };
    if let (Some((lo, hi)), true) = (h.trust_clip, wp > 0.0 && wu > 0.0) {
        ratio = ratio.clamp(lo as f64, hi as f64);
    }
    for i in 0..p.len() {
        p[i] -= h.lr as f64 * ratio * u[i];
    }
    ratio
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adam::tests::{rel_l2, values};

    #[test]
    fn fused_lamb_matches_the_f64_reference() {
        for n in [1usize, 7, 22, 64, 1000, 65537] {
            for clip in [None, Some((0.01, 10.0)), Some((0.5, 0.6))] {
                for bc in [true, false] {
                    let h = LambParams {
                        lr: 1e-2,
                        beta1: 0.9,
                        beta2: 0.999,
                        eps: 1e-6,
                        weight_decay: 0.01,
                        bias_correction: bc,
                        trust_clip: clip,
                    };
                    let mut p = values(n, 3);
                    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
                    let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
                    let (mut mr, mut vr) = (vec![0.0; n], vec![0.0; n]);
                    for step in 1..=10 {
                        let g = values(n, 50 + step as u64);
                        let gr: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                        let r = lamb_step(&h, step, &mut p, &g, &mut m, &mut v);
                        let rr = lamb_reference(&h, step, &mut pr, &gr, &mut mr, &mut vr);
                        assert!(
                            (r as f64 - rr).abs() <= 1e-5 * rr.abs().max(1.0),
                            "ratio {r} vs {rr}"
                        );
                        if let Some((lo, hi)) = clip {
                            assert!(r >= lo && r <= hi);
                        }
                    }
                    let rel = rel_l2(&p, &pr);
                    assert!(rel < 1e-6, "n {n} clip {clip:?} bc {bc}: rel {rel}");
                }
            }
        }
    }

    #[test]
    fn a_zero_norm_gives_ratio_one() {
        let h = LambParams {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.0,
            bias_correction: true,
            trust_clip: Some((0.01, 10.0)),
        };
        assert_eq!(
            trust_ratio(
                &h,
                LambNorms {
                    param_sq: 0.0,
                    update_sq: 4.0
                }
            ),
            1.0
        );
        assert_eq!(
            trust_ratio(
                &h,
                LambNorms {
                    param_sq: 400.0,
                    update_sq: 1.0
                }
            ),
            10.0
        );
    }
}
