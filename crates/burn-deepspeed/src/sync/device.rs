//! [`DeviceSync`]: ZeRO stages 0-2 (arXiv 1910.02054) with every buffer on the model's
//! device. The flat gradient, the flat fp32 parameters and the moments are rank-1 tensors
//! of the model's device; a micro-batch's gradients are flattened into the buffer by device
//! ops, the buffer is averaged through the [`DeviceCollectives`] (all-reduced at stage 0;
//! reduce-scattered at stage 1 at the end of the step and at stage 2 at every micro-batch,
//! so that only this rank's slice stays), clipped by its norm (one scalar read to the host,
//! summed over the slices), stepped by the fused Adam/AdamW (`burn-deepspeed-cubecl-kernels`:
//! the CubeCL kernel on wgpu and CUDA, one launch over this rank's slice) or LAMB (device ops,
//! see [`super::DeviceOptimizer`]), all-gathered at
//! stages 1-2, and the model's parameters are written back as slices of the flat buffer.
//! Nothing crosses to the host but the norm and what the collectives stage (nothing under
//! NCCL; the buffers they move on wgpu).
//!
//! In mixed precision ([`GradSync::keep_masters`]) the flat fp32 parameters are the masters:
//! the model becomes their 16-bit working copy, its gradients are widened to f32 as they are
//! flattened (the gradient buffer is fp32 under fp16 too, where the host regime keeps fp16),
//! and the written-back slices are rounded to the working dtype.
//!
//! The engine takes this regime at stages 0-2 on a device that is not host memory (wgpu, CUDA)
//! when the model steps Adam, AdamW or LAMB and offloads nothing; every other case keeps the host
//! regimes ([`ReplicatedSync`](super::ReplicatedSync), [`PartitionedSync`](super::PartitionedSync)),
//! so runs on Flex are unchanged.

use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use burn_deepspeed_strategies::comm::Communicator;
use burn_deepspeed_strategies::comm::ReduceOp;
use burn_deepspeed_strategies::device::DeviceCollectives;
use burn_deepspeed_strategies::zero::{FlatPartition, PartitionState};

use super::ModelParallelNorm;
use super::buffer::merge_presence;
use super::device_step::{
    DeviceOptimizer, StepState, accumulated, clip_to, device_step, scaled, squared_norm, staged,
};
use super::scale::{Scaling, sum_across};
use super::{GradSync, Reduced, SavedState, SyncOptions};
use crate::checkpoint::{Loaded, partition_state_bytes, partition_state_from_bytes};
use crate::config::ZeroStage;
use crate::flat::{ParamLayout, restore_params};
use crate::memory::{MemoryMeter, ModelStateBytes, param_bytes};
use crate::precision::cast_module;
use crate::primitive::autodiff_like;
use crate::transfer;
use crate::{DeepSpeedError, Result};

/// The device of `module`'s first float parameter, if it has one.
pub fn module_device<M: Module>(module: &M) -> Option<Device> {
    struct V(Option<Device>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.lazy_device());
            }
        }
    }
    let mut v = V(None);
    module.visit(&mut v);
    v.0
}

/// The module's parameters as one flat fp32 tensor on `device`, outside every graph.
pub(super) fn flat_params<M: Module>(module: &M, device: &Device) -> Tensor<1> {
    struct V(Vec<Tensor<1>>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val().detach().set_require_grad(false);
            let n = t.shape().num_elements();
            self.0.push(t.cast(DType::F32).reshape([n]));
        }
    }
    let mut v = V(Vec::new());
    module.visit(&mut v);
    match v.0.is_empty() {
        true => Tensor::zeros([0], device),
        false => Tensor::cat(v.0, 0).inner(),
    }
}

/// `model` with its parameters replaced by slices of the flat fp32 `flat` (in `layout`
/// order), each cast to its parameter's dtype and kept in or out of the autodiff graph as the
/// parameter was.
pub(super) fn write_back<M: Module>(model: M, layout: &ParamLayout, flat: &Tensor<1>) -> M {
    struct Mapper<'a> {
        layout: &'a ParamLayout,
        flat: &'a Tensor<1>,
        next: usize,
    }
    impl ModuleMapper for Mapper<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            let slot = &self.layout.slots[self.next];
            self.next += 1;
            let shape: [usize; D] = slot.shape.clone().try_into().expect("the slot's rank");
            let new = self
                .flat
                .clone()
                .slice(slot.offset..slot.offset + slot.numel)
                .reshape(shape)
                .cast(tensor.dtype());
            let new = autodiff_like(new, &tensor);
            let new = new.set_require_grad(tensor.is_require_grad());
            Param::from_mapped_value(id, new, mapper)
        }
    }
    model.map(&mut Mapper {
        layout,
        flat,
        next: 0,
    })
}

/// A micro-batch's gradients of `model` as one flat f32 tensor on `device` in `layout` order
/// (zeros for a parameter without a gradient), marking in `present` the parameters that have
/// one.
pub(super) fn flat_grads<M: Module>(
    model: &M,
    layout: &ParamLayout,
    grads: &GradientsParams,
    device: &Device,
    present: &mut [u8],
) -> Tensor<1> {
    struct V<'a> {
        layout: &'a ParamLayout,
        grads: &'a GradientsParams,
        device: &'a Device,
        present: &'a mut [u8],
        parts: Vec<Tensor<1>>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(i) = self.layout.slot_of(param.id) else {
                return;
            };
            let n = self.layout.slots[i].numel;
            let part = match self.grads.get::<D>(param.id) {
                Some(g) => {
                    self.present[i] = 1;
                    g.cast(DType::F32).reshape([n])
                }
                None => Tensor::zeros([n], self.device),
            };
            self.parts.push(part);
        }
    }
    let mut v = V {
        layout,
        grads,
        device,
        present,
        parts: Vec::with_capacity(layout.slots.len()),
    };
    model.visit(&mut v);
    match v.parts.is_empty() {
        true => Tensor::zeros([0], device),
        false => Tensor::cat(v.parts, 0),
    }
}

/// A rank's ZeRO state on the model's device (stages 0-2).
pub struct DeviceSync {
    layout: ParamLayout,
    comm: Arc<dyn Communicator>,
    coll: Arc<dyn DeviceCollectives>,
    /// Stages 1-2: this rank's slice of the flat buffers ([`FlatPartition::new`], the host
    /// regime's partition, so that checkpoints move between the two) and every rank's slice
    /// length; stage 0: everything.
    own: Range<usize>,
    counts: Vec<usize>,
    stage: ZeroStage,
    clip: f64,
    predivide: Option<f32>,
    optimizer: DeviceOptimizer,
    device: Device,
    /// The accumulated gradient (f32), from the first micro-batch of a step to its end: whole
    /// at stages 0-1; this rank's slice at stage 2 (reduce-scattered at each micro-batch),
    /// and at every stage after [`GradSync::reduce`].
    grads: Option<Tensor<1>>,
    micro_steps: u64,
    present: Vec<u8>,
    /// fp32 parameters, flat in layout order (whole on every rank), and m and v of this
    /// rank's slice.
    params: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    /// Steps each parameter has taken.
    steps: Vec<u32>,
    /// The model is a 16-bit working copy of the flat parameters (its masters).
    mixed: bool,
    /// A stage-2 reduce-scatter's failure during `accumulate`, returned by `reduce`.
    deferred: Option<DeepSpeedError>,
    /// `zero_optimization.ignore_unused_parameters` (stages 1-2 refuse a parameter that no
    /// rank gave a gradient when it is false, as the host regime does).
    ignore_unused: bool,
    meter: MemoryMeter,
    /// Tensor slicing: the norm's group, and the 0/1 mask of what this rank counts in its
    /// window of the gradient (`None`: everything).
    slices: Option<(ModelParallelNorm, Option<Tensor<1>>)>,
}

impl DeviceSync {
    /// ZeRO stage `options.stage` (0-2) of `model` (on `device`, in fp32) over `coll`,
    /// stepping `optimizer` (its `lr` is replaced by each step's).
    pub fn new<M: Module>(
        model: &M,
        layout: ParamLayout,
        comm: Arc<dyn Communicator>,
        coll: Arc<dyn DeviceCollectives>,
        options: &SyncOptions,
        optimizer: DeviceOptimizer,
        device: Device,
    ) -> Self {
        let inner = device.clone().inner();
        let params = flat_params(model, &inner);
        let (own, counts) = match options.stage {
            ZeroStage::Disabled => (0..layout.numel, vec![layout.numel]),
            _ => {
                let partition = FlatPartition::new(layout.numel, coll.world_size());
                (partition.range(coll.rank()), partition.sizes())
            }
        };
        let n = own.len();
        Self {
            own,
            counts,
            stage: options.stage,
            present: vec![0; layout.slots.len()],
            steps: vec![0; layout.slots.len()],
            mixed: false,
            deferred: None,
            slices: None,
            ignore_unused: options.ignore_unused,
            layout,
            comm,
            coll,
            clip: options.clip,
            predivide: options.predivide,
            optimizer,
            grads: None,
            micro_steps: 0,
            params,
            m: Tensor::zeros([n], &inner),
            v: Tensor::zeros([n], &inner),
            device: inner,
            meter: MemoryMeter::default(),
        }
    }

    fn collective<T>(&self, f: impl FnOnce(&dyn DeviceCollectives) -> T) -> T {
        staged(self.coll.as_ref(), &self.device, f)
    }

    /// The model with its parameters replaced by slices of the flat parameters.
    fn write_back<M: Module>(&self, model: M) -> M {
        write_back(model, &self.layout, &self.params)
    }

    /// m and v of this rank's slice, and the fp32 masters when the model is their 16-bit
    /// copy.
    fn state_bytes(&self) -> u64 {
        8 * self.own.len() as u64
            + if self.mixed {
                4 * self.layout.numel as u64
            } else {
                0
            }
    }

    /// Drops the step's gradient and micro-batch count.
    fn discard_state(&mut self) {
        self.grads = None;
        self.micro_steps = 0;
        self.present.iter_mut().for_each(|p| *p = 0);
    }

    /// Whether the flat buffers are cut into slices (stages 1-2).
    fn partitioned(&self) -> bool {
        self.stage != ZeroStage::Disabled
    }

    /// The whole moments (a collective at stages 1-2).
    fn whole_state(&self) -> Result<PartitionState> {
        let whole = |t: &Tensor<1>| -> Result<Vec<f32>> {
            let t = match self.partitioned() {
                true => self.collective(|c| c.all_gather(t.clone(), &self.counts))?,
                false => t.clone(),
            };
            Ok(transfer::read_f32(t))
        };
        Ok(PartitionState {
            steps: self.steps.clone(),
            m: whole(&self.m)?,
            v: whole(&self.v)?,
        })
    }

    fn own_state(&self) -> PartitionState {
        PartitionState {
            steps: self.steps.clone(),
            m: transfer::read_f32(self.m.clone()),
            v: transfer::read_f32(self.v.clone()),
        }
    }
}

impl<M: Module> GradSync<M> for DeviceSync {
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    fn accumulate(&mut self, model: &M, grads: &GradientsParams) {
        let flat = flat_grads(model, &self.layout, grads, &self.device, &mut self.present);
        // Stage 2 keeps only this rank's slice: each micro-batch is reduce-scattered here.
        let flat = match self.stage {
            ZeroStage::Gradients => {
                let pre = Scaling::mean(self.predivide, self.coll.world_size(), 1).pre;
                let flat = scaled(flat, pre);
                match self.collective(|c| c.reduce_scatter(flat, &self.counts)) {
                    Ok(own) => own,
                    Err(e) => {
                        // Reported by `reduce`, the step's next fallible call.
                        self.deferred.get_or_insert(e.into());
                        Tensor::zeros([self.own.len()], &self.device)
                    }
                }
            }
            _ => flat,
        };
        self.grads = Some(accumulated(self.grads.take(), flat));
        self.micro_steps += 1;
        let held = GradSync::<M>::held(self, model);
        self.meter.observe(held, 4 * self.layout.numel as u64);
    }

    fn micro_steps(&self) -> u64 {
        self.micro_steps
    }

    fn reduce(&mut self, loss_scale: f32) -> Result<Reduced> {
        if let Some(e) = self.deferred.take() {
            self.discard_state();
            return Err(e);
        }
        let refuse = (self.partitioned() && !self.ignore_unused).then_some(&self.layout);
        if let Err(e) = merge_presence(self.comm.as_ref(), &mut self.present, refuse) {
            self.discard_state();
            return Err(e);
        }
        let world = self.coll.world_size();
        let scaling = Scaling::mean(self.predivide, world, self.micro_steps).unscaled(loss_scale);
        let streamed = self.stage == ZeroStage::Gradients;
        let len = if streamed {
            self.own.len()
        } else {
            self.layout.numel
        };
        let grads = self
            .grads
            .take()
            .unwrap_or_else(|| Tensor::zeros([len], &self.device));
        // Stage 2 applied the factor before its reduce-scatters.
        let grads = match (streamed, scaling.pre) {
            (true, _) | (false, 1.0) => grads,
            (false, pre) => grads.mul_scalar(pre),
        };
        let grads = match self.stage {
            ZeroStage::Disabled => self.collective(|c| c.all_reduce(grads, ReduceOp::Sum))?,
            ZeroStage::Gradients => grads,
            _ => self.collective(|c| c.reduce_scatter(grads, &self.counts))?,
        };
        let grads = scaled(grads, scaling.post);
        // The norm's square is the one value the host reads (summed over the slices at
        // stages 1-2, in f64, over the host communicator).
        let local = match &self.slices {
            Some((_, Some(mask))) => squared_norm(&(grads.clone() * mask.clone())),
            _ => squared_norm(&grads),
        };
        let data = match self.partitioned() {
            true => sum_across(self.comm.as_ref(), local)?,
            false => local,
        };
        let norm = match &self.slices {
            Some((slices, _)) => slices.across(data)?.sqrt(),
            None => data.sqrt(),
        };
        let grads = clip_to(grads, norm, self.clip);
        self.grads = Some(grads);
        Ok(Reduced::global(norm))
    }

    fn model_parallel_norm(&mut self, norm: ModelParallelNorm) -> Result<()> {
        let mask = norm.mask(self.own.clone(), &self.device);
        self.slices = Some((norm, mask));
        Ok(())
    }

    fn step(&mut self, model: M, lr: f64) -> Result<M> {
        let span = tracing::debug_span!("optimizer_step").entered();
        let grads = self
            .grads
            .take()
            .ok_or_else(|| DeepSpeedError::Regime("step before reduce".into()))?;
        let own = self.own.clone();
        // Each parameter's part of this rank's slice, in slice coordinates.
        let pieces: Vec<(usize, Range<usize>)> = self
            .layout
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| {
                let a = slot.offset.max(own.start);
                let b = (slot.offset + slot.numel).min(own.end);
                (a < b).then(|| (i, a - own.start..b - own.start))
            })
            .collect();
        let across = self.partitioned().then_some(self.coll.as_ref());
        let params = device_step(
            &self.optimizer,
            lr,
            self.params.clone().slice(own),
            &grads,
            StepState {
                m: &mut self.m,
                v: &mut self.v,
                steps: &mut self.steps,
                present: &self.present,
            },
            &pieces,
            across,
            &self.device,
        )?;
        // Stages 1-2: every rank's stepped slice, joined.
        self.params = match self.partitioned() {
            true => self.collective(|c| c.all_gather(params, &self.counts))?,
            false => params,
        };
        drop((grads, span));
        self.present.iter_mut().for_each(|p| *p = 0);
        self.micro_steps = 0;
        let model = self.write_back(model);
        let held = GradSync::<M>::held(self, &model);
        self.meter.observe(held, 0);
        Ok(model)
    }

    fn discard(&mut self) {
        self.discard_state();
    }

    fn reduced_gradients(&mut self, _model: &M) -> Result<GradientsParams> {
        Err(super::steps_its_own_fused_optimizer(self.stage.into()))
    }

    fn held(&self, model: &M) -> ModelStateBytes {
        ModelStateBytes {
            params: param_bytes(model),
            // Whole at stages 0-1, this rank's slice at stage 2 and after `reduce`.
            grads: self.grads.as_ref().map_or(0, |g| 4 * g.dims()[0] as u64),
            optimizer: self.state_bytes(),
            offloaded: 0,
        }
    }

    fn peak(&self) -> u64 {
        self.meter.peak()
    }

    fn keep_masters(&mut self, model: M, dtype: FloatDType) -> Result<M> {
        self.mixed = true;
        Ok(cast_module(model, dtype))
    }

    /// The fp32 parameters (the masters under mixed precision), the same on every rank.
    fn whole_params(&self, _model: &M, wanted: bool) -> Result<Option<Vec<f32>>> {
        Ok(wanted.then(|| transfer::read_f32(self.params.clone())))
    }

    fn whole_moments(&self) -> Result<Option<PartitionState>> {
        self.whole_state().map(Some)
    }

    /// Stage 0: rank 0 writes the whole state; stages 1-2: every rank its slice, in the
    /// host regime's format.
    fn save(&self, root: bool) -> Result<SavedState> {
        if self.partitioned() {
            return Ok(SavedState::Slice(partition_state_bytes(&self.own_state())));
        }
        Ok(SavedState::Replicated(
            root.then(|| partition_state_bytes(&self.own_state())),
        ))
    }

    /// Everything fallible (reading the optimizer state) happens before the parameters are
    /// replaced.
    fn load(&mut self, model: M, loaded: &Loaded) -> Result<M> {
        let n = self.layout.numel;
        let state = match self.partitioned() {
            // This rank's slice, cut again from the saved slices (any world size).
            true => {
                let sizes: Vec<usize> = self.layout.slots.iter().map(|s| s.numel).collect();
                loaded.slice_state(&sizes, std::slice::from_ref(&self.own))?
            }
            false => partition_state_from_bytes(loaded.replicated_state()?, "optim.bin")
                .ok()
                .filter(|s| s.m.len() == n && s.v.len() == n && s.steps.len() == self.steps.len())
                .ok_or_else(|| {
                    DeepSpeedError::Checkpoint(format!(
                        "optim.bin is not the flat Adam state of this model's {n} elements in {} \
                         tensors, which stage 0 on a device resumes from (a stage-0 fp32 run \
                         on the host, Flex, saves Burn's optimizer record instead: resume such \
                         a checkpoint on the host)",
                        self.steps.len()
                    ))
                })?,
        };
        let model = restore_params(model, &self.layout, &loaded.meta.param_ids, &loaded.params);
        self.layout = ParamLayout::of(&model);
        let to_device = |values: Vec<f32>| {
            let len = values.len();
            transfer::write::<1>(TensorData::new(values, [len]), &self.device, DType::F32)
        };
        self.m = to_device(state.m);
        self.v = to_device(state.v);
        self.steps = state.steps;
        // The checkpoint's fp32 values, not the model's (rounded under mixed precision).
        self.params = to_device(loaded.params.clone());
        self.discard_state();
        Ok(model)
    }
}
