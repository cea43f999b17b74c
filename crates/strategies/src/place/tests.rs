use std::sync::Arc;

use burn::tensor::Device;

use super::conformance::{collectives, elementwise};
use super::*;
use crate::comm::{Communicator, ThreadWorld, ThreadWorldOptions};
use crate::compressed::reference::input;
use crate::compressed::{CompressionErrors, compressed_all_reduce};
use crate::device::HostCollectives;

fn device_place(comm: Arc<dyn Communicator>, device: &Device) -> DevicePlace {
    let coll = Arc::new(HostCollectives::new(comm.clone()));
    DevicePlace::new(coll, comm, device)
}

fn alone() -> Arc<dyn Communicator> {
    let world = ThreadWorld::new(1, ThreadWorldOptions::default()).expect("one rank");
    Arc::new(world.communicators().remove(0))
}

#[test]
fn the_host_place_conforms() {
    elementwise(&HostPlace::new(alone())).expect("element-wise");
    for world in 1..=3 {
        collectives(world, HostPlace::new).expect("collectives");
    }
}

#[test]
fn the_device_place_on_flex_conforms() {
    let flex = Device::flex();
    elementwise(&device_place(alone(), &flex)).expect("element-wise");
    for world in 1..=3 {
        collectives(world, |c| device_place(c, &flex)).expect("collectives");
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn the_device_place_on_wgpu_conforms() {
    let wgpu = Device::from(burn::backend::wgpu::WgpuDevice::default());
    elementwise(&device_place(alone(), &wgpu)).expect("element-wise");
    collectives(2, |c| device_place(c, &wgpu)).expect("collectives");
}

#[test]
fn paddings_make_whole_sign_words_per_chunk() {
    assert_eq!(byte_padded_len(4, 1), 8);
    assert_eq!(byte_padded_len(1, 2), 16);
    assert_eq!(byte_padded_len(37, 3), 72);
    assert_eq!(byte_padded_len(1000, 4), 1024);
    for world in 1..=8 {
        for n in [1, 7, 100, 1001] {
            let p = byte_padded_len(n, world);
            assert!(
                p >= n && (p / world).is_multiple_of(8),
                "{n} over {world}: {p}"
            );
        }
    }
    assert_eq!(word_padded_len(0, 2), 0);
    assert_eq!(word_padded_len(1, 1), 32);
    assert_eq!(word_padded_len(65, 2), 128);
    assert_eq!(word_padded_len(1000, 3), 1056);
}

/// On Flex the device place gives the host place's bits: every element-wise operation, and
/// the compressed all-reduce where the two paddings agree (1152 elements is a multiple of
/// 32·N and of N·lcm(N, 8) for N = 1..4).
#[test]
fn the_device_place_on_flex_is_the_host_place() {
    let flex = Device::flex();
    let (a, b): (Vec<f32>, Vec<f32>) = (input(0, 50, 1), input(1, 50, 2));
    let host = HostPlace::new(alone());
    let dev = device_place(alone(), &flex);
    let ranges = [0..20, 20..20, 20..50];
    let f = [0.5f32, 2.0, -3.0];
    let ops_host = {
        let (x, y) = (a.clone(), b.clone());
        vec![
            host.ema_sq(host.ema(x.clone(), &y, 0.9), &y, 0.99),
            host.div(
                host.add_scalar(host.sqrt(host.scaled(x.clone(), 2.0)), 1e-8),
                &y,
            ),
            host.add_scaled_ranges(host.div_scalar(x, 0.7), &y, &ranges, &f),
        ]
    };
    let (x, y) = (dev.upload(a), dev.upload(b));
    let ops_dev = [
        dev.ema_sq(dev.ema(x.clone(), &y, 0.9), &y, 0.99),
        dev.div(
            dev.add_scalar(dev.sqrt(dev.scaled(x.clone(), 2.0)), 1e-8),
            &y,
        ),
        dev.add_scaled_ranges(dev.div_scalar(x, 0.7), &y, &ranges, &f),
    ];
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (h, d) in ops_host.iter().zip(&ops_dev) {
        assert_eq!(bits(h), bits(&dev.download(d).expect("read")));
    }
    for world in 1..=4 {
        let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
            let rank = c.rank();
            let comm: Arc<dyn Communicator> = Arc::new(c);
            let (host, dev) = (HostPlace::new(comm.clone()), device_place(comm, &flex));
            let mut he = CompressionErrors::new(&host, 1152);
            let mut de = CompressionErrors::new(&dev, 1152);
            (0..3)
                .map(|round| {
                    let x = input(rank, 1152, round);
                    let d = compressed_all_reduce(&dev, dev.upload(x.clone()), &mut de)
                        .expect("device");
                    let h = compressed_all_reduce(&host, x, &mut he).expect("host");
                    (dev.download(&d).expect("read"), h)
                })
                .collect::<Vec<_>>()
        });
        for rank in out {
            for (d, h) in rank.expect("rank") {
                assert_eq!(d, h, "world {world}");
            }
        }
    }
}

/// Error buffers sized for another length or world are refused on every rank, before any
/// exchange, naming the constructor.
#[test]
fn error_buffers_of_the_wrong_size_are_refused() {
    let flex = Device::flex();
    let out = ThreadWorld::run(2, ThreadWorldOptions::default(), |c| {
        let comm: Arc<dyn Communicator> = Arc::new(c);
        let dev = device_place(comm, &flex);
        let mut errors = CompressionErrors {
            worker: dev.zeros(32),
            server: dev.zeros(8),
        };
        compressed_all_reduce(&dev, dev.upload(vec![1.0; 100]), &mut errors)
    });
    for r in out {
        let e = r.expect("no panic").expect_err("wrong sizes").to_string();
        assert!(e.contains("CompressionErrors::new"), "{e}");
    }
}
