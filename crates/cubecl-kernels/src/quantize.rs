//! Group-wise int8 and int4 quantization on the CPU, symmetric and asymmetric, in parallel
//! groups (rayon).
//!
//! The formulas are those of DeepSpeed's inference and ZeRO++ quantization kernels
//! (`quantization_utils.h`), with round-half-to-even as `__float2int_rn` does. Per group of
//! `group` consecutive values, with `b` bits:
//!
//! ```text
//! symmetric : scale = 2^b / (2·max|x|)                 q = clamp(rn(x·scale), −2^(b−1), 2^(b−1)−1)
//! asymmetric: scale = 2^b / (max − min), o = (max + min)/2   q = clamp(rn((x − o)·scale), same range)
//! dequantize: x ≈ q / scale (+ o)
//! ```
//!
//! Codes are signed. Each group stores `1/scale` (the step) and, when asymmetric, its offset.
//! A group with nothing to scale (all zeros, or a zero range when asymmetric) stores step 0
//! and dequantizes exactly.
//! int8 codes are bytes (two's complement); int4 codes are packed two per byte, the first
//! value in the high nibble (DeepSpeed's packing), so an int4 group must have an even size.

use rayon::prelude::*;

use crate::KernelError;

/// Code width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    /// 8-bit codes, one per byte.
    Int8,
    /// 4-bit codes, two per byte.
    Int4,
}

impl Bits {
    fn count(self) -> u32 {
        match self {
            Bits::Int8 => 8,
            Bits::Int4 => 4,
        }
    }

    /// Bytes that hold `n` codes.
    pub fn bytes_for(self, n: usize) -> usize {
        match self {
            Bits::Int8 => n,
            Bits::Int4 => n.div_ceil(2),
        }
    }

    /// 32-bit words that hold `n` codes (the kernels' storage; see [`crate::words`]).
    pub fn words_for(self, n: usize) -> usize {
        self.bytes_for(n).div_ceil(4)
    }
}

/// Where the codes are centred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Around zero: one scale per group.
    Symmetric,
    /// Around the group's mid-range: a scale and an offset per group.
    Asymmetric,
}

/// A group-wise quantizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantizer {
    bits: Bits,
    scheme: Scheme,
    group: usize,
}

/// Quantized values: the codes and each group's step (and offset).
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// The quantizer that produced them.
    pub quantizer: Quantizer,
    /// Number of values.
    pub len: usize,
    /// Codes: one byte each (int8) or two per byte, high nibble first (int4).
    pub codes: Vec<u8>,
    /// Per group, `1 / scale`: the value of one code step (0 for a constant group).
    pub steps: Vec<f32>,
    /// Per group, the offset (asymmetric only; empty when symmetric).
    pub offsets: Vec<f32>,
}

impl Quantizer {
    /// A quantizer to `bits` over groups of `group` values.
    ///
    /// # Errors
    /// When `group` is 0, or odd with 4-bit codes (a byte would straddle two groups).
    pub fn new(bits: Bits, scheme: Scheme, group: usize) -> Result<Self, KernelError> {
        if group == 0 || (bits == Bits::Int4 && group % 2 == 1) {
            return Err(KernelError::GroupSize {
                group,
                bits: bits.count(),
            });
        }
        Ok(Self {
            bits,
            scheme,
            group,
        })
    }

    /// The code width.
    pub fn bits(&self) -> Bits {
        self.bits
    }

    /// The scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Values per group.
    pub fn group(&self) -> usize {
        self.group
    }

    fn range(&self) -> (f32, f32) {
        let half = (1u32 << (self.bits.count() - 1)) as f32;
        (-half, half - 1.0)
    }

    /// The step and offset of one group.
    fn fit(&self, x: &[f32]) -> (f32, f32) {
        let levels = (1u32 << self.bits.count()) as f32;
        match self.scheme {
            Scheme::Symmetric => {
                let absmax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                (2.0 * absmax / levels, 0.0)
            }
            Scheme::Asymmetric => {
                let (lo, hi) = x
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                        (lo.min(v), hi.max(v))
                    });
                ((hi - lo) / levels, (hi + lo) / 2.0)
            }
        }
    }

    /// One value's code, from the group's scale (`1/step`, 0 when the group has no range)
    /// and offset.
    #[inline]
    fn code(&self, v: f32, scale: f32, offset: f32) -> i8 {
        let (lo, hi) = self.range();
        rne(((v - offset) * scale).clamp(lo, hi)) as i8
    }

    /// Quantizes `x`.
    pub fn quantize(&self, x: &[f32]) -> Quantized {
        let groups = x.len().div_ceil(self.group);
        let mut codes = vec![0u8; self.bits.bytes_for(x.len())];
        let mut steps = vec![0.0f32; groups];
        let mut offsets = vec![0.0f32; groups];
        let group_bytes = self.bits.bytes_for(self.group);
        x.par_chunks(self.group)
            .zip(codes.par_chunks_mut(group_bytes))
            .zip(steps.par_iter_mut().zip(offsets.par_iter_mut()))
            .for_each(|((x, codes), (step, offset))| {
                let (s, o) = self.fit(x);
                let scale = if s > 0.0 && s.is_finite() {
                    1.0 / s
                } else {
                    0.0
                };
                *step = s;
                *offset = o;
                match self.bits {
                    Bits::Int8 => {
                        for (c, &v) in codes.iter_mut().zip(x) {
                            *c = self.code(v, scale, o) as u8;
                        }
                    }
                    Bits::Int4 => {
                        for (c, pair) in codes.iter_mut().zip(x.chunks(2)) {
                            let high = self.code(pair[0], scale, o) as u8 & 0x0f;
                            let low = pair
                                .get(1)
                                .map_or(0, |&v| self.code(v, scale, o) as u8 & 0x0f);
                            *c = (high << 4) | low;
                        }
                    }
                }
            });
        if self.scheme == Scheme::Symmetric {
            offsets.clear();
        }
        Quantized {
            quantizer: *self,
            len: x.len(),
            codes,
            steps,
            offsets,
        }
    }
}

/// Round half to even of a value within ±2^22, without a library call: adding and taking away
/// 1.5·2^23 leaves the integer the default rounding mode chose. A clamp to integer bounds
/// before it commutes with the rounding.
#[inline]
fn rne(t: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (t + MAGIC) - MAGIC
}

/// Int4 codes from `codes` into `out` (one group's step and offset), starting at the low
/// nibble of the first byte when `odd`: whole pairs without a branch (the high nibble by an
/// arithmetic shift of the byte, the low one shifted up first), then an odd last value.
#[inline(always)]
fn int4_into(codes: &[u8], odd: bool, step: f32, o: f32, out: &mut [f32]) {
    let (codes, out) = match (odd, out.split_first_mut()) {
        (true, Some((y, rest))) => {
            *y = (((codes[0] << 4) as i8) >> 4) as f32 * step + o;
            (&codes[1..], rest)
        }
        _ => (codes, out),
    };
    // Eight bytes at a time: their high and low nibbles as two vectors, then interleaved
    // (a form the compiler vectorizes), the rest pair by pair.
    let whole = (out.len() / 16).min(codes.len() / 8);
    let (head, tail) = out.split_at_mut(whole * 16);
    for (out, c) in head.chunks_exact_mut(16).zip(codes.chunks_exact(8)) {
        let hi: [f32; 8] = std::array::from_fn(|i| ((c[i] as i8) >> 4) as f32 * step + o);
        let lo: [f32; 8] = std::array::from_fn(|i| (((c[i] << 4) as i8) >> 4) as f32 * step + o);
        for i in 0..8 {
            out[2 * i] = hi[i];
            out[2 * i + 1] = lo[i];
        }
    }
    let codes = &codes[whole * 8..];
    let last = tail.len() / 2;
    let mut pairs = tail.chunks_exact_mut(2);
    for (pair, &c) in (&mut pairs).zip(codes) {
        pair[0] = ((c as i8) >> 4) as f32 * step + o;
        pair[1] = (((c << 4) as i8) >> 4) as f32 * step + o;
    }
    if let [y] = pairs.into_remainder() {
        *y = ((codes[last] as i8) >> 4) as f32 * step + o;
    }
}

/// The signed value of a 4-bit two's complement nibble.
fn nibble(n: u8) -> f32 {
    (((n << 4) as i8) >> 4) as f32
}

impl Quantized {
    /// The code of value `i`, as a signed integer.
    pub fn code(&self, i: usize) -> i8 {
        match self.quantizer.bits {
            Bits::Int8 => self.codes[i] as i8,
            Bits::Int4 => {
                let byte = self.codes[i / 2];
                nibble(if i.is_multiple_of(2) {
                    byte >> 4
                } else {
                    byte & 0x0f
                }) as i8
            }
        }
    }

    /// Writes the dequantized values into `out`.
    ///
    /// # Panics
    /// When `out.len()` is not the number of quantized values.
    pub fn dequantize_into(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.len, "dequantize: output length");
        let q = self.quantizer;
        let group_bytes = q.bits.bytes_for(q.group);
        let offset = |g: usize| self.offsets.get(g).copied().unwrap_or(0.0);
        out.par_chunks_mut(q.group)
            .zip(self.codes.par_chunks(group_bytes))
            .enumerate()
            .for_each(|(g, (out, codes))| {
                let (step, o) = (self.steps[g], offset(g));
                match q.bits {
                    Bits::Int8 => {
                        for (y, &c) in out.iter_mut().zip(codes) {
                            *y = (c as i8) as f32 * step + o;
                        }
                    }
                    Bits::Int4 => {
                        for (pair, &c) in out.chunks_mut(2).zip(codes) {
                            pair[0] = nibble(c >> 4) * step + o;
                            if let Some(y) = pair.get_mut(1) {
                                *y = nibble(c & 0x0f) * step + o;
                            }
                        }
                    }
                }
            });
    }

    /// Writes the dequantized values `start..start + out.len()` into `out` (from anywhere:
    /// the range may start inside a group and span several).
    ///
    /// # Panics
    /// When the range passes the end.
    #[inline(always)]
    pub fn dequantize_range_into(&self, start: usize, out: &mut [f32]) {
        let q = self.quantizer;
        assert!(
            start + out.len() <= self.len,
            "dequantize_range_into: {start}..{} of {}",
            start + out.len(),
            self.len
        );
        let group_bytes = q.bits.bytes_for(q.group);
        let offset = |g: usize| self.offsets.get(g).copied().unwrap_or(0.0);
        let (mut pos, mut out) = (start, out);
        while !out.is_empty() {
            let (g, within) = (pos / q.group, pos % q.group);
            let take = (q.group - within).min(out.len());
            let (piece, rest) = out.split_at_mut(take);
            let (step, o) = (self.steps[g], offset(g));
            match q.bits {
                Bits::Int8 => {
                    let codes = &self.codes[g * q.group + within..];
                    for (y, &c) in piece.iter_mut().zip(codes) {
                        *y = (c as i8) as f32 * step + o;
                    }
                }
                Bits::Int4 => {
                    let codes = &self.codes[g * group_bytes + within / 2..];
                    int4_into(codes, within % 2 == 1, step, o, piece);
                }
            }
            pos += take;
            out = rest;
        }
    }

    /// The wire form a collective sends: the codes, then each group's step, then each
    /// group's offset (asymmetric only), the floats little-endian. [`bytes`](Self::bytes)
    /// long.
    pub fn to_bytes(&self) -> Vec<u8> {
        let floats = self.steps.iter().chain(&self.offsets);
        let mut out = Vec::with_capacity(self.bytes());
        out.extend_from_slice(&self.codes);
        out.extend(floats.flat_map(|f| f.to_le_bytes()));
        out
    }

    /// Reads [`to_bytes`](Self::to_bytes) back: `len` values quantized by `quantizer`.
    ///
    /// # Errors
    /// When `bytes` is not the length that wire form has.
    pub fn from_bytes(quantizer: Quantizer, len: usize, bytes: &[u8]) -> Result<Self, KernelError> {
        let groups = len.div_ceil(quantizer.group);
        let codes = quantizer.bits.bytes_for(len);
        let per_group = match quantizer.scheme {
            Scheme::Symmetric => 1,
            Scheme::Asymmetric => 2,
        };
        let want = codes + 4 * per_group * groups;
        if bytes.len() != want {
            return Err(KernelError::Arguments {
                op: "Quantized::from_bytes",
                detail: format!("{} bytes where {len} values need {want}", bytes.len()),
            });
        }
        let (code_bytes, floats) = bytes.split_at(codes);
        let mut floats = floats
            .chunks_exact(4)
            .map(|f| f32::from_le_bytes([f[0], f[1], f[2], f[3]]));
        let steps = floats.by_ref().take(groups).collect();
        Ok(Self {
            quantizer,
            len,
            codes: code_bytes.to_vec(),
            steps,
            offsets: floats.collect(),
        })
    }

    /// Bytes of the codes, steps and offsets.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * (self.steps.len() + self.offsets.len())
    }

    /// The dequantized values.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        self.dequantize_into(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adam::tests::values;

    /// DeepSpeed's group-wise quantization in f64: codes, steps and offsets.
    fn reference(q: &Quantizer, x: &[f32]) -> (Vec<i64>, Vec<f64>, Vec<f64>, Vec<bool>) {
        let levels = (1u64 << q.bits.count()) as f64;
        let (lo, hi) = (-levels / 2.0, levels / 2.0 - 1.0);
        let (mut codes, mut steps, mut offsets, mut tie) = (vec![], vec![], vec![], vec![]);
        for g in x.chunks(q.group) {
            let g: Vec<f64> = g.iter().map(|&v| v as f64).collect();
            let (step, offset) = match q.scheme {
                Scheme::Symmetric => (
                    2.0 * g.iter().fold(0.0f64, |a, v| a.max(v.abs())) / levels,
                    0.0,
                ),
                Scheme::Asymmetric => {
                    let mn = g.iter().cloned().fold(f64::INFINITY, f64::min);
                    let mx = g.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    ((mx - mn) / levels, (mx + mn) / 2.0)
                }
            };
            steps.push(step);
            offsets.push(offset);
            for v in g {
                let t = if step > 0.0 { (v - offset) / step } else { 0.0 };
                // Within f32 rounding of a .5 tie, f32 arithmetic may round the other way.
                tie.push(((t - t.floor()) - 0.5).abs() < 1e-4);
                codes.push(t.round_ties_even().clamp(lo, hi) as i64);
            }
        }
        (codes, steps, offsets, tie)
    }

    #[test]
    fn every_quantizer_matches_the_f64_reference() {
        for n in [1usize, 7, 22, 64, 1000, 65537] {
            for bits in [Bits::Int8, Bits::Int4] {
                for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
                    for group in [2usize, 64, 1000] {
                        let q = Quantizer::new(bits, scheme, group).expect("valid");
                        // Values with a shifted mean, so that the asymmetric offset matters.
                        let x: Vec<f32> =
                            values(n, n as u64).iter().map(|v| v * 3.0 + 0.5).collect();
                        let out = q.quantize(&x);
                        let (codes, steps, offsets, tie) = reference(&q, &x);
                        let ctx = format!("n {n} {bits:?} {scheme:?} group {group}");
                        assert_eq!(out.steps.len(), n.div_ceil(group), "{ctx}");
                        for (g, (&s, &r)) in out.steps.iter().zip(&steps).enumerate() {
                            assert!(
                                (s as f64 - r).abs() <= 1e-6 * r.abs(),
                                "{ctx} group {g}: step {s} vs {r}"
                            );
                            if scheme == Scheme::Asymmetric {
                                let o = out.offsets[g] as f64;
                                assert!(
                                    (o - offsets[g]).abs() <= 1e-6 * offsets[g].abs().max(1.0),
                                    "{ctx}"
                                );
                            }
                        }
                        for i in 0..n {
                            let c = out.code(i) as i64;
                            let ok = c == codes[i] || (tie[i] && (c - codes[i]).abs() == 1);
                            assert!(ok, "{ctx} value {i}: code {c} vs {}", codes[i]);
                        }
                        // Dequantized within half a step of the input (the clamped top code:
                        // within one step).
                        let y = out.dequantize();
                        for (i, (&a, &b)) in y.iter().zip(&x).enumerate() {
                            let step = steps[i / group];
                            let err = (a as f64 - b as f64).abs();
                            assert!(
                                err <= step * 1.0001 + 1e-6,
                                "{ctx} value {i}: {a} vs {b}, step {step}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn int4_packs_two_codes_per_byte_high_nibble_first() {
        let q = Quantizer::new(Bits::Int4, Scheme::Symmetric, 4).expect("valid");
        // absmax 8: scale 2^4 / 16 = 1, so codes are the values, clamped to [-8, 7].
        let out = q.quantize(&[1.0, -2.0, 8.0, -8.0, 3.0]);
        assert_eq!(out.codes, vec![0x1e, 0x78, 0x70]);
        assert_eq!(
            (0..5).map(|i| out.code(i)).collect::<Vec<_>>(),
            vec![1, -2, 7, -8, 7]
        );
        assert_eq!(out.steps, vec![1.0, 0.375]);
        assert_eq!(out.dequantize(), vec![1.0, -2.0, 7.0, -8.0, 2.625]);
    }

    #[test]
    fn constant_groups_dequantize_exactly() {
        for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
            let q = Quantizer::new(Bits::Int8, scheme, 3).expect("valid");
            let x = [0.0, 0.0, 0.0, 2.5, 2.5, 2.5];
            let y = q.quantize(&x).dequantize();
            // All zeros: exact in both schemes. A constant 2.5: exact when asymmetric (a zero
            // range); symmetric clamps the top code, within one step (5/256).
            assert_eq!(&y[..3], &[0.0; 3], "{scheme:?}");
            for &v in &y[3..] {
                let tolerance = if scheme == Scheme::Asymmetric {
                    0.0
                } else {
                    5.0 / 256.0
                };
                assert!((v - 2.5).abs() <= tolerance, "{scheme:?}: {y:?}");
            }
        }
    }

    /// Any range, starting inside a group (at an odd int4 position too) and spanning
    /// several, dequantizes to the whole dequantization's values.
    #[test]
    fn ranges_from_anywhere_match_the_whole() {
        let x = values(100, 3);
        for bits in [Bits::Int8, Bits::Int4] {
            let q = Quantizer::new(bits, Scheme::Asymmetric, 10)
                .expect("valid")
                .quantize(&x);
            let whole = q.dequantize();
            for (start, len) in [
                (0, 100),
                (3, 1),
                (7, 9),
                (9, 22),
                (10, 10),
                (41, 59),
                (99, 1),
            ] {
                let mut out = vec![f32::NAN; len];
                q.dequantize_range_into(start, &mut out);
                assert_eq!(out, whole[start..start + len], "{bits:?} {start}+{len}");
            }
        }
    }

    #[test]
    fn the_wire_form_reads_back_and_checks_its_length() {
        let x: Vec<f32> = (0..101).map(|i| (i as f32 * 0.37).sin()).collect();
        for bits in [Bits::Int8, Bits::Int4] {
            for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
                let q = Quantizer::new(bits, scheme, 10)
                    .expect("group")
                    .quantize(&x);
                let bytes = q.to_bytes();
                assert_eq!(bytes.len(), q.bytes());
                let back = Quantized::from_bytes(q.quantizer, x.len(), &bytes).expect("reads");
                assert_eq!(back, q);
                let short = Quantized::from_bytes(q.quantizer, x.len(), &bytes[1..]);
                assert!(short.is_err(), "{bits:?} {scheme:?}");
            }
        }
    }

    #[test]
    fn bad_group_sizes_are_refused() {
        assert!(Quantizer::new(Bits::Int8, Scheme::Symmetric, 0).is_err());
        let e = Quantizer::new(Bits::Int4, Scheme::Asymmetric, 3).expect_err("odd int4 group");
        assert!(e.to_string().contains("group of 3"), "{e}");
        assert!(Quantizer::new(Bits::Int8, Scheme::Symmetric, 3).is_ok());
    }
}
