//! 1-bit sign packing: eight signs per byte, least significant bit first; sign(0) = +1
//! (as in DeepSpeed's compressed all-reduce, 1-bit Adam arXiv 2102.02888), and the fused
//! error-feedback compression built on it ([`onebit_compress`]). Parallel chunks (rayon) of
//! [`crate::adam::CHUNK`] values, a multiple of 8, so that every byte has one owner.

use rayon::prelude::*;

use crate::adam::CHUNK;

/// Bytes needed to pack `n` signs.
pub fn packed_len(n: usize) -> usize {
    n.div_ceil(8)
}

/// Packs the signs of `x` into `out` (`packed_len(x.len())` bytes): bit set = non-negative.
///
/// # Panics
/// When `out` has the wrong length.
pub fn pack_signs(x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), packed_len(x.len()), "packed buffer length");
    x.par_chunks(CHUNK)
        .zip(out.par_chunks_mut(CHUNK / 8))
        .for_each(|(x, out)| pack_chunk(x, out));
}

fn pack_chunk(x: &[f32], out: &mut [u8]) {
    for (byte, chunk) in out.iter_mut().zip(x.chunks(8)) {
        *byte = chunk.iter().enumerate().fold(0u8, |b, (i, &v)| {
            b | (u8::from(v >= 0.0 || v.is_nan()) << i)
        });
    }
}

/// Unpacks `n = out.len()` signs from `packed`, writing `scale` or `-scale` for each.
///
/// # Panics
/// When `packed` has the wrong length.
pub fn unpack_signs(packed: &[u8], scale: f32, out: &mut [f32]) {
    assert_eq!(packed.len(), packed_len(out.len()), "packed buffer length");
    out.par_chunks_mut(CHUNK)
        .zip(packed.par_chunks(CHUNK / 8))
        .for_each(|(out, packed)| {
            for (i, o) in out.iter_mut().enumerate() {
                let bit = (packed[i / 8] >> (i % 8)) & 1;
                *o = if bit == 1 { scale } else { -scale };
            }
        });
}

/// Error-feedback 1-bit compression in two parallel passes: `c = x + error`, the signs of
/// `c` packed into `packed` (`packed_len(x.len())` bytes), and the returned scale
/// `‖c‖₂ / √n` (summed in f64); then `error ← c − scale·sign(c)`. `error` holds `c`
/// between the passes, so nothing else is allocated.
///
/// # Panics
/// When the lengths disagree.
pub fn onebit_compress(x: &[f32], error: &mut [f32], packed: &mut [u8]) -> f32 {
    let n = x.len();
    assert_eq!(error.len(), n, "input and error lengths");
    assert_eq!(packed.len(), packed_len(n), "packed buffer length");
    if n == 0 {
        return 0.0;
    }
    let squares: f64 = x
        .par_chunks(CHUNK)
        .zip(error.par_chunks_mut(CHUNK))
        .zip(packed.par_chunks_mut(CHUNK / 8))
        .map(|((x, e), packed)| {
            let mut sum = 0.0f64;
            for (e, &x) in e.iter_mut().zip(x) {
                *e += x;
                sum += (*e as f64) * (*e as f64);
            }
            pack_chunk(e, packed);
            sum
        })
        .sum();
    let scale = (squares.sqrt() / (n as f64).sqrt()) as f32;
    error.par_chunks_mut(CHUNK).for_each(|e| {
        for e in e.iter_mut() {
            *e -= if *e >= 0.0 || e.is_nan() {
                scale
            } else {
                -scale
            };
        }
    });
    scale
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adam::tests::values;

    #[test]
    fn round_trip_matches_the_reference_signs() {
        for n in [1, 7, 8, 9, 22, 64, 1000, 65537] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
            let mut packed = vec![0u8; packed_len(n)];
            pack_signs(&x, &mut packed);
            let mut y = vec![0.0; n];
            unpack_signs(&packed, 2.0, &mut y);
            for (a, b) in x.iter().zip(&y) {
                let reference = if *a >= 0.0 { 2.0 } else { -2.0 };
                assert_eq!(*b, reference, "n = {n}");
            }
        }
    }

    #[test]
    fn fused_compression_matches_the_f64_reference() {
        for n in [1usize, 7, 22, 64, 1000, 65537, 3 * CHUNK + 5] {
            let x = values(n, 3);
            let mut error: Vec<f32> = values(n, 4).iter().map(|e| e * 0.1).collect();
            let mut packed = vec![0u8; packed_len(n)];
            // Two rounds, so that the error fed back is the kernel's own.
            for round in 0..2 {
                let c: Vec<f64> = x
                    .iter()
                    .zip(&error)
                    .map(|(&a, &e)| a as f64 + e as f64)
                    .collect();
                let norm = c.iter().map(|v| v * v).sum::<f64>().sqrt();
                let scale_ref = norm / (n as f64).sqrt();
                let scale = onebit_compress(&x, &mut error, &mut packed);
                let ctx = format!("n {n} round {round}");
                assert!(
                    (scale as f64 - scale_ref).abs() <= 1e-6 * scale_ref,
                    "{ctx}: {scale} vs {scale_ref}"
                );
                let mut signs = vec![0.0; n];
                unpack_signs(&packed, 1.0, &mut signs);
                for i in 0..n {
                    let s: f64 = if c[i] >= 0.0 { 1.0 } else { -1.0 };
                    assert_eq!(signs[i] as f64, s, "{ctx} value {i}");
                    let e_ref = c[i] - s * scale_ref;
                    assert!(
                        (error[i] as f64 - e_ref).abs() <= 1e-6 * (1.0 + e_ref.abs()),
                        "{ctx} value {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn zero_is_positive_and_bits_are_lsb_first() {
        let mut packed = [0u8; 1];
        pack_signs(&[0.0, -1.0, 1.0, -0.5], &mut packed);
        assert_eq!(packed[0], 0b0101);
    }
}
