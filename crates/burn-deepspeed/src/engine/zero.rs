//! [`ZeroSync`]: ZeRO stages 1 and 2 (arXiv 1910.02054 §5): the optimizer state, and at
//! stage 2 the gradients, are cut across the data-parallel ranks.
//!
//! - **Stage 1** accumulates whole gradients in a flat buffer, as stage 0 does. At the
//!   accumulation boundary the buffer is reduce-scattered in buckets of `reduce_bucket_size`
//!   elements; each rank keeps the mean gradient of its own slice (in place in the buffer).
//! - **Stage 2** keeps only its slice: after each micro-batch's backward the gradients are
//!   streamed into a bucket of `reduce_bucket_size` elements and every full bucket is
//!   reduce-scattered straight away, so a rank never holds more than one bucket of other
//!   ranks' gradients.
//!
//! Then both clip by the global norm (one all-reduce of the slices' squared sums), step the
//! slice with the [`PartitionedOptimizer`] (m and v of the slice only), and all-gather the
//! updated slices in buckets of `allgather_bucket_size` elements into every rank's model.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn_deepspeed_cubecl_kernels::adam::AdamParams;
use burn_deepspeed_cubecl_kernels::lamb::LambParams;
use burn_deepspeed_strategies::bucket::bucket_ranges;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt, ReduceOp};
use burn_deepspeed_strategies::zero::{
    FlatPartition, PartitionState, PartitionedKind, PartitionedOptimizer,
};

use super::flat::{ParamLayout, for_each_grad, grads_from_flat, params_from_flat, params_range};
use super::memory::ModelStateBytes;
use super::optim::AdamFamily;
use super::reduce::scale_to_norm;
use crate::config::{DeepSpeedConfig, OffloadDevice, OptimizerKind, ZeroStage};
use crate::{DeepSpeedError, Result};

/// The optimizer of a ZeRO stage 1/2 slice for a resolved `optimizer` section, with the same
/// math as the Burn optimizer stage 0 runs (see [`build_optimizer`](super::build_optimizer)).
pub fn partitioned_kind(config: &DeepSpeedConfig) -> Result<PartitionedKind> {
    let cfg = config
        .optimizer
        .as_ref()
        .expect("resolve fills the optimizer");
    let AdamFamily { b1, b2, eps, wd } = AdamFamily::of(cfg)?;
    Ok(match cfg.kind {
        OptimizerKind::Adam | OptimizerKind::AdamW => PartitionedKind::Adam(AdamParams {
            lr: 0.0,
            beta1: b1 as f32,
            beta2: b2 as f32,
            eps,
            weight_decay: wd,
            decoupled: cfg.decoupled_weight_decay(),
            bias_correction: true,
        }),
        OptimizerKind::Lamb => PartitionedKind::Lamb(LambParams {
            lr: 0.0,
            beta1: b1 as f32,
            beta2: b2 as f32,
            eps,
            weight_decay: wd,
            bias_correction: true,
            trust_clip: None,
        }),
        kind => {
            return Err(DeepSpeedError::Unsupported {
                key: "optimizer.type".into(),
                reason: format!(
                    "{kind:?} does not run with ZeRO stages 1-3; use Adam, AdamW or Lamb"
                ),
            });
        }
    })
}

/// Refuses the `zero_optimization` settings this version does not run, naming the key and
/// the reason. Everything else is honoured (see the book's ZeRO chapter for what each key
/// does here).
pub fn refuse_zero_keys(config: &DeepSpeedConfig) -> Result<()> {
    let z = &config.zero_optimization;
    let refuse = |key: &str, reason: &str| {
        Err(DeepSpeedError::Unsupported {
            key: format!("zero_optimization.{key}"),
            reason: reason.into(),
        })
    };
    let offloaded = |d: Option<OffloadDevice>| d.is_some_and(|d| d != OffloadDevice::None);
    if offloaded(z.offload_optimizer.as_ref().map(|o| o.device)) || z.cpu_offload == Some(true) {
        return refuse(
            "offload_optimizer",
            "ZeRO-Offload (optimizer state on the CPU or NVMe) is not implemented yet; remove              the section or set its device to \"none\"",
        );
    }
    if offloaded(z.offload_param.as_ref().map(|o| o.device)) {
        return refuse(
            "offload_param",
            "parameter offload is not implemented yet; remove the section or set its device \
             to \"none\"",
        );
    }
    if z.zero_hpz_partition_size > 1 {
        return refuse(
            "zero_hpz_partition_size",
            "ZeRO++ hierarchical partitioning is not implemented; set it to 1",
        );
    }
    for (key, on) in [
        ("zero_quantized_weights", z.zero_quantized_weights),
        (
            "zero_quantized_nontrainable_weights",
            z.zero_quantized_nontrainable_weights,
        ),
        ("zero_quantized_gradients", z.zero_quantized_gradients),
    ] {
        if on {
            return refuse(
                key,
                "ZeRO++ quantized collectives are not implemented; set it to false",
            );
        }
    }
    if z.mics_shard_size > 0 {
        return refuse("mics_shard_size", "MiCS is not implemented; set it to -1");
    }
    Ok(())
}

/// Marks, on every rank, the tensors that had a gradient on any rank (one all-reduce), and
/// refuses a tensor that had none unless `ignore_unused_parameters`.
pub(crate) fn merge_presence(
    comm: &dyn Communicator,
    present: &mut [u8],
    ignore_unused: bool,
    layout: &ParamLayout,
) -> Result<()> {
    if comm.world_size() > 1 {
        comm.all_reduce(present, ReduceOp::Max)?;
    }
    match present.iter().position(|&p| p == 0) {
        Some(i) if !ignore_unused => Err(DeepSpeedError::Data(format!(
            "parameter {i} (shape {:?}) got no gradient on any rank and \
             zero_optimization.ignore_unused_parameters is false",
            layout.slots[i].shape
        ))),
        _ => Ok(()),
    }
}

/// Clips every rank's part `grads` of the gradient by the global norm (one all-reduce of the
/// parts' squared sums) to `clip`; returns the norm before clipping.
pub(crate) fn clip_partitioned(
    comm: &dyn Communicator,
    grads: &mut [f32],
    clip: f64,
) -> Result<f64> {
    let mut sq = [grads.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>() as f32];
    if comm.world_size() > 1 {
        comm.all_reduce(&mut sq, ReduceOp::Sum)?;
    }
    let norm = (sq[0] as f64).sqrt();
    scale_to_norm(grads, norm, clip);
    Ok(norm)
}

/// The factors applied before and after the reduction of `micro_steps` micro-batches on
/// `world` ranks: the mean, split by `gradient_predivide_factor` when prescaling.
pub(crate) fn pre_post(predivide: Option<f32>, world: usize, micro_steps: u64) -> (f32, f32) {
    let world = world as f32;
    let gas = micro_steps.max(1) as f32;
    match predivide {
        Some(f) => (1.0 / f, f / (world * gas)),
        None => (1.0, 1.0 / (world * gas)),
    }
}

/// A rank's gradient reduction and optimizer step at ZeRO stage 1 or 2.
pub struct ZeroSync {
    stage: ZeroStage,
    comm: Arc<dyn Communicator>,
    layout: ParamLayout,
    partition: FlatPartition,
    own: Range<usize>,
    /// Stage 1: the whole accumulated gradient; stage 2: empty.
    full: Vec<f32>,
    /// Stage 2: this rank's accumulated slice; stage 1: empty (the slice lives in `full`).
    slice: Vec<f32>,
    present: Vec<u8>,
    device: Option<Device>,
    micro_steps: u64,
    bucket_size: usize,
    gather_bucket_size: usize,
    predivide: Option<f32>,
    clip: f64,
    /// `reduce_scatter`: false all-reduces each bucket and keeps the own part (DeepSpeed's
    /// all-reduce path); the result is the same.
    reduce_scatter: bool,
    ignore_unused: bool,
    /// The slice's optimizer; `None` when the caller steps whole tensors itself
    /// ([`for_whole_tensors`](Self::for_whole_tensors)).
    optim: Option<PartitionedOptimizer>,
    /// A collective that failed during a micro-batch (stage 2), reported by the next step.
    deferred: Option<DeepSpeedError>,
}

impl ZeroSync {
    /// The stage-1/2 state for `layout` under `config` (stage 1 or 2) on `comm`: a balanced
    /// flat partition stepped by the [`PartitionedOptimizer`] the config names.
    pub fn new(
        layout: ParamLayout,
        config: &DeepSpeedConfig,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let partition = FlatPartition::new(layout.numel, comm.world_size());
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let optim =
            PartitionedOptimizer::new(partitioned_kind(config)?, &partition, comm.rank(), &sizes);
        Ok(Self::with_partition(
            layout,
            config,
            comm,
            partition,
            Some(optim),
        ))
    }

    /// The stage-1/2 state with a partition at tensor boundaries and no optimizer of its own:
    /// the caller steps this rank's whole tensors ([`own_gradients`](Self::own_gradients))
    /// with any optimizer, e.g. the Learner's, then [`gather`](Self::gather)s.
    pub fn for_whole_tensors(
        layout: ParamLayout,
        config: &DeepSpeedConfig,
        comm: Arc<dyn Communicator>,
    ) -> Self {
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let partition = FlatPartition::tensor_aligned(&sizes, comm.world_size());
        Self::with_partition(layout, config, comm, partition, None)
    }

    fn with_partition(
        layout: ParamLayout,
        config: &DeepSpeedConfig,
        comm: Arc<dyn Communicator>,
        partition: FlatPartition,
        optim: Option<PartitionedOptimizer>,
    ) -> Self {
        let stage = config.zero_optimization.stage;
        assert!(
            matches!(stage, ZeroStage::OptimizerStates | ZeroStage::Gradients),
            "ZeroSync runs stages 1 and 2"
        );
        let own = partition.range(comm.rank());
        let zero = &config.zero_optimization;
        Self {
            full: if stage == ZeroStage::OptimizerStates {
                vec![0.0; layout.numel]
            } else {
                Vec::new()
            },
            slice: if stage == ZeroStage::Gradients {
                vec![0.0; own.len()]
            } else {
                Vec::new()
            },
            present: vec![0; layout.slots.len()],
            stage,
            comm,
            layout,
            partition,
            own,
            device: None,
            micro_steps: 0,
            bucket_size: zero.reduce_bucket_size as usize,
            gather_bucket_size: zero.allgather_bucket_size as usize,
            predivide: config
                .prescale_gradients
                .then_some(config.gradient_predivide_factor as f32),
            clip: config.gradient_clipping,
            reduce_scatter: zero.reduce_scatter,
            ignore_unused: zero.ignore_unused_parameters,
            optim,
            deferred: None,
        }
    }

    /// This rank's slice of the flat parameters.
    pub fn own(&self) -> Range<usize> {
        self.own.clone()
    }

    /// The partition of the flat parameters.
    pub fn partition(&self) -> &FlatPartition {
        &self.partition
    }

    /// Micro-batches accumulated since the last step.
    pub fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    /// The model state this rank holds between steps: all parameters, the gradient buffer
    /// (whole at stage 1, a slice at stage 2) and the slice's optimizer state.
    pub fn state_bytes(&self) -> ModelStateBytes {
        ModelStateBytes {
            params: 4 * self.layout.numel as u64,
            grads: 4 * (self.full.len() + self.slice.len()) as u64,
            optimizer: self.optim.as_ref().map_or(0, |o| o.state_bytes()),
        }
    }

    /// Elements staged at once by a reduction (one bucket, capped by the buffer).
    pub fn bucket_elems(&self) -> usize {
        if self.bucket_size == 0 {
            self.layout.numel
        } else {
            self.bucket_size.min(self.layout.numel)
        }
    }

    /// Adds one micro-batch's gradients: into the whole buffer at stage 1; at stage 2
    /// reduce-scattered bucket by bucket into this rank's slice (a collective).
    pub fn accumulate<M: Module>(&mut self, module: &M, grads: &GradientsParams) {
        self.micro_steps += 1;
        let cap = self.bucket_elems();
        let present = &mut self.present;
        if self.stage == ZeroStage::OptimizerStates {
            let (full, layout) = (&mut self.full, &self.layout);
            for_each_grad(module, layout, grads, &mut self.device, |i, values| {
                if let Some(values) = values {
                    let s = &layout.slots[i];
                    full[s.offset..s.offset + s.numel]
                        .iter_mut()
                        .zip(values)
                        .for_each(|(d, v)| *d += v);
                    present[i] = 1;
                }
            });
            return;
        }
        let pre = match self.predivide {
            Some(f) => 1.0 / f,
            None => 1.0,
        };
        let mut bucket = Bucket {
            comm: self.comm.as_ref(),
            partition: &self.partition,
            own_start: self.own.start,
            slice: &mut self.slice,
            buf: Vec::with_capacity(cap),
            reduce_scatter: self.reduce_scatter,
            cap,
            start: 0,
            pre,
            error: self.deferred.take(),
        };
        for_each_grad(
            module,
            &self.layout,
            grads,
            &mut self.device,
            |i, values| {
                let n = self.layout.slots[i].numel;
                match values {
                    Some(values) => {
                        present[i] = 1;
                        bucket.push(&values);
                    }
                    None => bucket.push_zeros(n),
                }
            },
        );
        bucket.flush();
        self.deferred = bucket.error;
    }

    /// Reduces (stage 1), clips by the global norm, steps this rank's slice and all-gathers
    /// the updated slices into `model`. Returns the model and the norm before clipping.
    pub fn step<M: Module>(&mut self, model: M, lr: f64) -> Result<(M, f64)> {
        let norm = self.reduce()?;
        Ok((self.step_reduced(model, lr)?, norm))
    }

    /// After [`reduce`](Self::reduce): steps this rank's slice with its optimizer and
    /// all-gathers the updated slices into `model`.
    pub fn step_reduced<M: Module>(&mut self, model: M, lr: f64) -> Result<M> {
        let comm = self.comm.clone();
        let mut params = params_range(&model, &self.layout, self.own.clone());
        {
            let _span = tracing::debug_span!("optimizer_step", rank = comm.rank()).entered();
            let grads: &[f32] = match self.stage {
                ZeroStage::OptimizerStates => &self.full[self.own.clone()],
                _ => &self.slice,
            };
            let optim = self.optim.as_mut().ok_or_else(|| {
                DeepSpeedError::Data(
                    "this ZeroSync has no optimizer; step its tensors and call gather".into(),
                )
            })?;
            optim.step(comm.as_ref(), &mut params, grads, &self.present, lr)?;
        }
        self.gather(model, &params)
    }

    /// Ends the accumulation: reduce-scatters (stage 1; stage 2 did it per micro-batch),
    /// leaves this rank's slice of the mean gradient, clips it by the global norm (one
    /// all-reduce of the slices' squared sums), and returns the norm before clipping.
    pub fn reduce(&mut self) -> Result<f64> {
        if let Some(e) = self.deferred.take() {
            self.reset();
            return Err(e);
        }
        let comm = self.comm.clone();
        if let Err(e) = merge_presence(
            comm.as_ref(),
            &mut self.present,
            self.ignore_unused,
            &self.layout,
        ) {
            self.reset();
            return Err(e);
        }
        let (pre, post) = pre_post(self.predivide, comm.world_size(), self.micro_steps);
        let own = self.own.clone();
        if self.stage == ZeroStage::OptimizerStates {
            let mut tmp = Vec::new();
            for range in bucket_ranges(self.layout.numel, self.bucket_size) {
                let bucket = &mut self.full[range.clone()];
                if pre != 1.0 {
                    bucket.iter_mut().for_each(|g| *g *= pre);
                }
                let mine = self.partition.own_in(comm.rank(), &range);
                tmp.resize(mine.len(), 0.0);
                let counts = self.partition.counts_in(&range);
                let _span =
                    tracing::debug_span!("reduce_scatter_bucket", elems = range.len()).entered();
                if self.reduce_scatter {
                    comm.reduce_scatter(&self.full[range], &mut tmp, &counts, ReduceOp::Sum)?;
                    self.full[mine].copy_from_slice(&tmp);
                } else {
                    comm.all_reduce(&mut self.full[range], ReduceOp::Sum)?;
                }
            }
        }
        let grads: &mut [f32] = match self.stage {
            ZeroStage::OptimizerStates => &mut self.full[own],
            _ => &mut self.slice,
        };
        if post != 1.0 {
            grads.iter_mut().for_each(|g| *g *= post);
        }
        clip_partitioned(comm.as_ref(), grads, self.clip)
    }

    /// After [`reduce`](Self::reduce), with a [tensor-aligned](Self::for_whole_tensors)
    /// partition: the gradients of this rank's tensors (those that had one on any rank).
    pub fn own_gradients<M: Module>(&self, module: &M) -> GradientsParams {
        let grads: &[f32] = match self.stage {
            ZeroStage::OptimizerStates => &self.full[self.own.clone()],
            _ => &self.slice,
        };
        let device = self.device.clone().unwrap_or_default();
        grads_from_flat(
            module,
            &self.layout,
            grads,
            self.own.start,
            &self.present,
            &device,
        )
    }

    /// All-gathers every rank's updated slice (`own_params`, this rank's part) in buckets
    /// of `allgather_bucket_size` elements into `model`, and clears the gradient buffers
    /// for the next accumulation.
    pub fn gather<M: Module>(&mut self, model: M, own_params: &[f32]) -> Result<M> {
        let comm = self.comm.clone();
        let own = self.own.clone();
        let mut flat = vec![0.0f32; self.layout.numel];
        for range in bucket_ranges(self.layout.numel, self.gather_bucket_size) {
            let mine = self.partition.own_in(comm.rank(), &range);
            let counts = self.partition.counts_in(&range);
            let input = &own_params[mine.start - own.start..mine.end - own.start];
            let _span = tracing::debug_span!("all_gather_bucket", elems = range.len()).entered();
            comm.all_gather(input, &mut flat[range], &counts)?;
        }
        let model = params_from_flat(model, &self.layout, &flat);
        self.reset();
        self.present.iter_mut().for_each(|p| *p = 0);
        Ok(model)
    }

    fn reset(&mut self) {
        self.full.iter_mut().for_each(|g| *g = 0.0);
        self.slice.iter_mut().for_each(|g| *g = 0.0);
        self.micro_steps = 0;
    }

    /// This rank's optimizer state, to save (`None` without an optimizer of its own).
    pub fn export(&self) -> Option<&PartitionState> {
        self.optim.as_ref().map(|o| o.export())
    }

    /// Restores this rank's optimizer state.
    pub fn restore(&mut self, state: PartitionState) -> Result<()> {
        restore_state(&mut self.optim, state)
    }
}

/// Restores a rank's optimizer state into `optim`, refused when the rank keeps none (its
/// caller's optimizer steps instead).
pub(crate) fn restore_state(
    optim: &mut Option<PartitionedOptimizer>,
    state: PartitionState,
) -> Result<()> {
    match optim {
        Some(o) => Ok(o.restore(state)?),
        None => Err(DeepSpeedError::Checkpoint(
            "this rank steps with its caller's optimizer and keeps no optimizer state to restore"
                .into(),
        )),
    }
}

/// Stage 2's streaming bucket: gradients in layout order are appended, and every full
/// bucket is reduce-scattered into the owners' slices.
struct Bucket<'a> {
    comm: &'a dyn Communicator,
    partition: &'a FlatPartition,
    own_start: usize,
    slice: &'a mut [f32],
    buf: Vec<f32>,
    cap: usize,
    /// Flat offset of `buf[0]`.
    start: usize,
    pre: f32,
    reduce_scatter: bool,
    error: Option<DeepSpeedError>,
}

impl Bucket<'_> {
    fn push(&mut self, mut values: &[f32]) {
        while !values.is_empty() {
            let take = (self.cap - self.buf.len()).min(values.len());
            let pre = self.pre;
            self.buf.extend(values[..take].iter().map(|&g| g * pre));
            values = &values[take..];
            if self.buf.len() == self.cap {
                self.flush();
            }
        }
    }

    fn push_zeros(&mut self, mut n: usize) {
        while n > 0 {
            let take = (self.cap - self.buf.len()).min(n);
            self.buf.resize(self.buf.len() + take, 0.0);
            n -= take;
            if self.buf.len() == self.cap {
                self.flush();
            }
        }
    }

    fn flush(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let range = self.start..self.start + self.buf.len();
        self.start = range.end;
        if self.error.is_none() {
            let rank = self.comm.rank();
            let mine = self.partition.own_in(rank, &range);
            let counts = self.partition.counts_in(&range);
            let mut out = vec![0.0f32; mine.len()];
            let _span =
                tracing::debug_span!("reduce_scatter_bucket", elems = range.len()).entered();
            let reduced = if self.reduce_scatter {
                self.comm
                    .reduce_scatter(&self.buf, &mut out, &counts, ReduceOp::Sum)
            } else {
                self.comm
                    .all_reduce(&mut self.buf, ReduceOp::Sum)
                    .map(|()| {
                        if !mine.is_empty() {
                            out.copy_from_slice(
                                &self.buf[mine.start - range.start..mine.end - range.start],
                            )
                        }
                    })
            };
            match reduced {
                Ok(()) => {
                    let dst =
                        &mut self.slice[mine.start - self.own_start..mine.end - self.own_start];
                    dst.iter_mut().zip(out).for_each(|(d, v)| *d += v);
                }
                Err(e) => self.error = Some(e.into()),
            }
        }
        self.buf.clear();
    }
}
