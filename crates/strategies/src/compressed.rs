//! DeepSpeed's error-compensated 1-bit all-reduce (1-bit Adam, arXiv 2102.02888; 1-bit LAMB,
//! arXiv 2104.06069), over any [`Communicator`].
//!
//! Two phases, each moving one bit per element:
//! 1. **Workers.** Each rank adds its worker error to its vector, compresses it to packed signs
//!    and one scale ‖x‖₂/√n (keeping the remainder as the new worker error), and sends sign
//!    chunk `j` to rank `j` (all-to-all); the scales are all-gathered.
//! 2. **Servers.** Rank `j` averages chunk `j` over the ranks (scale/N · sign), adds its server
//!    error, compresses that again (keeping its own remainder), and every rank all-gathers the
//!    servers' packed signs and scales, so every rank ends with the same vector.
//!
//! The length is padded to a multiple of N·lcm(N, 8) so that every chunk packs into whole
//! bytes; the padding lives in the error buffers.

use burn_deepspeed_compress::onebit::compress;
use burn_deepspeed_cubecl_kernels::sign::unpack_signs;

use crate::comm::{Communicator, CommunicatorExt};
use crate::{CommError, Result};

/// Elements after padding `n` for a world of `world` ranks: a multiple of world·lcm(world, 8).
pub fn padded_len(n: usize, world: usize) -> usize {
    let lcm = world * 8 / gcd(world, 8);
    n.div_ceil(world * lcm) * world * lcm
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// A rank's error-feedback buffers for one compressed all-reduce site (one per buffer that is
/// reduced this way). They start at zero, and start again at zero after a checkpoint load, as
/// in DeepSpeed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompressionErrors {
    /// Padded length × 1: what this rank's last compression left out.
    pub worker: Vec<f32>,
    /// Padded length / N: what this rank's server chunk's last compression left out.
    pub server: Vec<f32>,
}

impl CompressionErrors {
    /// Zeroed buffers for vectors of `n` elements over `world` ranks.
    pub fn new(n: usize, world: usize) -> Self {
        let padded = padded_len(n, world);
        Self {
            worker: vec![0.0; padded],
            server: vec![0.0; padded / world],
        }
    }
}

/// Replaces `buf` on every rank by the 1-bit compressed mean of all ranks' `buf`, with error
/// feedback in `errors` (sized by [`CompressionErrors::new`] for `buf.len()` and this world).
pub fn compressed_all_reduce(
    comm: &dyn Communicator,
    buf: &mut [f32],
    errors: &mut CompressionErrors,
) -> Result<()> {
    let world = comm.world_size();
    let padded = padded_len(buf.len(), world);
    if errors.worker.len() != padded || errors.server.len() != padded / world {
        return Err(CommError::InvalidArgument {
            rank: comm.rank(),
            op: "compressed_all_reduce",
            detail: format!(
                "the error buffers hold {} (worker) and {} (server) values, where {} elements \
                 over {world} ranks need {padded} and {}: size them with \
                 CompressionErrors::new",
                errors.worker.len(),
                errors.server.len(),
                buf.len(),
                padded / world
            ),
        });
    }
    let chunk = padded / world;
    let _span = tracing::debug_span!("compressed_all_reduce", elems = buf.len()).entered();

    // Phase 1: workers compress; sign chunk j goes to rank j.
    let mut x = vec![0.0f32; padded];
    x[..buf.len()].copy_from_slice(buf);
    let worker = compress(&x, &mut errors.worker);
    let mut signs = vec![0u8; worker.signs.len()];
    comm.all_to_all(&worker.signs, &mut signs)?;
    let mut scales = vec![0.0f32; world];
    comm.all_gather_equal(&[worker.scale], &mut scales)?;

    // Phase 2: this rank serves its chunk: the mean of the ranks' decompressed chunks.
    let bytes = chunk / 8;
    let mut mean = vec![0.0f32; chunk];
    let mut part = vec![0.0f32; chunk];
    for (r, scale) in scales.iter().enumerate() {
        unpack_signs(
            &signs[r * bytes..(r + 1) * bytes],
            scale / world as f32,
            &mut part,
        );
        mean.iter_mut().zip(&part).for_each(|(m, p)| *m += p);
    }
    let server = compress(&mean, &mut errors.server);
    let mut all_signs = vec![0u8; padded / 8];
    comm.all_gather_equal(&server.signs, &mut all_signs)?;
    let mut server_scales = vec![0.0f32; world];
    comm.all_gather_equal(&[server.scale], &mut server_scales)?;

    let mut out = vec![0.0f32; padded];
    for (j, scale) in server_scales.iter().enumerate() {
        unpack_signs(
            &all_signs[j * bytes..(j + 1) * bytes],
            *scale,
            &mut out[j * chunk..(j + 1) * chunk],
        );
    }
    buf.copy_from_slice(&out[..buf.len()]);
    Ok(())
}

/// A dense, serial f64 simulation of [`compressed_all_reduce`] over every rank (DeepSpeed's
/// `torch_sim` oracle), for tests.
#[cfg(test)]
pub(crate) mod reference {
    use super::padded_len;

    /// Rank `rank`'s input of `n` elements at `round`, for the tests.
    pub(crate) fn input(rank: usize, n: usize, round: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let v = ((i * 31 + rank * 17 + round * 7) % 41) as f32 - 20.0;
                v / 8.0 + rank as f32 * 0.1
            })
            .collect()
    }

    /// DeepSpeed's dense simulation: every rank compresses x + error densely, the results are
    /// averaged, and each server chunk is compressed with its own error; all in f64.
    pub(crate) struct Dense {
        pub(crate) worker: Vec<Vec<f64>>,
        pub(crate) server: Vec<f64>,
    }

    impl Dense {
        pub(crate) fn new(n: usize, world: usize) -> Self {
            Self::padded(padded_len(n, world), world)
        }

        /// Vectors padded to `padded` elements (a multiple of `world`).
        pub(crate) fn padded(padded: usize, world: usize) -> Self {
            Self {
                worker: vec![vec![0.0; padded]; world],
                server: vec![0.0; padded],
            }
        }

        /// The reduced vector (the same on every rank) of one call with these inputs.
        pub(crate) fn step(&mut self, inputs: &[Vec<f32>], n: usize) -> Vec<f64> {
            let world = inputs.len();
            let padded = self.server.len();
            let chunk = padded / world;
            let sign = |v: f64| if v >= 0.0 { 1.0 } else { -1.0 };
            let mut mean = vec![0.0f64; padded];
            for (r, x) in inputs.iter().enumerate() {
                let c: Vec<f64> = (0..padded)
                    .map(|i| x.get(i).map_or(0.0, |&v| v as f64) + self.worker[r][i])
                    .collect();
                let s = (c.iter().map(|v| v * v).sum::<f64>() / padded as f64).sqrt();
                for i in 0..padded {
                    self.worker[r][i] = c[i] - s * sign(c[i]);
                    mean[i] += s * sign(c[i]) / world as f64;
                }
            }
            let mut out = vec![0.0f64; padded];
            for j in 0..world {
                let range = j * chunk..(j + 1) * chunk;
                let y: Vec<f64> = range.clone().map(|i| mean[i] + self.server[i]).collect();
                let s = (y.iter().map(|v| v * v).sum::<f64>() / chunk as f64).sqrt();
                for (k, i) in range.enumerate() {
                    self.server[i] = y[k] - s * sign(y[k]);
                    out[i] = s * sign(y[k]);
                }
            }
            out.truncate(n);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reference::{Dense, input};
    use super::*;
    use crate::comm::{ThreadWorld, ThreadWorldOptions};

    /// Error buffers sized for another length or world are refused on every rank, before
    /// any exchange.
    #[test]
    fn error_buffers_of_the_wrong_size_are_refused() {
        let results = ThreadWorld::run(2, ThreadWorldOptions::default(), |c| {
            let mut errors = CompressionErrors::new(10, 4);
            compressed_all_reduce(&c, &mut vec![1.0; 100], &mut errors)
        });
        for r in results {
            let e = r.expect("no panic").expect_err("wrong sizes").to_string();
            assert!(e.contains("CompressionErrors::new"), "{e}");
        }
    }

    #[test]
    fn padding_makes_whole_bytes_per_chunk() {
        assert_eq!(padded_len(4, 1), 8);
        assert_eq!(padded_len(1, 2), 16);
        assert_eq!(padded_len(37, 3), 72);
        assert_eq!(padded_len(1000, 4), 1024);
        for world in 1..=8 {
            for n in [1, 7, 100, 1001] {
                let p = padded_len(n, world);
                assert!(
                    p >= n && (p / world).is_multiple_of(8),
                    "{n} over {world}: {p}"
                );
            }
        }
    }

    #[test]
    fn matches_the_dense_reference_over_rounds() {
        for world in 2..=4 {
            for n in [1usize, 37, 1000, 4099] {
                let rounds = 4;
                let results = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
                    let mut errors = CompressionErrors::new(n, world);
                    (0..rounds)
                        .map(|round| {
                            let mut buf = input(c.rank(), n, round);
                            compressed_all_reduce(&c, &mut buf, &mut errors).expect("reduce");
                            (buf, errors.clone())
                        })
                        .collect::<Vec<_>>()
                });
                let results: Vec<_> = results.into_iter().map(|r| r.expect("rank")).collect();
                let padded = padded_len(n, world);
                let mut dense = Dense::new(n, world);
                for round in 0..rounds {
                    let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n, round)).collect();
                    let want = dense.step(&inputs, n);
                    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1.0);
                    for (r, rank) in results.iter().enumerate() {
                        let (got, errors) = &rank[round];
                        for (g, w) in got.iter().zip(&want) {
                            assert!(
                                (*g as f64 - w).abs() <= 1e-6 * scale,
                                "world {world} n {n} round {round} rank {r}: {g} vs {w}"
                            );
                        }
                        for (g, w) in errors.worker.iter().zip(&dense.worker[r]) {
                            assert!((*g as f64 - w).abs() <= 1e-5 * scale, "worker error");
                        }
                        let chunk = padded / world;
                        let mine = &dense.server[r * chunk..(r + 1) * chunk];
                        for (g, w) in errors.server.iter().zip(mine) {
                            assert!((*g as f64 - w).abs() <= 1e-5 * scale, "server error");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn one_bit_per_element_per_phase() {
        let n = 1 << 16;
        let world = 4;
        let sent = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
            let mut errors = CompressionErrors::new(n, world);
            let mut buf = input(c.rank(), n, 0);
            let before = c.stats().total_sent();
            compressed_all_reduce(&c, &mut buf, &mut errors).expect("reduce");
            let compressed = c.stats().total_sent() - before;
            let before = c.stats().total_sent();
            c.all_reduce(&mut buf, crate::comm::ReduceOp::Sum)
                .expect("dense");
            (compressed, c.stats().total_sent() - before)
        });
        for r in sent {
            let (compressed, dense) = r.expect("rank");
            // fp32 ring all-reduce sends 2(N−1)/N·4n bytes; the compressed one about
            // 2(N−1)/N·n/8: 32x less, minus the scales.
            let ratio = dense as f64 / compressed as f64;
            assert!(
                ratio >= 16.0,
                "only {ratio:.1}x less ({compressed} vs {dense} bytes)"
            );
        }
    }
}
