//! 1-bit Adam (arXiv 2102.02888) on a flat fp32 parameter buffer in any
//! [`Place`].
//!
//! - **Warm-up** (steps before `freeze_step`): the local gradients are averaged with a full
//!   all-reduce, then Adam updates m, v and the parameters.
//! - **Compression** (from `freeze_step` on): v is frozen; each rank updates m from its *local*
//!   gradient and the momenta are averaged by the error-compensated 1-bit all-reduce
//!   ([`compressed_all_reduce`]) instead of the gradients; the update uses the frozen v.
//!
//! As in DeepSpeed, no bias correction is applied in either phase (v is frozen after warm-up,
//! where a bias-corrected v would no longer match the momenta being exchanged). DeepSpeed also
//! skips the parameter update on its first compressed step while it allocates buffers; we do
//! not.

use super::state::OneBitState;
use super::{OneBitOptimizer, OneBitPhase, check_lengths, coefficients};
use crate::Result;
use crate::compressed::{CompressionErrors, compressed_all_reduce};
use crate::place::Place;

/// Hyper-parameters of [`OneBitAdam`] (DeepSpeed's defaults in [`Default`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OneBitAdamConfig {
    /// β1, β2.
    pub betas: (f64, f64),
    /// Added to √v.
    pub eps: f64,
    /// Decoupled weight decay added to the update (`p -= lr·(m/(√v+eps) + wd·p)`).
    pub weight_decay: f64,
    /// First step of the compression stage (0-based optimizer steps).
    pub freeze_step: u64,
}

impl Default for OneBitAdamConfig {
    fn default() -> Self {
        Self {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            freeze_step: 100_000,
        }
    }
}

/// One rank's 1-bit Adam state in place `P`: m, v and the compression error buffers.
#[derive(Debug, Clone)]
pub struct OneBitAdam<P: Place> {
    config: OneBitAdamConfig,
    m: P::Buf,
    v: P::Buf,
    errors: CompressionErrors<P>,
    n: usize,
    step: u64,
}

impl<P: Place> OneBitAdam<P> {
    /// State in `place` for `n` parameters.
    pub fn new(place: &P, n: usize, config: OneBitAdamConfig) -> Self {
        Self {
            config,
            m: place.zeros(n),
            v: place.zeros(n),
            errors: CompressionErrors::new(place, n),
            n,
            step: 0,
        }
    }

    /// The momentum (identical on every rank after each step).
    pub fn momentum(&self) -> &P::Buf {
        &self.m
    }
}

one_bit_phase!(OneBitAdam);

impl<P: Place> OneBitOptimizer<P> for OneBitAdam<P> {
    fn apply(&mut self, place: &P, params: P::Buf, grad: P::Buf, lr: f64) -> Result<P::Buf> {
        check_lengths("1-bit Adam", self.n, place, &params, &grad)?;
        let c = &self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        let take = |b: &mut P::Buf| std::mem::replace(b, place.zeros(0));
        let m = place.ema(take(&mut self.m), &grad, b1);
        if self.compressing() {
            self.m = compressed_all_reduce(place, m, &mut self.errors)?;
        } else {
            self.m = m;
            self.v = place.ema_sq(take(&mut self.v), &grad, b2);
        }
        // p − lr·(m/(√v + eps) + wd·p)
        let denom = place.add_scalar(place.sqrt(self.v.clone()), eps);
        let update = place.add_scaled(place.div(self.m.clone(), &denom), &params, wd);
        self.step += 1;
        Ok(place.add_scaled(params, &update, -(lr as f32)))
    }

    fn export(&self, place: &P) -> Result<OneBitState> {
        Ok(OneBitState {
            step: self.step,
            buffers: vec![
                ("m".into(), place.download(&self.m)?),
                ("v".into(), place.download(&self.v)?),
            ],
        })
    }

    fn restore(&mut self, place: &P, state: OneBitState) -> Result<()> {
        let mut state = state;
        let v = state.take("v", self.n)?;
        let m = state.take("m", self.n)?;
        (self.m, self.v) = (place.upload(m), place.upload(v));
        self.errors = CompressionErrors::new(place, self.n);
        self.step = state.step;
        Ok(())
    }

    fn state_bytes(&self, place: &P) -> u64 {
        8 * self.n as u64 + self.errors.bytes(place)
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

    const N: usize = 37;

    fn grad(rank: usize, step: usize) -> Vec<f32> {
        (0..N)
            // Irregular values: no momentum lands on 0, where a sign could flip on rounding.
            .map(|i| (i as f32 * 1.7 + rank as f32 * 0.31 + step as f32 * 0.93).sin() * 0.8)
            .collect()
    }

    /// Serial f64 reference of every rank: Adam on the mean gradient during warm-up, then local
    /// momenta through the dense simulation of the compressed all-reduce.
    fn reference(world: usize, steps: usize, cfg: OneBitAdamConfig, lr: f64) -> Vec<f64> {
        let mut p: Vec<f64> = (0..N).map(|i| i as f64 / N as f64 - 0.5).collect();
        let (mut m, mut v) = (vec![0.0f64; N], vec![0.0f64; N]);
        let mut dense = Dense::new(N, world);
        let (b1, b2) = cfg.betas;
        for step in 0..steps {
            let grads: Vec<Vec<f32>> = (0..world).map(|r| grad(r, step)).collect();
            if (step as u64) < cfg.freeze_step {
                for i in 0..N {
                    let g = grads.iter().map(|g| g[i] as f64).sum::<f64>() / world as f64;
                    m[i] = b1 * m[i] + (1.0 - b1) * g;
                    v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                }
            } else {
                let local: Vec<Vec<f32>> = grads
                    .iter()
                    .map(|g| {
                        (0..N)
                            .map(|i| (b1 * m[i] + (1.0 - b1) * g[i] as f64) as f32)
                            .collect()
                    })
                    .collect();
                m = dense.step(&local, N);
            }
            for i in 0..N {
                p[i] -= lr * (m[i] / (v[i].sqrt() + cfg.eps) + cfg.weight_decay * p[i]);
            }
        }
        p
    }

    #[test]
    fn warm_up_and_compression_follow_the_reference() {
        let cfg = OneBitAdamConfig {
            betas: (0.9, 0.99),
            eps: 1e-8,
            weight_decay: 0.01,
            freeze_step: 3,
        };
        let (steps, lr) = (8, 0.01);
        for world in 1..=4 {
            let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
                let rank = c.rank();
                let place = HostPlace::new(Arc::new(c));
                let mut p: Vec<f32> = (0..N).map(|i| i as f32 / N as f32 - 0.5).collect();
                let mut opt = OneBitAdam::new(&place, N, cfg);
                let mut phases = Vec::new();
                for s in 0..steps {
                    phases.push(opt.compressing());
                    p = step(&mut opt, &place, p, grad(rank, s), lr);
                }
                (p, phases)
            });
            let want = reference(world, steps, cfg, lr);
            for r in out {
                let (p, phases) = r.expect("rank");
                assert_eq!(phases, (0..steps).map(|s| s >= 3).collect::<Vec<_>>());
                for (got, w) in p.iter().zip(&want) {
                    assert!(
                        (*got as f64 - w).abs() < 1e-5,
                        "world {world}: {got} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn restore_keeps_the_phase_and_zeroes_the_errors() {
        let cfg = OneBitAdamConfig {
            freeze_step: 2,
            ..OneBitAdamConfig::default()
        };
        let world = ThreadWorld::new(2, ThreadWorldOptions::default()).expect("two ranks");
        let place = HostPlace::new(Arc::new(world.communicators().remove(0)));
        let mut opt = OneBitAdam::new(&place, N, cfg);
        opt.errors.worker[0] = 1.0;
        let state = OneBitState {
            step: 5,
            buffers: vec![("m".into(), vec![0.1; N]), ("v".into(), vec![0.2; N])],
        };
        opt.restore(&place, state.clone()).expect("restore");
        assert_eq!(opt.export(&place).expect("export"), state);
        assert!(opt.compressing());
        assert_eq!(opt.steps(), 5);
        assert_eq!(opt.momentum(), &vec![0.1; N]);
        let zeros = CompressionErrors::new(&place, N);
        assert_eq!(
            (&opt.errors.worker, &opt.errors.server),
            (&zeros.worker, &zeros.server)
        );
    }

    #[test]
    fn compression_sends_at_least_16x_less_than_the_warm_up() {
        let n = 1 << 15;
        let cfg = OneBitAdamConfig {
            freeze_step: 1,
            ..OneBitAdamConfig::default()
        };
        let out = ThreadWorld::run(4, ThreadWorldOptions::default(), |c| {
            let c = Arc::new(c);
            let place = HostPlace::new(c.clone());
            let mut p = vec![0.5f32; n];
            let mut opt = OneBitAdam::new(&place, n, cfg);
            let mut sent = Vec::new();
            for s in 0..2 {
                let g: Vec<f32> = (0..n)
                    .map(|i| ((i + s + c.rank()) % 5) as f32 - 2.0)
                    .collect();
                let before = c.stats().total_sent();
                p = step(&mut opt, &place, p, g, 1e-3);
                sent.push(c.stats().total_sent() - before);
            }
            sent
        });
        for r in out {
            let sent = r.expect("rank");
            let ratio = sent[0] as f64 / sent[1] as f64;
            assert!(
                ratio >= 16.0,
                "warm-up {} vs compressed {} bytes: {ratio:.1}x",
                sent[0],
                sent[1]
            );
        }
    }
}
