//! Deterministic inputs for the kernels' tests and benchmarks.

/// `n` pseudo-random values in [−1, 1) from `seed` (xorshift64): the same on every machine.
pub fn uniform(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_in_range_and_repeat_with_the_seed() {
        let a = uniform(1000, 7);
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
        assert_eq!(a, uniform(1000, 7));
        assert_ne!(a, uniform(1000, 8));
    }
}
