//! 1-bit LAMB (arXiv 2104.06069) on a flat fp32 buffer of consecutive tensors, over any
//! [`Communicator`].
//!
//! - **Warm-up** (steps before `freeze_step`): plain LAMB on the mean gradient. Per tensor,
//!   `u = m/(√v+eps) + wd·p`, the trust ratio `c = clip(‖p‖/‖u‖, min_coeff, max_coeff)` (1 when
//!   either norm is 0), `p -= lr·c·u`, and a running average of the ratios is kept
//!   (`coeff_freeze = coeff_beta·coeff_freeze + (1−coeff_beta)·c`). After the last warm-up step
//!   a copy of v is kept as the *fresh* variance.
//! - **Compression** (from `freeze_step` on): v and the trust ratio are frozen. The momenta of
//!   all tensors, each scaled so that every tensor has the same mean magnitude (scales computed
//!   once, at the first compressed step), go through the error-compensated 1-bit all-reduce.
//!   The gradient the averaged momentum implies, `(m − β1·m_prev)/(1−β1)`, updates the fresh
//!   variance, and the ratio of the frozen to the fresh denominators (its maximum per tensor,
//!   blended with the share of the update that weight decay does not explain, clamped to
//!   `[factor_min, factor_max]` and to ±`factor_threshold` of the previous step's factor)
//!   corrects the frozen trust ratio: `p -= lr·coeff_freeze·factor·u`.
//!
//! As in DeepSpeed, no bias correction is applied.

use std::ops::Range;

use super::state::{LambBuffers, OneBitState};
use super::{OneBitOptimizer, OneBitPhase, check_lengths, coefficients, consecutive};
use crate::Result;
use crate::comm::Communicator;
use crate::compressed::{CompressionErrors, compressed_all_reduce};

/// Hyper-parameters of [`OneBitLamb`] (DeepSpeed's defaults in [`Default`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OneBitLambConfig {
    /// β1, β2.
    pub betas: (f64, f64),
    /// Added to √v.
    pub eps: f64,
    /// Weight decay added to the update before the trust ratio.
    pub weight_decay: f64,
    /// First step of the compression stage (0-based optimizer steps).
    pub freeze_step: u64,
    /// Largest trust ratio.
    pub max_coeff: f64,
    /// Smallest trust ratio.
    pub min_coeff: f64,
    /// Momentum of the running trust ratio frozen at `freeze_step`.
    pub coeff_beta: f64,
    /// Largest variance-correction factor.
    pub factor_max: f64,
    /// Smallest variance-correction factor.
    pub factor_min: f64,
    /// Largest relative change of the factor from one step to the next.
    pub factor_threshold: f64,
}

impl Default for OneBitLambConfig {
    fn default() -> Self {
        Self {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            freeze_step: 100_000,
            max_coeff: 10.0,
            min_coeff: 0.01,
            coeff_beta: 0.9,
            factor_max: 4.0,
            factor_min: 0.5,
            factor_threshold: 0.1,
        }
    }
}

/// One rank's 1-bit LAMB state.
#[derive(Debug, Clone)]
pub struct OneBitLamb {
    config: OneBitLambConfig,
    tensors: Vec<Range<usize>>,
    m: Vec<f32>,
    v: Vec<f32>,
    /// The fresh variance, kept from the last warm-up step on (empty before).
    v_fresh: Vec<f32>,
    /// Per tensor: the running trust ratio, frozen once compressing.
    coeff_freeze: Vec<f32>,
    /// Per tensor: the previous compressed step's factor.
    last_factor: Vec<f32>,
    /// Per tensor: the momentum scale of the compressed all-reduce (empty until the first
    /// compressed step).
    scaling: Vec<f32>,
    m_prev: Vec<f32>,
    errors: CompressionErrors,
    world: usize,
    step: u64,
}

fn norm(x: &[f32]) -> f32 {
    x.iter()
        .map(|v| (*v as f64) * (*v as f64))
        .sum::<f64>()
        .sqrt() as f32
}

impl OneBitLamb {
    /// State for consecutive tensors of `lengths` elements (the trust ratio is per tensor) in a
    /// world of `world` ranks.
    pub fn new(lengths: &[usize], world: usize, config: OneBitLambConfig) -> Self {
        let tensors = consecutive(lengths);
        let offset = tensors.last().map_or(0, |r| r.end);
        let k = tensors.len();
        Self {
            config,
            tensors,
            m: vec![0.0; offset],
            v: vec![0.0; offset],
            v_fresh: Vec::new(),
            coeff_freeze: vec![0.0; k],
            last_factor: vec![1.0; k],
            scaling: Vec::new(),
            m_prev: Vec::new(),
            errors: CompressionErrors::new(offset, world),
            world,
            step: 0,
        }
    }

    /// The momentum (identical on every rank after each step).
    pub fn momentum(&self) -> &[f32] {
        &self.m
    }

    /// Per tensor, the running trust ratio (frozen once compressing).
    pub fn frozen_coefficients(&self) -> &[f32] {
        &self.coeff_freeze
    }

    /// Per tensor, the variance-correction factor of the last compressed step (1 before).
    pub fn factors(&self) -> &[f32] {
        &self.last_factor
    }

    fn warm_up_step(&mut self, params: &mut [f32], grad: &[f32], lr: f64) {
        let c = &self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        for ((m, v), g) in self.m.iter_mut().zip(self.v.iter_mut()).zip(grad) {
            *m = b1 * *m + (1.0 - b1) * g;
            *v = b2 * *v + (1.0 - b2) * g * g;
        }
        if self.step + 1 == c.freeze_step {
            self.v_fresh = self.v.clone();
        }
        let mut update = Vec::new();
        for (t, range) in self.tensors.iter().enumerate() {
            let p = &mut params[range.clone()];
            update.clear();
            update.extend(
                self.m[range.clone()]
                    .iter()
                    .zip(&self.v[range.clone()])
                    .zip(p.iter())
                    .map(|((m, v), p)| m / (v.sqrt() + eps) + wd * p),
            );
            let (pn, un) = (norm(p), norm(&update));
            let mut coeff = 1.0f32;
            if pn != 0.0 && un != 0.0 {
                coeff = (pn / un).clamp(c.min_coeff as f32, c.max_coeff as f32);
            }
            if coeff != 1.0 {
                let cb = c.coeff_beta as f32;
                self.coeff_freeze[t] = cb * self.coeff_freeze[t] + (1.0 - cb) * coeff;
            }
            let step = lr as f32 * coeff;
            p.iter_mut().zip(&update).for_each(|(p, u)| *p -= step * u);
        }
    }

    fn compressed_step(
        &mut self,
        comm: &dyn Communicator,
        params: &mut [f32],
        grad: &[f32],
        lr: f64,
    ) -> Result<()> {
        let c = self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        if self.v_fresh.is_empty() {
            // freeze_step 0: no warm-up step kept a copy.
            self.v_fresh = self.v.clone();
        }
        if self.scaling.is_empty() {
            // One scale per tensor, so that every tensor's momentum has the mean magnitude.
            let rms: Vec<f32> = self
                .tensors
                .iter()
                .map(|r| norm(&self.m[r.clone()]) / (r.len().max(1) as f32).sqrt())
                .collect();
            let mean = rms.iter().sum::<f32>() / rms.len().max(1) as f32;
            self.scaling = rms
                .iter()
                .map(|&s| if s > 0.0 && mean > 0.0 { mean / s } else { 1.0 })
                .collect();
        }
        self.m_prev.clone_from(&self.m);
        for (range, &s) in self.tensors.iter().zip(&self.scaling) {
            for (m, g) in self.m[range.clone()].iter_mut().zip(&grad[range.clone()]) {
                *m = (b1 * *m + (1.0 - b1) * g) * s;
            }
        }
        compressed_all_reduce(comm, &mut self.m, &mut self.errors)?;
        let mut update = Vec::new();
        for (t, range) in self.tensors.iter().enumerate() {
            let s = self.scaling[t];
            self.m[range.clone()].iter_mut().for_each(|m| *m /= s);
            let mut factor = 0.0f32;
            let mut prelim_sq = 0.0f64;
            update.clear();
            for i in range.clone() {
                let m = self.m[i];
                let g = (m - b1 * self.m_prev[i]) / (1.0 - b1);
                let fresh = b2 * self.v_fresh[i] + (1.0 - b2) * g * g;
                self.v_fresh[i] = fresh;
                let denom = self.v[i].sqrt() + eps;
                factor = factor.max(denom / (fresh.sqrt() + eps));
                let prelim = m / denom;
                prelim_sq += (prelim as f64) * (prelim as f64);
                update.push(prelim + wd * params[i]);
            }
            if wd > 0.0 {
                let un = norm(&update);
                let ratio = if un > 0.0 {
                    (prelim_sq.sqrt() as f32 / un).min(1.0)
                } else {
                    1.0
                };
                factor = factor * ratio + (1.0 - ratio);
            }
            let last = self.last_factor[t];
            let thr = c.factor_threshold as f32;
            factor = factor
                .clamp(c.factor_min as f32, c.factor_max as f32)
                .clamp(last * (1.0 - thr), last * (1.0 + thr));
            self.last_factor[t] = factor;
            let step = lr as f32 * self.coeff_freeze[t] * factor;
            params[range.clone()]
                .iter_mut()
                .zip(&update)
                .for_each(|(p, u)| *p -= step * u);
        }
        Ok(())
    }
}

one_bit_phase!(OneBitLamb);

impl OneBitOptimizer for OneBitLamb {
    fn state_bytes(&self) -> u64 {
        let elems = self.m.len()
            + self.v.len()
            + self.v_fresh.len()
            + self.m_prev.len()
            + self.errors.worker.len()
            + self.errors.server.len()
            + 3 * self.tensors.len();
        4 * elems as u64
    }

    fn export(&self) -> OneBitState {
        LambBuffers {
            m: self.m.clone(),
            v: self.v.clone(),
            v_fresh: self.v_fresh.clone(),
            coeff_freeze: self.coeff_freeze.clone(),
            last_factor: self.last_factor.clone(),
            scaling: self.scaling.clone(),
        }
        .into_state(self.step)
    }

    fn restore(&mut self, state: OneBitState) -> Result<()> {
        let (n, k) = (self.m.len(), self.tensors.len());
        let (step, b) = LambBuffers::take(state, n, k)?;
        (self.m, self.v, self.v_fresh) = (b.m, b.v, b.v_fresh);
        (self.coeff_freeze, self.last_factor, self.scaling) =
            (b.coeff_freeze, b.last_factor, b.scaling);
        self.errors = CompressionErrors::new(n, self.world);
        self.step = step;
        Ok(())
    }

    fn apply(
        &mut self,
        comm: &dyn Communicator,
        params: &mut [f32],
        grad: &[f32],
        lr: f64,
    ) -> Result<()> {
        check_lengths("1-bit LAMB", self.m.len(), params, grad)?;
        if self.compressing() {
            self.compressed_step(comm, params, grad, lr)?;
        } else {
            self.warm_up_step(params, grad, lr);
        }
        self.step += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{CommunicatorExt, ReduceOp, ThreadWorld, ThreadWorldOptions};
    use crate::compressed::reference::Dense;

    const LENGTHS: [usize; 3] = [13, 40, 7];

    fn n() -> usize {
        LENGTHS.iter().sum()
    }

    fn grad(rank: usize, step: usize) -> Vec<f32> {
        (0..n())
            .map(|i| {
                let scale = if i < 13 { 0.1 } else { 1.0 };
                (i as f32 * 1.3 + rank as f32 * 0.57 + step as f32 * 1.11).sin() * scale
            })
            .collect()
    }

    fn init() -> Vec<f32> {
        (0..n()).map(|i| (i as f32 * 0.37).cos() * 0.5).collect()
    }

    /// Serial f64 reference of every rank, written from the algorithm's description.
    fn reference(world: usize, steps: usize, c: OneBitLambConfig, lr: f64) -> (Vec<f64>, Vec<f64>) {
        let n = n();
        let mut p: Vec<f64> = init().iter().map(|&v| v as f64).collect();
        let (mut m, mut v) = (vec![0.0f64; n], vec![0.0f64; n]);
        let mut fresh = vec![0.0f64; n];
        let k = LENGTHS.len();
        let (mut coeff, mut last) = (vec![0.0f64; k], vec![1.0f64; k]);
        let mut scaling: Option<Vec<f64>> = None;
        let mut dense = Dense::new(n, world);
        let (b1, b2) = c.betas;
        let ranges: Vec<Range<usize>> = LENGTHS
            .iter()
            .scan(0, |o, &l| {
                *o += l;
                Some(*o - l..*o)
            })
            .collect();
        let l2 = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
        for step in 0..steps {
            let grads: Vec<Vec<f32>> = (0..world).map(|r| grad(r, step)).collect();
            if (step as u64) < c.freeze_step {
                for i in 0..n {
                    let g = grads.iter().map(|g| g[i] as f64).sum::<f64>() / world as f64;
                    m[i] = b1 * m[i] + (1.0 - b1) * g;
                    v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                }
                if step as u64 + 1 == c.freeze_step {
                    fresh = v.clone();
                }
                for (t, r) in ranges.iter().enumerate() {
                    let u: Vec<f64> = r
                        .clone()
                        .map(|i| m[i] / (v[i].sqrt() + c.eps) + c.weight_decay * p[i])
                        .collect();
                    let (pn, un) = (l2(&p[r.clone()]), l2(&u));
                    let ratio = if pn > 0.0 && un > 0.0 {
                        (pn / un).clamp(c.min_coeff, c.max_coeff)
                    } else {
                        1.0
                    };
                    if ratio != 1.0 {
                        coeff[t] = c.coeff_beta * coeff[t] + (1.0 - c.coeff_beta) * ratio;
                    }
                    for (k, i) in r.clone().enumerate() {
                        p[i] -= lr * ratio * u[k];
                    }
                }
            } else {
                let s = scaling.get_or_insert_with(|| {
                    let rms: Vec<f64> = ranges
                        .iter()
                        .map(|r| l2(&m[r.clone()]) / (r.len() as f64).sqrt())
                        .collect();
                    let mean = rms.iter().sum::<f64>() / rms.len() as f64;
                    rms.iter().map(|x| mean / x).collect()
                });
                let prev = m.clone();
                let scaled_of = |i: usize, g: f32| {
                    let t = ranges.iter().position(|r| r.contains(&i)).expect("range");
                    ((b1 * prev[i] + (1.0 - b1) * g as f64) * s[t]) as f32
                };
                let local: Vec<Vec<f32>> = grads
                    .iter()
                    .map(|g| (0..n).map(|i| scaled_of(i, g[i])).collect())
                    .collect();
                let reduced = dense.step(&local, n);
                for (t, r) in ranges.iter().enumerate() {
                    let mut factor = 0.0f64;
                    let (mut prelim, mut u) = (Vec::new(), Vec::new());
                    for i in r.clone() {
                        m[i] = reduced[i] / s[t];
                        let g = (m[i] - b1 * prev[i]) / (1.0 - b1);
                        fresh[i] = b2 * fresh[i] + (1.0 - b2) * g * g;
                        let denom = v[i].sqrt() + c.eps;
                        factor = factor.max(denom / (fresh[i].sqrt() + c.eps));
                        prelim.push(m[i] / denom);
                        u.push(m[i] / denom + c.weight_decay * p[i]);
                    }
                    if c.weight_decay > 0.0 {
                        let ratio = (l2(&prelim) / l2(&u)).min(1.0);
                        factor = factor * ratio + (1.0 - ratio);
                    }
                    factor = factor.clamp(c.factor_min, c.factor_max).clamp(
                        last[t] * (1.0 - c.factor_threshold),
                        last[t] * (1.0 + c.factor_threshold),
                    );
                    last[t] = factor;
                    for (k, i) in r.clone().enumerate() {
                        p[i] -= lr * coeff[t] * factor * u[k];
                    }
                }
            }
        }
        (p, last)
    }

    fn run(
        world: usize,
        steps: usize,
        c: OneBitLambConfig,
        lr: f64,
    ) -> Vec<(Vec<f32>, Vec<Vec<f32>>)> {
        ThreadWorld::run(world, ThreadWorldOptions::default(), |comm| {
            let mut p = init();
            let mut opt = OneBitLamb::new(&LENGTHS, world, c);
            let mut factors = Vec::new();
            for step in 0..steps {
                let mut g = grad(comm.rank(), step);
                if !opt.compressing() && world > 1 {
                    comm.all_reduce(&mut g, ReduceOp::Mean).expect("all-reduce");
                }
                opt.apply(&comm, &mut p, &g, lr).expect("step");
                factors.push(opt.factors().to_vec());
            }
            (p, factors)
        })
        .into_iter()
        .map(|r| r.expect("rank"))
        .collect()
    }

    #[test]
    fn warm_up_and_compression_follow_the_reference() {
        let c = OneBitLambConfig {
            betas: (0.9, 0.99),
            weight_decay: 0.01,
            freeze_step: 4,
            ..OneBitLambConfig::default()
        };
        let (steps, lr) = (12, 0.02);
        for world in 1..=4 {
            let (want, want_factors) = reference(world, steps, c, lr);
            for (p, factors) in run(world, steps, c, lr) {
                for (got, w) in p.iter().zip(&want) {
                    let tol = 1e-4 * (1.0 + w.abs());
                    assert!((*got as f64 - w).abs() < tol, "world {world}: {got} vs {w}");
                }
                for (got, w) in factors.last().expect("steps").iter().zip(&want_factors) {
                    assert!((*got as f64 - w).abs() < 1e-4, "factor {got} vs {w}");
                }
                // The factor never leaves [min, max] nor moves by more than the threshold.
                for pair in factors.windows(2) {
                    for (a, b) in pair[0].iter().zip(&pair[1]) {
                        assert!((0.5..=4.0).contains(b), "factor {b}");
                        assert!(*b <= a * 1.1 + 1e-6 && *b >= a * 0.9 - 1e-6, "{a} -> {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_factor_moves_when_the_fresh_variance_departs() {
        // Gradients shrink after the freeze, so the fresh variance falls below the frozen one
        // and the factor climbs by the threshold each step until it reaches factor_max.
        let c = OneBitLambConfig {
            freeze_step: 3,
            betas: (0.5, 0.5),
            ..OneBitLambConfig::default()
        };
        let out = ThreadWorld::run(2, ThreadWorldOptions::default(), |comm| {
            let mut p = init();
            let mut opt = OneBitLamb::new(&LENGTHS, 2, c);
            let mut trace = Vec::new();
            for step in 0..20 {
                let scale = if step < 3 { 1.0 } else { 1e-3 };
                let mut g: Vec<f32> = grad(comm.rank(), step).iter().map(|g| g * scale).collect();
                if !opt.compressing() {
                    comm.all_reduce(&mut g, ReduceOp::Mean).expect("all-reduce");
                }
                opt.apply(&comm, &mut p, &g, 1e-3).expect("step");
                trace.push(opt.factors()[1]);
            }
            trace
        });
        let trace = out.into_iter().next().expect("rank").expect("ok");
        assert_eq!(trace[..3], [1.0, 1.0, 1.0]);
        assert!((trace[3] - 1.1).abs() < 1e-6, "{trace:?}");
        assert!((trace[19] - 4.0).abs() < 1e-6, "{trace:?}");
    }

    #[test]
    fn export_restore_round_trips_and_zeroes_the_errors() {
        let c = OneBitLambConfig {
            freeze_step: 2,
            ..OneBitLambConfig::default()
        };
        let mut opt = OneBitLamb::new(&LENGTHS, 1, c);
        let comm = ThreadWorld::new(1, ThreadWorldOptions::default())
            .expect("one rank")
            .communicators()
            .remove(0);
        let mut p = init();
        for step in 0..4 {
            opt.apply(&comm, &mut p, &grad(0, step), 1e-3)
                .expect("step");
        }
        let saved = opt.export();
        let mut fresh = OneBitLamb::new(&LENGTHS, 1, c);
        fresh.restore(saved.clone()).expect("restore");
        assert_eq!(fresh.export(), saved);
        assert!(fresh.compressing());
        assert_eq!(fresh.errors, CompressionErrors::new(n(), 1));
        let mut short = saved;
        short.buffers[0].1.pop();
        let err = fresh.restore(short).unwrap_err().to_string();
        assert!(err.contains("buffer `m` holds 59 elements"), "{err}");
    }
}
