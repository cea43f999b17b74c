//! The fused dequantize-matmul as a CubeCL kernel: `y = x · W` for a weight `W` `[k, n]`
//! quantized group-wise ([`DeviceQuantized`]), each weight value dequantized as it is loaded
//! (its code from its word, times its group's step, plus the offset), so the weight is never
//! whole in f32 on the device either. The CPU path is [`crate::qmatmul`].
//!
//! One unit per output value walks the inner dimension. Neighbouring units take neighbouring
//! columns of one row, so they read neighbouring codes (one word serves four int8 or eight
//! int4 units) and the same value of `x`.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::grid::{UNITS, arg, cover, holds};
use super::quantize::{DeviceQuantized, dequantize_one};
use crate::KernelError;
use crate::quantize::Bits;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dequant_matmul_kernel(
    x: &[f32],
    codes: &[u32],
    steps: &[f32],
    offsets: &[f32],
    out: &mut [f32],
    k: usize,
    n: usize,
    group: usize,
    #[comptime] int4: bool,
) {
    let pos = ABSOLUTE_POS;
    if pos < out.len() {
        let (i, j) = (pos / n, pos % n);
        let mut acc = 0.0f32;
        let mut p = 0usize;
        while p < k {
            let w = dequantize_one(codes, steps, offsets, p * n + j, group, int4);
            acc += x[i * k + p] * w;
            p += 1;
        }
        out[pos] = acc;
    }
}

/// `x · W` (`[m, n]`, a new f32 buffer) for `x` `[m, k]` (f32, row-major) and `w` the
/// quantized `[k, n]` weight (row-major).
///
/// # Errors
/// [`KernelError::Arguments`] when `w` does not hold `k · n` values or `x` holds fewer than
/// `m · k`.
pub fn dequant_matmul(
    client: &Client,
    x: &Handle,
    m: usize,
    w: &DeviceQuantized,
    k: usize,
    n: usize,
) -> Result<Handle, KernelError> {
    // Products that overflow would wrap in a release build and let the unchecked launch
    // below read past a buffer: they are refused.
    let product = |a: usize, b: usize| {
        a.checked_mul(b).ok_or_else(|| KernelError::Arguments {
            op: "dequant_matmul",
            detail: format!("[{m}, {k}] x [{k}, {n}] has more elements than a buffer can hold"),
        })
    };
    let (mk, kn, mn) = (product(m, k)?, product(k, n)?, product(m, n)?);
    product(mn.max(1), size_of::<f32>())?;
    if w.len() != kn {
        return Err(KernelError::Arguments {
            op: "dequant_matmul",
            detail: format!("the weight holds {} values, not [{k}, {n}]", w.len()),
        });
    }
    holds::<f32>("dequant_matmul", "x", x, mk)?;
    let out = client.empty(mn.max(1) * size_of::<f32>());
    if mn == 0 {
        return Ok(out);
    }
    let q = w.quantizer();
    let groups = kn.div_ceil(q.group());
    let (codes, steps, offsets) = w.buffers();
    let (count, dim, _) = cover(client, mn, UNITS);
    // SAFETY: unit `pos < m·n` reads row `pos / n` of `x` (m·k values, checked), values
    // `p·n + pos % n < k·n` of the weight (its words and groups, checked when it was built),
    // and writes value `pos` of `out` (m·n values).
    unsafe {
        dequant_matmul_kernel::launch_unchecked(
            client,
            count,
            dim,
            arg(x, mk),
            arg(codes, q.bits().words_for(kn)),
            arg(steps, groups),
            arg(offsets, groups),
            arg(&out, mn),
            k,
            n,
            q.group(),
            q.bits() == Bits::Int4,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::grid::{download, upload};
    use super::super::quantize::quantize;
    use super::super::tests::clients;
    use super::*;
    use crate::adam::tests::values;
    use crate::qmatmul::dequant_matmul_reference;
    use crate::quantize::{Quantizer, Scheme};

    /// On every runtime built: int8 and int4, symmetric and asymmetric, groups in parts of
    /// rows, straddling rows, whole rows and the whole matrix, against dequantize-then-matmul
    /// of the device's own codes (in f64) within 1e-5 of the output's largest value.
    #[test]
    fn matches_dequantize_then_matmul_on_every_runtime() {
        for (name, client) in clients() {
            for (m, k, n) in [(1, 7, 6), (4, 300, 96), (3, 64, 2048)] {
                for bits in [Bits::Int8, Bits::Int4] {
                    for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
                        for group in [32, 6, 2 * n, k * n] {
                            let q = Quantizer::new(bits, scheme, group).expect("valid");
                            let wv = values(k * n, 5);
                            let dev =
                                quantize(&client, &q, &upload(&client, &wv), k * n).expect("sized");
                            let x = values(m * k, 9);
                            let y = dequant_matmul(&client, &upload(&client, &x), m, &dev, k, n)
                                .expect("shapes");
                            let y: Vec<f32> = download(&client, &y);
                            let want = dequant_matmul_reference(&x, m, &dev.to_host(&client), k, n);
                            let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs())).max(1e-3);
                            let ctx = format!(
                                "{name} [{m}, {k}] x [{k}, {n}] {bits:?} {scheme:?} group {group}"
                            );
                            for (a, b) in y[..m * n].iter().zip(&want) {
                                assert!((a - b).abs() <= 1e-5 * scale, "{ctx}: {a} vs {b}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        for (name, client) in clients() {
            let q = Quantizer::new(Bits::Int8, Scheme::Symmetric, 8).expect("valid");
            let w = quantize(&client, &q, &upload(&client, &values(32, 1)), 32).expect("sized");
            let x = upload(&client, &values(7, 2));
            let e = dequant_matmul(&client, &x, 1, &w, 4, 9).expect_err("32 values, not 36");
            assert!(e.to_string().contains("not [4, 9]"), "{name}: {e}");
            let e = dequant_matmul(&client, &x, 2, &w, 4, 8).expect_err("x holds 7 of 8");
            assert!(e.to_string().contains("`x` holds"), "{name}: {e}");
            // k·n and m·k wrap to 32 and 4 in 64 bits: refused, never launched.
            let k = (1usize << 63) + 2;
            let w4 = quantize(&client, &q, &upload(&client, &values(4, 1)), 4).expect("sized");
            let e = dequant_matmul(&client, &x, 2, &w4, k, 2).expect_err("overflows");
            assert!(
                e.to_string().contains("more elements than a buffer"),
                "{name}: {e}"
            );
        }
    }
}
