//! The 1-bit optimizers on the model's device: [`DeviceOneBitAdam`] (arXiv 2102.02888) and
//! [`DeviceOneBitLamb`] (arXiv 2104.06069) step flat f32 tensors of the model's device with
//! the same algorithm as the host [`OneBitAdam`](super::OneBitAdam) and
//! [`OneBitLamb`](super::OneBitLamb) (see those for the two phases), exchanging the momenta
//! through [`device_compressed_all_reduce`]. Their checkpoint state is the host optimizers'
//! [`OneBitState`], so that a run moves between the host and a device.
//!
//! LAMB's per-tensor norms, trust ratios and variance-correction factors are vectors of one
//! value per tensor on the device: the host reads nothing of them. Where the host sums norms
//! in f64, the device sums in f32.

use std::ops::Range;

use burn::tensor::{DType, Device, Tensor, TensorData};

use super::state::{LambBuffers, OneBitState};
use super::{OneBitAdamConfig, OneBitLambConfig, OneBitPhase, coefficients, consecutive};
use crate::comm::Communicator;
use crate::device::{DeviceCollectives, DeviceCompressionErrors, device_compressed_all_reduce};
use crate::{CommError, Result};

/// What a device 1-bit optimizer offers its engine: a step on flat device buffers and the
/// state a checkpoint keeps.
pub trait DeviceOneBitOptimizer: OneBitPhase {
    /// One step on a prepared gradient (f32, the buffer's length, on the device): during
    /// warm-up the mean over ranks, once compressing this rank's local gradient. Returns the
    /// stepped parameters. Every rank calls it with the same `lr`; `host` is the host
    /// communicator of `coll`'s ranks.
    fn apply(
        &mut self,
        coll: &dyn DeviceCollectives,
        host: &dyn Communicator,
        params: Tensor<1>,
        grad: Tensor<1>,
        lr: f64,
    ) -> Result<Tensor<1>>;

    /// Bytes of optimizer state this rank holds on the device, error buffers included.
    fn state_bytes(&self) -> u64;

    /// Bytes the compressed all-reduce read into host memory so far (its scales).
    fn host_bytes(&self) -> u64;

    /// The state a checkpoint keeps (read from the device), as the host optimizer's.
    fn export(&self) -> Result<OneBitState>;

    /// Restores a state from [`export`](Self::export) or from the host optimizer's; the error
    /// buffers start again from zero.
    fn restore(&mut self, state: OneBitState) -> Result<()>;
}

fn to_device(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::F32))
}

fn to_host(t: &Tensor<1>, optimizer: &'static str) -> Result<Vec<f32>> {
    t.clone()
        .try_into_data()
        .map_err(|e| format!("{e:?}"))
        .and_then(|d| d.try_into_vec::<f32>().map_err(|e| format!("{e:?}")))
        .map_err(|e| CommError::Optimizer {
            optimizer,
            detail: format!("reading its state from the device: {e}"),
        })
}

fn check_length(
    optimizer: &'static str,
    n: usize,
    params: &Tensor<1>,
    grad: &Tensor<1>,
) -> Result<()> {
    let (p, g) = (params.dims()[0], grad.dims()[0]);
    if p != n || g != n {
        return Err(CommError::Optimizer {
            optimizer,
            detail: format!("it holds {n} elements; got {p} parameters and {g} gradients"),
        });
    }
    Ok(())
}

/// `b·x + (1−b)·g`, in the host loops' order of operations.
fn ema(x: Tensor<1>, g: Tensor<1>, b: f32) -> Tensor<1> {
    x.mul_scalar(b) + g.mul_scalar(1.0 - b)
}

/// `b·x + (1−b)·g·g`, in the host loops' order of operations.
fn ema_sq(x: Tensor<1>, g: Tensor<1>, b: f32) -> Tensor<1> {
    x.mul_scalar(b) + g.clone().mul_scalar(1.0 - b) * g
}

/// 1-bit Adam on the device: m, v and the compression error buffers are device tensors.
#[derive(Debug)]
pub struct DeviceOneBitAdam {
    config: OneBitAdamConfig,
    m: Tensor<1>,
    v: Tensor<1>,
    errors: DeviceCompressionErrors,
    n: usize,
    world: usize,
    step: u64,
    device: Device,
}

impl DeviceOneBitAdam {
    /// State on `device` for `n` parameters in a world of `world` ranks.
    pub fn new(n: usize, world: usize, config: OneBitAdamConfig, device: &Device) -> Self {
        Self {
            config,
            m: Tensor::zeros([n], device),
            v: Tensor::zeros([n], device),
            errors: DeviceCompressionErrors::new(n, world, device),
            n,
            world,
            step: 0,
            device: device.clone(),
        }
    }
}

one_bit_phase!(DeviceOneBitAdam);

impl DeviceOneBitOptimizer for DeviceOneBitAdam {
    fn apply(
        &mut self,
        coll: &dyn DeviceCollectives,
        host: &dyn Communicator,
        params: Tensor<1>,
        grad: Tensor<1>,
        lr: f64,
    ) -> Result<Tensor<1>> {
        check_length("1-bit Adam", self.n, &params, &grad)?;
        let c = &self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        let m = ema(self.m.clone(), grad.clone(), b1);
        if self.compressing() {
            self.m = device_compressed_all_reduce(coll, host, m, &mut self.errors)?;
        } else {
            self.m = m;
            self.v = ema_sq(self.v.clone(), grad, b2);
        }
        let update = self.m.clone() / self.v.clone().sqrt().add_scalar(eps);
        let update = match wd {
            0.0 => update,
            wd => update + params.clone().mul_scalar(wd),
        };
        self.step += 1;
        Ok(params - update.mul_scalar(lr as f32))
    }

    fn state_bytes(&self) -> u64 {
        8 * self.n as u64 + self.errors.bytes()
    }

    fn host_bytes(&self) -> u64 {
        self.errors.host_bytes()
    }

    fn export(&self) -> Result<OneBitState> {
        Ok(OneBitState {
            step: self.step,
            buffers: vec![
                ("m".into(), to_host(&self.m, "1-bit Adam")?),
                ("v".into(), to_host(&self.v, "1-bit Adam")?),
            ],
        })
    }

    fn restore(&mut self, state: OneBitState) -> Result<()> {
        let mut state = state;
        let v = state.take("v", self.n)?;
        let m = state.take("m", self.n)?;
        self.v = to_device(v, &self.device);
        self.m = to_device(m, &self.device);
        self.errors = DeviceCompressionErrors::new(self.n, self.world, &self.device);
        self.step = state.step;
        Ok(())
    }
}

/// 1-bit LAMB on the device: the moments, the fresh variance and the error buffers are
/// device tensors of the buffer's length, the per-tensor coefficients device vectors of one
/// value per tensor.
#[derive(Debug)]
pub struct DeviceOneBitLamb {
    config: OneBitLambConfig,
    tensors: Vec<Range<usize>>,
    m: Tensor<1>,
    v: Tensor<1>,
    /// Kept from the last warm-up step on.
    v_fresh: Option<Tensor<1>>,
    coeff_freeze: Tensor<1>,
    last_factor: Tensor<1>,
    /// Set at the first compressed step.
    scaling: Option<Tensor<1>>,
    errors: DeviceCompressionErrors,
    n: usize,
    world: usize,
    step: u64,
    device: Device,
}

impl DeviceOneBitLamb {
    /// State on `device` for consecutive tensors of `lengths` elements in a world of
    /// `world` ranks.
    pub fn new(lengths: &[usize], world: usize, config: OneBitLambConfig, device: &Device) -> Self {
        let tensors = consecutive(lengths);
        let offset = tensors.last().map_or(0, |r| r.end);
        let k = tensors.len();
        Self {
            config,
            tensors,
            m: Tensor::zeros([offset], device),
            v: Tensor::zeros([offset], device),
            v_fresh: None,
            coeff_freeze: Tensor::zeros([k], device),
            last_factor: Tensor::ones([k], device),
            scaling: None,
            errors: DeviceCompressionErrors::new(offset, world, device),
            n: offset,
            world,
            step: 0,
            device: device.clone(),
        }
    }

    /// One value per tensor, `f(range)` of a non-empty range (`empty` for an empty one),
    /// as a device vector.
    fn per_tensor(&self, empty: f32, f: impl Fn(Range<usize>) -> Tensor<1>) -> Tensor<1> {
        let parts: Vec<Tensor<1>> = self
            .tensors
            .iter()
            .map(|r| match r.is_empty() {
                true => Tensor::full([1], empty, &self.device),
                false => f(r.clone()),
            })
            .collect();
        match parts.is_empty() {
            true => Tensor::zeros([0], &self.device),
            false => Tensor::cat(parts, 0),
        }
    }

    /// Each tensor's range of `x` times its value of the per-tensor vector `k`.
    fn scale_per_tensor(&self, x: &Tensor<1>, k: &Tensor<1>) -> Tensor<1> {
        self.map_per_tensor(x, k, |x, k| x * k)
    }

    /// `f(range of x, value of k)` for each tensor, joined.
    fn map_per_tensor(
        &self,
        x: &Tensor<1>,
        k: &Tensor<1>,
        f: impl Fn(Tensor<1>, Tensor<1>) -> Tensor<1>,
    ) -> Tensor<1> {
        let parts: Vec<Tensor<1>> = self
            .tensors
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.is_empty())
            .map(|(t, r)| f(x.clone().slice(r.clone()), k.clone().slice(t..t + 1)))
            .collect();
        match parts.is_empty() {
            true => x.clone(),
            false => Tensor::cat(parts, 0),
        }
    }

    /// Per tensor, the L2 norm of `x`.
    fn norms(&self, x: &Tensor<1>) -> Tensor<1> {
        self.per_tensor(0.0, |r| x.clone().slice(r).powi_scalar(2).sum())
            .sqrt()
    }

    fn warm_up_step(&mut self, params: Tensor<1>, grad: Tensor<1>, lr: f64) -> Tensor<1> {
        let c = self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        self.m = ema(self.m.clone(), grad.clone(), b1);
        self.v = ema_sq(self.v.clone(), grad, b2);
        if self.step + 1 == c.freeze_step {
            self.v_fresh = Some(self.v.clone());
        }
        let update = self.m.clone() / self.v.clone().sqrt().add_scalar(eps);
        let update = match wd {
            0.0 => update,
            wd => update + params.clone().mul_scalar(wd),
        };
        let (pn, un) = (self.norms(&params), self.norms(&update));
        let valid = pn
            .clone()
            .greater_elem(0.0)
            .bool_and(un.clone().greater_elem(0.0));
        let coeff = (pn / un).clamp(c.min_coeff as f32, c.max_coeff as f32);
        let k = self.tensors.len();
        let coeff = Tensor::<1>::ones([k], &self.device).mask_where(valid, coeff);
        // The running ratio moves only where the ratio is not exactly 1, as on the host.
        let cb = c.coeff_beta as f32;
        let moved = ema(self.coeff_freeze.clone(), coeff.clone(), cb);
        let keep = coeff.clone().equal_elem(1.0);
        self.coeff_freeze = moved.mask_where(keep, self.coeff_freeze.clone());
        params.clone() - self.scale_per_tensor(&update, &coeff.mul_scalar(lr as f32))
    }

    fn compressed_step(
        &mut self,
        coll: &dyn DeviceCollectives,
        host: &dyn Communicator,
        params: Tensor<1>,
        grad: Tensor<1>,
        lr: f64,
    ) -> Result<Tensor<1>> {
        let c = self.config;
        let (b1, b2, eps, wd) = coefficients(c.betas, c.eps, c.weight_decay);
        let v_fresh = self.v_fresh.take().unwrap_or_else(|| self.v.clone());
        let scaling = match self.scaling.take() {
            Some(s) => s,
            None => {
                // One scale per tensor, so that every tensor's momentum has the mean
                // magnitude.
                let rms = self.per_tensor(0.0, |r| {
                    let len = r.len() as f32;
                    self.m
                        .clone()
                        .slice(r)
                        .powi_scalar(2)
                        .sum()
                        .sqrt()
                        .div_scalar(len.sqrt())
                });
                let k = self.tensors.len().max(1) as f32;
                let mean = rms.clone().sum().div_scalar(k);
                let valid = rms
                    .clone()
                    .greater_elem(0.0)
                    .bool_and(mean.clone().greater_elem(0.0).expand([rms.dims()[0]]));
                let ratio = mean.expand([rms.dims()[0]]) / rms.clone();
                Tensor::ones(rms.shape(), &self.device).mask_where(valid, ratio)
            }
        };
        let m_prev = self.m.clone();
        let m = self.scale_per_tensor(&ema(self.m.clone(), grad, b1), &scaling);
        let m = device_compressed_all_reduce(coll, host, m, &mut self.errors)?;
        let m = self.map_per_tensor(&m, &scaling, |m, s| m / s);
        let implied = (m.clone() - m_prev.mul_scalar(b1)).div_scalar(1.0 - b1);
        let fresh = ema_sq(v_fresh, implied, b2);
        let denom = self.v.clone().sqrt().add_scalar(eps);
        let ratio = denom.clone() / fresh.clone().sqrt().add_scalar(eps);
        let mut factor = self.per_tensor(0.0, |r| ratio.clone().slice(r).max());
        let prelim = m.clone() / denom;
        let update = match wd {
            0.0 => prelim.clone(),
            wd => prelim.clone() + params.clone().mul_scalar(wd),
        };
        if wd > 0.0 {
            let (pn, un) = (self.norms(&prelim), self.norms(&update));
            let share = (pn / un.clone()).clamp_max(1.0);
            let share =
                Tensor::ones(share.shape(), &self.device).mask_where(un.greater_elem(0.0), share);
            factor = factor * share.clone() + (share.neg().add_scalar(1.0));
        }
        let thr = c.factor_threshold as f32;
        let last = self.last_factor.clone();
        let factor = factor
            .clamp(c.factor_min as f32, c.factor_max as f32)
            .max_pair(last.clone().mul_scalar(1.0 - thr))
            .min_pair(last.mul_scalar(1.0 + thr));
        self.last_factor = factor.clone();
        let step = self.coeff_freeze.clone().mul_scalar(lr as f32) * factor;
        self.m = m;
        self.v_fresh = Some(fresh);
        self.scaling = Some(scaling);
        Ok(params - self.scale_per_tensor(&update, &step))
    }
}

one_bit_phase!(DeviceOneBitLamb);

impl DeviceOneBitOptimizer for DeviceOneBitLamb {
    fn apply(
        &mut self,
        coll: &dyn DeviceCollectives,
        host: &dyn Communicator,
        params: Tensor<1>,
        grad: Tensor<1>,
        lr: f64,
    ) -> Result<Tensor<1>> {
        check_length("1-bit LAMB", self.n, &params, &grad)?;
        let params = match self.compressing() {
            true => self.compressed_step(coll, host, params, grad, lr)?,
            false => self.warm_up_step(params, grad, lr),
        };
        self.step += 1;
        Ok(params)
    }

    fn state_bytes(&self) -> u64 {
        let n = self.n as u64;
        let fresh = self.v_fresh.as_ref().map_or(0, |_| n);
        4 * (2 * n + fresh + 3 * self.tensors.len() as u64) + self.errors.bytes()
    }

    fn host_bytes(&self) -> u64 {
        self.errors.host_bytes()
    }

    fn export(&self) -> Result<OneBitState> {
        let name = "1-bit LAMB";
        let read = |t: &Option<Tensor<1>>| t.as_ref().map_or(Ok(Vec::new()), |t| to_host(t, name));
        Ok(LambBuffers {
            m: to_host(&self.m, name)?,
            v: to_host(&self.v, name)?,
            v_fresh: read(&self.v_fresh)?,
            coeff_freeze: to_host(&self.coeff_freeze, name)?,
            last_factor: to_host(&self.last_factor, name)?,
            scaling: read(&self.scaling)?,
        }
        .into_state(self.step))
    }

    fn restore(&mut self, state: OneBitState) -> Result<()> {
        let (n, k) = (self.n, self.tensors.len());
        let (step, b) = LambBuffers::take(state, n, k)?;
        let d = &self.device;
        let opt = |v: Vec<f32>| (!v.is_empty()).then(|| to_device(v, d));
        (self.v_fresh, self.scaling) = (opt(b.v_fresh), opt(b.scaling));
        (self.m, self.v) = (to_device(b.m, d), to_device(b.v, d));
        self.coeff_freeze = to_device(b.coeff_freeze, d);
        self.last_factor = to_device(b.last_factor, d);
        self.errors = DeviceCompressionErrors::new(n, self.world, d);
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::comm::{ThreadWorld, ThreadWorldOptions};
    use crate::device::HostCollectives;
    use crate::onebit::{OneBitAdam, OneBitLamb, OneBitOptimizer};

    /// Three tensors; 1152 elements in all, where the device and host paddings agree for 1-3
    /// ranks.
    const LENGTHS: [usize; 3] = [500, 0, 652];
    const N: usize = 1152;

    fn grad(rank: usize, step: usize) -> Vec<f32> {
        (0..N)
            .map(|i| (i as f32 * 1.7 + rank as f32 * 0.31 + step as f32 * 0.93).sin() * 0.8)
            .collect()
    }

    fn start() -> Vec<f32> {
        (0..N).map(|i| i as f32 / N as f32 - 0.5).collect()
    }

    fn adam() -> OneBitAdamConfig {
        OneBitAdamConfig {
            betas: (0.9, 0.99),
            eps: 1e-8,
            weight_decay: 0.01,
            freeze_step: 3,
        }
    }

    fn lamb(weight_decay: f64) -> OneBitLambConfig {
        OneBitLambConfig {
            betas: (0.9, 0.99),
            weight_decay,
            freeze_step: 3,
            ..OneBitLambConfig::default()
        }
    }

    fn read(t: Tensor<1>) -> Vec<f32> {
        to_host(&t, "test").expect("f32")
    }

    /// `steps` steps of the device optimizer `device_opt` and of the host one `host_opt` on
    /// every rank of `world` (warm-up gradients averaged by the caller, as the engine does):
    /// each rank's (device, host) parameters, and the device optimizer's exported state.
    fn both(
        world: usize,
        device: &Device,
        steps: usize,
        device_opt: impl Fn() -> Box<dyn DeviceOneBitOptimizer> + Sync,
        host_opt: impl Fn() -> Box<dyn OneBitOptimizer> + Sync,
    ) -> Vec<(Vec<f32>, Vec<f32>, OneBitState, OneBitState)> {
        let host = |comm| Box::new(HostCollectives::new(comm)) as Box<dyn DeviceCollectives>;
        both_over(world, device, steps, host, device_opt, host_opt)
    }

    /// [`both`] with the device collectives `collectives` makes for each rank.
    fn both_over(
        world: usize,
        device: &Device,
        steps: usize,
        collectives: impl Fn(Arc<dyn Communicator>) -> Box<dyn DeviceCollectives> + Sync,
        device_opt: impl Fn() -> Box<dyn DeviceOneBitOptimizer> + Sync,
        host_opt: impl Fn() -> Box<dyn OneBitOptimizer> + Sync,
    ) -> Vec<(Vec<f32>, Vec<f32>, OneBitState, OneBitState)> {
        ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
            let rank = c.rank();
            let comm: Arc<dyn Communicator> = Arc::new(c);
            let coll = collectives(comm.clone());
            let (mut dev, mut host) = (device_opt(), host_opt());
            let mut p = to_device(start(), device);
            let mut q = start();
            for step in 0..steps {
                let mut g = grad(rank, step);
                if !host.compressing() {
                    crate::comm::CommunicatorExt::all_reduce(
                        comm.as_ref(),
                        &mut g,
                        crate::comm::ReduceOp::Mean,
                    )
                    .expect("mean");
                }
                let gd = to_device(g.clone(), device);
                p = dev
                    .apply(coll.as_ref(), comm.as_ref(), p, gd, 0.01)
                    .expect("device step");
                host.apply(comm.as_ref(), &mut q, &g, 0.01)
                    .expect("host step");
            }
            (read(p), q, dev.export().expect("export"), host.export())
        })
        .into_iter()
        .map(|r| r.expect("rank"))
        .collect()
    }

    fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= tol * w.abs().max(1.0),
                "{what}: element {i} is {g}, the host has {w}"
            );
        }
    }

    /// On Flex the device 1-bit Adam computes what the host one does, bit for bit, through
    /// warm-up and compression, and exports the same state.
    #[test]
    fn device_one_bit_adam_on_flex_is_the_host_one() {
        let device = Device::flex();
        for world in 1..=3 {
            let out = both(
                world,
                &device,
                7,
                || Box::new(DeviceOneBitAdam::new(N, world, adam(), &device)),
                || Box::new(OneBitAdam::new(N, world, adam())),
            );
            for (p, q, ds, hs) in out {
                assert_eq!(p, q, "world {world}");
                assert_eq!(ds, hs, "world {world}");
            }
        }
    }

    /// The device 1-bit LAMB follows the host one (which sums its norms in f64) through
    /// warm-up and compression, with and without weight decay, and exports the same state.
    #[test]
    fn device_one_bit_lamb_follows_the_host_one() {
        let device = Device::flex();
        for (world, wd) in [(1, 0.0), (2, 0.01), (3, 0.0)] {
            let out = both(
                world,
                &device,
                7,
                || Box::new(DeviceOneBitLamb::new(&LENGTHS, world, lamb(wd), &device)),
                || Box::new(OneBitLamb::new(&LENGTHS, world, lamb(wd))),
            );
            for (p, q, ds, hs) in out {
                assert_close(&format!("world {world} wd {wd}: p"), &p, &q, 1e-5);
                assert_eq!(ds.step, hs.step);
                for ((dn, dv), (hn, hv)) in ds.buffers.iter().zip(&hs.buffers) {
                    assert_eq!(dn, hn);
                    assert_close(&format!("world {world} wd {wd}: {dn}"), dv, hv, 1e-4);
                }
            }
        }
    }

    /// A state exported by the host optimizer restores on the device (and the next steps
    /// agree), and a state for another length is refused with the buffer's name.
    #[test]
    fn host_states_restore_on_the_device() {
        let device = Device::flex();
        let mut host = OneBitLamb::new(&LENGTHS, 1, lamb(0.0));
        let mut q = start();
        let world = ThreadWorld::new(1, ThreadWorldOptions::default()).expect("one rank");
        let comm: Arc<dyn Communicator> = Arc::new(world.communicators().remove(0));
        for step in 0..4 {
            host.apply(comm.as_ref(), &mut q, &grad(0, step), 0.01)
                .expect("host");
        }
        let mut dev = DeviceOneBitLamb::new(&LENGTHS, 1, lamb(0.0), &device);
        dev.restore(host.export()).expect("restore");
        // A restore zeroes the error buffers on both sides.
        host.restore(host.export()).expect("host restore");
        assert_eq!(dev.steps(), 4);
        assert!(dev.compressing());
        let coll = HostCollectives::new(comm.clone());
        let p = dev
            .apply(
                &coll,
                comm.as_ref(),
                to_device(q.clone(), &device),
                to_device(grad(0, 4), &device),
                0.01,
            )
            .expect("device");
        host.apply(comm.as_ref(), &mut q, &grad(0, 4), 0.01)
            .expect("host");
        assert_close("after restore", &read(p), &q, 1e-5);

        let mut short = DeviceOneBitAdam::new(N - 1, 1, adam(), &device);
        let e = short
            .restore(OneBitAdam::new(N, 1, adam()).export())
            .unwrap_err()
            .to_string();
        assert!(e.contains("buffer `v` holds 1152 elements"), "{e}");
    }

    /// On wgpu (the CubeCL compression kernels, host-staged words) both optimizers follow
    /// the host ones at 2 ranks.
    #[cfg(feature = "wgpu")]
    #[test]
    fn device_one_bit_optimizers_on_wgpu_follow_the_host_ones() {
        let device = Device::from(burn::backend::wgpu::WgpuDevice::default());
        let world = 2;
        let out = both(
            world,
            &device,
            6,
            || Box::new(DeviceOneBitAdam::new(N, world, adam(), &device)),
            || Box::new(OneBitAdam::new(N, world, adam())),
        );
        for (p, q, _, _) in out {
            assert_close("1-bit Adam on wgpu", &p, &q, 1e-5);
        }
        let out = both(
            world,
            &device,
            6,
            || Box::new(DeviceOneBitLamb::new(&LENGTHS, world, lamb(0.01), &device)),
            || Box::new(OneBitLamb::new(&LENGTHS, world, lamb(0.01))),
        );
        for (p, q, _, _) in out {
            assert_close("1-bit LAMB on wgpu", &p, &q, 1e-5);
        }
    }

    /// On CUDA (the CubeCL compression kernels) both optimizers follow the host ones: at 2
    /// ranks sharing GPU 0 through the host-staged word collectives, and at 1 rank through
    /// NCCL itself (its one-rank shortcut off).
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a CUDA GPU and libnccl: run with --include-ignored on a GPU machine"]
    fn device_one_bit_optimizers_on_cuda_follow_the_host_ones() {
        use crate::device::NcclCollectives;
        let device = Device::cuda(0);
        let host = |comm| Box::new(HostCollectives::new(comm)) as Box<dyn DeviceCollectives>;
        let nccl = |comm| {
            let c = NcclCollectives::new(comm, 0).expect("NCCL on GPU 0");
            Box::new(c.without_shortcut()) as Box<dyn DeviceCollectives>
        };
        let cases: [(
            usize,
            &(dyn Fn(Arc<dyn Communicator>) -> Box<dyn DeviceCollectives> + Sync),
        ); 2] = [(2, &host), (1, &nccl)];
        for (world, collectives) in cases {
            let out = both_over(
                world,
                &device,
                6,
                collectives,
                || Box::new(DeviceOneBitAdam::new(N, world, adam(), &device)),
                || Box::new(OneBitAdam::new(N, world, adam())),
            );
            for (p, q, _, _) in out {
                assert_close(&format!("1-bit Adam on CUDA, world {world}"), &p, &q, 1e-5);
            }
            let out = both_over(
                world,
                &device,
                6,
                collectives,
                || Box::new(DeviceOneBitLamb::new(&LENGTHS, world, lamb(0.01), &device)),
                || Box::new(OneBitLamb::new(&LENGTHS, world, lamb(0.01))),
            );
            for (p, q, _, _) in out {
                assert_close(&format!("1-bit LAMB on CUDA, world {world}"), &p, &q, 1e-5);
            }
        }
    }
}
