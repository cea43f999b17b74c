//! [`checkpoint_tiles`]: a position-wise computation run over tiles of the sequence, each tile
//! an activation checkpoint, so that its intermediates exist for one tile at a time in the
//! forward and in the backward. This is ALST's tiled MLP and tiled loss (Arctic Long Sequence
//! Training, arXiv 2506.13996 §3.2): over a long sequence an MLP's hidden activations
//! (`4·d` per position) or a loss's logits (`vocab` per position) outweigh everything else a
//! block keeps, and tiling bounds them by the tile instead of the sequence.

use burn::module::Module;
use burn::tensor::Tensor;

use super::{CheckpointOptions, checkpoint, current_options, with_options};

/// `forward(module, tile, start)` for each tile of at most `tile` positions of `input` along
/// `dim` (`start`: the tile's first position), each run as a [`checkpoint`]: nothing of a
/// tile's forward is kept but its output, and its recompute in the backward holds one
/// tile's intermediates. The outputs come back in order; concatenate them for a
/// position-wise layer, or add them for a loss summed over positions.
///
/// The tiles' inputs stay where `input` is, whatever `cpu_checkpointing` says (they are
/// views of it). Only a computation that treats positions independently (an MLP, a head and its loss; not
/// attention) gives the same values tiled. The gradients equal the untiled ones up to the
/// order of the sums over positions.
///
/// ```
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use burn_deepspeed::activation::checkpoint_tiles;
///
/// let device = Device::flex().autodiff();
/// let mlp: Linear = LinearConfig::new(4, 4).init(&device);
/// let x = Tensor::<3>::ones([1, 10, 4], &device).require_grad();
/// let tiles = checkpoint_tiles(&mlp, x.clone(), 1, 4, |l, x, _start| l.forward(x).tanh());
/// assert_eq!(tiles.len(), 3); // positions 0-3, 4-7, 8-9
/// let y = Tensor::cat(tiles, 1);
/// let grads = y.sum().backward();
/// assert!(x.grad(&grads).is_some());
/// ```
pub fn checkpoint_tiles<M, F, const D: usize, const O: usize>(
    module: &M,
    input: Tensor<D>,
    dim: usize,
    tile: usize,
    forward: F,
) -> Vec<Tensor<O>>
where
    M: Module + 'static,
    F: Fn(&M, Tensor<D>, usize) -> Tensor<O> + Clone + Send + 'static,
{
    assert!(tile > 0, "a tile holds at least one position");
    let positions = input.dims()[dim];
    // A tile's input is a view of `input`, which the caller keeps: a host copy of it
    // (`cpu_checkpointing`) would add memory, not free any.
    let options = CheckpointOptions {
        cpu_checkpointing: false,
        ..current_options()
    };
    with_options(options, || {
        (0..positions)
            .step_by(tile)
            .map(|start| {
                let piece = input
                    .clone()
                    .narrow(dim, start, tile.min(positions - start));
                let forward = forward.clone();
                checkpoint(module, piece, move |m, x| forward(m, x, start))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use super::*;

    #[derive(Module, Debug)]
    struct Mlp {
        up: Linear,
        down: Linear,
    }

    impl Mlp {
        fn forward(&self, x: Tensor<3>) -> Tensor<3> {
            self.down.forward(self.up.forward(x).tanh())
        }
    }

    /// The input's gradient then each parameter's, flattened, of `sum(y · w)`.
    fn gradients(mlp: &Mlp, x: &Tensor<3>, y: Tensor<3>, w: &Tensor<3>) -> Vec<Tensor<1>> {
        let grads = (y * w.clone()).sum().backward();
        let mut out = vec![x.grad(&grads).expect("the input's gradient").flatten(0, 2)];
        let params = GradientsParams::from_grads(grads, mlp);
        struct V<'a>(&'a GradientsParams, &'a mut Vec<Tensor<1>>);
        impl ModuleVisitor for V<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let g = self
                    .0
                    .get::<D>(param.id)
                    .expect("every parameter's gradient");
                self.1.push(g.flatten(0, D - 1));
            }
        }
        mlp.visit(&mut V(&params, &mut out));
        out
    }

    /// Tiles that divide the sequence or not, and tiles inside a checkpointed block (ALST
    /// tiles the MLP of a checkpointed layer): the same outputs and gradients as untiled.
    #[test]
    fn tiled_outputs_and_gradients_equal_the_untiled_ones() {
        let device = Device::flex().autodiff();
        let mlp = Mlp {
            up: LinearConfig::new(6, 12).init(&device),
            down: LinearConfig::new(12, 6).init(&device),
        };
        let x = Tensor::<3>::random([2, 11, 6], Distribution::Default, &device).require_grad();
        let w = Tensor::<3>::random([2, 11, 6], Distribution::Default, &device);
        let tiled = |m: &Mlp, x: Tensor<3>, tile| {
            Tensor::cat(checkpoint_tiles(m, x, 1, tile, |m, x, _| m.forward(x)), 1)
        };
        let plain = mlp.forward(x.clone());
        let (reference, reference_grads) = (plain.clone().inner(), gradients(&mlp, &x, plain, &w));
        let cases: [(&str, Tensor<3>); 3] = [
            ("tiles of 4", tiled(&mlp, x.clone(), 4)),
            ("one tile of 11", tiled(&mlp, x.clone(), 11)),
            (
                "tiles of 3 in a checkpoint",
                checkpoint(&mlp, x.clone(), move |m, x| tiled(m, x, 3)),
            ),
        ];
        // Tiles sum a parameter's gradient in another order: entries near zero differ by a
        // few float steps of the whole sum, hence the absolute floor beside the relative bound.
        let tol = Tolerance::rel_abs(1e-5, 1e-6);
        for (name, y) in cases {
            y.clone()
                .inner()
                .into_data()
                .assert_approx_eq::<f32>(&reference.clone().into_data(), tol);
            let grads = gradients(&mlp, &x, y, &w);
            assert_eq!(grads.len(), reference_grads.len(), "{name}");
            for (a, b) in grads.into_iter().zip(&reference_grads) {
                a.into_data()
                    .assert_approx_eq::<f32>(&b.clone().into_data(), tol);
            }
        }
    }
}
