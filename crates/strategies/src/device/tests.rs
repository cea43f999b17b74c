//! The device collectives over the thread world: conformance on every device built, the
//! traffic counters, argument checks and the bootstrap.

use std::sync::Arc;

use burn::tensor::{DType, Device, Tensor, TensorData};

use super::*;
use crate::CommError;
use crate::comm::{Communicator, ReduceOp, ThreadWorld, ThreadWorldOptions};

fn run<R: Send>(world: usize, f: impl Fn(Arc<dyn Communicator>) -> R + Sync) -> Vec<R> {
    ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
        f(Arc::new(c) as Arc<dyn Communicator>)
    })
    .into_iter()
    .map(|r| r.expect("rank panicked"))
    .collect()
}

/// Conformance at worlds 1-4 on `device`, and the host/device bytes each rank counted.
fn conformance_on(device: &Device, dtypes: &[DType]) -> Vec<DeviceTraffic> {
    let mut traffic = Vec::new();
    for world in 1..=4 {
        for (rank, (result, t)) in run(world, |comm| {
            let c = HostCollectives::new(comm);
            (conformance::check_all(&c, device, dtypes), c.traffic())
        })
        .into_iter()
        .enumerate()
        {
            let checks = result.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
            assert!(checks >= 7 * dtypes.len(), "only {checks} checks ran");
            traffic.push(t);
        }
    }
    traffic
}

#[test]
fn host_collectives_on_flex_match_the_reference_without_host_device_copies() {
    for device in [Device::flex(), Device::flex().autodiff()] {
        let traffic = conformance_on(&device, &[DType::F32, DType::F16, DType::BF16]);
        assert!(traffic.iter().all(|t| t.total() == 0), "{traffic:?}");
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn host_collectives_on_wgpu_match_the_reference_and_count_the_staging() {
    let device = Device::from(burn::backend::wgpu::WgpuDevice::default());
    // WGSL has no bf16.
    let traffic = conformance_on(&device, &[DType::F32, DType::F16]);
    assert!(
        traffic
            .iter()
            .all(|t| t.device_to_host > 0 && t.host_to_device > 0)
    );
    // One all-reduce of 1000 f32 values copies 4000 bytes each way.
    let counted = run(2, |comm| {
        let c = HostCollectives::new(comm);
        let t = Tensor::<1>::from_data(TensorData::new(vec![1.0f32; 1000], [1000]), &device);
        let out = c.all_reduce(t, ReduceOp::Sum).unwrap();
        assert_eq!(
            out.into_data().try_into_vec::<f32>().unwrap(),
            vec![2.0; 1000]
        );
        c.traffic()
    });
    for t in counted {
        assert_eq!(
            t,
            DeviceTraffic {
                device_to_host: 4000,
                host_to_device: 4000
            }
        );
    }
}

#[test]
fn bad_arguments_are_refused_on_every_rank_before_any_transfer() {
    let errors = run(2, |comm| {
        let c = HostCollectives::new(comm);
        let device = Device::flex();
        let t = |n: usize| Tensor::<1>::from_data(TensorData::new(vec![0.0f32; n], [n]), &device);
        let ints =
            Tensor::<1, burn::tensor::Int>::from_data(TensorData::new(vec![1i64, 2], [2]), &device)
                .float()
                .cast(DType::F64);
        vec![
            c.reduce_scatter(t(5), &[3, 3]).unwrap_err(),
            c.all_gather(t(3), &[3]).unwrap_err(),
            c.all_to_all(t(5)).unwrap_err(),
            c.broadcast(t(2), 2).unwrap_err(),
            c.send(t(2), c.rank(), 0).unwrap_err(),
            c.all_reduce(ints, ReduceOp::Sum).unwrap_err(),
        ]
    });
    for rank_errors in errors {
        for e in rank_errors {
            assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
        }
    }
}

#[test]
fn bootstrap_hands_rank_0s_id_to_every_rank() {
    for world in 1..=4 {
        let ids = run(world, |comm| {
            bootstrap_id::<128>(comm.as_ref(), || {
                let mut id = [0u8; 128];
                for (i, b) in id.iter_mut().enumerate() {
                    *b = (i * 31 + 7) as u8;
                }
                Ok(id)
            })
            .unwrap()
        });
        assert!(ids.iter().all(|id| id == &ids[0]));
        assert_eq!(ids[0][1], 38);
    }
}

#[test]
fn bootstrap_failure_on_rank_0_fails_every_rank_with_its_reason() {
    let results = run(3, |comm| {
        let rank = comm.rank();
        bootstrap_id::<128>(comm.as_ref(), || {
            assert_eq!(rank, 0, "only rank 0 makes the id");
            Err("libnccl.so.2 not found".to_string())
        })
    });
    for r in results {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("libnccl.so.2 not found"), "{e}");
        assert!(e.contains("rank 0 could not create"), "{e}");
    }
}

/// NCCL (feature `cuda`). The GPU test is ignored by default and run on a GPU machine with
/// `-- --ignored`, where it fails, not skips, when no GPU or NCCL is present.
/// The ranks take NCCL only when every one can: one rank that cannot (no library, or
/// `BURN_DEEPSPEED_NCCL=0`) keeps them all on the host path.
#[test]
fn the_ranks_agree_on_whether_all_can() {
    assert_eq!(
        run(3, |comm| all_ranks_can(comm.as_ref(), true).ok()),
        vec![Some(true); 3]
    );
    let mixed = run(3, |comm| {
        all_ranks_can(comm.as_ref(), comm.rank() != 1).ok()
    });
    assert_eq!(mixed, vec![Some(false); 3]);
}

#[test]
fn host_devices_select_the_host_collectives() {
    for kind in run(2, |comm| {
        device_collectives(comm, &Device::flex()).map(|c| (c.kind(), c.world_size()))
    }) {
        assert_eq!(kind.expect("no collective fails"), ("host", 2));
    }
}

#[cfg(feature = "cuda")]
mod nccl {
    use super::*;

    #[test]
    fn cuda_devices_name_their_ordinal() {
        assert_eq!(cuda_ordinal(&Device::cuda(3)), Some(3));
        assert_eq!(cuda_ordinal(&Device::cuda(0).autodiff()), Some(0));
        assert_eq!(cuda_ordinal(&Device::flex()), None);
    }

    #[test]
    fn ranks_sharing_a_gpu_are_told_apart() {
        let distinct = run(3, |comm| {
            ordinals_distinct(comm.as_ref(), comm.rank()).unwrap()
        });
        assert_eq!(distinct, vec![true; 3]);
        let shared = run(3, |comm| {
            ordinals_distinct(comm.as_ref(), comm.rank() % 2).unwrap()
        });
        assert_eq!(shared, vec![false; 3]);
    }

    #[test]
    fn init_matches_what_this_machine_has() {
        if nccl_available() {
            let kinds = run(1, |comm| NcclCollectives::new(comm, 0).map(|c| c.kind()));
            assert_eq!(kinds[0].as_ref().expect("NCCL on GPU 0"), &"nccl");
        } else {
            // Every rank fails with rank 0's reason; none hangs in an NCCL init.
            for r in run(2, |comm| NcclCollectives::new(comm, 0).map(|c| c.kind())) {
                let e = r.expect_err("no CUDA here").to_string();
                assert!(e.contains("cannot be loaded"), "{e}");
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: run with -- --ignored on a GPU machine"]
    fn ranks_sharing_a_gpu_stage_through_the_host() {
        let traffic = conformance_on(&Device::cuda(0), &[DType::F32, DType::F16, DType::BF16]);
        assert!(
            traffic.iter().all(|t| t.total() > 0),
            "staged collectives are counted"
        );
        let kinds = run(2, |comm| {
            device_collectives(comm, &Device::cuda(0)).map(|c| c.kind())
        });
        for kind in kinds {
            assert_eq!(
                kind.expect("no collective fails"),
                "host",
                "two ranks on GPU 0"
            );
        }
    }

    #[test]
    #[ignore = "needs CUDA GPUs and libnccl: run with -- --ignored on a GPU machine"]
    fn nccl_conformance_on_every_gpu_count() {
        assert!(
            nccl_available(),
            "this test needs the CUDA driver and libnccl"
        );
        let gpus = cudarc::driver::CudaContext::device_count().expect("CUDA devices") as usize;
        assert!(gpus > 0, "no CUDA device");
        for world in 1..=gpus.min(4) {
            for (rank, result) in run(world, |comm| {
                let rank = comm.rank();
                // NCCL itself, also at one rank (where the engine's collectives skip it).
                let c = NcclCollectives::new(comm, rank)
                    .map_err(|e| e.to_string())?
                    .without_shortcut();
                let device = Device::cuda(rank);
                let checks =
                    conformance::check_all(&c, &device, &[DType::F32, DType::F16, DType::BF16])?;
                Ok::<_, String>((checks, c.traffic()))
            })
            .into_iter()
            .enumerate()
            {
                let (checks, traffic) =
                    result.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
                assert!(checks >= 23, "only {checks} checks");
                assert_eq!(traffic.total(), 0, "NCCL moves device memory directly");
            }
        }
        // The engine's one-rank collectives: the identity, without NCCL or a synchronisation.
        let out = run(1, |comm| {
            let c = NcclCollectives::new(comm, 0).map_err(|e| e.to_string())?;
            conformance::check_all(&c, &Device::cuda(0), &[DType::F32, DType::BF16])
        });
        let checks = out
            .into_iter()
            .next()
            .expect("rank 0")
            .expect("the shortcut");
        assert!(checks >= 15, "only {checks} checks");
    }
}

#[test]
fn flex_buffers_are_reduced_in_place() {
    let ptrs = run(2, |comm| {
        let c = HostCollectives::new(comm);
        let data = TensorData::new(vec![1.0f32; 4096], [4096]);
        let before = data.as_bytes().as_ptr() as usize;
        let t = Tensor::<1>::from_data(data, &Device::flex());
        let out = c.all_reduce(t, ReduceOp::Sum).unwrap().into_data();
        assert_eq!(out.as_slice::<f32>().unwrap(), &[2.0f32; 4096][..]);
        (before, out.as_bytes().as_ptr() as usize)
    });
    for (before, after) in ptrs {
        assert_eq!(
            before, after,
            "the reduced values are in the tensor's own buffer"
        );
    }
}
