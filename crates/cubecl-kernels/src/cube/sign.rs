//! 1-bit compression as CubeCL kernels (1-bit Adam, arXiv 2102.02888), in
//! [`crate::sign`]'s layout: 32 signs per 32-bit word, value `32w + j` in bit `j`, so the
//! little-endian bytes of the words are the CPU path's bytes; sign(0) = +1.
//!
//! [`onebit_compress`] fuses error feedback: one unit per word adds the error, writes it
//! back as `c = x + error`, packs the signs of `c` and adds `c²` into its cube's partial sum;
//! the host adds the partials (f64) into the scale `‖c‖/√n`; a second kernel writes the new
//! error `c − scale·sign(c)`.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::grid::{UNITS, arg, cover, download, holds, reduce_units};
use super::reduce::cube_sum;
use crate::KernelError;

/// 32-bit words that hold `n` signs.
pub fn sign_words(n: usize) -> usize {
    n.div_ceil(32)
}

#[cube(launch_unchecked)]
fn compress_kernel(
    x: &[f32],
    error: &mut [f32],
    packed: &mut [u32],
    partial: &mut [f32],
    #[comptime] units: usize,
) {
    let mut shared = Shared::<[f32]>::new_slice(units);
    let w = ABSOLUTE_POS;
    let mut squares = 0.0f32;
    if w < packed.len() {
        let mut word = 0u32;
        for j in 0..32usize {
            let i = w * 32 + j;
            if i < x.len() {
                let c = error[i] + x[i];
                error[i] = c;
                squares += c * c;
                // NaN counts as non-negative, as on the CPU.
                word |= select(c < 0.0, 0u32, 1u32) << (j as u32);
            }
        }
        packed[w] = word;
    }
    let total = cube_sum(&mut shared, squares);
    if UNIT_POS == 0 {
        partial[CUBE_POS] = total;
    }
}

#[cube(launch_unchecked)]
fn feedback_kernel(error: &mut [f32], scale: f32) {
    let i = ABSOLUTE_POS;
    if i < error.len() {
        let c = error[i];
        error[i] = c - select(c < 0.0, -scale, scale);
    }
}

#[cube(launch_unchecked)]
fn pack_kernel(x: &[f32], packed: &mut [u32]) {
    let w = ABSOLUTE_POS;
    if w < packed.len() {
        let mut word = 0u32;
        for j in 0..32usize {
            let i = w * 32 + j;
            if i < x.len() {
                word |= select(x[i] < 0.0, 0u32, 1u32) << (j as u32);
            }
        }
        packed[w] = word;
    }
}

#[cube(launch_unchecked)]
fn unpack_kernel(packed: &[u32], out: &mut [f32], scale: f32) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        let bit = (packed[i / 32] >> ((i % 32) as u32)) & 1;
        out[i] = select(bit == 1, scale, -scale);
    }
}

/// Packs the signs of the `n` values of `x` into `packed` ([`sign_words`]`(n)` words).
///
/// # Errors
/// [`KernelError::Arguments`] when `x` holds fewer than `n` f32 values or `packed` fewer
/// than [`sign_words`]`(n)` words.
pub fn pack_signs(
    client: &Client,
    n: usize,
    x: &Handle,
    packed: &Handle,
) -> Result<(), KernelError> {
    let nw = sign_words(n);
    holds::<f32>("pack_signs", "x", x, n)?;
    holds::<u32>("pack_signs", "packed", packed, nw)?;
    if nw == 0 {
        return Ok(());
    }
    let (count, dim, _) = cover(client, nw, UNITS);
    // SAFETY: unit `w < words` reads values below `n` and writes word `w`.
    unsafe {
        pack_kernel::launch_unchecked(client, count, dim, arg(x, n), arg(packed, nw));
    }
    Ok(())
}

/// Writes `scale` or `-scale` for each of the `n` signs in `packed` into `out`.
///
/// # Errors
/// [`KernelError::Arguments`] when `packed` holds fewer than [`sign_words`]`(n)` words or
/// `out` fewer than `n` f32 values.
pub fn unpack_signs(
    client: &Client,
    n: usize,
    packed: &Handle,
    scale: f32,
    out: &Handle,
) -> Result<(), KernelError> {
    holds::<u32>("unpack_signs", "packed", packed, sign_words(n))?;
    holds::<f32>("unpack_signs", "out", out, n)?;
    if n == 0 {
        return Ok(());
    }
    let (count, dim, _) = cover(client, n, UNITS);
    // SAFETY: unit `i < n` reads word `i/32` and writes value `i`.
    unsafe {
        unpack_kernel::launch_unchecked(
            client,
            count,
            dim,
            arg(packed, sign_words(n)),
            arg(out, n),
            scale,
        );
    }
    Ok(())
}

/// Error-feedback 1-bit compression of the `n` values of `x` with the running `error`
/// (updated in place), signs into `packed`; returns the scale `‖x + error‖ / √n`.
///
/// # Errors
/// [`KernelError::Arguments`] when `x` or `error` holds fewer than `n` f32 values, or
/// `packed` fewer than [`sign_words`]`(n)` words.
pub fn onebit_compress(
    client: &Client,
    n: usize,
    x: &Handle,
    error: &Handle,
    packed: &Handle,
) -> Result<f32, KernelError> {
    let nw = sign_words(n);
    holds::<f32>("onebit_compress", "x", x, n)?;
    holds::<f32>("onebit_compress", "error", error, n)?;
    holds::<u32>("onebit_compress", "packed", packed, nw)?;
    if nw == 0 {
        return Ok(0.0);
    }
    let units = reduce_units(client);
    let (count, dim, cubes) = cover(client, nw, units);
    let partial = client.empty(cubes * size_of::<f32>());
    // SAFETY: unit `w < words` touches values below `n` and word `w`; cube `c` writes
    // partial `c`.
    unsafe {
        compress_kernel::launch_unchecked(
            client,
            count,
            dim,
            arg(x, n),
            arg(error, n),
            arg(packed, nw),
            arg(&partial, cubes),
            units as usize,
        );
    }
    let sums: Vec<f32> = download(client, &partial);
    let squares: f64 = sums[..cubes].iter().map(|&s| s as f64).sum();
    let scale = (squares.sqrt() / (n as f64).sqrt()) as f32;
    let (count, dim, _) = cover(client, n, UNITS);
    // SAFETY: the kernel guards every index against `n`.
    unsafe {
        feedback_kernel::launch_unchecked(client, count, dim, arg(error, n), scale);
    }
    Ok(scale)
}

#[cfg(test)]
mod tests {
    use super::super::grid::upload;
    use super::super::tests::clients;
    use super::*;
    use crate::adam::tests::values;
    use crate::sign::{self as cpu, packed_len};

    fn bytes(words: &[u32], n: usize) -> Vec<u8> {
        crate::words::to_bytes(words, packed_len(n))
    }

    #[test]
    fn fused_compression_matches_the_cpu_path_and_the_f64_reference() {
        for (name, client) in clients() {
            for n in [1usize, 7, 22, 64, 1000, 65537] {
                let x = values(n, 3);
                let e0: Vec<f32> = values(n, 4).iter().map(|e| e * 0.1).collect();
                let (xh, eh) = (upload(&client, &x), upload(&client, &e0));
                let ph = client.empty(sign_words(n) * 4);
                let mut error = e0.clone();
                let mut packed = vec![0u8; packed_len(n)];
                for round in 0..2 {
                    let ctx = format!("{name} n {n} round {round}");
                    let c: Vec<f64> = x
                        .iter()
                        .zip(&error)
                        .map(|(&a, &e)| a as f64 + e as f64)
                        .collect();
                    let scale_ref = (c.iter().map(|v| v * v).sum::<f64>() / n as f64).sqrt();
                    let scale = onebit_compress(&client, n, &xh, &eh, &ph).expect("sized buffers");
                    let cpu_scale = cpu::onebit_compress(&x, &mut error, &mut packed);
                    assert!(
                        (scale as f64 - scale_ref).abs() <= 1e-6 * scale_ref,
                        "{ctx}: scale {scale} vs f64 {scale_ref}"
                    );
                    assert!(
                        (scale - cpu_scale).abs() <= 1e-6 * cpu_scale,
                        "{ctx}: scale {scale} vs CPU {cpu_scale}"
                    );
                    let words: Vec<u32> = download(&client, &ph);
                    assert_eq!(bytes(&words, n), packed, "{ctx}: signs");
                    let e: Vec<f32> = download(&client, &eh);
                    for i in 0..n {
                        assert!(
                            (e[i] - error[i]).abs() <= 1e-6 * (1.0 + error[i].abs()),
                            "{ctx} value {i}: error {} vs CPU {}",
                            e[i],
                            error[i]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn pack_and_unpack_round_trip_with_zero_positive() {
        for (name, client) in clients() {
            for n in [1usize, 7, 22, 64, 1000, 65537] {
                let mut x = values(n, 9);
                x[0] = 0.0;
                let xh = upload(&client, &x);
                let ph = client.empty(sign_words(n) * 4);
                pack_signs(&client, n, &xh, &ph).expect("sized buffers");
                let mut packed = vec![0u8; packed_len(n)];
                cpu::pack_signs(&x, &mut packed);
                let words: Vec<u32> = download(&client, &ph);
                assert_eq!(bytes(&words, n), packed, "{name} n {n}");
                let out = client.empty(n * 4);
                unpack_signs(&client, n, &ph, 0.5, &out).expect("sized buffers");
                let y: Vec<f32> = download(&client, &out);
                for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
                    assert_eq!(
                        b,
                        if a >= 0.0 { 0.5 } else { -0.5 },
                        "{name} n {n} value {i}"
                    );
                }
            }
        }
    }
}
