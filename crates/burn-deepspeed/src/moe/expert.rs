//! What an MoE layer routes to: the [`Expert`] trait, DeepSpeed's default [`ExpertMlp`], and
//! the PR-MoE [`Residual`] beside the experts.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor};

/// An expert of an [`MoE`](super::MoE) layer: any module from tokens `[n, d]` to `[n, d]` (DeepSpeed
/// takes any `nn.Module`; the usual one is the transformer's MLP, [`ExpertMlp`]).
pub trait Expert: Module {
    /// The expert applied to `x` `[n, d]`.
    fn forward(&self, x: Tensor<2>) -> Tensor<2>;
}

/// A transformer's feed-forward block as an expert: `Linear(d, hidden)`, GELU,
/// `Linear(hidden, d)`.
#[derive(Module, Debug)]
pub struct ExpertMlp {
    /// The input projection.
    pub fc_in: Linear,
    /// The output projection.
    pub fc_out: Linear,
}

impl ExpertMlp {
    /// An MLP of width `d` with `hidden` features, Burn's default initialisation.
    pub fn new(d: usize, hidden: usize, device: &Device) -> Self {
        Self {
            fc_in: LinearConfig::new(d, hidden).init(device),
            fc_out: LinearConfig::new(hidden, d).init(device),
        }
    }
}

impl Expert for ExpertMlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc_out.forward(gelu(self.fc_in.forward(x)))
    }
}

/// PR-MoE's dense branch (arXiv 2201.05596 §4.1): an MLP whose output is mixed with the
/// experts' by `softmax(coefficient(x))`.
#[derive(Module, Debug)]
pub struct Residual<E: Expert> {
    /// The dense MLP.
    pub mlp: E,
    /// `Linear(d, 2)`: the mixing logits.
    pub coefficient: Linear,
}
