//! DeepSpeed's counting rules (`profiling/flops_profiler/profiler.py`), as functions of the
//! shapes an operation sees: plain data, no tensors.
//!
//! | operation | MACs | flops |
//! |---|---|---|
//! | linear | numel(x)·out_features (bias not counted: Burn's `Linear` records a matmul and an add of the bias, and that add is not counted) | 2·MACs |
//! | matmul | numel(out)·K | 2·MACs |
//! | convolution | numel(out)·(C_in/groups)·Πkernel | 2·MACs + numel(out) with a bias |
//! | scaled dot-product attention | numel(q)·S + numel(q)/d·S·d_v | 2·MACs |
//! | layer norm | 0 | 5·numel with an affine transform, 4 without |
//! | softmax, activations, pooling | 0 | numel |
//! | elementwise add, sub, mul, div | 0 | numel(out) |
//! | embedding, dropout, reshapes, math functions (exp, tanh, …) | 0 | 0 |
//!
//! One difference: DeepSpeed counts `add` and `mul` only when a model calls `torch.add` or
//! `torch.mul` (the `+` and `*` operators are not patched), where Burn records every
//! elementwise operation alike; here every elementwise add, sub, mul and div counts. In a
//! transformer they are the residual adds and the attention's scaling, well under 1% of the
//! flops (the GPT test shows the share).

use serde::Serialize;

/// The multiply-accumulates and floating-point operations of some work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct OpCost {
    /// Multiply-accumulate operations.
    pub macs: u64,
    /// Floating-point operations.
    pub flops: u64,
}

impl OpCost {
    /// Nothing.
    pub const ZERO: OpCost = OpCost { macs: 0, flops: 0 };

    /// Work of `macs` multiply-accumulates, two flops each.
    pub fn macs(macs: u64) -> Self {
        Self {
            macs,
            flops: 2 * macs,
        }
    }

    /// Work of `flops` operations that are not multiply-accumulates.
    pub fn flops(flops: u64) -> Self {
        Self { macs: 0, flops }
    }
}

impl std::ops::Add for OpCost {
    type Output = OpCost;
    fn add(self, o: OpCost) -> OpCost {
        OpCost {
            macs: self.macs + o.macs,
            flops: self.flops + o.flops,
        }
    }
}

impl std::ops::AddAssign for OpCost {
    fn add_assign(&mut self, o: OpCost) {
        *self = *self + o;
    }
}

/// Elements of a tensor of `shape`.
pub fn numel(shape: &[usize]) -> u64 {
    shape.iter().map(|&d| d as u64).product()
}

/// A linear layer on input `x` with `out_features` outputs.
pub fn linear(x: &[usize], out_features: usize) -> OpCost {
    OpCost::macs(numel(x) * out_features as u64)
}

/// A (batched) matrix product of `lhs` (`[…, M, K]`) giving `out` (`[…, M, N]`).
pub fn matmul(lhs: &[usize], out: &[usize]) -> OpCost {
    let k = lhs.last().copied().unwrap_or(1) as u64;
    OpCost::macs(numel(out) * k)
}

/// A convolution with output `out` and weight `[C_out, C_in/groups, k…]`.
pub fn conv(out: &[usize], weight: &[usize], bias: bool) -> OpCost {
    let per_output: u64 = weight.iter().skip(1).map(|&d| d as u64).product();
    let mut cost = OpCost::macs(numel(out) * per_output);
    if bias {
        cost.flops += numel(out);
    }
    cost
}

/// A transposed convolution of input `x` with weight `[C_in, C_out/groups, k…]`: each input
/// element meets `C_out/groups·Πk` weights.
pub fn conv_transpose(x: &[usize], weight: &[usize], out: &[usize], bias: bool) -> OpCost {
    let per_input: u64 = weight.iter().skip(1).map(|&d| d as u64).product();
    let mut cost = OpCost::macs(numel(x) * per_input);
    if bias {
        cost.flops += numel(out);
    }
    cost
}

/// Scaled dot-product attention of `q` (`[…, L, d]`) over `k` (`[…, S, d]`) and `v`
/// (`[…, S, d_v]`): the scores `q·kᵀ` and their product with `v`.
pub fn attention(q: &[usize], k: &[usize], v: &[usize]) -> OpCost {
    let s = k.iter().rev().nth(1).copied().unwrap_or(1) as u64;
    let dv = v.last().copied().unwrap_or(1) as u64;
    let rows = numel(&q[..q.len().saturating_sub(1)]);
    OpCost::macs(numel(q) * s + rows * s * dv)
}

/// Layer normalisation of `numel` elements, with or without its affine transform.
pub fn layer_norm(numel: u64, affine: bool) -> OpCost {
    OpCost::flops(numel * if affine { 5 } else { 4 })
}

/// One operation per element: softmax, an activation, pooling, an elementwise operation.
pub fn per_element(numel: u64) -> OpCost {
    OpCost::flops(numel)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSpeed's own test vectors (`test_flops_profiler.py`): `Linear(10, 10)` at batch 1
    /// is 200 flops; LeNet-5 at batch 1024 on 1×32×32 is 426,516,480 MACs and 866,076,672
    /// flops (the convolutions' and linears' MACs, plus the convolutions' biases, the
    /// average pools and the softmax; tanh counts nothing).
    #[test]
    fn deepspeeds_reference_values() {
        assert_eq!(linear(&[1, 10], 10).flops, 200);
        let b = 1024;
        let mut cost = OpCost::ZERO;
        // conv1 6x1x5x5 -> [b,6,28,28]; tanh; avgpool 2 -> [b,6,14,14] (pool over its input)
        cost += conv(&[b, 6, 28, 28], &[6, 1, 5, 5], true);
        cost += per_element(numel(&[b, 6, 28, 28]));
        // conv2 16x6x5x5 -> [b,16,10,10]; tanh; avgpool -> [b,16,5,5]
        cost += conv(&[b, 16, 10, 10], &[16, 6, 5, 5], true);
        cost += per_element(numel(&[b, 16, 10, 10]));
        // conv3 120x16x5x5 -> [b,120,1,1]; tanh
        cost += conv(&[b, 120, 1, 1], &[120, 16, 5, 5], true);
        // fc 120 -> 84; tanh; fc 84 -> 10; softmax
        cost += linear(&[b, 120], 84);
        cost += linear(&[b, 84], 10);
        cost += per_element(numel(&[b, 10]));
        assert_eq!(cost.macs, 426_516_480);
        assert_eq!(cost.flops, 866_076_672);
    }

    #[test]
    fn attention_is_the_two_products() {
        // [B=2, H=4, L=8, d=16] over S=8: q·kᵀ = 2·4·8·8·16, att·v = 2·4·8·8·16.
        let q = [2, 4, 8, 16];
        let cost = attention(&q, &q, &q);
        assert_eq!(cost.macs, 2 * (2 * 4 * 8 * 8 * 16));
        assert_eq!(cost, matmul(&q, &[2, 4, 8, 8]) + matmul(&[2, 4, 8, 8], &q));
        assert_eq!(layer_norm(10, true).flops, 50);
        assert_eq!(layer_norm(10, false).flops, 40);
    }
}
