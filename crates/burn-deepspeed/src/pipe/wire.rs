//! Activations and gradients between neighbouring stages: a 24-byte shape header, then the
//! f32 values, both on the same tag (messages between two ranks on one tag arrive in order).

use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt};

use crate::{DeepSpeedError, Result};

/// The most elements a received tensor may claim (16 GiB of f32): a header beyond it, or one
/// whose element count overflows, is refused before anything is allocated.
pub(crate) const MAX_WIRE_ELEMS: usize = 1 << 32;

/// Tag of activations (forward direction).
pub(crate) const TAG_ACTIVATION: u16 = 1;
/// Tag of gradients (backward direction).
pub(crate) const TAG_GRADIENT: u16 = 2;

/// Sends `t`'s shape and values to `dst`.
pub(crate) fn send(comm: &dyn Communicator, t: &Tensor<3>, dst: usize, tag: u16) -> Result<()> {
    let header: Vec<u8> = t
        .dims()
        .iter()
        .flat_map(|&d| (d as u64).to_le_bytes())
        .collect();
    comm.send(&header, dst, tag)?;
    let values = t
        .clone()
        .into_data_as::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 data converts to a Vec<f32>");
    comm.send(&values, dst, tag)?;
    Ok(())
}

/// Receives a tensor sent by [`send`] from `src`, on `device`.
pub(crate) fn recv(
    comm: &dyn Communicator,
    src: usize,
    tag: u16,
    device: &Device,
) -> Result<Tensor<3>> {
    let mut header = [0u8; 24];
    comm.recv(&mut header, src, tag)?;
    let dims: [usize; 3] = std::array::from_fn(|i| {
        u64::from_le_bytes(header[i * 8..i * 8 + 8].try_into().expect("8 bytes")) as usize
    });
    let n = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= MAX_WIRE_ELEMS)
        .ok_or_else(|| {
            DeepSpeedError::Data(format!(
                "rank {src} announced a tensor of shape {dims:?} on tag {tag}: more than \
                 {MAX_WIRE_ELEMS} elements (a corrupt header or a peer out of step)"
            ))
        })?;
    let mut values = vec![0.0f32; n];
    comm.recv(&mut values, src, tag)?;
    Ok(Tensor::from_data(TensorData::new(values, dims), device))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_deepspeed_strategies::comm::{ThreadWorld, ThreadWorldOptions};

    #[test]
    fn a_header_claiming_too_much_is_refused_before_allocating() {
        for dims in [
            [u64::MAX, 2, 1],
            [1 << 20, 1 << 20, 1 << 20],
            [1 << 33, 1, 1],
        ] {
            let out = ThreadWorld::run(2, ThreadWorldOptions::default(), |c| {
                if c.rank() == 0 {
                    let header: Vec<u8> = dims.iter().flat_map(|d| d.to_le_bytes()).collect();
                    c.send(&header, 1, TAG_ACTIVATION).map(|()| String::new())
                } else {
                    recv(&c, 0, TAG_ACTIVATION, &Device::default())
                        .map(|_| String::new())
                        .or_else(|e| Ok(e.to_string()))
                }
            });
            let err = out[1]
                .as_ref()
                .expect("no panic")
                .as_ref()
                .expect("no comm error");
            assert!(err.contains("announced a tensor"), "{dims:?}: {err}");
        }
    }
}
