//! The error-compensated 1-bit all-reduce (1-bit Adam, arXiv 2102.02888; 1-bit LAMB, arXiv
//! 2104.06069) on the model's device: [`crate::compressed`]'s two phases with the vector, the
//! error buffers and the packed signs as device tensors, the compression by the fused
//! `onebit_compress` (the CubeCL kernel on wgpu and CUDA, the CPU path on Flex), the signs
//! moved as u32 words by the [`DeviceCollectives`] (NCCL on CUDA) and the two scales per rank
//! through the host communicator.
//!
//! The signs travel as 32-bit words, so each rank's chunk is padded to whole words: the
//! length is padded to a multiple of 32·N ([`word_padded_len`]) where the host path pads to
//! whole bytes. Where both paddings agree (any length that is a multiple of 32·N and of
//! N·lcm(N, 8)) the two give the same values; otherwise the scales `‖c‖/√n` see a different
//! `n` and differ in proportion.

use burn::tensor::{Device, Tensor};
use burn_deepspeed_cubecl_kernels::ext::{onebit_compress, unpack_signs};

use super::DeviceCollectives;
use super::host_resident;
use crate::comm::{Communicator, CommunicatorExt};
use crate::{CommError, Result};

/// Elements after padding `n` for `world` ranks on the device: a multiple of 32·`world`, so
/// that every rank's chunk packs into whole u32 words.
pub fn word_padded_len(n: usize, world: usize) -> usize {
    let unit = 32 * world.max(1);
    n.div_ceil(unit) * unit
}

/// A rank's error-feedback buffers for one device compressed all-reduce site, on the device.
/// They start at zero, and start again at zero after a checkpoint load, as in DeepSpeed.
#[derive(Debug, Clone)]
pub struct DeviceCompressionErrors {
    /// [`word_padded_len`] elements: what this rank's last compression left out.
    pub worker: Tensor<1>,
    /// A chunk (padded length / N): what this rank's server chunk's last compression left out.
    pub server: Tensor<1>,
    /// Bytes of scales read from the device into host memory so far (zero on Flex).
    host_bytes: u64,
}

impl DeviceCompressionErrors {
    /// Zeroed buffers on `device` for vectors of `n` elements over `world` ranks.
    pub fn new(n: usize, world: usize, device: &Device) -> Self {
        let padded = word_padded_len(n, world);
        Self {
            worker: Tensor::zeros([padded], device),
            server: Tensor::zeros([padded / world.max(1)], device),
            host_bytes: 0,
        }
    }

    /// Bytes of scales this site read from the device into host memory so far: 4 per
    /// compression off Flex (two per call), the only values of the all-reduce that the host
    /// sees; the packed signs stay on the device (under NCCL) or are staged by the device
    /// collectives, which count them.
    pub fn host_bytes(&self) -> u64 {
        self.host_bytes
    }

    /// Bytes the buffers hold.
    pub fn bytes(&self) -> u64 {
        4 * (self.worker.dims()[0] + self.server.dims()[0]) as u64
    }
}

/// Returns, on every rank, the 1-bit compressed mean of all ranks' `buf` (rank-1 f32 on the
/// model's device), with error feedback in `errors` (sized by [`DeviceCompressionErrors::new`]
/// for `buf`'s length and this world). `host` is the host communicator of the same ranks,
/// which all-gathers the scales. Collective: every rank calls it.
pub fn device_compressed_all_reduce(
    coll: &dyn DeviceCollectives,
    host: &dyn Communicator,
    buf: Tensor<1>,
    errors: &mut DeviceCompressionErrors,
) -> Result<Tensor<1>> {
    let (rank, world) = (coll.rank(), coll.world_size());
    let n = buf.dims()[0];
    let padded = word_padded_len(n, world);
    let chunk = padded / world;
    if errors.worker.dims()[0] != padded || errors.server.dims()[0] != chunk {
        return Err(CommError::InvalidArgument {
            rank,
            op: "device_compressed_all_reduce",
            detail: format!(
                "the error buffers hold {} (worker) and {} (server) values, where {n} elements \
                 over {world} ranks need {padded} and {chunk}: size them with \
                 DeviceCompressionErrors::new",
                errors.worker.dims()[0],
                errors.server.dims()[0],
            ),
        });
    }
    if n == 0 {
        return Ok(buf);
    }
    let _span = tracing::debug_span!("device_compressed_all_reduce", elems = n).entered();
    let device = buf.device();
    let kernel = |e: burn_deepspeed_cubecl_kernels::KernelError| CommError::Device {
        rank,
        op: "device_compressed_all_reduce",
        detail: e.to_string(),
    };
    let scale_bytes = if host_resident(&device) { 0 } else { 4 };
    let words = chunk / 32;

    // Phase 1: workers compress; word chunk j goes to rank j, the scales to every rank.
    let x = match padded - n {
        0 => buf,
        pad => Tensor::cat(vec![buf, Tensor::zeros([pad], &device)], 0),
    };
    let (signs, scale, worker) = onebit_compress(x, errors.worker.clone()).map_err(kernel)?;
    errors.worker = worker;
    errors.host_bytes += scale_bytes;
    let signs = coll.all_to_all_words(signs)?;
    let mut scales = vec![0.0f32; world];
    host.all_gather_equal(&[scale], &mut scales)?;

    // Phase 2: this rank serves its chunk, the mean of the ranks' decompressed chunks (added
    // in rank order, as on the host).
    let mut mean: Option<Tensor<1>> = None;
    for (r, s) in scales.iter().enumerate() {
        let part = signs.clone().slice(r * words..(r + 1) * words);
        let part = unpack_signs(part, s / world as f32, chunk).map_err(kernel)?;
        mean = Some(match mean {
            Some(m) => m + part,
            None => part,
        });
    }
    let mean = mean.unwrap_or_else(|| Tensor::zeros([chunk], &device));
    let (served, scale, server) = onebit_compress(mean, errors.server.clone()).map_err(kernel)?;
    errors.server = server;
    errors.host_bytes += scale_bytes;
    let all = coll.all_gather_words(served)?;
    let mut scales = vec![0.0f32; world];
    host.all_gather_equal(&[scale], &mut scales)?;
    let parts = scales
        .iter()
        .enumerate()
        .map(|(j, s)| unpack_signs(all.clone().slice(j * words..(j + 1) * words), *s, chunk))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(kernel)?;
    Ok(Tensor::cat(parts, 0).slice(0..n))
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;
    use crate::comm::{ThreadWorld, ThreadWorldOptions};
    use crate::compressed::reference::{Dense, input};
    use crate::compressed::{CompressionErrors, compressed_all_reduce};
    use crate::device::HostCollectives;

    fn tensor(v: Vec<f32>) -> Tensor<1> {
        let n = v.len();
        Tensor::from_data(TensorData::new(v, [n]), &Device::flex())
    }

    fn read(t: Tensor<1>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().expect("f32")
    }

    #[test]
    fn padding_makes_whole_words_per_chunk() {
        assert_eq!(word_padded_len(0, 2), 0);
        assert_eq!(word_padded_len(1, 1), 32);
        assert_eq!(word_padded_len(65, 2), 128);
        assert_eq!(word_padded_len(1000, 3), 1056);
    }

    /// Rounds of `n` elements over `world` thread ranks: every rank's (device, host) results.
    fn rounds(world: usize, n: usize, rounds: usize) -> Vec<Vec<(Vec<f32>, Vec<f32>)>> {
        let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
            let rank = c.rank();
            let comm: std::sync::Arc<dyn Communicator> = std::sync::Arc::new(c);
            let coll = HostCollectives::new(comm.clone());
            let mut dev = DeviceCompressionErrors::new(n, world, &Device::flex());
            let mut host = CompressionErrors::new(n, world);
            (0..rounds)
                .map(|round| {
                    let x = input(rank, n, round);
                    let got = device_compressed_all_reduce(
                        &coll,
                        comm.as_ref(),
                        tensor(x.clone()),
                        &mut dev,
                    )
                    .expect("device reduce");
                    let mut want = x;
                    compressed_all_reduce(comm.as_ref(), &mut want, &mut host)
                        .expect("host reduce");
                    (read(got), want)
                })
                .collect()
        });
        out.into_iter().map(|r| r.expect("rank")).collect()
    }

    /// Where both paddings agree, the device path gives the host path's values exactly.
    #[test]
    fn matches_the_host_path_where_the_paddings_agree() {
        for world in 1..=4 {
            // 1152 is a multiple of 32·N and of N·lcm(N, 8) for N = 1..4.
            for rank in rounds(world, 1152, 3) {
                for (got, want) in rank {
                    assert_eq!(got, want, "world {world}");
                }
            }
        }
    }

    /// With its own padding, the device path follows the dense f64 simulation.
    #[test]
    fn follows_the_dense_reference_with_word_padding() {
        for world in [2, 3] {
            let n = 1000;
            let results = rounds(world, n, 4);
            let mut dense = Dense::padded(word_padded_len(n, world), world);
            for round in 0..4 {
                let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, n, round)).collect();
                let want = dense.step(&inputs, n);
                for (r, rank) in results.iter().enumerate() {
                    for (g, w) in rank[round].0.iter().zip(&want) {
                        assert!(
                            (*g as f64 - w).abs() <= 1e-5,
                            "world {world} round {round} rank {r}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn error_buffers_of_the_wrong_size_are_refused() {
        let out = ThreadWorld::run(2, ThreadWorldOptions::default(), |c| {
            let comm: std::sync::Arc<dyn Communicator> = std::sync::Arc::new(c);
            let coll = HostCollectives::new(comm.clone());
            let mut errors = DeviceCompressionErrors::new(10, 4, &Device::flex());
            device_compressed_all_reduce(&coll, comm.as_ref(), tensor(vec![1.0; 100]), &mut errors)
        });
        for r in out {
            let e = r.expect("no panic").expect_err("wrong sizes").to_string();
            assert!(e.contains("DeviceCompressionErrors::new"), "{e}");
        }
    }
}
