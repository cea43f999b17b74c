//! [`TensorParallel`]: one rank's handle on its tensor-parallel group, and the registry the
//! ops find it through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};

use burn::tensor::Tensor;
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::ReduceOp;
use burn_deepspeed_strategies::device::DeviceCollectives;

use super::op;
use crate::engine::transfer;

/// The collectives of one tensor-parallel group and the first failure of its ops.
pub(crate) struct Group {
    coll: Arc<dyn DeviceCollectives>,
    error: Mutex<Option<CommError>>,
}

impl Group {
    /// The sum of `t` over the group (zeros after a failure, which is kept for
    /// [`TensorParallel::take_error`]; the calls after it do not communicate).
    pub(crate) fn all_reduce(&self, t: Tensor<1>) -> Tensor<1> {
        let mut error = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if error.is_some() || self.coll.world_size() == 1 {
            return match error.is_some() {
                true => t.zeros_like(),
                false => t,
            };
        }
        let device = t.device();
        let zeros = t.zeros_like();
        let _span = tracing::trace_span!("tp_all_reduce", elems = t.dims()[0]).entered();
        match transfer::staged_collective(self.coll.as_ref(), &device, |c| {
            c.all_reduce(t, ReduceOp::Sum)
        }) {
            Ok(sum) => sum,
            Err(e) => {
                // The op cannot return the error: the world is aborted so that the peers
                // fail at once instead of waiting in their next collective.
                if !matches!(e, CommError::PeerFailed { .. }) {
                    self.coll
                        .abort(&format!("a tensor-parallel all-reduce failed: {e}"));
                }
                *error = Some(e);
                zeros
            }
        }
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> MutexGuard<'static, HashMap<u64, Weak<Group>>> {
    static REGISTRY: LazyLock<Mutex<HashMap<u64, Weak<Group>>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// The group registered under `id`.
///
/// # Panics
/// When its [`TensorParallel`] handle was dropped: a sliced layer cannot run without its
/// group.
pub(crate) fn resolve(id: u64) -> Arc<Group> {
    registry()
        .get(&id)
        .and_then(Weak::upgrade)
        .unwrap_or_else(|| panic!("tensor parallelism: the group {id} of a sliced layer is gone"))
}

/// One rank's tensor-parallel group: the ranks that each hold a slice of the same layers
/// (consecutive ranks of a [`GridTopology`](burn_deepspeed_strategies::pipe::GridTopology)).
/// Cloning shares the group; it is deregistered when the last clone drops.
#[derive(Clone)]
pub struct TensorParallel {
    id: u64,
    group: Arc<Group>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel")
            .field("id", &self.id)
            .field("rank", &self.group.coll.rank())
            .field("size", &self.group.coll.world_size())
            .finish()
    }
}

impl TensorParallel {
    /// The group whose ranks `coll` joins (e.g. the device collectives of the communicator
    /// split by [`GridTopology::color`](burn_deepspeed_strategies::pipe::GridTopology::color)
    /// along the tensor axis).
    pub fn new(coll: Arc<dyn DeviceCollectives>) -> Self {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let group = Arc::new(Group {
            coll,
            error: Mutex::new(None),
        });
        registry().insert(id, Arc::downgrade(&group));
        Self { id, group }
    }

    /// This rank's slice index in the group.
    pub fn rank(&self) -> usize {
        self.group.coll.rank()
    }

    /// Ranks in the group (the number of slices).
    pub fn size(&self) -> usize {
        self.group.coll.world_size()
    }

    /// Megatron's `f`, before a column-parallel layer: `x` unchanged; in backward, its
    /// gradient summed over the group (each slice contributed a part of it).
    pub fn copy<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        op::tp_copy(x, self.id)
    }

    /// Megatron's `g`, after a row-parallel layer: `x` summed over the group (each slice
    /// computed a partial product); in backward, the gradient unchanged.
    pub fn reduce<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        op::tp_reduce(x, self.id)
    }

    /// The first collective failure of this group's ops since the last call: the ops return
    /// zeros after one, so a training step checks this before it steps.
    pub fn take_error(&self) -> Option<CommError> {
        self.group
            .error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        registry().retain(|_, g| g.strong_count() > 0);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::tensor::{Device, TensorData};
    use burn_deepspeed_strategies::device::HostCollectives;

    use super::super::test_util::{close, read};
    use super::*;
    use crate::launch::launch;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|j| (((j * 7 + seed * 13) % 17) as f32 - 8.0) / 8.0)
            .collect()
    }

    #[test]
    fn a_sliced_mlp_matches_the_whole_one() {
        sliced_mlp_on(Device::flex());
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn a_sliced_mlp_matches_the_whole_one_on_wgpu() {
        sliced_mlp_on(Device::from(burn::backend::wgpu::WgpuDevice::default()));
    }

    fn sliced_mlp_on(device: Device) {
        let device = device.autodiff();
        let (n, d, h) = (3, 4, 6);
        let tensor = |v: Vec<f32>, shape: [usize; 2]| {
            Tensor::<2>::from_data(TensorData::new(v, shape), &device)
        };
        let (x0, w1, w2) = (values(n * d, 1), values(d * h, 2), values(h * d, 3));
        let x = tensor(x0.clone(), [n, d]).require_grad();
        let a = tensor(w1.clone(), [d, h]).require_grad();
        let b = tensor(w2.clone(), [h, d]).require_grad();
        let y = x.clone().matmul(a.clone()).tanh().matmul(b.clone());
        let grads = (y.clone() * y.clone()).sum().backward();
        let whole_y = read(y);
        let whole_x = read(x.grad(&grads).expect("x's gradient"));
        let whole_a = a.grad(&grads).expect("a's gradient");
        let whole_b = b.grad(&grads).expect("b's gradient");

        let cols = h / 2;
        let (_, ranks) = launch(2, Duration::from_secs(60), |comm| {
            let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm)));
            let r = tp.rank();
            let x = tensor(x0.clone(), [n, d]).require_grad();
            let a = tensor(w1.clone(), [d, h])
                .slice([0..d, r * cols..(r + 1) * cols])
                .detach()
                .require_grad();
            let b = tensor(w2.clone(), [h, d])
                .slice([r * cols..(r + 1) * cols, 0..d])
                .detach()
                .require_grad();
            let partial = tp
                .copy(x.clone())
                .matmul(a.clone())
                .tanh()
                .matmul(b.clone());
            let y = tp.reduce(partial);
            let grads = (y.clone() * y.clone()).sum().backward();
            assert!(tp.take_error().is_none(), "the collectives ran");
            Ok((
                read(y),
                read(x.grad(&grads).expect("x's gradient")),
                read(a.grad(&grads).expect("a's gradient")),
                read(b.grad(&grads).expect("b's gradient")),
            ))
        })
        .expect("both ranks run");
        for (r, (y, gx, ga, gb)) in ranks.into_iter().enumerate() {
            close(&y, &whole_y, "y");
            close(&gx, &whole_x, "x's gradient, summed by f's backward");
            let a_slice = whole_a.clone().slice([0..d, r * cols..(r + 1) * cols]);
            close(&ga, &read(a_slice), "the column slice's gradient");
            let b_slice = whole_b.clone().slice([r * cols..(r + 1) * cols, 0..d]);
            close(&gb, &read(b_slice), "the row slice's gradient");
        }
    }
}
