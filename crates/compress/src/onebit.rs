//! Error-feedback 1-bit compression (1-bit Adam, arXiv 2102.02888).
//!
//! `c = x + error`; the compressed form is the signs of `c` (packed, sign(0) = +1) and one
//! scale `‖c‖₂ / √n`; the new error is `c − scale · sign(c)`, fed back into the next call so
//! that nothing is lost over time.

use burn_deepspeed_cubecl_kernels::sign::{onebit_compress, packed_len, unpack_signs};

/// A compressed vector: packed signs and one scale.
#[derive(Debug, Clone, PartialEq)]
pub struct OneBit {
    /// Signs, eight per byte, least significant bit first.
    pub signs: Vec<u8>,
    /// `‖x + error‖₂ / √n`.
    pub scale: f32,
    /// Number of elements.
    pub len: usize,
}

impl OneBit {
    /// The decompressed values `scale · sign`.
    pub fn decompress(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        unpack_signs(&self.signs, self.scale, &mut out);
        out
    }
}

/// Compresses `x` with error feedback, updating `error` in place.
///
/// # Panics
/// When `x` and `error` differ in length.
pub fn compress(x: &[f32], error: &mut [f32]) -> OneBit {
    assert_eq!(x.len(), error.len(), "input and error lengths");
    let mut signs = vec![0u8; packed_len(x.len())];
    let scale = onebit_compress(x, error, &mut signs);
    OneBit {
        signs,
        scale,
        len: x.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_deepspeeds_worked_example() {
        // x = [1, -2, 3, -4]: scale = √30 / 2, error = x − scale·sign(x).
        let mut error = vec![0.0; 4];
        let c = compress(&[1.0, -2.0, 3.0, -4.0], &mut error);
        assert!((c.scale - 30f32.sqrt() / 2.0).abs() < 1e-6);
        for (e, want) in error.iter().zip([-1.7386, 0.7386, 0.2614, -1.2614]) {
            assert!((e - want).abs() < 1e-4, "{error:?}");
        }
        assert_eq!(c.decompress(), vec![c.scale, -c.scale, c.scale, -c.scale]);
    }

    #[test]
    fn error_feedback_loses_nothing_over_time() {
        // The sum of decompressed outputs plus the final error equals the sum of inputs.
        let inputs: Vec<Vec<f32>> = (0..5)
            .map(|k| {
                (0..22)
                    .map(|i| ((i * 7 + k * 3) % 13) as f32 - 6.0)
                    .collect()
            })
            .collect();
        let mut error = vec![0.0; 22];
        let mut sent = [0.0f64; 22];
        for x in &inputs {
            for (s, v) in sent.iter_mut().zip(compress(x, &mut error).decompress()) {
                *s += v as f64;
            }
        }
        for i in 0..22 {
            let total: f64 = inputs.iter().map(|x| x[i] as f64).sum();
            assert!((sent[i] + error[i] as f64 - total).abs() < 1e-4);
        }
    }
}
