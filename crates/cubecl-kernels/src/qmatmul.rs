//! The fused dequantize-matmul on the CPU: `y = x · W` for a weight `W` `[k, n]` (row-major,
//! Burn's linear layout) quantized group-wise by [`Quantizer`](crate::quantize::Quantizer)
//! along its flattened values, without ever holding `W` whole in f32.
//!
//! The weight is taken a block of columns at a time, the blocks in parallel: each block's
//! groups are dequantized (in AVX-512 or AVX2 when the CPU has them, chosen at run time) into
//! a buffer of about [`TILE_BYTES`] that stays in cache, and `y[:, cols] = x · block` runs on
//! `gemm` (the matrix multiply Burn's Flex backend uses) over the whole inner dimension,
//! writing its columns of the output in place. Memory per thread: one block, not the weight.
//! A few rows (a decode step) stream the weight's rows instead ([`SKINNY`]).

use gemm::Parallelism;
use rayon::prelude::*;

use crate::KernelError;
use crate::quantize::Quantized;

/// About the bytes of one dequantized block of columns: a core's L2 cache on an EPYC (wider
/// blocks mean fewer passes of `x` through `gemm`'s packing; 512 KiB was 3-5% slower at 256
/// rows).
pub const TILE_BYTES: usize = 2 * 1024 * 1024;

/// Columns per block for a weight of `k` rows and `n` columns in groups of `group`: as
/// many as [`TILE_BYTES`] holds, a multiple of the group when the groups tile a row (so that
/// each row of a block is whole groups), any number when each row lies in one group (groups
/// of whole rows), else every column (a group may then straddle two
/// rows, and the block is the whole weight: such layouts lose the bound on memory).
fn block_cols(k: usize, n: usize, group: usize) -> usize {
    if group.is_multiple_of(n) {
        // Each row lies in one group: any block of columns holds whole pieces of groups.
        return (TILE_BYTES / 4 / k.max(1)).clamp(1, n);
    }
    if !n.is_multiple_of(group) {
        return n;
    }
    let fit = TILE_BYTES / 4 / k.max(1);
    ((fit / group).max(1) * group).min(n)
}

/// `out = x · W` with `x` `[m, k]` and `W` `[k, n]` quantized in `w` (row-major), `out`
/// `[m, n]`, all row-major.
///
/// # Errors
/// When the lengths do not match the shapes.
pub fn dequant_matmul(
    x: &[f32],
    m: usize,
    w: &Quantized,
    k: usize,
    n: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if x.len() != m * k || w.len != k * n || out.len() != m * n {
        return Err(KernelError::Arguments {
            op: "dequant_matmul",
            detail: format!(
                "x has {} values for [{m}, {k}], the weight {} for [{k}, {n}], the output {} \
                 for [{m}, {n}]",
                x.len(),
                w.len,
                out.len()
            ),
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let group = w.quantizer.group();
    if m <= SKINNY && (n.is_multiple_of(group) || group.is_multiple_of(n)) {
        // Two blocks per thread, whole groups each.
        let per = n.div_ceil(2 * rayon::current_num_threads());
        let unit = if group.is_multiple_of(n) { 1 } else { group };
        let cols = (per.div_ceil(unit) * unit).min(n);
        skinny(x, m, w, k, n, cols, out);
        return Ok(());
    }
    let cols = block_cols(k, n, group);
    let dst = OutPtr(out.as_mut_ptr());
    (0..n)
        .step_by(cols)
        .collect::<Vec<_>>()
        .into_par_iter()
        .for_each(|j0| {
            let nb = cols.min(n - j0);
            let mut tile = vec![0.0f32; k * nb];
            dequantize_block(w, n, j0, &mut tile);
            // SAFETY: `out` is [m, n], `x` [m, k] and `tile` [k, nb], all row-major and of
            // exactly those lengths (checked above), so every index the strides reach is inside
            // its slice; this call writes only columns j0..j0 + nb of `out`, which no other
            // block writes, and `out` aliases neither input.
            unsafe {
                gemm::gemm(
                    m,
                    nb,
                    k,
                    dst.at(j0),
                    1,
                    n as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    tile.as_ptr(),
                    1,
                    nb as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
        });
    Ok(())
}

/// Runs `$body` compiled for AVX-512 or AVX2 when the CPU has them (chosen at run time, as
/// `gemm` chooses its kernels; the build's baseline is SSE2), as the function `$name`.
macro_rules! simd_dispatch {
    ($(#[$doc:meta])* fn $name:ident = $body:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (and so AVX2 and FMA), checked above.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2, checked just above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

simd_dispatch! {
    /// Columns `j0..j0 + nb` of the weight (`[k, n]`) into `tile` (`[k, nb]`).
    fn dequantize_block = dequantize_block_any(w: &Quantized, n: usize, j0: usize, tile: &mut [f32]) -> ()
}

#[inline(always)]
fn dequantize_block_any(w: &Quantized, n: usize, j0: usize, tile: &mut [f32]) {
    let nb = tile.len() / (w.len / n);
    if nb == n {
        w.dequantize_range_into(0, tile);
    } else {
        // Row p of the block: whole groups from p·n + j0.
        for (p, row) in tile.chunks_mut(nb).enumerate() {
            w.dequantize_range_into(p * n + j0, row);
        }
    }
}

/// The output's pointer, shared by blocks that each write their own rows or columns (here
/// and in the `blas` module's products).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);

// SAFETY: the blocks that share it write disjoint parts (see `dequant_matmul` and `sgemm`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer `j0` values on (a method, so that closures capture the whole wrapper
    /// rather than its raw field).
    pub(crate) fn at(self, j0: usize) -> *mut f32 {
        self.0.wrapping_add(j0)
    }
}

/// `out` `[m, n]` from its column blocks of `cols` (the last may be narrower), each made by
/// `block(j0, nb)` as `[m, nb]`, in parallel.
fn by_column_blocks(
    m: usize,
    n: usize,
    cols: usize,
    out: &mut [f32],
    block: impl Fn(usize, usize) -> Vec<f32> + Sync,
) {
    let starts: Vec<usize> = (0..n).step_by(cols).collect();
    let blocks: Vec<(usize, Vec<f32>)> = starts
        .into_par_iter()
        .map(|j0| (j0, block(j0, cols.min(n - j0))))
        .collect();
    for (j0, block) in blocks {
        let nb = block.len() / m;
        for (i, row) in block.chunks(nb).enumerate() {
            out[i * n + j0..i * n + j0 + nb].copy_from_slice(row);
        }
    }
}

/// Rows of `x` up to which [`dequant_matmul`] streams the weight instead of multiplying
/// dequantized blocks (a decode step's few rows; when the groups tile a row): each weight
/// row is dequantized once into a buffer in L1 and added into every output row, so the codes
/// are read once and nothing larger than a row of a block is written.
pub const SKINNY: usize = 8;

/// Rows of `W` dequantized and added together in [`skinny`]: each output value is loaded
/// and stored once per this many multiply-adds.
const ROWS_AT_ONCE: usize = 4;

/// `out = x · W` for few rows: column blocks in parallel, each streaming the rows of `W`
/// [`ROWS_AT_ONCE`] at a time into a buffer in L1 and adding them into the outputs.
fn skinny(x: &[f32], m: usize, w: &Quantized, k: usize, n: usize, cols: usize, out: &mut [f32]) {
    by_column_blocks(m, n, cols, out, |j0, nb| {
        skinny_block(x, m, w, k, n, j0, nb)
    });
}

simd_dispatch! {
    /// Columns `j0..j0 + nb` of `x · W` (`[m, nb]`), see [`skinny_block_any`].
    fn skinny_block = skinny_block_any(
        x: &[f32], m: usize, w: &Quantized, k: usize, n: usize, j0: usize, nb: usize
    ) -> Vec<f32>
}

/// Columns `j0..j0 + nb` of `x · W` (`[m, nb]`): the rows of `W` dequantized
/// [`ROWS_AT_ONCE`] at a time into a buffer in L1 and added into the outputs.
#[inline(always)]
fn skinny_block_any(
    x: &[f32],
    m: usize,
    w: &Quantized,
    k: usize,
    n: usize,
    j0: usize,
    nb: usize,
) -> Vec<f32> {
    let mut acc = vec![0.0f32; m * nb];
    let mut rows = vec![0.0f32; ROWS_AT_ONCE * nb];
    let mut p = 0;
    while p + ROWS_AT_ONCE <= k {
        for (r, row) in rows.chunks_mut(nb).enumerate() {
            w.dequantize_range_into((p + r) * n + j0, row);
        }
        let [r0, r1, r2, r3] = [0, 1, 2, 3].map(|r| &rows[r * nb..(r + 1) * nb]);
        for (i, acc) in acc.chunks_exact_mut(nb).enumerate() {
            let xi = &x[i * k + p..i * k + p + ROWS_AT_ONCE];
            let (x0, x1, x2, x3) = (xi[0], xi[1], xi[2], xi[3]);
            // Equal lengths up front, so the loop indexes without checks and vectorizes.
            let n = acc.len();
            let (r0, r1, r2, r3) = (&r0[..n], &r1[..n], &r2[..n], &r3[..n]);
            for j in 0..n {
                acc[j] += x0 * r0[j] + x1 * r1[j] + x2 * r2[j] + x3 * r3[j];
            }
        }
        p += ROWS_AT_ONCE;
    }
    for p in p..k {
        let row = &mut rows[..nb];
        w.dequantize_range_into(p * n + j0, row);
        for (i, acc) in acc.chunks_mut(nb).enumerate() {
            let xi = x[i * k + p];
            for (a, r) in acc.iter_mut().zip(row.iter()) {
                *a += xi * r;
            }
        }
    }
    acc
}

/// The plain reference: the weight dequantized whole, then a triple loop in f64.
pub fn dequant_matmul_reference(
    x: &[f32],
    m: usize,
    w: &Quantized,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let weight = w.dequantize();
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let sum: f64 = (0..k)
                .map(|p| x[i * k + p] as f64 * weight[p * n + j] as f64)
                .sum();
            out[i * n + j] = sum as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adam::tests::values;
    use crate::quantize::{Bits, Quantizer, Scheme};

    /// int8 and int4, symmetric and asymmetric, groups that divide a row and groups that
    /// straddle rows, shapes of one block and of many: within 1e-5 relative of the
    /// reference.
    #[test]
    fn matches_dequantize_then_matmul() {
        for (m, k, n) in [(1, 7, 6), (4, 300, 96), (3, 1500, 70), (33, 64, 2048)] {
            for bits in [Bits::Int8, Bits::Int4] {
                for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
                    // Parts of rows, groups straddling rows, whole rows, the whole matrix.
                    for group in [32, 64, 6, 2 * n, k * n] {
                        let q = Quantizer::new(bits, scheme, group).expect("valid");
                        let w = q.quantize(&values(k * n, 5));
                        let x = values(m * k, 9);
                        let mut out = vec![f32::NAN; m * n];
                        dequant_matmul(&x, m, &w, k, n, &mut out).expect("shapes");
                        let want = dequant_matmul_reference(&x, m, &w, k, n);
                        let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs())).max(1e-3);
                        for (a, b) in out.iter().zip(&want) {
                            assert!(
                                (a - b).abs() <= 1e-5 * scale,
                                "[{m}, {k}] x [{k}, {n}] {bits:?} {scheme:?} group {group}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn blocks_hold_whole_groups_and_fit_the_tile() {
        for (k, n, group) in [(300, 96, 32), (10, 70, 32), (1024, 4096, 64), (7, 6, 6)] {
            let cols = block_cols(k, n, group);
            assert!(n.is_multiple_of(group) == cols.is_multiple_of(group) || cols == n);
            let whole_rows = block_cols(k, n, 4 * n);
            assert!(whole_rows >= 1 && (k * whole_rows * 4 <= TILE_BYTES || whole_rows == 1));
            assert!(
                k * cols * 4 <= TILE_BYTES || cols <= group || cols == n,
                "{k} x {cols}"
            );
        }
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let w = Quantizer::new(Bits::Int8, Scheme::Symmetric, 4)
            .expect("valid")
            .quantize(&[0.5; 12]);
        let mut out = vec![0.0; 6];
        let e = dequant_matmul(&[1.0; 5], 2, &w, 3, 4, &mut out).expect_err("x is [2, 3]");
        assert!(e.to_string().contains("[2, 3]"), "{e}");
    }
}
