//! The cost of one captured operation ([`OperationIr`]) under DeepSpeed's rules.

use burn_ir::{
    ActivationOperationIr, FloatOperationIr, ModuleOperationIr, NumericOperationIr, OperationIr,
};

use super::rules::{self, OpCost, numel};

/// The kind (for the printed profile) and the cost of `op`; `None` for an operation that
/// costs nothing under DeepSpeed's rules (reshapes, copies, reductions, initialisations).
pub fn op_cost(op: &OperationIr) -> Option<(&'static str, OpCost)> {
    use ModuleOperationIr as M;
    let out_numel = || op.outputs().map(|t| numel(&t.shape)).sum::<u64>();
    Some(match op {
        OperationIr::Float(_, FloatOperationIr::Matmul(m)) => {
            ("matmul", rules::matmul(&m.lhs.shape, &m.out.shape))
        }
        OperationIr::Module(m) => match m {
            M::Linear(l) => {
                let out = l.weight.shape.last().copied().unwrap_or(1);
                ("linear", rules::linear(&l.x.shape, out))
            }
            M::Attention(a) => (
                "attention",
                rules::attention(&a.query.shape, &a.key.shape, &a.value.shape),
            ),
            M::LayerNorm(l) => ("layer_norm", rules::layer_norm(numel(&l.input.shape), true)),
            M::Conv1d(c) => (
                "conv",
                rules::conv(&c.out.shape, &c.weight.shape, c.bias.is_some()),
            ),
            M::Conv2d(c) => (
                "conv",
                rules::conv(&c.out.shape, &c.weight.shape, c.bias.is_some()),
            ),
            M::Conv3d(c) => (
                "conv",
                rules::conv(&c.out.shape, &c.weight.shape, c.bias.is_some()),
            ),
            M::ConvTranspose1d(c) => (
                "conv_transpose",
                rules::conv_transpose(&c.x.shape, &c.weight.shape, &c.out.shape, c.bias.is_some()),
            ),
            M::ConvTranspose2d(c) => (
                "conv_transpose",
                rules::conv_transpose(&c.x.shape, &c.weight.shape, &c.out.shape, c.bias.is_some()),
            ),
            M::ConvTranspose3d(c) => (
                "conv_transpose",
                rules::conv_transpose(&c.x.shape, &c.weight.shape, &c.out.shape, c.bias.is_some()),
            ),
            M::AvgPool1d(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            M::AvgPool2d(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            M::AdaptiveAvgPool1d(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            M::AdaptiveAvgPool2d(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            M::AdaptiveAvgPool3d(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            M::MaxPool1d(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            M::MaxPool2d(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            M::MaxPool1dWithIndices(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            M::MaxPool2dWithIndices(p) => ("pool", rules::per_element(numel(&p.x.shape))),
            _ => return None,
        },
        OperationIr::Activation(a) => match a {
            ActivationOperationIr::Softmax(_)
            | ActivationOperationIr::LogSoftmax(_)
            | ActivationOperationIr::Softmin(_) => ("softmax", rules::per_element(out_numel())),
            ActivationOperationIr::Relu(_)
            | ActivationOperationIr::LeakyRelu(_)
            | ActivationOperationIr::PRelu(_)
            | ActivationOperationIr::Gelu(_)
            | ActivationOperationIr::Sigmoid(_)
            | ActivationOperationIr::HardSigmoid(_)
            | ActivationOperationIr::LogSigmoid(_) => {
                ("activation", rules::per_element(out_numel()))
            }
            _ => return None,
        },
        OperationIr::NumericFloat(
            _,
            NumericOperationIr::Add(_)
            | NumericOperationIr::AddScalar(_)
            | NumericOperationIr::Sub(_)
            | NumericOperationIr::SubScalar(_)
            | NumericOperationIr::Mul(_)
            | NumericOperationIr::MulScalar(_)
            | NumericOperationIr::Div(_)
            | NumericOperationIr::DivScalar(_),
        ) => ("elementwise", rules::per_element(out_numel())),
        _ => return None,
    })
}
