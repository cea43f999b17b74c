//! 1-bit LAMB (arXiv 2104.06069) on a flat fp32 buffer of consecutive tensors in any
//! [`Place`]. The per-tensor values (norms, trust ratios, factors: a few per tensor) are
//! computed on the host in f32 from the place's per-tensor norms.
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
//!
//! `m_prev` is a transient of the compressed step, not kept between steps.

use std::ops::Range;

use super::state::{LambBuffers, OneBitState};
use super::{OneBitOptimizer, OneBitPhase, check_lengths, coefficients, consecutive};
use crate::Result;
use crate::compressed::{CompressionErrors, compressed_all_reduce};
use crate::place::Place;

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

/// One rank's 1-bit LAMB state in place `P`: the moments, the fresh variance and the error
/// buffers in the place, the per-tensor coefficients (a few values) on the host.
#[derive(Debug, Clone)]
pub struct OneBitLamb<P: Place> {
    config: OneBitLambConfig,
    tensors: Vec<Range<usize>>,
    m: P::Buf,
    v: P::Buf,
    /// The fresh variance, kept from the last warm-up step on.
    v_fresh: Option<P::Buf>,
    /// Per tensor: the running trust ratio, frozen once compressing.
    coeff_freeze: Vec<f32>,
    /// Per tensor: the previous compressed step's factor.
    last_factor: Vec<f32>,
    /// Per tensor: the momentum scale of the compressed all-reduce (set at the first
    /// compressed step).
    scaling: Option<Vec<f32>>,
    errors: CompressionErrors<P>,
    n: usize,
    step: u64,
}

impl<P: Place> OneBitLamb<P> {
    /// State in `place` for consecutive tensors of `lengths` elements (the trust ratio is per
    /// tensor).
    pub fn new(place: &P, lengths: &[usize], config: OneBitLambConfig) -> Self {
        let tensors = consecutive(lengths);
        let n = tensors.last().map_or(0, |r| r.end);
        let k = tensors.len();
        Self {
            config,
            tensors,
            m: place.zeros(n),
            v: place.zeros(n),
            v_fresh: None,
            coeff_freeze: vec![0.0; k],
            last_factor: vec![1.0; k],
            scaling: None,
            errors: CompressionErrors::new(place, n),
            n,
            step: 0,
        }
    }

    /// The momentum (identical on every rank after each step).
    pub fn momentum(&self) -> &P::Buf {
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

    fn warm_up_step(&mut self, place: &P, params: P::Buf, grad: P::Buf, lr: f64) -> Result<P::Buf> {
        let c = self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        let take = |b: &mut P::Buf| std::mem::replace(b, place.zeros(0));
        self.m = place.ema(take(&mut self.m), &grad, b1);
        self.v = place.ema_sq(take(&mut self.v), &grad, b2);
        if self.step + 1 == c.freeze_step {
            self.v_fresh = Some(self.v.clone());
        }
        // u = m/(√v + eps) + wd·p
        let denom = place.add_scalar(place.sqrt(self.v.clone()), eps);
        let update = place.add_scaled(place.div(self.m.clone(), &denom), &params, wd);
        let pn = place.norms(&params, &self.tensors)?;
        let un = place.norms(&update, &self.tensors)?;
        let mut steps = Vec::with_capacity(self.tensors.len());
        for (t, (pn, un)) in pn.into_iter().zip(un).enumerate() {
            let mut coeff = 1.0f32;
            if pn != 0.0 && un != 0.0 {
                coeff = (pn / un).clamp(c.min_coeff as f32, c.max_coeff as f32);
            }
            if coeff != 1.0 {
                let cb = c.coeff_beta as f32;
                self.coeff_freeze[t] = cb * self.coeff_freeze[t] + (1.0 - cb) * coeff;
            }
            steps.push(-(lr as f32 * coeff));
        }
        Ok(place.add_scaled_ranges(params, &update, &self.tensors, &steps))
    }

    /// One scale per tensor, so that every tensor's momentum has the mean magnitude.
    fn momentum_scales(&self, place: &P) -> Result<Vec<f32>> {
        let norms = place.norms(&self.m, &self.tensors)?;
        let rms: Vec<f32> = (self.tensors.iter().zip(norms))
            .map(|(r, norm)| norm / (r.len().max(1) as f32).sqrt())
            .collect();
        let mean = rms.iter().sum::<f32>() / rms.len().max(1) as f32;
        Ok(rms
            .iter()
            .map(|&s| if s > 0.0 && mean > 0.0 { mean / s } else { 1.0 })
            .collect())
    }

    fn compressed_step(
        &mut self,
        place: &P,
        params: P::Buf,
        grad: P::Buf,
        lr: f64,
    ) -> Result<P::Buf> {
        let c = self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        // freeze_step 0: no warm-up step kept a copy.
        let v_fresh = self.v_fresh.take().unwrap_or_else(|| self.v.clone());
        let scaling = match self.scaling.take() {
            Some(s) => s,
            None => self.momentum_scales(place)?,
        };
        let m_prev = self.m.clone();
        let m = place.ema(std::mem::replace(&mut self.m, place.zeros(0)), &grad, b1);
        let m = place.scale_ranges(m, &self.tensors, &scaling);
        let m = compressed_all_reduce(place, m, &mut self.errors)?;
        let m = place.div_ranges(m, &self.tensors, &scaling);
        // The gradient the averaged momentum implies updates the fresh variance.
        let implied = place.sub(m.clone(), &place.scaled(m_prev, b1));
        let implied = place.div_scalar(implied, 1.0 - b1);
        let fresh = place.ema_sq(v_fresh, &implied, b2);
        let denom = place.add_scalar(place.sqrt(self.v.clone()), eps);
        let fresh_denom = place.add_scalar(place.sqrt(fresh.clone()), eps);
        let mut factors = place.maxes(&place.div(denom.clone(), &fresh_denom), &self.tensors)?;
        let prelim = place.div(m.clone(), &denom);
        let update = place.add_scaled(prelim.clone(), &params, wd);
        if wd > 0.0 {
            // Blended with the share of the update that weight decay does not explain.
            let pn = place.norms(&prelim, &self.tensors)?;
            let un = place.norms(&update, &self.tensors)?;
            for ((factor, pn), un) in factors.iter_mut().zip(pn).zip(un) {
                let ratio = if un > 0.0 { (pn / un).min(1.0) } else { 1.0 };
                *factor = *factor * ratio + (1.0 - ratio);
            }
        }
        let thr = c.factor_threshold as f32;
        let mut steps = Vec::with_capacity(factors.len());
        for (t, factor) in factors.into_iter().enumerate() {
            let last = self.last_factor[t];
            let factor = factor
                .clamp(c.factor_min as f32, c.factor_max as f32)
                .max(last * (1.0 - thr))
                .min(last * (1.0 + thr));
            self.last_factor[t] = factor;
            steps.push(-(lr as f32 * self.coeff_freeze[t] * factor));
        }
        self.m = m;
        self.v_fresh = Some(fresh);
        self.scaling = Some(scaling);
        Ok(place.add_scaled_ranges(params, &update, &self.tensors, &steps))
    }
}

one_bit_phase!(OneBitLamb);

impl<P: Place> OneBitOptimizer<P> for OneBitLamb<P> {
    fn apply(&mut self, place: &P, params: P::Buf, grad: P::Buf, lr: f64) -> Result<P::Buf> {
        check_lengths("1-bit LAMB", self.n, place, &params, &grad)?;
        let params = match self.compressing() {
            true => self.compressed_step(place, params, grad, lr)?,
            false => self.warm_up_step(place, params, grad, lr)?,
        };
        self.step += 1;
        Ok(params)
    }

    fn state_bytes(&self, place: &P) -> u64 {
        let n = self.n as u64;
        let fresh = self.v_fresh.as_ref().map_or(0, |_| n);
        4 * (2 * n + fresh + 3 * self.tensors.len() as u64) + self.errors.bytes(place)
    }

    fn export(&self, place: &P) -> Result<OneBitState> {
        let read = |b: &Option<P::Buf>| b.as_ref().map_or(Ok(Vec::new()), |b| place.download(b));
        Ok(LambBuffers {
            m: place.download(&self.m)?,
            v: place.download(&self.v)?,
            v_fresh: read(&self.v_fresh)?,
            coeff_freeze: self.coeff_freeze.clone(),
            last_factor: self.last_factor.clone(),
            scaling: self.scaling.clone().unwrap_or_default(),
        }
        .into_state(self.step))
    }

    fn restore(&mut self, place: &P, state: OneBitState) -> Result<()> {
        let (n, k) = (self.n, self.tensors.len());
        let (step, b) = LambBuffers::take(state, n, k)?;
        (self.m, self.v) = (place.upload(b.m), place.upload(b.v));
        self.v_fresh = (!b.v_fresh.is_empty()).then(|| place.upload(b.v_fresh));
        (self.coeff_freeze, self.last_factor) = (b.coeff_freeze, b.last_factor);
        self.scaling = (!b.scaling.is_empty()).then_some(b.scaling);
        self.errors = CompressionErrors::new(place, n);
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::comm::{Communicator, ThreadWorld, ThreadWorldOptions};
    use crate::compressed::reference::Dense;
    use crate::onebit::tests::engine_step as step;
    use crate::place::HostPlace;

    fn alone() -> HostPlace {
        let world = ThreadWorld::new(1, ThreadWorldOptions::default()).expect("one rank");
        HostPlace::new(Arc::new(world.communicators().remove(0)))
    }

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
            let rank = comm.rank();
            let place = HostPlace::new(Arc::new(comm));
            let mut p = init();
            let mut opt = OneBitLamb::new(&place, &LENGTHS, c);
            let mut factors = Vec::new();
            for s in 0..steps {
                p = step(&mut opt, &place, p, grad(rank, s), lr);
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
            let rank = comm.rank();
            let place = HostPlace::new(Arc::new(comm));
            let mut p = init();
            let mut opt = OneBitLamb::new(&place, &LENGTHS, c);
            let mut trace = Vec::new();
            for s in 0..20 {
                let scale = if s < 3 { 1.0 } else { 1e-3 };
                let g: Vec<f32> = grad(rank, s).iter().map(|g| g * scale).collect();
                p = step(&mut opt, &place, p, g, 1e-3);
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
        let place = alone();
        let mut opt = OneBitLamb::new(&place, &LENGTHS, c);
        let mut p = init();
        for s in 0..4 {
            p = step(&mut opt, &place, p, grad(0, s), 1e-3);
        }
        let saved = opt.export(&place).expect("export");
        let mut fresh = OneBitLamb::new(&place, &LENGTHS, c);
        fresh.restore(&place, saved.clone()).expect("restore");
        assert_eq!(fresh.export(&place).expect("export"), saved);
        assert!(fresh.compressing());
        let zeros = CompressionErrors::new(&place, n());
        assert_eq!(
            (&fresh.errors.worker, &fresh.errors.server),
            (&zeros.worker, &zeros.server)
        );
        let mut short = saved;
        short.buffers[0].1.pop();
        let err = fresh.restore(&place, short).unwrap_err().to_string();
        assert!(err.contains("buffer `m` holds 59 elements"), "{err}");
    }
}
