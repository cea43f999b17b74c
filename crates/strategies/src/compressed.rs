//! DeepSpeed's error-compensated 1-bit all-reduce (1-bit Adam, arXiv 2102.02888; 1-bit LAMB,
//! arXiv 2104.06069), written once over any [`Place`]: host buffers over the
//! [`Communicator`](crate::comm::Communicator), or device tensors over the device collectives
//! (the compression by the fused CubeCL kernel, the signs moved as u32 words).
//!
//! Two phases, each moving one bit per element:
//! 1. **Workers.** Each rank adds its worker error to its vector, compresses it to packed signs
//!    and one scale ‖x‖₂/√n (keeping the remainder as the new worker error), and sends sign
//!    chunk `j` to rank `j` (all-to-all); the scales are all-gathered.
//! 2. **Servers.** Rank `j` averages chunk `j` over the ranks (scale/N · sign, added in rank
//!    order), adds its server error, compresses that again (keeping its own remainder), and
//!    every rank all-gathers the servers' packed signs and scales, so every rank ends with the
//!    same vector.
//!
//! The length is padded so that every chunk packs into the place's whole sign words
//! ([`Place::sign_padded_len`]: bytes on the host, N·lcm(N, 8); u32 words on a device, 32·N);
//! the padding lives in the error buffers. Where both paddings agree the two places give the
//! same values; otherwise the scales see a different `n` and differ in proportion.

use crate::comm::CommunicatorExt;
use crate::place::Place;
use crate::{CommError, Result};

pub use crate::place::byte_padded_len as padded_len;

/// A rank's error-feedback buffers for one compressed all-reduce site (one per buffer that is
/// reduced this way), in place `P`. They start at zero, and start again at zero after a
/// checkpoint load, as in DeepSpeed.
#[derive(Debug, Clone)]
pub struct CompressionErrors<P: Place> {
    /// The padded length: what this rank's last compression left out.
    pub worker: P::Buf,
    /// The padded length / N: what this rank's server chunk's last compression left out.
    pub server: P::Buf,
}

impl<P: Place> CompressionErrors<P> {
    /// Zeroed buffers in `place` for vectors of `n` elements over its world.
    pub fn new(place: &P, n: usize) -> Self {
        let padded = place.sign_padded_len(n);
        Self {
            worker: place.zeros(padded),
            server: place.zeros(padded / place.world_size().max(1)),
        }
    }

    /// Bytes the buffers hold.
    pub fn bytes(&self, place: &P) -> u64 {
        4 * (place.len(&self.worker) + place.len(&self.server)) as u64
    }
}

/// The 1-bit compressed mean of every rank's `buf`, the same on every rank, with error
/// feedback in `errors` (sized by [`CompressionErrors::new`] for `buf`'s length in this
/// place). Collective: every rank calls it.
pub fn compressed_all_reduce<P: Place>(
    place: &P,
    buf: P::Buf,
    errors: &mut CompressionErrors<P>,
) -> Result<P::Buf> {
    let world = place.world_size();
    let n = place.len(&buf);
    let padded = place.sign_padded_len(n);
    let chunk = padded / world;
    let (worker_len, server_len) = (place.len(&errors.worker), place.len(&errors.server));
    if worker_len != padded || server_len != chunk {
        return Err(CommError::InvalidArgument {
            rank: place.rank(),
            op: "compressed_all_reduce",
            detail: format!(
                "the error buffers hold {worker_len} (worker) and {server_len} (server) values, \
                 where {n} elements over {world} ranks need {padded} and {chunk}: size them \
                 with CompressionErrors::new"
            ),
        });
    }
    if n == 0 {
        return Ok(buf);
    }
    let _span = tracing::debug_span!("compressed_all_reduce", elems = n).entered();
    let take = |b: &mut P::Buf| std::mem::replace(b, place.zeros(0));

    // Phase 1: workers compress; sign chunk j goes to rank j, the scales to every rank.
    let x = place.pad(buf, padded);
    let (signs, scale, worker) = place.compress(x, take(&mut errors.worker))?;
    errors.worker = worker;
    let signs = place.all_to_all_signs(signs)?;
    let mut scales = vec![0.0f32; world];
    place.comm().all_gather_equal(&[scale], &mut scales)?;

    // Phase 2: this rank serves its chunk, the mean of the ranks' decompressed chunks.
    let mut mean = place.zeros(chunk);
    for (r, s) in scales.iter().enumerate() {
        let part = place.unpack(&signs, r, world, s / world as f32, chunk)?;
        mean = place.add(mean, &part);
    }
    let (served, scale, server) = place.compress(mean, take(&mut errors.server))?;
    errors.server = server;
    let all = place.all_gather_signs(served)?;
    let mut scales = vec![0.0f32; world];
    place.comm().all_gather_equal(&[scale], &mut scales)?;
    let parts = scales
        .iter()
        .enumerate()
        .map(|(j, s)| place.unpack(&all, j, world, *s, chunk))
        .collect::<Result<Vec<_>>>()?;
    Ok(place.slice(&place.cat(parts), 0..n))
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
    use std::sync::Arc;

    use super::reference::{Dense, input};
    use super::*;
    use crate::comm::{Communicator, ThreadWorld, ThreadWorldOptions};
    use crate::place::HostPlace;

    /// Error buffers sized for another length or world are refused on every rank, before
    /// any exchange.
    #[test]
    fn error_buffers_of_the_wrong_size_are_refused() {
        let results = ThreadWorld::run(2, ThreadWorldOptions::default(), |c| {
            let place = HostPlace::new(Arc::new(c));
            // Sized for 10 elements over 4 ranks.
            let mut errors = CompressionErrors::<HostPlace> {
                worker: vec![0.0; 32],
                server: vec![0.0; 8],
            };
            compressed_all_reduce(&place, vec![1.0; 100], &mut errors)
        });
        for r in results {
            let e = r.expect("no panic").expect_err("wrong sizes").to_string();
            assert!(e.contains("CompressionErrors::new"), "{e}");
        }
    }

    #[test]
    fn matches_the_dense_reference_over_rounds() {
        for world in 2..=4 {
            for n in [1usize, 37, 1000, 4099] {
                let rounds = 4;
                let results = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
                    let rank = c.rank();
                    let place = HostPlace::new(Arc::new(c));
                    let mut errors = CompressionErrors::new(&place, n);
                    (0..rounds)
                        .map(|round| {
                            let buf = input(rank, n, round);
                            let buf =
                                compressed_all_reduce(&place, buf, &mut errors).expect("reduce");
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
            let c = Arc::new(c);
            let place = HostPlace::new(c.clone());
            let mut errors = CompressionErrors::new(&place, n);
            let buf = input(c.rank(), n, 0);
            let before = c.stats().total_sent();
            let mut buf = compressed_all_reduce(&place, buf, &mut errors).expect("reduce");
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
