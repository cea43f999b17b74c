//! 1-bit sign packing: eight signs per byte, least significant bit first; sign(0) = +1
//! (as in DeepSpeed's compressed all-reduce, 1-bit Adam arXiv 2102.02888).

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
    for (i, o) in out.iter_mut().enumerate() {
        let bit = (packed[i / 8] >> (i % 8)) & 1;
        *o = if bit == 1 { scale } else { -scale };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_matches_the_reference_signs() {
        for n in [1, 7, 8, 9, 22, 64, 1000] {
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
    fn zero_is_positive_and_bits_are_lsb_first() {
        let mut packed = [0u8; 1];
        pack_signs(&[0.0, -1.0, 1.0, -0.5], &mut packed);
        assert_eq!(packed[0], 0b0101);
    }
}
