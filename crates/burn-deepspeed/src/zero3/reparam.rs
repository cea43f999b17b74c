//! Sharding a Burn module for ZeRO stage 3: each partitioned parameter stores only this
//! rank's chunk, and a [`ShardGather`] reparameterization makes `Param::val()` return the
//! whole tensor through [`zero3_gather`](super::zero3_gather). Stock modules (`Linear`,
//! `Embedding`, `LayerNorm`, ...) run unchanged; the `ParamId`s stay, so gradients, records
//! and optimizers see the chunks.

use burn::module::{Module, Param, Reparameterization, Reparameterizer};
use burn::tensor::{Device, Tensor, TensorData};
use std::sync::{Arc, Mutex};

use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::zero::{ShardPlan, TensorShard};

use super::group::GatherGroup;
use super::op::zero3_gather;
use super::registry::key_of;
use super::store::ParamStore;

/// The reparameterization of a sharded parameter: `val()` gathers the whole tensor.
#[derive(Module, Debug)]
pub struct ShardGather {
    key: u64,
}

impl Reparameterization for ShardGather {
    const NAME: &'static str = "zero3_gather";

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        zero3_gather(base, self.key)
    }
}

/// The shape a chunk of `chunk` elements is stored in: the same rank as the whole tensor.
pub fn chunk_shape(chunk: usize, rank: usize) -> Vec<usize> {
    let mut shape = vec![1; rank.max(1)];
    shape[0] = chunk;
    shape
}

/// This rank's padded chunk of a whole tensor's values.
pub fn chunk_of(values: &[f32], chunk: usize, rank: usize) -> Vec<f32> {
    let start = (rank * chunk).min(values.len());
    let end = ((rank + 1) * chunk).min(values.len());
    let mut out = values[start..end].to_vec();
    out.resize(chunk, 0.0);
    out
}

/// What a module sharded ahead of its ranks ([`shard_module_ahead`]) does with the whole
/// tensors a Burn record carries: Burn's checkpointer saves and loads whole tensors, while
/// the module stores chunks.
pub trait AheadRecords: Send + Sync {
    /// A record loaded tensor `t` whole into the module (a resume): keep its values for the
    /// ranks, which take their chunks of them.
    fn loaded(&self, t: usize, whole: TensorData);
    /// While a save is under way on this thread: the whole values to record in place of
    /// tensor `t`'s chunk.
    fn saving(&self, t: usize) -> Option<TensorData>;
}

/// Replaces the partitioned parameters of a module by one rank's chunks (in layout order)
/// and attaches [`ShardGather`] with the keys of group `id`; persistent ones stay whole.
/// Every parameter moves to the [`checkpointing`] form of its device.
struct Sharder<'a> {
    plan: &'a ShardPlan,
    shapes: &'a [Vec<usize>],
    id: u64,
    rank: usize,
    /// The live group to record the chunks in, for prefetching.
    group: Option<&'a GatherGroup>,
    /// Next parameter, in layout order.
    next: usize,
    /// Under `offload_param`: the store the pieces go to (the module keeps empty
    /// placeholders), and the first failed write.
    store: Option<(&'a ParamStore, &'a Mutex<Option<CommError>>)>,
    /// Sharding ahead of the ranks: where whole tensors of records go and come from.
    ahead: Option<Arc<dyn AheadRecords>>,
}

impl Reparameterizer for Sharder<'_> {
    type Reparam = ShardGather;

    fn reparameterize<const D: usize>(
        &mut self,
        _path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<ShardGather>) {
        let t = self.next;
        self.next += 1;
        let s = self.plan.tensors()[t];
        let (rank, group, whole_shape) = (self.rank, self.group, &self.shapes[t]);
        let reparam = (!s.persistent).then(|| ShardGather {
            key: key_of(self.id, t),
        });
        if let Some(records) = &self.ahead {
            return (ahead(param, t, whole_shape, s, records.clone()), reparam);
        }
        let param = param.map(|tensor| {
            let require_grad = tensor.is_require_grad();
            let device = checkpointing(tensor.device());
            let values = crate::transfer::read_f32(tensor);
            let (values, shape) = if s.persistent {
                (values, whole_shape.clone())
            } else if let Some((store, failed)) = self.store {
                // This rank's piece goes to the store, one tensor at a time (a lazily
                // initialised model is never whole in memory).
                let own = self.plan.own(rank, t);
                let start = own.start.min(values.len());
                let end = own.end.min(values.len());
                let mut piece = values[start..end].to_vec();
                piece.resize(own.len(), 0.0);
                drop(values);
                if let Err(e) = store.write(t, &piece) {
                    failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                }
                (Vec::new(), chunk_shape(0, D))
            } else {
                let chunk = chunk_of(&values, s.chunk, rank);
                if let Some(group) = group {
                    let flat = crate::transfer::write_default::<1>(
                        TensorData::new(chunk.clone(), [s.chunk]),
                        &device,
                    );
                    group.set_shard(t, flat.inner());
                }
                (chunk, chunk_shape(s.chunk, D))
            };
            crate::transfer::write_default::<D>(TensorData::new(values, shape), &device)
                .set_require_grad(require_grad)
        });
        (param, reparam)
    }
}

/// A parameter of a module sharded ahead of its ranks. A partitioned one is declared with
/// its whole shape and materializes as a zero chunk (each rank loads its own values), so
/// that Burn's record loading, which checks the declared shape, accepts a whole tensor: it
/// goes to `records`, and the parameter keeps a chunk. A save records the whole values
/// `records` has for it, if any. A persistent one stays whole; a whole tensor loaded into
/// it goes to `records` too.
fn ahead<const D: usize>(
    param: Param<Tensor<D>>,
    t: usize,
    whole_shape: &[usize],
    s: TensorShard,
    records: Arc<dyn AheadRecords>,
) -> Param<Tensor<D>> {
    let value = param.val();
    let (device, require_grad) = (checkpointing(value.device()), value.is_require_grad());
    let whole = whole_shape.to_vec();
    let chunk = if s.persistent {
        whole.clone()
    } else {
        chunk_shape(s.chunk, D)
    };
    let placeholder = {
        let chunk = chunk.clone();
        move |device: &Device, require_grad: bool| {
            let zeros = TensorData::new(vec![0f32; chunk.iter().product()], chunk.clone());
            crate::transfer::write_default::<D>(zeros, device).set_require_grad(require_grad)
        }
    };
    let param = if s.persistent {
        let values = TensorData::new(crate::transfer::read_f32(value), whole.clone());
        Param::initialized(
            param.id,
            crate::transfer::write_default::<D>(values, &device).set_require_grad(require_grad),
        )
    } else {
        drop(value);
        Param::uninitialized(
            param.id,
            placeholder.clone(),
            device,
            require_grad,
            whole.clone().into(),
        )
    };
    let loading = records.clone();
    let param = param.load_mapper(move |tensor: Tensor<D>| {
        if tensor.dims().as_slice() != whole.as_slice() {
            return tensor;
        }
        loading.loaded(t, crate::transfer::read(tensor.clone()));
        if whole == chunk {
            tensor
        } else {
            placeholder(&tensor.device(), tensor.is_require_grad())
        }
    });
    if s.persistent {
        return param;
    }
    param.save_mapper(move |tensor: Tensor<D>| match records.saving(t) {
        Some(whole) => crate::transfer::write_default::<D>(whole, &tensor.device()),
        None => tensor,
    })
}

/// `device` with Burn's gradient checkpointing when it is an autodiff device: the consumers
/// of a gathered weight then re-gather it for their backward instead of keeping it.
pub fn checkpointing(device: Device) -> Device {
    match device.gradient_checkpointing_strategy() {
        Some(_) => device.gradient_checkpointing(),
        None => device,
    }
}

/// Shards `module` (whose parameters are whole, in the plan's layout order) through `group`.
pub fn shard_module<M: Module>(module: M, group: &GatherGroup) -> M {
    module.apply_reparameterization(Sharder {
        plan: group.plan(),
        shapes: group.shapes(),
        id: group.id(),
        rank: group.comm().rank(),
        group: Some(group),
        next: 0,
        store: None,
        ahead: None,
    })
}

/// [`shard_module`] under `offload_param`: each rank's pieces go to `store`, and the module
/// keeps empty placeholders of the chunks' rank. The first failed write is returned beside
/// the module (this rank's alone: the caller agrees on it with its peers).
pub fn shard_module_to_store<M: Module>(
    module: M,
    group: &GatherGroup,
    store: &ParamStore,
) -> (M, Result<(), CommError>) {
    let failed = Mutex::new(None);
    let module = module.apply_reparameterization(Sharder {
        plan: group.plan(),
        shapes: group.shapes(),
        id: group.id(),
        rank: group.comm().rank(),
        group: None,
        next: 0,
        store: Some((store, &failed)),
        ahead: None,
    });
    let failed = failed.into_inner().unwrap_or_else(|e| e.into_inner());
    (module, failed.map_or(Ok(()), Err))
}

/// Shards `module` for ranks that do not exist yet: the partitioned parameters become
/// zero chunks (placeholders, overwritten by each rank, declared with their whole shape:
/// see [`AheadRecords`]) with the keys of the prepared id `id` (see
/// [`prepared_id`](super::prepared_id)).
pub fn shard_module_ahead<M: Module>(
    module: M,
    plan: &ShardPlan,
    shapes: &[Vec<usize>],
    id: u64,
    records: Arc<dyn AheadRecords>,
) -> M {
    module.apply_reparameterization(Sharder {
        plan,
        shapes,
        id,
        rank: 0,
        group: None,
        next: 0,
        store: None,
        ahead: Some(records),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_keep_the_rank_and_pad_the_tail() {
        assert_eq!(chunk_shape(5, 2), vec![5, 1]);
        assert_eq!(chunk_shape(5, 1), vec![5]);
        let v: Vec<f32> = (0..10).map(|x| x as f32).collect();
        assert_eq!(chunk_of(&v, 3, 3), vec![9.0, 0.0, 0.0]);
        assert_eq!(chunk_of(&v, 3, 1), vec![3.0, 4.0, 5.0]);
        assert_eq!(chunk_of(&v[..3], 1, 3), vec![0.0]);
    }
}
