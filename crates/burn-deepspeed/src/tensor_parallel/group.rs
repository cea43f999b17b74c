//! [`TensorParallel`]: one rank's handle on its tensor-parallel group, and the registry the
//! ops find it through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, Weak};

use burn::module::ParamId;
use burn::tensor::Tensor;
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::ReduceOp;
use burn_deepspeed_strategies::device::DeviceCollectives;

use super::{SliceLayout, op};
use crate::transfer;

/// The collectives of one tensor-parallel group and the first failure of its ops.
pub(crate) struct Group {
    coll: Arc<dyn DeviceCollectives>,
    error: Mutex<Option<CommError>>,
    /// How each parameter sliced over this group is cut.
    layouts: Mutex<HashMap<ParamId, SliceLayout>>,
}

impl Group {
    /// `op` of `t` over the group (zeros after a failure, which is kept for
    /// [`TensorParallel::take_error`]; the calls after it do not communicate).
    pub(crate) fn all_reduce(&self, t: Tensor<1>, op: ReduceOp) -> Tensor<1> {
        self.guarded("all-reduce", t, |c, t| c.all_reduce(t, op))
    }

    /// `t`'s equal chunks exchanged over the group: chunk `j` goes to rank `j`, and chunk
    /// `j` of the result came from rank `j` (zeros after a failure, as
    /// [`all_reduce`](Self::all_reduce)).
    pub(crate) fn all_to_all(&self, t: Tensor<1>) -> Tensor<1> {
        self.guarded("all-to-all", t, |c, t| c.all_to_all(t))
    }

    /// The collective `f` on `t`: `t` itself in a group of one, zeros once a collective of
    /// the group failed (the failure is kept and the world aborted so that the peers fail at
    /// once instead of waiting in their next collective).
    fn guarded(
        &self,
        what: &str,
        t: Tensor<1>,
        f: impl FnOnce(&dyn DeviceCollectives, Tensor<1>) -> Result<Tensor<1>, CommError>,
    ) -> Tensor<1> {
        let mut error = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if error.is_some() || self.coll.world_size() == 1 {
            return match error.is_some() {
                true => t.zeros_like(),
                false => t,
            };
        }
        let device = t.device();
        let zeros = t.zeros_like();
        let _span = tracing::trace_span!("group_collective", what, elems = t.dims()[0]).entered();
        match transfer::staged_collective(self.coll.as_ref(), &device, |c| f(c, t)) {
            Ok(out) => out,
            Err(e) => {
                // The op cannot return the error.
                if !matches!(e.root_cause(), CommError::PeerFailed { .. }) {
                    self.coll
                        .abort(&format!("a model-parallel {what} failed: {e}"));
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
///
/// [`TensorParallel::none`] is the group of one rank: the layers are whole and the ops are
/// the identity, so a model written with sliced layers runs unchanged without slicing (as
/// Megatron-LM's models do at a tensor-parallel size of 1).
#[derive(Clone)]
pub struct TensorParallel {
    group: Option<(u64, Arc<Group>)>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel")
            .field("id", &self.group.as_ref().map(|(id, _)| *id))
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish()
    }
}

impl Default for TensorParallel {
    fn default() -> Self {
        Self::none()
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
            layouts: Mutex::new(HashMap::new()),
        });
        registry().insert(id, Arc::downgrade(&group));
        Self {
            group: Some((id, group)),
        }
    }

    /// No slicing: a group of this rank alone.
    pub fn none() -> Self {
        Self { group: None }
    }

    /// This rank's slice index in the group.
    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, |(_, g)| g.coll.rank())
    }

    /// Ranks in the group (the number of slices).
    pub fn size(&self) -> usize {
        self.group.as_ref().map_or(1, |(_, g)| g.coll.world_size())
    }

    /// The group's key for the ops, when it has more than one rank (the ops of a group of
    /// one are the identity, and are not recorded at all).
    pub(crate) fn key(&self) -> Option<u64> {
        self.group
            .as_ref()
            .filter(|(_, g)| g.coll.world_size() > 1)
            .map(|(id, _)| *id)
    }

    /// Megatron's `f`, before a column-parallel layer: `x` unchanged; in backward, its
    /// gradient summed over the group (each slice contributed a part of it).
    pub fn copy<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self.key() {
            Some(id) => op::tp_copy(x, id),
            None => x,
        }
    }

    /// Megatron's `g`, after a row-parallel layer: `x` summed over the group (each slice
    /// computed a partial product); in backward, the gradient unchanged.
    pub fn reduce<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self.key() {
            Some(id) => op::tp_reduce(x, id),
            None => x,
        }
    }

    /// `x`'s equal chunks (along its flat order: its first axis) exchanged over the group,
    /// chunk `j` to rank `j`, chunk `j` of the result from rank `j`; its backward sends each
    /// gradient chunk back where its values came from. The identity in a group of one.
    pub fn exchange<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self.key() {
            Some(id) => crate::moe::ep_all_to_all(x, id),
            None => x,
        }
    }

    /// The elementwise maximum of `x` over the group, outside autodiff (a constant for the
    /// graph: vocabulary-parallel softmax subtracts it for stability only).
    pub fn max<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let x = x.detach();
        match (&self.group, self.key()) {
            (Some((_, group)), Some(_)) => {
                let shape = x.shape();
                let flat = x.reshape([shape.num_elements()]);
                group.all_reduce(flat, ReduceOp::Max).reshape(shape)
            }
            _ => x,
        }
    }

    /// Records how parameter `id`, one of this rank's slices, is cut from its whole tensor
    /// (see [`TensorParallel::gather`]). Sliced layers call it as they cut.
    pub fn record(&self, id: ParamId, layout: SliceLayout) {
        if let Some((_, group)) = &self.group {
            lock(&group.layouts).insert(id, layout);
        }
    }

    /// How parameter `id` is cut, `None` when it is whole on every rank of the group
    /// (replicated: a LayerNorm, a row-parallel layer's bias).
    pub fn layout(&self, id: ParamId) -> Option<SliceLayout> {
        match self.key() {
            Some(_) => self
                .group
                .as_ref()
                .and_then(|(_, g)| lock(&g.layouts).get(&id).copied()),
            None => None,
        }
    }

    /// The whole tensor of which `slice` is this rank's block under `layout`: every rank's
    /// block, gathered over the group (a collective: every rank calls it, in the same
    /// order). Outside autodiff.
    pub fn gather<const D: usize>(
        &self,
        slice: Tensor<D>,
        layout: SliceLayout,
    ) -> Result<Tensor<D>, CommError> {
        let (Some((_, group)), Some(_)) = (&self.group, self.key()) else {
            return Ok(slice);
        };
        let size = self.size();
        let shape = slice.shape();
        let n = shape.num_elements();
        let device = slice.device();
        let flat = slice.detach().reshape([n]);
        let all = transfer::staged_collective(group.coll.as_ref(), &device, |c| {
            c.all_gather(flat, &vec![n; size])
        })?;
        let block = shape[layout.dim] / layout.sections;
        let ranks: Vec<Tensor<D>> = (0..size)
            .map(|r| all.clone().narrow(0, r * n, n).reshape(shape.clone()))
            .collect();
        let pieces = (0..layout.sections)
            .flat_map(|s| {
                ranks
                    .iter()
                    .map(move |t| t.clone().narrow(layout.dim, s * block, block))
            })
            .collect();
        Ok(Tensor::cat(pieces, layout.dim))
    }

    /// The first collective failure of this group's ops since the last call: the ops return
    /// zeros after one, so a training step checks this before it steps.
    pub fn take_error(&self) -> Option<CommError> {
        self.group.as_ref().and_then(|(_, g)| lock(&g.error).take())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
