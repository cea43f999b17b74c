//! [`checkpoint`]: run a module's forward without keeping its activations, and run it again
//! in backward (Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv
//! 1604.06174; DeepSpeed's `deepspeed.checkpointing.checkpoint`).

use std::time::Instant;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor, TensorData};

use super::op::{self, FlatGrad, Recompute, Recomputed};
use super::options::{CheckpointOptions, current_options, record};
use crate::primitive::autodiff_like;
use crate::transfer;

/// `forward(module, input)`, with only `input` kept for backward: the activations inside the
/// closure are freed as the forward goes, and recomputed when the backward reaches them. A
/// stack of L checkpointed blocks keeps L block inputs instead of every intermediate of every
/// block, for one extra forward of each block.
///
/// The gradients are those of the plain `forward(module, input)`: the input's, and every
/// parameter's the closure reads through `module` (ZeRO stage-3 chunks included, which are
/// gathered again in the recompute). Options come from the engine's `activation_checkpointing`
/// section on this thread ([`with_options`](super::with_options)).
///
/// The closure must reach trainable tensors only through `module`; a tracked tensor it
/// captures otherwise would not get its gradient, and is refused with a panic. The closure
/// runs twice, so randomness inside it (dropout) is drawn twice: Burn has no RNG state to
/// restore, unlike DeepSpeed's CUDA RNG tracker. Without autodiff, or when nothing needs a
/// gradient, this is `forward(module, input)`.
///
/// ```
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use burn_deepspeed::activation::checkpoint;
///
/// let device = Device::flex().autodiff();
/// let layer: Linear = LinearConfig::new(4, 4).init(&device);
/// let x = Tensor::<2>::ones([2, 4], &device).require_grad();
/// let y = checkpoint(&layer, x.clone(), |l, x| l.forward(x).tanh());
/// let grads = y.sum().backward();
/// assert!(x.grad(&grads).is_some());
/// ```
pub fn checkpoint<M, F, const D: usize, const O: usize>(
    module: &M,
    input: Tensor<D>,
    forward: F,
) -> Tensor<O>
where
    M: Module + 'static,
    F: Fn(&M, Tensor<D>) -> Tensor<O> + Send + 'static,
{
    let input_tracked = input.is_tracked();
    // Every parameter is made now: a lazy one (Burn's modules are lazy until first read) shares
    // its pending state with the clones below, and would otherwise take their `no_grad`.
    let trainable = any_trainable(module);
    if !input.is_autodiff() || !(input_tracked || trainable) {
        return forward(module, input);
    }
    let options = current_options();

    // The forward, with no graph: its intermediates are freed as it goes.
    let start = Instant::now();
    let output = forward(&module.clone().no_grad(), constant(input.clone()));
    assert!(
        !output.is_tracked(),
        "a checkpointed closure used a tracked tensor that it did not reach through its \
         module argument; pass it in the module, or detach it"
    );
    if options.synchronize_checkpoint_boundary {
        sync(&output.device());
    }
    record(|s| {
        s.forwards += 1;
        if options.profile {
            s.forward_seconds += start.elapsed().as_secs_f64();
        }
    });

    let saved = Saved::new(constant(input.clone()), options.cpu_checkpointing);
    let mut attach = Attach {
        chain: Some(input),
        key: 0,
        index: 0,
    };
    let params = count_params(module);
    let copy = module.clone();
    let recompute: Recompute = Box::new(move |grad: FlatGrad| {
        recompute(copy, saved, input_tracked, forward, grad, options)
    });
    attach.key = op::register(recompute, params);
    module.visit(&mut attach);
    let chain = attach
        .chain
        .expect("the chain is put back after each parameter");
    op::output(chain, output, attach.key)
}

/// The recompute of one checkpoint: the closure again on fresh leaves (the module's
/// trainable parameters and, when it is tracked, the input), backward from the output's
/// gradient, and the leaves' gradients.
fn recompute<M, F, const D: usize, const O: usize>(
    module: M,
    saved: Saved<D>,
    input_tracked: bool,
    forward: F,
    grad: FlatGrad,
    options: CheckpointOptions,
) -> Recomputed
where
    M: Module,
    F: Fn(&M, Tensor<D>) -> Tensor<O>,
{
    let start = Instant::now();
    let leaves = module.map(&mut FreshLeaves);
    let input = saved.restore();
    let input = if input_tracked {
        input.require_grad()
    } else {
        input
    };
    let output = forward(&leaves, input.clone());
    let device = output.device();
    // The output's gradient stays on the device: it enters this graph as a constant.
    let dims: [usize; O] = grad.shape.dims();
    let grad = autodiff_like(grad.values.reshape(dims).cast(output.dtype()), &output);
    // d/d(output) of sum(output * grad) is grad: the backward of this graph is the piece of
    // the outer backward that the forward did not keep.
    let grads = (output * grad).sum().backward();
    let mut collect = CollectGrads {
        grads: &grads,
        out: Vec::new(),
    };
    leaves.visit(&mut collect);
    let recomputed = Recomputed {
        input: input_tracked
            .then(|| input.grad(&grads).map(FlatGrad::of))
            .flatten(),
        params: collect.out,
    };
    if options.synchronize_checkpoint_boundary {
        sync(&device);
    }
    record(|s| {
        s.recomputes += 1;
        if options.profile {
            s.recompute_seconds += start.elapsed().as_secs_f64();
        }
    });
    recomputed
}

/// `t` outside every graph, needing no gradient (`detach` alone keeps a leaf's
/// `require_grad`).
fn constant<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    t.detach().set_require_grad(false)
}

fn sync(device: &Device) {
    if let Err(e) = device.sync() {
        tracing::warn!("synchronizing at a checkpoint boundary failed: {e:?}");
    }
}

/// A checkpoint's input, kept for its recompute.
// One per checkpoint, moved into its recompute once: boxing the tensor saves nothing.
#[allow(clippy::large_enum_variant)]
enum Saved<const D: usize> {
    /// On its device.
    Device(Tensor<D>),
    /// In host memory (`cpu_checkpointing`), with the device and dtype to restore it to.
    Host(TensorData, Device),
}

impl<const D: usize> Saved<D> {
    fn new(input: Tensor<D>, host: bool) -> Self {
        if host {
            let device = input.device();
            let data = transfer::read(input);
            record(|s| s.host_bytes += data.bytes().len() as u64);
            Saved::Host(data, device)
        } else {
            Saved::Device(input)
        }
    }

    fn restore(self) -> Tensor<D> {
        match self {
            Saved::Device(t) => t,
            Saved::Host(data, device) => {
                let dtype = data.dtype();
                transfer::write(data, &device, dtype)
            }
        }
    }
}

/// Whether any parameter needs a gradient; reads (and so initialises) every one.
fn any_trainable<M: Module>(module: &M) -> bool {
    struct V(bool);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 |= param.base().is_require_grad();
        }
    }
    let mut v = V(false);
    module.visit(&mut v);
    v.0
}

fn count_params<M: Module>(module: &M) -> usize {
    struct V(usize);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
            self.0 += 1;
        }
    }
    let mut v = V(0);
    module.visit(&mut v);
    v.0
}

/// Attaches each parameter (its stored tensor: at ZeRO stage 3 the chunk) to the chain.
struct Attach<const D: usize> {
    chain: Option<Tensor<D>>,
    key: u64,
    index: usize,
}

impl<const C: usize> ModuleVisitor for Attach<C> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(chain) = self.chain.take() {
            self.chain = Some(op::attach(chain, param.base(), self.key, self.index));
        }
        self.index += 1;
    }
}

/// Each trainable parameter as a new leaf, outside every graph so far (the outer backward
/// holds its graph while the recompute runs).
struct FreshLeaves;

impl ModuleMapper for FreshLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| {
            if t.is_require_grad() {
                t.detach().require_grad()
            } else {
                t
            }
        })
    }
}

/// The gradient of each parameter's stored tensor, in visiting order.
struct CollectGrads<'a> {
    grads: &'a burn::tensor::Gradients,
    out: Vec<Option<FlatGrad>>,
}

impl ModuleVisitor for CollectGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.out
            .push(param.base().grad(self.grads).map(FlatGrad::of));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::{take_stats, with_options};
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;
    use burn::tensor::{DType, Distribution, FloatDType};

    #[derive(Module, Debug)]
    struct Block {
        a: Linear,
        b: Linear,
    }

    impl Block {
        fn forward(&self, x: Tensor<2>) -> Tensor<2> {
            x.clone() + self.b.forward(self.a.forward(x).tanh())
        }
    }

    #[derive(Module, Debug)]
    struct Net {
        blocks: Vec<Block>,
    }

    impl Net {
        fn new(device: &Device) -> Self {
            Self {
                blocks: (0..3)
                    .map(|_| Block {
                        a: LinearConfig::new(8, 16).init(device),
                        b: LinearConfig::new(16, 8).init(device),
                    })
                    .collect(),
            }
        }

        fn forward(&self, mut x: Tensor<2>, checkpointed: bool) -> Tensor<2> {
            for block in &self.blocks {
                x = if checkpointed {
                    checkpoint(block, x, |b, x| b.forward(x))
                } else {
                    block.forward(x)
                };
            }
            x
        }
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    /// The input's gradient and every parameter's, in visiting order.
    fn gradients(net: &Net, x: &Tensor<2>, checkpointed: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
        let y = net.forward(x.clone(), checkpointed);
        let grads = (y.clone() * y).sum().backward();
        let gx = if x.is_require_grad() {
            values(x.grad(&grads).unwrap())
        } else {
            Vec::new()
        };
        let params = GradientsParams::from_grads(grads, net);
        struct V<'a>(&'a GradientsParams, Vec<Vec<f32>>);
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let g = self.0.get::<D>(param.id).map(values).unwrap_or_default();
                self.1.push(g);
            }
        }
        let mut v = V(&params, Vec::new());
        net.visit(&mut v);
        (gx, v.1)
    }

    fn input(device: &Device) -> Tensor<2> {
        Tensor::<2>::random([4, 8], Distribution::Normal(0.0, 1.0), device)
    }

    #[test]
    fn checkpointed_gradients_equal_the_plain_ones() {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let x = input(&device).require_grad();
        let plain = gradients(&net, &x, false);
        let _ = take_stats();
        let ckpt = gradients(&net, &x, true);
        let stats = take_stats();
        assert_eq!(ckpt, plain);
        assert!(plain.1.iter().all(|g| !g.is_empty()));
        assert_eq!((stats.forwards, stats.recomputes), (3, 3));
    }

    /// A module whose parameters are still lazy (never read) keeps them trainable through
    /// its first checkpoint: the forward's `no_grad` clone must not reach the pending state
    /// it shares with them.
    #[test]
    fn lazy_parameters_stay_trainable_through_the_first_checkpoint() {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let x = input(&device).require_grad();
        let ckpt = gradients(&net, &x, true);
        assert!(
            ckpt.1.iter().all(|g| !g.is_empty()),
            "every parameter has a gradient"
        );
        assert_eq!(ckpt, gradients(&net, &x, false));
    }

    #[test]
    fn parameters_get_gradients_when_the_input_needs_none() {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let x = input(&device);
        assert_eq!(gradients(&net, &x, true), gradients(&net, &x, false));
    }

    #[test]
    fn frozen_parameters_get_none_and_the_rest_are_unchanged() {
        let device = Device::flex().autodiff();
        let mut net = Net::new(&device);
        net.blocks[1] = net.blocks[1].clone().no_grad();
        let x = input(&device).require_grad();
        let plain = gradients(&net, &x, false);
        assert_eq!(gradients(&net, &x, true), plain);
        assert!(plain.1[4].is_empty() && !plain.1[0].is_empty());
    }

    #[test]
    fn host_checkpoints_and_profiling_give_the_same_gradients() {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let x = input(&device).require_grad();
        let plain = gradients(&net, &x, false);
        let options = CheckpointOptions {
            cpu_checkpointing: true,
            synchronize_checkpoint_boundary: true,
            profile: true,
        };
        let _ = take_stats();
        let ckpt = with_options(options, || gradients(&net, &x, true));
        let stats = take_stats();
        assert_eq!(ckpt, plain);
        assert!(stats.forward_seconds > 0.0 && stats.recompute_seconds > 0.0);
        // Three blocks' inputs of 4 × 8 f32 went to host memory.
        assert_eq!(stats.host_bytes, 3 * 4 * 8 * 4);
        assert_eq!(current_options(), CheckpointOptions::default());
    }

    #[test]
    fn half_precision_blocks_match_too() {
        let device = Device::flex().autodiff();
        let net = Net::new(&device).map(&mut Cast);
        let x = input(&device).cast(FloatDType::F16).require_grad();
        let plain = gradients(&net, &x, false);
        let ckpt = gradients(&net, &x, true);
        assert_eq!(ckpt, plain);

        struct Cast;
        impl ModuleMapper for Cast {
            fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
                p.map(|t| t.cast(DType::F16).detach().require_grad())
            }
        }
    }

    #[test]
    fn without_autodiff_it_is_the_plain_forward() {
        let device = Device::flex();
        let net = Net::new(&device);
        let x = input(&device);
        let _ = take_stats();
        let a = values(net.forward(x.clone(), true));
        assert_eq!(a, values(net.forward(x, false)));
        assert_eq!(take_stats().forwards, 0);
    }

    #[test]
    #[should_panic(expected = "did not reach through its module argument")]
    fn a_captured_tracked_tensor_is_refused() {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let w = Tensor::<2>::ones([4, 8], &device).require_grad();
        let _ = checkpoint(&net.blocks[0], input(&device), move |b, x| {
            b.forward(x) * w.clone()
        });
    }
}
