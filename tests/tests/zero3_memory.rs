//! ZeRO stage 3 lowers the memory *during* the step: a gathered weight lives only while it
//! is used. Measured on the real heap with a counting allocator: after the forward of a stack
//! of stock `nn::Linear` layers whose weights are sharded, the heap holds about what the
//! forward of the whole model adds (activations), not the gathered weights; the backward
//! gathers each weight again and hands back gradients of the chunks only.

use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Distribution, Tensor};
use burn_deepspeed::flat::ParamLayout;
use burn_deepspeed::launch::launch;
use burn_deepspeed::memory::heap;
use burn_deepspeed::zero3::{GatherGroup, shard_module};
use burn_deepspeed_strategies::zero::ShardPlan;

/// Bytes live on the heap now.
fn live() -> isize {
    heap::live_bytes().expect("the counting allocator is installed") as isize
}

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn new(width: usize, depth: usize, device: &Device) -> Self {
        Self {
            layers: (0..depth)
                .map(|_| LinearConfig::new(width, width).init(device))
                .collect(),
        }
    }

    fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        for layer in &self.layers {
            x = layer.forward(x).tanh();
        }
        x
    }
}

const WIDTH: usize = 512;
const DEPTH: usize = 6;
const WEIGHT_BYTES: isize = (WIDTH * WIDTH * 4) as isize;

/// Heap growth over a forward pass whose output is kept (so autodiff keeps what backward
/// needs).
fn forward_growth(model: &Mlp, x: &Tensor<2>) -> (isize, Tensor<2>) {
    let before = live();
    let y = model.forward(x.clone());
    (live() - before, y)
}

#[test]
fn gathered_weights_do_not_outlive_their_use() {
    // The heap's counters are the process's: no other test may allocate meanwhile.
    let _alone = crate::alone();
    let device = Device::flex().autodiff();
    let (_, results) = launch(1, Duration::from_secs(60), |comm| {
        let x = Tensor::<2>::random([8, WIDTH], Distribution::Default, &device.clone().inner());
        // The whole model: its weights exist before the forward, which adds activations.
        let whole = Mlp::new(WIDTH, DEPTH, &device);
        forward_growth(&whole, &x); // warm-up of one-time allocations
        let (plain, y) = forward_growth(&whole, &x);
        drop(y.sum().backward());

        let layout = ParamLayout::of(&whole);
        let sizes: Vec<usize> = layout.slots.iter().map(|s| s.numel).collect();
        let shapes = layout.slots.iter().map(|s| s.shape.clone()).collect();
        let plan = ShardPlan::new(&sizes, comm.world_size(), 0, usize::MAX);
        let group = GatherGroup::new(comm, plan, shapes, 0, usize::MAX, 1.0, false);
        let sharded = shard_module(whole, &group);
        let (growth, y) = forward_growth(&sharded, &x);
        let stats = group.stats();
        let grads = y.sum().backward();
        let grads = GradientsParams::from_grads(grads, &sharded);
        let after = group.stats();
        let chunk_grad = grads
            .get::<2>(sharded.layers[0].weight.id)
            .map(|g| g.dims());
        Ok((plain, growth, stats, after, chunk_grad))
    })
    .expect("runs");
    let (plain, growth, fwd, all, chunk_grad) = results.into_iter().next().expect("rank 0");
    println!(
        "forward heap growth: whole model {plain} B, sharded {growth} B \
         ({DEPTH} weights of {WEIGHT_BYTES} B); gathers {fwd:?} then {all:?}"
    );
    assert_eq!(fwd.forward_gathers, 2 * DEPTH as u64, "weights and biases");
    // Holding the gathered weights until backward would add DEPTH weights; at most the one
    // in use may remain.
    assert!(
        growth <= plain + WEIGHT_BYTES,
        "the sharded forward kept {growth} B against {plain} B"
    );
    // Each weight is gathered again for its backward (biases when Burn's linear asks).
    assert!(
        (DEPTH as u64..=2 * DEPTH as u64).contains(&all.backward_gathers),
        "{all:?}"
    );
    assert_eq!(all.reduce_scatters, 2 * DEPTH as u64);
    assert_eq!(chunk_grad, Some([WIDTH * WIDTH, 1]), "the chunk's gradient");
}
