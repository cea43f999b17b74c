//! The 1-bit optimizers in the device place against the host place: the same algorithm, so
//! bit for bit on Flex where the paddings agree (Adam), within f32 summation order elsewhere.

use std::sync::Arc;

use burn::tensor::Device;

use super::*;
use crate::comm::{Communicator, ReduceOp, ThreadWorld, ThreadWorldOptions};
use crate::device::{DeviceCollectives, HostCollectives};
use crate::place::{DevicePlace, HostPlace, Place};

/// Three tensors; 1152 elements in all, where the device and host paddings agree for 1-4
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

/// A 0/1 Adam schedule that takes every kind of step within 11 steps.
fn zero_one() -> ZeroOneAdamConfig {
    ZeroOneAdamConfig {
        betas: (0.9, 0.99),
        weight_decay: 0.01,
        var_freeze_step: 4,
        var_update_scaler: 2,
        local_step_scaler: 2,
        local_step_clipper: 4,
        ..ZeroOneAdamConfig::default()
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

/// A step of `opt` as the engine takes it: the gradient averaged over ranks during warm-up.
pub(super) fn engine_step<P: Place>(
    opt: &mut dyn OneBitOptimizer<P>,
    place: &P,
    p: P::Buf,
    g: P::Buf,
    lr: f64,
) -> P::Buf {
    let g = match opt.compressing() {
        true => g,
        false => place.all_reduce(g, ReduceOp::Mean).expect("mean"),
    };
    opt.apply(place, p, g, lr).expect("step")
}

type Collectives<'a> = &'a (dyn Fn(Arc<dyn Communicator>) -> Box<dyn DeviceCollectives> + Sync);
type Made<P> = Box<dyn OneBitOptimizer<P>>;

/// `steps` steps of the optimizer `dev` makes in the device place (on `device`, through the
/// collectives `coll` makes) and of the one `host` makes in the host place, on every rank of
/// `world` (warm-up gradients averaged by the caller, as the engine does): each rank's
/// (device, host) parameters and exported states.
fn both(
    world: usize,
    device: &Device,
    steps: usize,
    coll: Collectives<'_>,
    dev: impl Fn(&DevicePlace) -> Made<DevicePlace> + Sync,
    host: impl Fn(&HostPlace) -> Made<HostPlace> + Sync,
) -> Vec<(Vec<f32>, Vec<f32>, OneBitState, OneBitState)> {
    ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
        let rank = c.rank();
        let comm: Arc<dyn Communicator> = Arc::new(c);
        let dp = DevicePlace::new(Arc::from(coll(comm.clone())), comm.clone(), device);
        let hp = HostPlace::new(comm);
        let (mut d, mut h) = (dev(&dp), host(&hp));
        let (mut p, mut q) = (dp.upload(start()), start());
        for step in 0..steps {
            let mut g = grad(rank, step);
            if !h.compressing() {
                g = hp.all_reduce(g, ReduceOp::Mean).expect("mean");
            }
            p = d
                .apply(&dp, p, dp.upload(g.clone()), 0.01)
                .expect("device step");
            q = h.apply(&hp, q, g, 0.01).expect("host step");
        }
        let (ds, hs) = (
            d.export(&dp).expect("export"),
            h.export(&hp).expect("export"),
        );
        (dp.download(&p).expect("read"), q, ds, hs)
    })
    .into_iter()
    .map(|r| r.expect("rank"))
    .collect()
}

fn staged(comm: Arc<dyn Communicator>) -> Box<dyn DeviceCollectives> {
    Box::new(HostCollectives::new(comm))
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

/// On Flex 1-bit Adam in the device place computes what it does in the host place, bit for
/// bit, through warm-up and compression, and exports the same state.
#[test]
fn one_bit_adam_on_flex_is_the_host_one() {
    let device = Device::flex();
    for world in 1..=3 {
        let out = both(
            world,
            &device,
            7,
            &staged,
            |p| Box::new(OneBitAdam::new(p, N, adam())),
            |p| Box::new(OneBitAdam::new(p, N, adam())),
        );
        for (p, q, ds, hs) in out {
            assert_eq!(p, q, "world {world}");
            assert_eq!(ds, hs, "world {world}");
        }
    }
}

/// 0/1 Adam in the device place computes what it does in the host place through variance,
/// 1-bit gradient, local and sync steps, and exports the same state.
#[test]
fn zero_one_adam_on_flex_is_the_host_one() {
    let device = Device::flex();
    let config = zero_one();
    for world in 1..=3 {
        let out = both(
            world,
            &device,
            11,
            &staged,
            |p: &DevicePlace| -> Made<DevicePlace> {
                Box::new(ZeroOneAdam::new(p, N, config).expect("config"))
            },
            |p: &HostPlace| -> Made<HostPlace> {
                Box::new(ZeroOneAdam::new(p, N, config).expect("config"))
            },
        );
        for (p, q, ds, hs) in out {
            assert_close(&format!("world {world}: p"), &p, &q, 1e-6);
            assert_eq!(ds.step, hs.step);
            for ((dn, dv), (hn, hv)) in ds.buffers.iter().zip(&hs.buffers) {
                assert_eq!(dn, hn);
                assert_close(&format!("world {world}: {dn}"), dv, hv, 1e-5);
            }
        }
    }
}

/// 1-bit LAMB in the device place follows the host one (which sums its norms in f64) through
/// warm-up and compression, with and without weight decay, and exports the same state.
#[test]
fn one_bit_lamb_on_flex_follows_the_host_one() {
    let device = Device::flex();
    for (world, wd) in [(1, 0.0), (2, 0.01), (3, 0.0)] {
        let out = both(
            world,
            &device,
            7,
            &staged,
            |p| Box::new(OneBitLamb::new(p, &LENGTHS, lamb(wd))),
            |p| Box::new(OneBitLamb::new(p, &LENGTHS, lamb(wd))),
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

/// A state exported in the host place restores in the device place (and the next steps
/// agree), and a state for another length is refused with the buffer's name.
#[test]
fn host_states_restore_on_the_device() {
    let world = ThreadWorld::new(1, ThreadWorldOptions::default()).expect("one rank");
    let comm: Arc<dyn Communicator> = Arc::new(world.communicators().remove(0));
    let hp = HostPlace::new(comm.clone());
    let dp = DevicePlace::new(staged(comm.clone()).into(), comm, &Device::flex());
    let mut host = OneBitLamb::new(&hp, &LENGTHS, lamb(0.0));
    let mut q = start();
    for step in 0..4 {
        q = host.apply(&hp, q, grad(0, step), 0.01).expect("host");
    }
    let mut dev = OneBitLamb::new(&dp, &LENGTHS, lamb(0.0));
    let saved = host.export(&hp).expect("export");
    dev.restore(&dp, saved.clone()).expect("restore");
    // A restore zeroes the error buffers on both sides.
    host.restore(&hp, saved).expect("host restore");
    assert_eq!(dev.steps(), 4);
    assert!(dev.compressing());
    let p = dev
        .apply(&dp, dp.upload(q.clone()), dp.upload(grad(0, 4)), 0.01)
        .expect("device");
    q = host.apply(&hp, q, grad(0, 4), 0.01).expect("host");
    assert_close("after restore", &dp.download(&p).expect("read"), &q, 1e-5);

    let mut short = OneBitAdam::new(&dp, N - 1, adam());
    let full = OneBitAdam::new(&hp, N, adam()).export(&hp).expect("export");
    let e = short.restore(&dp, full).unwrap_err().to_string();
    assert!(e.contains("buffer `v` holds 1152 elements"), "{e}");
}

/// On wgpu (the CubeCL compression kernels, host-staged words) both optimizers follow the
/// host ones at 2 ranks.
#[cfg(feature = "wgpu")]
#[test]
fn one_bit_optimizers_on_wgpu_follow_the_host_ones() {
    let device = Device::from(burn::backend::wgpu::WgpuDevice::default());
    let out = both(
        2,
        &device,
        6,
        &staged,
        |p| Box::new(OneBitAdam::new(p, N, adam())),
        |p| Box::new(OneBitAdam::new(p, N, adam())),
    );
    for (p, q, _, _) in out {
        assert_close("1-bit Adam on wgpu", &p, &q, 1e-5);
    }
    let out = both(
        2,
        &device,
        6,
        &staged,
        |p| Box::new(OneBitLamb::new(p, &LENGTHS, lamb(0.01))),
        |p| Box::new(OneBitLamb::new(p, &LENGTHS, lamb(0.01))),
    );
    for (p, q, _, _) in out {
        assert_close("1-bit LAMB on wgpu", &p, &q, 1e-5);
    }
    let out = both(
        2,
        &device,
        11,
        &staged,
        |p| Box::new(ZeroOneAdam::new(p, N, zero_one()).expect("config")),
        |p| Box::new(ZeroOneAdam::new(p, N, zero_one()).expect("config")),
    );
    for (p, q, _, _) in out {
        assert_close("0/1 Adam on wgpu", &p, &q, 1e-5);
    }
}

/// On CUDA (the CubeCL compression kernels) both optimizers follow the host ones: at 2 ranks
/// sharing GPU 0 through the host-staged word collectives, and at 1 rank through NCCL itself
/// (its one-rank shortcut off).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU and libnccl: run with --include-ignored on a GPU machine"]
fn one_bit_optimizers_on_cuda_follow_the_host_ones() {
    use crate::device::NcclCollectives;
    let device = Device::cuda(0);
    let nccl = |comm| {
        let c = NcclCollectives::new(comm, 0).expect("NCCL on GPU 0");
        Box::new(c.without_shortcut()) as Box<dyn DeviceCollectives>
    };
    let cases: [(usize, Collectives<'_>); 2] = [(2, &staged), (1, &nccl)];
    for (world, coll) in cases {
        let out = both(
            world,
            &device,
            6,
            coll,
            |p| Box::new(OneBitAdam::new(p, N, adam())),
            |p| Box::new(OneBitAdam::new(p, N, adam())),
        );
        for (p, q, _, _) in out {
            assert_close(&format!("1-bit Adam on CUDA, world {world}"), &p, &q, 1e-5);
        }
        let out = both(
            world,
            &device,
            6,
            coll,
            |p| Box::new(OneBitLamb::new(p, &LENGTHS, lamb(0.01))),
            |p| Box::new(OneBitLamb::new(p, &LENGTHS, lamb(0.01))),
        );
        for (p, q, _, _) in out {
            assert_close(&format!("1-bit LAMB on CUDA, world {world}"), &p, &q, 1e-5);
        }
    }
}
