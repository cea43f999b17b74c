//! The byte layout of packed codes and signs carried in 32-bit words: the kernels store
//! words (WGSL has no byte buffers), and a word's little-endian bytes are the CPU path's
//! bytes in order.

/// Little-endian 32-bit words of `bytes`, the last one zero-padded.
pub fn to_words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

/// The first `len` bytes of `words`, little-endian.
pub fn to_bytes(words: &[u32], len: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes.truncate(len);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_through_little_endian_words() {
        let bytes: Vec<u8> = (1..=7).collect();
        let words = to_words(&bytes);
        assert_eq!(words, vec![0x0403_0201, 0x0007_0605]);
        assert_eq!(to_bytes(&words, 7), bytes);
    }
}
