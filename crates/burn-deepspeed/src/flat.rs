//! A module's parameters laid out as one flat f32 buffer, in the module's visiting order.
//!
//! Every rank builds the same layout from the same model, so a flat gradient buffer can be
//! reduced in buckets and mapped back to [`GradientsParams`] by [`ParamId`]. This is the seam
//! between Burn's per-parameter tensors and the communicator's flat buffers.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

/// One parameter's place in the flat buffer.
#[derive(Debug, Clone)]
pub struct ParamSlot {
    /// The parameter.
    pub id: ParamId,
    /// Its shape.
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
}

/// The flat layout of a module's float parameters.
#[derive(Debug, Clone, Default)]
pub struct ParamLayout {
    /// Slots in visiting order.
    pub slots: Vec<ParamSlot>,
    /// Total elements.
    pub numel: usize,
    /// Slot of each parameter id, built once with the layout.
    index: HashMap<ParamId, usize>,
}

impl ParamLayout {
    /// The layout of `module`'s float parameters.
    pub fn of<M: Module>(module: &M) -> Self {
        struct V(ParamLayout);
        impl ModuleVisitor for V {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let shape = param.lazy_shape().to_vec();
                let numel = shape.iter().product();
                self.0.slots.push(ParamSlot {
                    id: param.id,
                    shape,
                    offset: self.0.numel,
                    numel,
                });
                self.0.numel += numel;
            }
        }
        let mut v = V(ParamLayout::default());
        module.visit(&mut v);
        let mut layout = v.0;
        layout.reindex();
        layout
    }

    fn reindex(&mut self) {
        self.index = self
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id, i))
            .collect();
    }

    /// The same layout with the parameter ids `ids` (in slot order).
    pub fn with_ids(&self, ids: &[u64]) -> Self {
        let mut layout = self.clone();
        for (slot, &id) in layout.slots.iter_mut().zip(ids) {
            slot.id = ParamId::from(id);
        }
        layout.reindex();
        layout
    }

    /// A layout of tensors of the given ids and shapes, in this order (plain data).
    pub fn from_shapes(params: impl IntoIterator<Item = (ParamId, Vec<usize>)>) -> Self {
        let mut layout = ParamLayout::default();
        for (id, shape) in params {
            let numel = shape.iter().product();
            layout.slots.push(ParamSlot {
                id,
                shape,
                offset: layout.numel,
                numel,
            });
            layout.numel += numel;
        }
        layout.reindex();
        layout
    }

    /// The layout of the parameters `keep` selects, in the same order, packed from offset 0
    /// (a regime over part of a model: expert parallelism reduces the experts and the rest
    /// in different groups).
    pub fn subset(&self, keep: impl Fn(ParamId) -> bool) -> Self {
        let mut layout = ParamLayout::default();
        for slot in self.slots.iter().filter(|s| keep(s.id)) {
            layout.slots.push(ParamSlot {
                offset: layout.numel,
                ..slot.clone()
            });
            layout.numel += slot.numel;
        }
        layout.reindex();
        layout
    }

    /// The slot of parameter `id`, if it belongs to this layout.
    pub fn slot_of(&self, id: ParamId) -> Option<usize> {
        self.index.get(&id).copied()
    }

    /// This layout with the parameter ids of `other`, slot for slot (a record loaded into a
    /// module restores the ids it was saved with); `None` when the slot counts differ.
    pub fn with_ids_of(&self, other: &ParamLayout) -> Option<ParamLayout> {
        if self.slots.len() != other.slots.len() {
            return None;
        }
        let mut layout = self.clone();
        for (slot, theirs) in layout.slots.iter_mut().zip(&other.slots) {
            slot.id = theirs.id;
        }
        layout.reindex();
        Some(layout)
    }
}

/// The tensor's values as f32 on the host (a counted host/device copy off Flex).
pub(crate) fn to_f32_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    crate::transfer::read_f32(t)
}

/// Rebuilds [`GradientsParams`] for the parameters marked in `present` that lie wholly in
/// `flat`, which holds the flat elements from `start` on (the whole buffer when `start` is 0
/// and `flat` has every element).
pub fn grads_from_flat<M: Module>(
    module: &M,
    layout: &ParamLayout,
    flat: &[f32],
    start: usize,
    present: &[u8],
    device: &Device,
) -> GradientsParams {
    struct V<'a> {
        layout: &'a ParamLayout,
        flat: &'a [f32],
        start: usize,
        present: &'a [u8],
        device: &'a Device,
        out: GradientsParams,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(i) = self.layout.slot_of(param.id) else {
                return;
            };
            let slot = &self.layout.slots[i];
            let end = self.start + self.flat.len();
            if self.present[i] == 0 || slot.offset < self.start || slot.offset + slot.numel > end {
                return;
            }
            let at = slot.offset - self.start;
            let data = TensorData::new(self.flat[at..at + slot.numel].to_vec(), slot.shape.clone());
            self.out
                .register::<D>(param.id, crate::transfer::write_default(data, self.device));
        }
    }
    let mut v = V {
        layout,
        flat,
        start,
        present,
        device,
        out: GradientsParams::new(),
    };
    module.visit(&mut v);
    v.out
}

/// The module's parameter values as one flat f32 buffer (those of `layout`, in its order).
pub fn params_to_flat<M: Module>(module: &M, layout: &ParamLayout) -> Vec<f32> {
    struct V<'a> {
        layout: &'a ParamLayout,
        out: &'a mut Vec<f32>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.layout.slot_of(param.id).is_some() {
                self.out.extend(to_f32_vec(param.val()));
            }
        }
    }
    let mut out = Vec::with_capacity(layout.numel);
    module.visit(&mut V {
        layout,
        out: &mut out,
    });
    out
}

/// Replaces the values of the module's parameters in `layout` with those in `flat`, keeping
/// each parameter's id, device, dtype (f32 values are rounded into a 16-bit parameter) and
/// `require_grad` flag; the parameters outside `layout` stay as they are.
pub fn params_from_flat<M: Module>(module: M, layout: &ParamLayout, flat: &[f32]) -> M {
    struct Mapper<'a> {
        layout: &'a ParamLayout,
        flat: &'a [f32],
    }
    impl ModuleMapper for Mapper<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(i) = self.layout.slot_of(param.id) else {
                return param;
            };
            let (id, tensor, mapper) = param.consume();
            let slot = &self.layout.slots[i];
            let data = TensorData::new(
                self.flat[slot.offset..slot.offset + slot.numel].to_vec(),
                slot.shape.clone(),
            );
            let require_grad = tensor.is_require_grad();
            let new = crate::transfer::write_default::<D>(data, &tensor.device());
            // A 16-bit working copy gets the f32 values rounded to its dtype.
            let new = if new.dtype() == tensor.dtype() {
                new
            } else {
                new.cast(tensor.dtype())
            };
            let new = new.set_require_grad(require_grad);
            Param::from_mapped_value(id, new, mapper)
        }
    }
    module.map(&mut Mapper { layout, flat })
}

/// The one gradient visitor: calls `f(slot, values)` for every parameter of `layout` in
/// layout order, with its gradient from `grads` as f32 values, or `None` when it has none;
/// remembers the gradients' device. Returns the bytes of the gradient tensors it read (their
/// stored dtype), which are alive while the caller copies them.
pub fn for_each_grad<M: Module>(
    module: &M,
    layout: &ParamLayout,
    grads: &GradientsParams,
    device: &mut Option<Device>,
    mut f: impl FnMut(usize, Option<Vec<f32>>),
) -> u64 {
    struct V<'a, F> {
        layout: &'a ParamLayout,
        grads: &'a GradientsParams,
        device: &'a mut Option<Device>,
        f: &'a mut F,
        bytes: u64,
    }
    impl<F: FnMut(usize, Option<Vec<f32>>)> ModuleVisitor for V<'_, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(i) = self.layout.slot_of(param.id) else {
                return;
            };
            let values = self.grads.get::<D>(param.id).map(|g| {
                if self.device.is_none() {
                    *self.device = Some(g.device());
                }
                self.bytes += crate::memory::tensor_bytes(&g);
                to_f32_vec(g)
            });
            (self.f)(i, values);
        }
    }
    let mut v = V {
        layout,
        grads,
        device,
        f: &mut f,
        bytes: 0,
    };
    module.visit(&mut v);
    v.bytes
}

/// `module` with the parameter ids `ids` (in layout order).
pub fn set_param_ids<M: Module>(module: M, ids: &[u64]) -> M {
    struct Mapper<'a> {
        ids: &'a [u64],
        next: usize,
    }
    impl ModuleMapper for Mapper<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (_, tensor, mapper) = param.consume();
            let id = ParamId::from(self.ids[self.next]);
            self.next += 1;
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Mapper { ids, next: 0 })
}

/// `module` with the values `flat` and the parameter ids `ids`, both in `layout` order (a
/// checkpoint's parameters).
pub fn restore_params<M: Module>(module: M, layout: &ParamLayout, ids: &[u64], flat: &[f32]) -> M {
    set_param_ids(params_from_flat(module, layout, flat), ids)
}

/// The elements `range` of the module's flat parameters, reading only the tensors that
/// overlap it.
pub fn params_range<M: Module>(module: &M, layout: &ParamLayout, range: Range<usize>) -> Vec<f32> {
    struct V<'a> {
        layout: &'a ParamLayout,
        range: Range<usize>,
        out: Vec<f32>,
    }
    impl ModuleVisitor for V<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(i) = self.layout.slot_of(param.id) else {
                return;
            };
            let slot = &self.layout.slots[i];
            let (a, b) = (
                slot.offset.max(self.range.start),
                (slot.offset + slot.numel).min(self.range.end),
            );
            if a < b {
                let values = to_f32_vec(param.val());
                self.out
                    .extend_from_slice(&values[a - slot.offset..b - slot.offset]);
            }
        }
    }
    let mut v = V {
        layout,
        out: Vec::with_capacity(range.len()),
        range,
    };
    module.visit(&mut v);
    v.out
}

/// The module paths of `module`'s float parameters in `layout`'s order (`blocks.0.attn.weight`:
/// the names Burn's stores give them), or none when the module's parameters are not the
/// layout's.
pub fn param_paths<M: Module>(module: &M, layout: &ParamLayout) -> Vec<String> {
    let found = param_entries(module);
    let same = found.len() == layout.slots.len()
        && found
            .iter()
            .zip(&layout.slots)
            .all(|((id, ..), s)| *id == s.id);
    if !same {
        return Vec::new();
    }
    found.into_iter().map(|(_, path, _)| path).collect()
}

/// Each float parameter of `module` in visiting order: its id, its module path and its
/// (lazy) dims.
pub(crate) fn param_entries<M: Module>(module: &M) -> Vec<(ParamId, String, Vec<usize>)> {
    struct V {
        stack: Vec<String>,
        found: Vec<(ParamId, String, Vec<usize>)>,
    }
    impl ModuleVisitor for V {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let dims = param.lazy_shape().dims::<D>().to_vec();
            self.found.push((param.id, self.stack.join("."), dims));
        }
    }
    let mut v = V {
        stack: Vec::new(),
        found: Vec::new(),
    };
    module.visit(&mut v);
    v.found
}
