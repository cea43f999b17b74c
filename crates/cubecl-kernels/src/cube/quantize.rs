//! Group-wise int8 / int4 quantization as CubeCL kernels, with [`crate::quantize`]'s
//! formulas (DeepSpeed's inference and ZeRO++ quantizers) and byte layout: the codes live in
//! 32-bit words (WGSL has no byte buffers) whose little-endian bytes are exactly the CPU
//! path's bytes: four int8 codes per word, or eight int4 codes with the first of each pair
//! in the high nibble.
//!
//! One cube per group finds the group's range in shared memory; then one unit per word
//! writes codes, and one unit per value dequantizes.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::grid::{UNITS, arg, cover, download, holds, reduce_units};
use super::reduce::cube_max;
use crate::KernelError;
use crate::quantize::{Bits, Quantized, Quantizer, Scheme};
use crate::words::to_bytes;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn group_range_kernel(
    x: &[f32],
    steps: &mut [f32],
    offsets: &mut [f32],
    group: usize,
    groups: usize,
    levels: f32,
    #[comptime] asymmetric: bool,
    #[comptime] units: usize,
) {
    let mut shared = Shared::<[f32]>::new_slice(units);
    // A whole cube leaves together, so the syncs below stay uniform.
    if CUBE_POS < groups {
        let start = CUBE_POS * group;
        let end = select(start + group < x.len(), start + group, x.len());
        let mut hi = f32::new(-3.0e38);
        let mut neg_lo = f32::new(-3.0e38);
        let mut j = start + UNIT_POS as usize;
        while j < end {
            let v = x[j];
            if asymmetric {
                hi = select(v > hi, v, hi);
                neg_lo = select(-v > neg_lo, -v, neg_lo);
            } else {
                let a = select(v < 0.0, -v, v);
                hi = select(a > hi, a, hi);
            }
            j += CUBE_DIM as usize;
        }
        let hi = cube_max(&mut shared, hi);
        sync_cube();
        if asymmetric {
            let lo = -cube_max(&mut shared, neg_lo);
            if UNIT_POS == 0 {
                steps[CUBE_POS] = (hi - lo) / levels;
                offsets[CUBE_POS] = (hi + lo) / 2.0;
            }
        } else if UNIT_POS == 0 {
            steps[CUBE_POS] = 2.0 * hi / levels;
            offsets[CUBE_POS] = 0.0;
        }
    }
}

/// Where code `k` of a word sits: int8 in byte `k`; int4 in byte `k/2`, even `k` high.
#[cube]
pub(super) fn code_shift(k: u32, #[comptime] int4: bool) -> u32 {
    if int4 {
        8 * (k / 2) + 4 * (1 - k % 2)
    } else {
        8 * k
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn quantize_kernel(
    x: &[f32],
    steps: &[f32],
    offsets: &[f32],
    codes: &mut [u32],
    group: usize,
    lo: f32,
    hi: f32,
    #[comptime] int4: bool,
) {
    let w = ABSOLUTE_POS;
    if w < codes.len() {
        let per = comptime!(if int4 { 8usize } else { 4usize });
        let mask = comptime!(if int4 { 0xfu32 } else { 0xffu32 });
        let mut word = 0u32;
        #[unroll]
        for k in 0..per {
            let i = w * per + k;
            if i < x.len() {
                let g = i / group;
                let step = steps[g];
                let scale = select(step > 0.0, 1.0 / step, 0.0);
                let t = (x[i] - offsets[g]) * scale;
                let t = select(t < lo, lo, select(t > hi, hi, t));
                let code = u32::cast_from(i32::cast_from(f32::round(t))) & mask;
                word |= code << code_shift(k as u32, int4);
            }
        }
        codes[w] = word;
    }
}

#[cube(launch_unchecked)]
fn dequantize_kernel(
    codes: &[u32],
    steps: &[f32],
    offsets: &[f32],
    out: &mut [f32],
    group: usize,
    #[comptime] int4: bool,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        out[i] = dequantize_one(codes, steps, offsets, i, group, int4);
    }
}

/// Value `i` of the quantized buffers: its code (two's complement of 8 or 4 bits, read from
/// its word) times its group's step, plus the group's offset.
#[cube]
pub(super) fn dequantize_one(
    codes: &[u32],
    steps: &[f32],
    offsets: &[f32],
    i: usize,
    group: usize,
    #[comptime] int4: bool,
) -> f32 {
    let per = comptime!(if int4 { 8usize } else { 4usize });
    let bits = comptime!(if int4 { 4u32 } else { 8u32 });
    let mask = comptime!(if int4 { 0xfu32 } else { 0xffu32 });
    let raw = (codes[i / per] >> code_shift((i % per) as u32, int4)) & mask;
    let half = 1u32 << (bits - 1);
    let code = select(
        raw >= half,
        f32::cast_from(raw) - f32::cast_from(2 * half),
        f32::cast_from(raw),
    );
    let g = i / group;
    code * steps[g] + offsets[g]
}

/// Quantized values on a device: the codes (in 32-bit words) and each group's step and
/// offset (zero offsets when symmetric). Built by [`quantize`], or from parts by
/// [`DeviceQuantized::from_parts`], which checks the buffers' sizes.
#[derive(Debug, Clone)]
pub struct DeviceQuantized {
    quantizer: Quantizer,
    len: usize,
    codes: Handle,
    steps: Handle,
    offsets: Handle,
}

/// Quantizes the `n` f32 values of `x` on the device.
///
/// # Errors
/// [`KernelError::Arguments`] when `x` holds fewer than `n` f32 values.
pub fn quantize(
    client: &Client,
    q: &Quantizer,
    x: &Handle,
    n: usize,
) -> Result<DeviceQuantized, KernelError> {
    holds::<f32>("quantize", "x", x, n)?;
    let groups = n.div_ceil(q.group());
    let int4 = q.bits() == Bits::Int4;
    let asymmetric = q.scheme() == Scheme::Asymmetric;
    let levels = if int4 { 16.0 } else { 256.0 };
    let f32s = |k: usize| client.empty(k.max(1) * size_of::<f32>());
    let (steps, offsets) = (f32s(groups), f32s(groups));
    let codes = client.empty(q.bits().words_for(n).max(1) * size_of::<u32>());
    if n > 0 {
        let units = reduce_units(client);
        let (count, dim, _) = cover(client, groups * units as usize, units);
        // SAFETY: cube `c < groups` reads its group within `n` and writes slot `c`.
        unsafe {
            group_range_kernel::launch_unchecked(
                client,
                count,
                dim,
                arg(x, n),
                arg(&steps, groups),
                arg(&offsets, groups),
                q.group(),
                groups,
                levels,
                asymmetric,
                units as usize,
            );
        }
        let nw = q.bits().words_for(n);
        let (count, dim, _) = cover(client, nw, UNITS);
        let half = levels / 2.0;
        // SAFETY: unit `w < words` reads values below `n` and writes word `w`.
        unsafe {
            quantize_kernel::launch_unchecked(
                client,
                count,
                dim,
                arg(x, n),
                arg(&steps, groups),
                arg(&offsets, groups),
                arg(&codes, nw),
                q.group(),
                -half,
                half - 1.0,
                int4,
            );
        }
    }
    Ok(DeviceQuantized {
        quantizer: *q,
        len: n,
        codes,
        steps,
        offsets,
    })
}

impl DeviceQuantized {
    /// Quantized values from their buffers: `codes` of [`Bits::words_for`]`(len)` u32 words,
    /// and `steps` and `offsets` of one f32 per group.
    ///
    /// # Errors
    /// [`KernelError::Arguments`] when a buffer is smaller than that.
    pub fn from_parts(
        quantizer: Quantizer,
        len: usize,
        codes: Handle,
        steps: Handle,
        offsets: Handle,
    ) -> Result<Self, KernelError> {
        let groups = len.div_ceil(quantizer.group());
        holds::<u32>(
            "DeviceQuantized",
            "codes",
            &codes,
            quantizer.bits().words_for(len),
        )?;
        holds::<f32>("DeviceQuantized", "steps", &steps, groups)?;
        holds::<f32>("DeviceQuantized", "offsets", &offsets, groups)?;
        Ok(Self {
            quantizer,
            len,
            codes,
            steps,
            offsets,
        })
    }

    /// The quantizer that produced them.
    pub fn quantizer(&self) -> Quantizer {
        self.quantizer
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffers, borrowed: codes, steps and offsets.
    pub(super) fn buffers(&self) -> (&Handle, &Handle, &Handle) {
        (&self.codes, &self.steps, &self.offsets)
    }

    /// The buffers: codes (u32 words), per-group steps (`1/scale`) and offsets (f32).
    pub fn into_parts(self) -> (Handle, Handle, Handle) {
        (self.codes, self.steps, self.offsets)
    }

    /// Dequantizes into a new device buffer of `len` f32 values.
    pub fn dequantize(&self, client: &Client) -> Handle {
        let n = self.len;
        let out = client.empty(n.max(1) * size_of::<f32>());
        if n == 0 {
            return out;
        }
        let q = self.quantizer;
        let groups = n.div_ceil(q.group());
        let (count, dim, _) = cover(client, n, UNITS);
        // SAFETY: unit `i < n` reads its word and its group's slot and writes value `i`.
        unsafe {
            dequantize_kernel::launch_unchecked(
                client,
                count,
                dim,
                arg(&self.codes, q.bits().words_for(n)),
                arg(&self.steps, groups),
                arg(&self.offsets, groups),
                arg(&out, n),
                q.group(),
                q.bits() == Bits::Int4,
            );
        }
        out
    }

    /// The same values in the CPU path's form (bytes of codes, steps, offsets).
    pub fn to_host(&self, client: &Client) -> Quantized {
        let q = self.quantizer;
        let groups = self.len.div_ceil(q.group());
        let words: Vec<u32> = download(client, &self.codes);
        let codes = to_bytes(&words, q.bits().bytes_for(self.len));
        let mut steps: Vec<f32> = download(client, &self.steps);
        steps.truncate(groups);
        let mut offsets: Vec<f32> = download(client, &self.offsets);
        offsets.truncate(groups);
        if q.scheme() == Scheme::Symmetric {
            offsets.clear();
        }
        Quantized {
            quantizer: q,
            len: self.len,
            codes,
            steps,
            offsets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::grid::upload;
    use super::super::tests::clients;
    use super::*;
    use crate::adam::tests::values;

    #[test]
    fn device_quantizers_match_the_cpu_path_and_dequantize_alike() {
        for (name, client) in clients() {
            for n in [1usize, 7, 22, 64, 1000, 65537] {
                for bits in [Bits::Int8, Bits::Int4] {
                    for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
                        for group in [2usize, 64, 1000] {
                            let q = Quantizer::new(bits, scheme, group).expect("valid");
                            let x: Vec<f32> =
                                values(n, n as u64).iter().map(|v| v * 3.0 + 0.5).collect();
                            let ctx = format!("{name} n {n} {bits:?} {scheme:?} group {group}");
                            let cpu = q.quantize(&x);
                            let xh = upload(&client, &x);
                            let dev = quantize(&client, &q, &xh, n).expect("n values");
                            let host = dev.to_host(&client);
                            // The CPU path is itself checked against the f64 reference
                            // (crate::quantize's tests); here the device must agree with
                            // it: the same ranges, and codes equal except ±1 where the
                            // scaled value sits on a rounding tie.
                            assert_eq!(host.steps, cpu.steps, "{ctx}: steps");
                            assert_eq!(host.offsets, cpu.offsets, "{ctx}: offsets");
                            let mut ties = 0;
                            for (i, &xi) in x.iter().enumerate() {
                                let (a, b) = (host.code(i) as i32, cpu.code(i) as i32);
                                if a != b {
                                    let g = i / group;
                                    let o = cpu.offsets.get(g).copied().unwrap_or(0.0) as f64;
                                    let t = (xi as f64 - o) / cpu.steps[g] as f64;
                                    let tie = ((t - t.floor()) - 0.5).abs() < 1e-4;
                                    assert!(
                                        tie && (a - b).abs() == 1,
                                        "{ctx} value {i}: code {a} vs CPU {b} (t = {t})"
                                    );
                                    ties += 1;
                                }
                            }
                            assert!(ties * 1000 <= n.max(1000), "{ctx}: {ties} ties");
                            // Dequantized on the device equals the CPU dequantization of
                            // the device's own codes.
                            let y: Vec<f32> = download(&client, &dev.dequantize(&client));
                            let expected = host.dequantize();
                            for i in 0..n {
                                assert!(
                                    (y[i] - expected[i]).abs() <= 1e-6 * expected[i].abs().max(1.0),
                                    "{ctx} value {i}: {} vs {}",
                                    y[i],
                                    expected[i]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
