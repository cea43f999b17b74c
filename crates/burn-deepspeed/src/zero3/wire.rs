//! The dtype chunks travel in ([`GatherGroup::set_wire`](super::GatherGroup::set_wire): f32, or
//! the 16-bit working dtype; or int8 codes under ZeRO++'s qwZ,
//! [`GatherGroup::set_quantized_weights`](super::GatherGroup::set_quantized_weights)), from and
//! to the f32 the group computes in.

use burn::tensor::{FloatDType, bf16, f16};
use burn_deepspeed_cubecl_kernels::quantize::{Bits, Quantized, Quantizer, Scheme};
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::{CommElement, Communicator, CommunicatorExt, ReduceOp};

/// Every rank's `input` into `out` (rank order) on `comm`, travelling in `wire` (f32 when
/// `None`): an all-gather, or with `by_all_reduce` an all-reduce of a zero-padded buffer
/// (exact, as each position has one non-zero term).
pub(super) fn fetch(
    comm: &dyn Communicator,
    wire: Option<FloatDType>,
    by_all_reduce: bool,
    input: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    match wire {
        Some(FloatDType::F16) => fetch_as::<f16>(comm, by_all_reduce, input, out),
        Some(FloatDType::BF16) => fetch_as::<bf16>(comm, by_all_reduce, input, out),
        _ => fetch_as::<f32>(comm, by_all_reduce, input, out),
    }
}

/// qwZ (ZeRO++, arXiv 2306.10209 §3.1): every rank's `input` into `out` (rank order), each
/// rank's part travelling as int8 codes in symmetric groups with one f32 step per group
/// (DeepSpeed's adaptive group size, [`weight_group`]), and dequantized on arrival: about a
/// quarter of the f32 bytes. Every rank, the sender included, uses the dequantized values, so
/// the ranks compute with the same weights.
pub(super) fn fetch_quantized(
    comm: &dyn Communicator,
    input: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    let n = input.len();
    if n == 0 {
        return Ok(());
    }
    let quantizer = Quantizer::new(Bits::Int8, Scheme::Symmetric, weight_group(n))
        .expect("weight_group is at least 1");
    let mine = quantizer.quantize(input).to_bytes();
    let block = mine.len();
    let mut all = vec![0u8; block * comm.world_size()];
    comm.all_gather_equal(&mine, &mut all)?;
    for (bytes, out) in all.chunks_exact(block).zip(out.chunks_mut(n)) {
        let part = Quantized::from_bytes(quantizer, n, bytes).expect("every rank's part");
        part.dequantize_into(out);
    }
    Ok(())
}

/// DeepSpeed's qwZ group size for a partition of `numel` values: about 8000 per group, the
/// group count raised until it divides `numel` in multiples of 8, then doubled while groups
/// stay above 8000 and `numel` splits into multiples of 16. A `numel` that is not a multiple of
/// 8 (DeepSpeed's partitions always are) gets groups of at most 8000 with a shorter last one.
pub(crate) fn weight_group(numel: usize) -> usize {
    if numel == 0 {
        return 1;
    }
    let mut groups = numel.div_ceil(8000);
    if !numel.is_multiple_of(8) {
        return numel.div_ceil(groups);
    }
    while !numel.is_multiple_of(8 * groups) {
        groups += 1;
    }
    while numel.is_multiple_of(16 * groups) && numel / groups > 8000 {
        groups *= 2;
    }
    numel / groups
}

/// A gather as the group is set: int8 codes under qwZ (`quantized`, which gathers by
/// all-gather whatever `by_all_reduce` says), else [`fetch`] in `wire`.
pub(super) fn fetch_as_set(
    comm: &dyn Communicator,
    quantized: bool,
    wire: Option<FloatDType>,
    by_all_reduce: bool,
    input: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    match quantized {
        true => fetch_quantized(comm, input, out),
        false => fetch(comm, wire, by_all_reduce, input, out),
    }
}

/// [`fetch`] travelling as `T`.
fn fetch_as<T: Wire>(
    comm: &dyn Communicator,
    by_all_reduce: bool,
    input: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    let input: Vec<T> = input.iter().map(|&x| T::narrow(x)).collect();
    let mut wire = vec![T::narrow(0.0); out.len()];
    if by_all_reduce {
        let rank = comm.rank();
        wire[rank * input.len()..(rank + 1) * input.len()].copy_from_slice(&input);
        comm.all_reduce(&mut wire, ReduceOp::Sum)?;
    } else {
        comm.all_gather_equal(&input, &mut wire)?;
    }
    out.iter_mut().zip(&wire).for_each(|(o, w)| *o = w.widen());
    Ok(())
}

/// A dtype chunks travel in, from and to the f32 the group computes in.
trait Wire: CommElement {
    fn narrow(x: f32) -> Self;
    fn widen(self) -> f32;
}

impl Wire for f32 {
    fn narrow(x: f32) -> Self {
        x
    }
    fn widen(self) -> f32 {
        self
    }
}

impl Wire for f16 {
    fn narrow(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Wire for bf16 {
    fn narrow(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn_deepspeed_strategies::comm::{ThreadWorld, ThreadWorldOptions};

    use super::*;

    #[test]
    fn weight_groups_follow_deepspeed() {
        // One group up to 8000; a multiple of 8 split into groups whose count times 8
        // divides it; doubled while the groups stay above 8000.
        assert_eq!(weight_group(4096), 4096);
        assert_eq!(weight_group(8000), 8000);
        assert_eq!(weight_group(16_384), 16_384 / 4);
        assert_eq!(weight_group(8 * 10_007), 8);
        assert_eq!(weight_group(1 << 20), 4096);
        assert_eq!(weight_group(12_345), 6173);
        for numel in [1, 7, 8, 100, 8001, 65_536, 1_000_000, 999_999] {
            let g = weight_group(numel);
            assert!((1..16_000).contains(&g), "{numel}: {g}");
        }
    }

    #[test]
    fn quantized_gathers_agree_on_every_rank_and_move_a_quarter() {
        let n = 3000;
        let results = ThreadWorld::run(3, ThreadWorldOptions::default(), |c| {
            let c = Arc::new(c);
            let input: Vec<f32> = (0..n)
                .map(|i| ((i * 7 + c.rank() * 13) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let (mut exact, mut quantized) = (vec![0.0; 3 * n], vec![0.0; 3 * n]);
            let before = c.stats().total_sent();
            fetch(c.as_ref(), None, false, &input, &mut exact).expect("gather");
            let plain = c.stats().total_sent() - before;
            let before = c.stats().total_sent();
            fetch_quantized(c.as_ref(), &input, &mut quantized).expect("gather");
            let int8 = c.stats().total_sent() - before;
            (exact, quantized, plain, int8)
        });
        let results: Vec<_> = results.into_iter().map(|r| r.expect("rank")).collect();
        for (exact, quantized, plain, int8) in &results {
            assert_eq!(quantized, &results[0].1, "every rank sees the same weights");
            // One step is 2·absmax/256 of its group (absmax 1 here): values round to within
            // half a step, but +absmax saturates at code 127, a whole step below it.
            let error = |a: &f32, b: &f32| (a - b).abs();
            let saturated = |a: &f32| *a >= 1.0 - 1.0 / 256.0;
            let worst = |top: bool| {
                (exact.iter().zip(quantized))
                    .filter(|(a, _)| saturated(a) == top)
                    .map(|(a, b)| error(a, b))
                    .fold(0.0f32, f32::max)
            };
            assert!(worst(false) <= 1.0 / 256.0 + 1e-6, "{}", worst(false));
            assert!(worst(true) <= 1.0 / 128.0 + 1e-6, "{}", worst(true));
            let ratio = *plain as f64 / *int8 as f64;
            assert!((3.9..4.0).contains(&ratio), "{plain} / {int8} = {ratio}");
        }
    }
}
