//! Single-precision matrix products through the system's BLAS (OpenBLAS), behind the `blas`
//! feature: one single-threaded `cblas_sgemm` per block of rows or columns, the blocks on
//! rayon's pool (OpenBLAS's own threads would compete with rayon's for the same cores).

use std::ffi::c_int;
use std::sync::Once;

use rayon::prelude::*;

use crate::KernelError;
use crate::qmatmul::OutPtr;

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

#[link(name = "openblas")]
unsafe extern "C" {
    fn cblas_sgemm(
        layout: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
    fn openblas_set_num_threads(n: c_int);
}

/// A matrix as it lies in memory: element `(i, j)` is `values[offset + i·row_step + j·col_step]`,
/// with one of the two steps 1 (row-major, or a transposed view of a row-major matrix).
#[derive(Debug, Clone, Copy)]
pub struct MatrixView<'a> {
    /// The storage.
    pub values: &'a [f32],
    /// Where element `(0, 0)` lies.
    pub offset: usize,
    /// Rows and columns.
    pub shape: [usize; 2],
    /// Steps between rows and between columns.
    pub steps: [usize; 2],
}

impl MatrixView<'_> {
    /// The BLAS transposition flag and leading dimension, or why BLAS cannot read it.
    fn blas(&self, name: &str) -> Result<(c_int, usize), KernelError> {
        let [rows, cols] = self.shape;
        let [rs, cs] = self.steps;
        let last = self.offset + (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs;
        if rows > 0 && cols > 0 && last >= self.values.len() {
            return Err(arguments(format!(
                "{name} {rows}x{cols} with steps {rs}, {cs} from {} reaches past its {} values",
                self.offset,
                self.values.len()
            )));
        }
        match (rs, cs) {
            (_, 1) if rs >= cols.max(1) => Ok((NO_TRANS, rs)),
            (1, _) if cs >= rows.max(1) => Ok((TRANS, cs)),
            _ => Err(arguments(format!(
                "{name} with steps {rs}, {cs}: BLAS reads a matrix or its transpose stored by rows"
            ))),
        }
    }

    fn at(&self, i: usize, j: usize) -> *const f32 {
        let at = self.offset + i * self.steps[0] + j * self.steps[1];
        self.values.as_ptr().wrapping_add(at)
    }
}

fn arguments(detail: String) -> KernelError {
    KernelError::Arguments {
        op: "sgemm",
        detail,
    }
}

/// `a · b` (`[m, k]` by `[k, n]`) as a row-major `[m, n]`, split into one block per rayon
/// thread along the longer side of the output.
///
/// # Errors
/// [`KernelError::Arguments`] when the shapes disagree, a view reaches past its storage, or
/// neither of a view's steps is 1.
pub fn sgemm(a: MatrixView, b: MatrixView) -> Result<Vec<f32>, KernelError> {
    static SERIAL: Once = Once::new();
    // SAFETY: sets a global of the library, before any product of ours runs.
    SERIAL.call_once(|| unsafe { openblas_set_num_threads(1) });
    let ([m, k], [kb, n]) = (a.shape, b.shape);
    if k != kb {
        return Err(arguments(format!("[{m}, {k}] by [{kb}, {n}]")));
    }
    let ((ta, lda), (tb, ldb)) = (a.blas("a")?, b.blas("b")?);
    let too_big = |x: usize| c_int::try_from(x).is_err();
    if [m, n, k, lda, ldb].into_iter().any(too_big) {
        return Err(arguments(format!(
            "[{m}, {k}] by [{k}, {n}]: past BLAS's 32-bit sizes"
        )));
    }
    let mut out = vec![0.0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return Ok(out);
    }
    let parts = rayon::current_num_threads().max(1);
    let by_rows = m >= n;
    let len = if by_rows { m } else { n };
    let step = len.div_ceil(parts).max(1);
    let dst = OutPtr(out.as_mut_ptr());
    (0..len)
        .step_by(step)
        .collect::<Vec<_>>()
        .into_par_iter()
        .for_each(|s| {
            let w = step.min(len - s);
            let (mm, nn, pa, pb, pc) = match by_rows {
                true => (w, n, a.at(s, 0), b.at(0, 0), dst.at(s * n)),
                false => (m, w, a.at(0, 0), b.at(0, s), dst.at(s)),
            };
            // SAFETY: `blas` bounded both views and checked their leading dimensions; this block
            // writes rows (or columns) s..s + w of `out`, which no other block writes; the sizes
            // fit a C int (checked above).
            unsafe {
                cblas_sgemm(
                    ROW_MAJOR,
                    ta,
                    tb,
                    mm as c_int,
                    nn as c_int,
                    k as c_int,
                    1.0,
                    pa,
                    lda as c_int,
                    pb,
                    ldb as c_int,
                    0.0,
                    pc,
                    n as c_int,
                );
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(values: &[f32], shape: [usize; 2], steps: [usize; 2]) -> MatrixView<'_> {
        MatrixView {
            values,
            offset: 0,
            shape,
            steps,
        }
    }

    /// Products of row-major and transposed views, split by rows and by columns, equal the
    /// definition (sums in f64).
    #[test]
    fn products_equal_the_definition() {
        for (m, k, n) in [(7, 5, 3), (3, 9, 20), (64, 33, 65), (1, 4, 1)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
                .collect();
            let want: Vec<f32> = (0..m * n)
                .map(|x| {
                    let (i, j) = (x / n, x % n);
                    (0..k)
                        .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            // The transposes, stored by rows, read back through swapped steps.
            let at: Vec<f32> = (0..k * m).map(|x| a[(x % m) * k + x / m]).collect();
            let bt: Vec<f32> = (0..n * k).map(|x| b[(x % k) * n + x / k]).collect();
            for (va, vb) in [
                (view(&a, [m, k], [k, 1]), view(&b, [k, n], [n, 1])),
                (view(&at, [m, k], [1, m]), view(&bt, [k, n], [1, k])),
            ] {
                let got = sgemm(va, vb).expect("a product");
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{m}x{k}x{n}: {g} against {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn refuses_what_blas_cannot_read() {
        let v = vec![0.0f32; 12];
        let err = |a, b| sgemm(a, b).unwrap_err().to_string();
        assert!(
            err(view(&v, [3, 4], [4, 1]), view(&v, [3, 4], [4, 1])).contains("[3, 4] by [3, 4]")
        );
        assert!(err(view(&v, [2, 2], [2, 2]), view(&v, [2, 2], [2, 1])).contains("stored by rows"));
        assert!(err(view(&v, [4, 4], [4, 1]), view(&v, [4, 1], [1, 1])).contains("reaches past"));
    }
}
