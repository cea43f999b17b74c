//! The dtype chunks travel in ([`GatherGroup::set_wire`](super::GatherGroup::set_wire): f32, or
//! the 16-bit working dtype), from and to the f32 the group computes in.

use burn::tensor::{FloatDType, bf16, f16};
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
