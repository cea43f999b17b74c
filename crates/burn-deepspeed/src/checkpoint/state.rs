//! How state is serialized in a checkpoint's files: f32 values, ZeRO partition states and
//! the 1-bit optimizers' states, each little-endian and length-checked when read.

use burn_deepspeed_strategies::onebit::OneBitState;
use burn_deepspeed_strategies::zero::PartitionState;

use crate::{DeepSpeedError, Result};

/// f32 values as little-endian bytes.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Little-endian bytes as f32 values (the length must be a multiple of 4).
pub fn f32_values(bytes: &[u8], what: &str) -> Result<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(DeepSpeedError::Checkpoint(format!(
            "{what}: {} bytes is not a whole number of f32 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A 1-bit optimizer state as bytes: step (u64), buffer count (u32), then per buffer its name
/// length (u32), name, element count (u64) and f32 values; all little-endian.
pub fn one_bit_state_bytes(state: &OneBitState) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend(state.step.to_le_bytes());
    out.extend((state.buffers.len() as u32).to_le_bytes());
    for (name, values) in &state.buffers {
        out.extend((name.len() as u32).to_le_bytes());
        out.extend(name.as_bytes());
        out.extend((values.len() as u64).to_le_bytes());
        out.extend(f32_bytes(values));
    }
    out
}

/// Parses [`one_bit_state_bytes`].
pub fn one_bit_state_from_bytes(bytes: &[u8]) -> Result<OneBitState> {
    let truncated = || DeepSpeedError::Checkpoint("1-bit optimizer state is truncated".into());
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let end = at.checked_add(n).ok_or_else(truncated)?;
        let s = bytes.get(at..end).ok_or_else(truncated)?;
        at = end;
        Ok(s)
    };
    let u64_of = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let u32_of = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
    let step = u64_of(take(8)?);
    let count = u32_of(take(4)?) as usize;
    let mut buffers = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        let len = u32_of(take(4)?) as usize;
        let name = String::from_utf8(take(len)?.to_vec())
            .map_err(|_| DeepSpeedError::Checkpoint("1-bit state: a name is not UTF-8".into()))?;
        let n = u64_of(take(8)?) as usize;
        let values = f32_values(take(n.checked_mul(4).ok_or_else(truncated)?)?, &name)?;
        buffers.push((name, values));
    }
    Ok(OneBitState { step, buffers })
}

/// A ZeRO stage 1/2 slice's state as bytes: tensor count (u32), per-tensor steps (u32), slice
/// length (u64), then m and v (f32); all little-endian.
pub fn partition_state_bytes(state: &PartitionState) -> Vec<u8> {
    let mut out = partition_state_head(&state.steps, state.m.len());
    out.reserve(8 * state.m.len());
    out.extend(f32_bytes(&state.m));
    out.extend(f32_bytes(&state.v));
    out
}

/// What [`partition_state_bytes`] writes before the moments of a slice of `len` elements.
pub fn partition_state_head(steps: &[u32], len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + 4 * steps.len());
    out.extend((steps.len() as u32).to_le_bytes());
    steps.iter().for_each(|s| out.extend(s.to_le_bytes()));
    out.extend((len as u64).to_le_bytes());
    out
}

/// Where a slice's bytes go: each piece with its byte offset in the file.
pub type SliceSink<'a> = &'a mut dyn FnMut(u64, &[u8]) -> Result<()>;

/// A rank's slice of the optimizer state as its checkpoint file ([`partition_state_bytes`]'s
/// layout): its length, and how its bytes are produced, from memory or tile by tile from a
/// swap file (ZeRO-Infinity), so that a save never holds an offloaded slice whole.
pub struct SliceState<'a> {
    /// The file's length in bytes.
    pub bytes: u64,
    write: Box<dyn FnOnce(SliceSink) -> Result<()> + 'a>,
}

impl<'a> SliceState<'a> {
    /// A slice already serialized in memory.
    pub fn held(bytes: Vec<u8>) -> Self {
        Self::streamed(bytes.len() as u64, move |sink| sink(0, &bytes))
    }

    /// A slice of `bytes` bytes that `write` hands to its sink piece by piece, in any order;
    /// together the pieces cover the file once.
    pub fn streamed(bytes: u64, write: impl FnOnce(SliceSink) -> Result<()> + 'a) -> Self {
        Self {
            bytes,
            write: Box::new(write),
        }
    }

    /// Hands every piece to `sink`.
    pub fn write_to(self, sink: SliceSink) -> Result<()> {
        (self.write)(sink)
    }

    /// The whole file in memory (for tests and small slices).
    pub fn into_bytes(self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; usize::try_from(self.bytes).unwrap_or(usize::MAX)];
        self.write_to(&mut |at, piece| {
            let at = at as usize;
            let end = at + piece.len();
            let Some(to) = out.get_mut(at..end) else {
                return Err(DeepSpeedError::Checkpoint(format!(
                    "a slice piece at bytes {at}..{end} lies outside its declared length"
                )));
            };
            to.copy_from_slice(piece);
            Ok(())
        })?;
        Ok(out)
    }
}

impl std::fmt::Debug for SliceState<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SliceState")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// Parses [`partition_state_bytes`].
pub fn partition_state_from_bytes(bytes: &[u8], what: &str) -> Result<PartitionState> {
    let bad = |detail: &str| DeepSpeedError::Checkpoint(format!("{what}: {detail}"));
    let count = u32::from_le_bytes(
        bytes
            .get(..4)
            .ok_or_else(|| bad("truncated"))?
            .try_into()
            .expect("4 bytes"),
    ) as usize;
    let steps_end = count
        .checked_mul(4)
        .and_then(|n| n.checked_add(4))
        .ok_or_else(|| bad("the step count overflows"))?;
    let steps: Vec<u32> = bytes
        .get(4..steps_end)
        .ok_or_else(|| bad("truncated step counts"))?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    let len_bytes = bytes
        .get(steps_end..)
        .and_then(|rest| rest.get(..8))
        .ok_or_else(|| bad("truncated"))?;
    let len = usize::try_from(u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")))
        .map_err(|_| bad("the slice length overflows"))?;
    let body = &bytes[steps_end + 8..];
    if len.checked_mul(8) != Some(body.len()) {
        return Err(bad(&format!(
            "{} bytes of moments for a slice of {len} elements",
            body.len()
        )));
    }
    Ok(PartitionState {
        steps,
        m: f32_values(&body[..4 * len], what)?,
        v: f32_values(&body[4 * len..], what)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bit_state_round_trips() {
        let state = OneBitState {
            step: 42,
            buffers: vec![("m".into(), vec![0.5, -1.0]), ("scaling".into(), vec![])],
        };
        let bytes = one_bit_state_bytes(&state);
        assert_eq!(one_bit_state_from_bytes(&bytes).expect("parse"), state);
        let err = one_bit_state_from_bytes(&bytes[..bytes.len() - 1]).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}
