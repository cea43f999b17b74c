//! The model's parameters and gradients as flat f32 tensors on its device, and the
//! parameters written back from one: what the device place reads and writes of a model
//! ([`super::ModelPlace`] for [`DevicePlace`](burn_deepspeed_strategies::place::DevicePlace)),
//! the device-resident stage 3 ([`super::ShardedSync`] over the device place) too.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor};

use crate::flat::ParamLayout;
use crate::primitive::autodiff_like;

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
