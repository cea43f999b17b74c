//! Activations and gradients between neighbouring stages: a 24-byte shape header, then the
//! f32 values, both on the same tag (messages between two ranks on one tag arrive in order).

use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt};

use crate::Result;

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
    let mut values = vec![0.0f32; dims.iter().product()];
    comm.recv(&mut values, src, tag)?;
    Ok(Tensor::from_data(TensorData::new(values, dims), device))
}
