//! 0/1 Adam (Lu et al., arXiv 2202.06009) on a flat fp32 parameter buffer in any [`Place`].
//!
//! Two ideas on top of 1-bit Adam. **Adaptive variance freezing**: instead of one warm-up
//! with full-precision gradients, v is updated only on steps whose gradient is averaged in
//! full precision, and those steps grow further apart (the interval doubles after every
//! `var_update_scaler` variance updates); the steps between average the gradient by the 1-bit
//! all-reduce and update m only. After `var_freeze_step` steps v is frozen for good.
//! **1-bit sync with local steps**: once v is frozen, each rank steps on its own gradient with
//! no communication, accumulating its updates in `u`; every `local_step_interval` steps the
//! ranks roll back to the last synchronised point and apply the mean of their accumulated
//! updates, exchanged through the 1-bit all-reduce (as momenta, `u·(√v + eps)`), and the
//! momentum becomes that mean divided by the summed learning rates. The local-step interval
//! doubles after every `local_step_scaler` frozen steps, up to `local_step_clipper`.
//!
//! The schedule follows DeepSpeed's `zoadam.py` step for step (its doubling intervals, which
//! differ from the paper's exponential formula). Where we differ from DeepSpeed, on purpose:
//! - DeepSpeed's first call only initialises buffers and drops its gradient; ours steps, so
//!   our step `t` (0-based) is DeepSpeed's step `t + 2`, and every later decision matches.
//! - A checkpoint keeps `u`, the summed learning rates and the schedule, so a resumed run
//!   continues where it stopped; DeepSpeed drops `u` and restarts the schedule on load. The
//!   compression error buffers start again from zero, as in the rest of the family.
//! - Parameters differ between ranks between two syncs (as in DeepSpeed); a checkpoint holds
//!   rank 0's.

use super::state::OneBitState;
use super::{OneBitOptimizer, OneBitPhase, check_lengths, coefficients};
use crate::compressed::{CompressionErrors, compressed_all_reduce};
use crate::place::Place;
use crate::{CommError, Result};

/// Hyper-parameters of [`ZeroOneAdam`] (DeepSpeed's defaults in [`Default`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ZeroOneAdamConfig {
    /// β1, β2.
    pub betas: (f64, f64),
    /// Added to √v.
    pub eps: f64,
    /// Decoupled weight decay added to the update (`p -= lr·(m/(√v+eps) + wd·p)`).
    pub weight_decay: f64,
    /// Steps after which v is frozen (DeepSpeed's `var_freeze_step`; at least one step
    /// updates v).
    pub var_freeze_step: u64,
    /// Variance updates after which their interval doubles (`var_update_scaler`).
    pub var_update_scaler: u64,
    /// Frozen steps after which the local-step interval doubles (`local_step_scaler`;
    /// DeepSpeed's default is 32678, kept as it is).
    pub local_step_scaler: u64,
    /// The largest local-step interval (`local_step_clipper`).
    pub local_step_clipper: u64,
}

impl Default for ZeroOneAdamConfig {
    fn default() -> Self {
        Self {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            var_freeze_step: 100_000,
            var_update_scaler: 16,
            local_step_scaler: 32_678,
            local_step_clipper: 16,
        }
    }
}

/// What one step of 0/1 Adam does, and so what it exchanges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroOneStep {
    /// The gradient comes averaged in full precision (the caller's all-reduce); m and v are
    /// updated.
    Variance,
    /// The local gradient is averaged by the 1-bit all-reduce; m is updated, v is not.
    OneBitGradient,
    /// v is frozen: a step on the local gradient, with no communication.
    Local,
    /// A local step, then the ranks synchronise their accumulated updates (1-bit).
    Sync,
}

/// 0/1 Adam's schedule as plain data: which kind of step comes next, and how the intervals
/// grow (DeepSpeed's counters, over our step count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroOneSchedule {
    /// Steps taken.
    pub step: u64,
    /// Steps between two variance updates.
    pub var_interval: u64,
    /// Variance updates since the interval last doubled.
    pub var_counter: u64,
    /// Steps between two syncs once v is frozen.
    pub local_interval: u64,
    /// Frozen steps since the local interval last doubled.
    pub local_counter: u64,
}

impl Default for ZeroOneSchedule {
    fn default() -> Self {
        Self {
            step: 0,
            var_interval: 1,
            var_counter: 0,
            local_interval: 1,
            local_counter: 0,
        }
    }
}

impl ZeroOneSchedule {
    /// DeepSpeed's number of the next step (its first call only initialises).
    fn number(&self) -> u64 {
        self.step + 2
    }

    /// Whether v is frozen for the next step.
    pub fn frozen(&self, config: &ZeroOneAdamConfig) -> bool {
        self.step >= config.var_freeze_step.max(1)
    }

    /// The kind of the next step.
    pub fn next(&self, config: &ZeroOneAdamConfig) -> ZeroOneStep {
        let s = self.number();
        match self.frozen(config) {
            true if s.is_multiple_of(self.local_interval) => ZeroOneStep::Sync,
            true => ZeroOneStep::Local,
            false if s.is_multiple_of(self.var_interval) => ZeroOneStep::Variance,
            false => ZeroOneStep::OneBitGradient,
        }
    }

    /// Counts the step just taken.
    pub fn advance(&mut self, config: &ZeroOneAdamConfig) {
        let s = self.number();
        if !self.frozen(config) {
            if s.is_multiple_of(self.var_interval) {
                self.var_counter += 1;
                if self.var_counter == config.var_update_scaler {
                    self.var_counter = 0;
                    self.var_interval *= 2;
                }
            }
        } else {
            self.local_counter += 1;
            if self.local_counter == config.local_step_scaler {
                self.local_counter = 0;
                self.local_interval = (2 * self.local_interval).min(config.local_step_clipper);
            }
        }
        self.step += 1;
    }

    /// The counters as saved (the step is the state's own).
    fn saved(&self, lrs: f64) -> Vec<f32> {
        let counters = [
            self.var_interval,
            self.var_counter,
            self.local_interval,
            self.local_counter,
        ];
        let mut out: Vec<f32> = counters.iter().map(|&c| c as f32).collect();
        out.push(lrs as f32);
        out
    }
}

/// One rank's 0/1 Adam state in place `P`: m, v, the accumulated local updates `u`, the
/// schedule and the compression error buffers.
#[derive(Debug, Clone)]
pub struct ZeroOneAdam<P: Place> {
    config: ZeroOneAdamConfig,
    m: P::Buf,
    v: P::Buf,
    u: P::Buf,
    /// The learning rates summed since the last sync.
    lrs: f64,
    schedule: ZeroOneSchedule,
    errors: CompressionErrors<P>,
    n: usize,
}

impl<P: Place> ZeroOneAdam<P> {
    /// State in `place` for `n` parameters. The intervals must be at least 1.
    pub fn new(place: &P, n: usize, config: ZeroOneAdamConfig) -> Result<Self> {
        if config.local_step_clipper == 0 {
            return Err(CommError::Optimizer {
                optimizer: "0/1 Adam",
                detail: "local_step_clipper must be at least 1".into(),
            });
        }
        Ok(Self {
            config,
            m: place.zeros(n),
            v: place.zeros(n),
            u: place.zeros(n),
            lrs: 0.0,
            schedule: ZeroOneSchedule::default(),
            errors: CompressionErrors::new(place, n),
            n,
        })
    }

    /// The schedule, as of the next step.
    pub fn schedule(&self) -> ZeroOneSchedule {
        self.schedule
    }
}

impl<P: Place> OneBitPhase for ZeroOneAdam<P> {
    fn steps(&self) -> u64 {
        self.schedule.step
    }

    fn freeze_step(&self) -> u64 {
        self.config.var_freeze_step.max(1)
    }

    /// Every step but a variance step takes the local gradient.
    fn compressing(&self) -> bool {
        self.schedule.next(&self.config) != ZeroOneStep::Variance
    }
}

impl<P: Place> OneBitOptimizer<P> for ZeroOneAdam<P> {
    fn apply(&mut self, place: &P, params: P::Buf, grad: P::Buf, lr: f64) -> Result<P::Buf> {
        check_lengths("0/1 Adam", self.n, place, &params, &grad)?;
        let c = self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        let take = |b: &mut P::Buf| std::mem::replace(b, place.zeros(0));
        let kind = self.schedule.next(&c);
        match kind {
            ZeroOneStep::Variance => {
                self.m = place.ema(take(&mut self.m), &grad, b1);
                self.v = place.ema_sq(take(&mut self.v), &grad, b2);
            }
            ZeroOneStep::OneBitGradient => {
                let mean = compressed_all_reduce(place, grad, &mut self.errors)?;
                self.m = place.ema(take(&mut self.m), &mean, b1);
            }
            ZeroOneStep::Local | ZeroOneStep::Sync => {
                self.m = place.ema(take(&mut self.m), &grad, b1);
                self.lrs += lr;
            }
        }
        // p − lr·(m/(√v + eps) + wd·p); once frozen, u accumulates the same −lr·update.
        let denom = place.add_scalar(place.sqrt(self.v.clone()), eps);
        let update = place.add_scaled(place.div(self.m.clone(), &denom), &params, wd);
        let mut params = place.add_scaled(params, &update, -(lr as f32));
        let frozen = self.schedule.frozen(&c);
        if frozen {
            self.u = place.add_scaled(take(&mut self.u), &update, -(lr as f32));
        }
        if kind == ZeroOneStep::Sync {
            // Back to the last synchronised point, then forward by the mean of the ranks'
            // accumulated updates, exchanged as momenta.
            params = place.sub(params, &self.u);
            let momenta = place.mul(take(&mut self.u), &denom);
            let mean = compressed_all_reduce(place, momenta, &mut self.errors)?;
            self.m = place.scaled(mean.clone(), -(1.0 / self.lrs) as f32);
            params = place.add(params, &place.div(mean, &denom));
            self.u = place.zeros(self.n);
            self.lrs = 0.0;
        }
        self.schedule.advance(&c);
        if !frozen && self.schedule.frozen(&c) {
            // The error buffers now encode momenta, not gradients: start them afresh.
            self.errors = CompressionErrors::new(place, self.n);
        }
        Ok(params)
    }

    fn export(&self, place: &P) -> Result<OneBitState> {
        Ok(OneBitState {
            step: self.schedule.step,
            buffers: vec![
                ("m".into(), place.download(&self.m)?),
                ("v".into(), place.download(&self.v)?),
                ("u".into(), place.download(&self.u)?),
                ("schedule".into(), self.schedule.saved(self.lrs)),
            ],
        })
    }

    fn restore(&mut self, place: &P, state: OneBitState) -> Result<()> {
        let mut state = state;
        let m = state.take("m", self.n)?;
        let v = state.take("v", self.n)?;
        let u = state.take("u", self.n)?;
        let saved = state.take("schedule", 5)?;
        let counter = |i: usize| -> Result<u64> {
            let x = saved[i];
            match x.is_finite() && x >= 0.0 && x.fract() == 0.0 {
                true => Ok(x as u64),
                false => Err(CommError::Optimizer {
                    optimizer: "0/1 Adam",
                    detail: format!("the saved schedule holds {x} where a count belongs"),
                }),
            }
        };
        let schedule = ZeroOneSchedule {
            step: state.step,
            var_interval: counter(0)?.max(1),
            var_counter: counter(1)?,
            local_interval: counter(2)?.max(1),
            local_counter: counter(3)?,
        };
        (self.m, self.v, self.u) = (place.upload(m), place.upload(v), place.upload(u));
        self.lrs = saved[4] as f64;
        self.schedule = schedule;
        self.errors = CompressionErrors::new(place, self.n);
        Ok(())
    }

    fn state_bytes(&self, place: &P) -> u64 {
        12 * self.n as u64 + self.errors.bytes(place)
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

    /// DeepSpeed's `zoadam.py` control flow, written out on its own step numbers: the first
    /// call initialises; later calls take a variance step when the step number is a multiple
    /// of the variance interval, which doubles after `var_update_scaler` variance updates;
    /// after the step numbered above `var_freeze_step` v is frozen, and a frozen step syncs
    /// when its number is a multiple of the local interval, which doubles (up to the clipper)
    /// after `local_step_scaler` frozen steps. Returns the kinds of calls 2, 3, ...
    fn deepspeed_kinds(c: &ZeroOneAdamConfig, calls: u64) -> Vec<ZeroOneStep> {
        let (mut var_interval, mut var_counter) = (1u64, 0u64);
        let (mut local_interval, mut local_counter) = (1u64, 0u64);
        let mut frozen = false;
        let mut kinds = Vec::new();
        for s in 2..=calls + 1 {
            if !frozen {
                kinds.push(match s % var_interval == 0 {
                    true => ZeroOneStep::Variance,
                    false => ZeroOneStep::OneBitGradient,
                });
                if s % var_interval == 0 {
                    var_counter += 1;
                    if var_counter == c.var_update_scaler {
                        var_counter = 0;
                        var_interval *= 2;
                    }
                }
            } else {
                kinds.push(match s % local_interval == 0 {
                    true => ZeroOneStep::Sync,
                    false => ZeroOneStep::Local,
                });
                local_counter += 1;
                if local_counter == c.local_step_scaler {
                    local_counter = 0;
                    local_interval = c.local_step_clipper.min(local_interval * 2);
                }
            }
            if s > c.var_freeze_step {
                frozen = true;
            }
        }
        kinds
    }

    #[test]
    fn the_schedule_follows_deepspeed_step_for_step() {
        let small = ZeroOneAdamConfig {
            var_freeze_step: 40,
            var_update_scaler: 3,
            local_step_scaler: 5,
            local_step_clipper: 8,
            ..ZeroOneAdamConfig::default()
        };
        let tutorial = ZeroOneAdamConfig {
            var_freeze_step: 1000,
            local_step_scaler: 1000,
            ..ZeroOneAdamConfig::default()
        };
        let never = ZeroOneAdamConfig {
            var_freeze_step: 0,
            ..small
        };
        for (config, calls) in [(small, 200), (tutorial, 6000), (never, 30)] {
            let mut schedule = ZeroOneSchedule::default();
            let ours: Vec<ZeroOneStep> = (0..calls)
                .map(|_| {
                    let kind = schedule.next(&config);
                    schedule.advance(&config);
                    kind
                })
                .collect();
            assert_eq!(ours, deepspeed_kinds(&config, calls), "{config:?}");
        }
        // Written out for the small schedule: 3 variance updates per interval (1, 2, 4, 8),
        // v frozen after 40 steps, then syncs 1, 2, 4, 8 steps apart, 5 steps per interval.
        let mut schedule = ZeroOneSchedule::default();
        let kinds: Vec<ZeroOneStep> = (0..80)
            .map(|_| {
                let k = schedule.next(&small);
                schedule.advance(&small);
                k
            })
            .collect();
        let variance: Vec<usize> = (0..80)
            .filter(|&t| kinds[t] == ZeroOneStep::Variance)
            .collect();
        // DeepSpeed numbers 2, 3, 4 | 6, 8, 10 | 12, 16, 20 | 24, 32, 40 (ours are 2 less).
        assert_eq!(variance, [0, 1, 2, 4, 6, 8, 10, 14, 18, 22, 30, 38]);
        let syncs: Vec<usize> = (40..80)
            .filter(|&t| kinds[t] == ZeroOneStep::Sync)
            .collect();
        // Numbers 42..=46 every step, then every 2nd (48, 50), every 4th (52, 56), every 8th
        // (64, 72, 80).
        assert_eq!(syncs, [40, 41, 42, 43, 44, 46, 48, 50, 54, 62, 70, 78]);
        assert!(
            kinds[40..]
                .iter()
                .all(|k| matches!(k, ZeroOneStep::Sync | ZeroOneStep::Local))
        );
    }

    const N: usize = 37;

    fn grad(rank: usize, step: usize) -> Vec<f32> {
        (0..N)
            .map(|i| (i as f32 * 1.3 + rank as f32 * 0.47 + step as f32 * 0.71).sin() * 0.6)
            .collect()
    }

    /// Serial f64 reference of every rank, from the definition: variance steps on the mean
    /// gradient, 1-bit gradient steps through the dense compression oracle, local steps that
    /// accumulate `u`, and syncs that roll back and apply the compressed mean momentum.
    fn reference(world: usize, steps: usize, c: ZeroOneAdamConfig, lr: f64) -> Vec<Vec<f64>> {
        let start: Vec<f64> = (0..N).map(|i| i as f64 / N as f64 - 0.5).collect();
        let mut p = vec![start; world];
        let mut m = vec![vec![0.0f64; N]; world];
        let mut u = vec![vec![0.0f64; N]; world];
        let mut v = vec![0.0f64; N];
        let mut lrs = 0.0;
        let mut dense = Dense::new(N, world);
        let mut schedule = ZeroOneSchedule::default();
        let (b1, b2) = c.betas;
        for step in 0..steps {
            let grads: Vec<Vec<f32>> = (0..world).map(|r| grad(r, step)).collect();
            let kind = schedule.next(&c);
            match kind {
                ZeroOneStep::Variance => {
                    for i in 0..N {
                        let g = grads.iter().map(|g| g[i] as f64).sum::<f64>() / world as f64;
                        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                        (0..world).for_each(|r| m[r][i] = b1 * m[r][i] + (1.0 - b1) * g);
                    }
                }
                ZeroOneStep::OneBitGradient => {
                    let mean = dense.step(&grads, N);
                    for m in m.iter_mut() {
                        (0..N).for_each(|i| m[i] = b1 * m[i] + (1.0 - b1) * mean[i]);
                    }
                }
                ZeroOneStep::Local | ZeroOneStep::Sync => {
                    for r in 0..world {
                        (0..N)
                            .for_each(|i| m[r][i] = b1 * m[r][i] + (1.0 - b1) * grads[r][i] as f64);
                    }
                    lrs += lr;
                }
            }
            let frozen = schedule.frozen(&c);
            let denom: Vec<f64> = v.iter().map(|v| v.sqrt() + c.eps).collect();
            for r in 0..world {
                for i in 0..N {
                    let update = m[r][i] / denom[i] + c.weight_decay * p[r][i];
                    p[r][i] -= lr * update;
                    if frozen {
                        u[r][i] -= lr * update;
                    }
                }
            }
            if kind == ZeroOneStep::Sync {
                let momenta: Vec<Vec<f32>> = (0..world)
                    .map(|r| (0..N).map(|i| (u[r][i] * denom[i]) as f32).collect())
                    .collect();
                let mean = dense.step(&momenta, N);
                for r in 0..world {
                    for i in 0..N {
                        p[r][i] += -u[r][i] + mean[i] / denom[i];
                        m[r][i] = -mean[i] / lrs;
                        u[r][i] = 0.0;
                    }
                }
                lrs = 0.0;
            }
            schedule.advance(&c);
            if !frozen && schedule.frozen(&c) {
                dense = Dense::new(N, world);
            }
        }
        p
    }

    #[test]
    fn every_kind_of_step_follows_the_reference() {
        let config = ZeroOneAdamConfig {
            betas: (0.9, 0.99),
            weight_decay: 0.01,
            var_freeze_step: 6,
            var_update_scaler: 2,
            local_step_scaler: 2,
            local_step_clipper: 4,
            ..ZeroOneAdamConfig::default()
        };
        let (steps, lr) = (16, 0.01);
        for world in 1..=3 {
            let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
                let rank = c.rank();
                let place = HostPlace::new(Arc::new(c));
                let mut p: Vec<f32> = (0..N).map(|i| i as f32 / N as f32 - 0.5).collect();
                let mut opt = ZeroOneAdam::new(&place, N, config).expect("config");
                let mut kinds = Vec::new();
                for s in 0..steps {
                    kinds.push(opt.schedule().next(&config));
                    p = step(&mut opt, &place, p, grad(rank, s), lr);
                }
                (p, kinds)
            });
            let want = reference(world, steps, config, lr);
            for (rank, r) in out.into_iter().enumerate() {
                let (p, kinds) = r.expect("rank");
                for k in [
                    ZeroOneStep::Variance,
                    ZeroOneStep::OneBitGradient,
                    ZeroOneStep::Local,
                    ZeroOneStep::Sync,
                ] {
                    assert!(kinds.contains(&k), "the run takes a {k:?} step");
                }
                for (got, w) in p.iter().zip(&want[rank]) {
                    assert!(
                        (*got as f64 - w).abs() < 2e-5,
                        "world {world} rank {rank}: {got} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_restored_state_is_the_saved_state() {
        let config = ZeroOneAdamConfig {
            var_freeze_step: 3,
            local_step_scaler: 2,
            local_step_clipper: 4,
            ..ZeroOneAdamConfig::default()
        };
        let lr = 0.01;
        // The whole state comes back: m, v, u, the summed learning rates and the schedule.
        let world = ThreadWorld::new(1, ThreadWorldOptions::default()).expect("world");
        let place = HostPlace::new(Arc::new(world.communicators().remove(0)));
        let mut a = ZeroOneAdam::new(&place, N, config).expect("config");
        let mut p: Vec<f32> = vec![0.1; N];
        for s in 0..7 {
            p = step(&mut a, &place, p, grad(0, s), lr);
        }
        let saved = a.export(&place).expect("export");
        let mut b = ZeroOneAdam::new(&place, N, config).expect("config");
        b.restore(&place, saved.clone()).expect("restore");
        assert_eq!(b.schedule(), a.schedule());
        assert_eq!(b.export(&place).expect("export"), saved);
        assert_eq!(b.compressing(), a.compressing());
        // A schedule that is not a count is refused, naming the optimizer.
        let mut bad = saved;
        bad.buffers[3].1[0] = 1.5;
        let err = b.restore(&place, bad).unwrap_err().to_string();
        assert!(err.contains("0/1 Adam") && err.contains("1.5"), "{err}");
    }

    #[test]
    fn local_steps_send_nothing_and_syncs_send_one_bit() {
        let n = 1 << 14;
        let config = ZeroOneAdamConfig {
            var_freeze_step: 1,
            local_step_scaler: 1,
            local_step_clipper: 4,
            ..ZeroOneAdamConfig::default()
        };
        let out = ThreadWorld::run(2, ThreadWorldOptions::default(), |c| {
            let c = Arc::new(c);
            let place = HostPlace::new(c.clone());
            let mut p = vec![0.5f32; n];
            let mut opt = ZeroOneAdam::new(&place, n, config).expect("config");
            let mut sent = Vec::new();
            for s in 0..8 {
                let g: Vec<f32> = (0..n)
                    .map(|i| ((i + s + c.rank()) % 5) as f32 - 2.0)
                    .collect();
                let kind = opt.schedule().next(&config);
                let before = c.stats().total_sent();
                p = step(&mut opt, &place, p, g, 1e-3);
                sent.push((kind, c.stats().total_sent() - before));
            }
            sent
        });
        for r in out {
            let sent = r.expect("rank");
            let full = sent[0].1;
            assert_eq!(sent[0].0, ZeroOneStep::Variance);
            for &(kind, bytes) in &sent[1..] {
                match kind {
                    ZeroOneStep::Local => assert_eq!(bytes, 0),
                    ZeroOneStep::Sync => assert!(full as f64 / bytes as f64 >= 16.0),
                    k => panic!("{k:?} after the freeze"),
                }
            }
            assert!(sent.iter().any(|s| s.0 == ZeroOneStep::Local));
        }
    }
}
