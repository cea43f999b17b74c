//! Activations and gradients between neighbouring stages: a 24-byte shape header, then the
//! values in the run's working dtype (f32, or f16/bf16 under mixed precision: half the
//! bytes), both on the same tag (messages between two ranks on one tag arrive in order).

use burn::tensor::{Device, FloatDType, Tensor, TensorData, bf16, f16};
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt};

use crate::{DeepSpeedError, Result};

/// The most elements a received tensor may claim (16 GiB of f32): a header beyond it, or one
/// whose element count overflows, is refused before anything is allocated.
pub(crate) const MAX_WIRE_ELEMS: usize = 1 << 32;

/// Tag of activations (forward direction).
pub(crate) const TAG_ACTIVATION: u16 = 1;
/// Tag of gradients (backward direction).
pub(crate) const TAG_GRADIENT: u16 = 2;

/// Sends `t`'s shape and values, as `dtype`, to `dst`.
pub(crate) fn send(
    comm: &dyn Communicator,
    t: &Tensor<3>,
    dst: usize,
    tag: u16,
    dtype: FloatDType,
) -> Result<()> {
    let header: Vec<u8> = t
        .dims()
        .iter()
        .flat_map(|&d| (d as u64).to_le_bytes())
        .collect();
    comm.send(&header, dst, tag)?;
    let data = crate::transfer::staging(|| crate::transfer::read(t.clone().cast(dtype)));
    let converted = "a tensor cast to the wire's dtype reads as that dtype";
    match dtype {
        FloatDType::F16 => comm.send(&data.try_into_vec::<f16>().expect(converted), dst, tag)?,
        FloatDType::BF16 => comm.send(&data.try_into_vec::<bf16>().expect(converted), dst, tag)?,
        _ => comm.send(
            &data
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect(converted),
            dst,
            tag,
        )?,
    }
    Ok(())
}

/// Receives a tensor sent by [`send`] as `dtype` from `src`, on `device`, in `dtype`.
pub(crate) fn recv(
    comm: &dyn Communicator,
    src: usize,
    tag: u16,
    device: &Device,
    dtype: FloatDType,
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
    let data = match dtype {
        FloatDType::F16 => {
            let mut values = vec![f16::ZERO; n];
            comm.recv(&mut values, src, tag)?;
            TensorData::new(values, dims)
        }
        FloatDType::BF16 => {
            let mut values = vec![bf16::ZERO; n];
            comm.recv(&mut values, src, tag)?;
            TensorData::new(values, dims)
        }
        _ => {
            let mut values = vec![0.0f32; n];
            comm.recv(&mut values, src, tag)?;
            TensorData::new(values, dims)
        }
    };
    Ok(crate::transfer::staging(|| {
        crate::transfer::write(data, device, dtype.into())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_deepspeed_strategies::comm::{ThreadWorld, ThreadWorldOptions};

    #[test]
    fn tensors_cross_in_the_working_dtype_at_its_width() {
        let device = Device::flex();
        let t = Tensor::<3>::from_data(
            TensorData::new(
                (0..24).map(|i| i as f32 / 7.0).collect::<Vec<_>>(),
                [2, 3, 4],
            ),
            &device,
        );
        for (dtype, width) in [
            (FloatDType::F32, 4),
            (FloatDType::F16, 2),
            (FloatDType::BF16, 2),
        ] {
            let t = t.clone();
            let out = ThreadWorld::run(2, ThreadWorldOptions::default(), move |c| -> Result<_> {
                if c.rank() == 0 {
                    send(&c, &t, 1, TAG_ACTIVATION, dtype)?;
                    Ok((c.stats().total_sent(), None))
                } else {
                    let r = recv(&c, 0, TAG_ACTIVATION, &Device::flex(), dtype)?;
                    Ok((
                        0,
                        Some((r.dtype(), r.into_data(), t.clone().cast(dtype).into_data())),
                    ))
                }
            });
            let sent = out[0].as_ref().expect("no panic").as_ref().expect("sent").0;
            assert_eq!(sent, 24 + 24 * width, "{dtype:?}: header and values");
            let (got, data, want) = out[1]
                .as_ref()
                .expect("no panic")
                .as_ref()
                .expect("received")
                .1
                .clone()
                .expect("a tensor");
            assert_eq!(got, dtype.into(), "{dtype:?}");
            assert_eq!(data, want, "{dtype:?}: the sent values, in the dtype");
        }
    }

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
                    recv(&c, 0, TAG_ACTIVATION, &Device::flex(), FloatDType::F32)
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
