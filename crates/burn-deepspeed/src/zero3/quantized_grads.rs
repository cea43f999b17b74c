//! ZeRO++'s quantized gradients, qgZ (arXiv 2306.10209 §3.3): stage 3's gradient
//! reduce-scatter replaced by two all-to-alls of int4 codes, first inside each node, then
//! between nodes, so that each value crosses a slow link once, quantized, instead of in fp32
//! at every step of a ring.
//!
//! With `g` ranks per node and `n` nodes (rank `r` = node `r / g`, local index `r % g`), the
//! padded gradient is cut into `g·n` partitions, partition `k` belonging to rank `k`:
//! 1. each rank sends local rank `d` the partitions of every node's rank `d`, as int4;
//! 2. rank `d` dequantizes the `g` blocks it received and sums them: its node's share of the
//!    partitions of rank `d` on every node;
//! 3. it sends node `m`'s part, requantized to int4, to rank `d` of node `m`;
//! 4. each rank dequantizes the `n` parts it received and sums them: its own partition of the
//!    sum over all ranks.
//!
//! We return the sum, as the reduce-scatter it replaces does (the caller pre-divides); DeepSpeed's
//! code divides by the node count only (see `wave3-design-notes.md` §2.5). The quantization is
//! symmetric int4 in groups of [`GROUP`] values with one f32 step each: smaller groups than
//! DeepSpeed's (about a row of the tensor each), because with groups of 256 a small GPT
//! learned 11% slower over 12 steps (a group's largest gradient sets its step, and the many
//! small ones round to zero), with groups of 64 3.6%, and with 32 1.2%, for 5 bits a value.

use std::sync::Arc;

use burn_deepspeed_cubecl_kernels::quantize::{Bits, Quantized, Quantizer, Scheme};
use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::{Communicator, CommunicatorExt};

/// Values per quantization group (even, as int4 packs two codes per byte): an f32 step per 32
/// int4 codes, 5 bits a value, 6.4x fewer bytes than f32.
pub(crate) const GROUP: usize = 32;

/// The two communicators of the hierarchy: this rank's node, and the ranks with its local
/// index on every node.
pub(crate) struct Hierarchy {
    node: Arc<dyn Communicator>,
    across: Arc<dyn Communicator>,
}

impl std::fmt::Debug for Hierarchy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hierarchy")
            .field("ranks_per_node", &self.node.world_size())
            .field("nodes", &self.across.world_size())
            .finish()
    }
}

impl Hierarchy {
    /// The hierarchy of `comm` with nodes of `per_node` consecutive ranks (which divides the
    /// world). Collective: it splits `comm` twice.
    pub(crate) fn new(comm: &dyn Communicator, per_node: usize) -> Result<Self, CommError> {
        let rank = comm.rank();
        let node = comm.split(rank / per_node)?;
        let across = comm.split(rank % per_node)?;
        Ok(Self { node, across })
    }

    /// This rank's `chunk` values of the sum over all ranks of `padded` (every rank's gradient,
    /// `chunk` per rank of the world), through the two quantized all-to-alls. Returns the sum
    /// and the bytes this rank sent (inside its node, and across nodes).
    pub(crate) fn reduce_scatter(
        &self,
        padded: &[f32],
        chunk: usize,
    ) -> Result<(Vec<f32>, (u64, u64)), CommError> {
        let (g, n) = (self.node.world_size(), self.across.world_size());
        debug_assert_eq!(padded.len(), g * n * chunk);
        let partition = |k: usize| &padded[k * chunk..(k + 1) * chunk];
        // 1. To local rank d: partitions d, g + d, 2g + d, ... (rank d of every node).
        let blocks: Vec<Vec<f32>> = (0..g)
            .map(|d| (0..n).flat_map(|m| partition(m * g + d)).copied().collect())
            .collect();
        let before = self.node.stats().total_sent();
        let received = exchange(self.node.as_ref(), &blocks)?;
        let inside = self.node.stats().total_sent() - before;
        // 2. The node's sum of this rank's column of partitions.
        let mut column = vec![0.0f32; n * chunk];
        for block in &received {
            column.iter_mut().zip(block).for_each(|(s, v)| *s += v);
        }
        // 3. Node m's part to rank d of node m.
        let parts: Vec<Vec<f32>> = column.chunks(chunk.max(1)).map(<[f32]>::to_vec).collect();
        let parts = match chunk {
            0 => vec![Vec::new(); n],
            _ => parts,
        };
        let before = self.across.stats().total_sent();
        let received = exchange(self.across.as_ref(), &parts)?;
        let between = self.across.stats().total_sent() - before;
        // 4. This rank's partition of the total.
        let mut out = vec![0.0f32; chunk];
        for part in &received {
            out.iter_mut().zip(part).for_each(|(s, v)| *s += v);
        }
        Ok((out, (inside, between)))
    }
}

/// Sends `blocks[j]` (all of one length) to rank `j` of `comm` as int4 codes with their steps,
/// and returns what every rank sent this one, dequantized, in rank order.
fn exchange(comm: &dyn Communicator, blocks: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, CommError> {
    let len = blocks.first().map_or(0, Vec::len);
    let quantizer =
        Quantizer::new(Bits::Int4, Scheme::Symmetric, GROUP).expect("an even group size");
    let packed: Vec<u8> = (blocks.iter())
        .flat_map(|b| quantizer.quantize(b).to_bytes())
        .collect();
    let mut got = vec![0u8; packed.len()];
    comm.all_to_all(&packed, &mut got)?;
    let each = packed.len() / blocks.len().max(1);
    Ok(got
        .chunks(each.max(1))
        .take(blocks.len())
        .map(|bytes| {
            let q = Quantized::from_bytes(quantizer, len, bytes).expect("every rank's block");
            q.dequantize()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use burn_deepspeed_strategies::comm::{ReduceOp, ThreadWorld, ThreadWorldOptions};

    use super::*;

    #[test]
    fn two_hops_give_each_rank_its_partition_of_the_sum() {
        let chunk = 600;
        for (per_node, world) in [(2, 4), (3, 6), (1, 3), (4, 4)] {
            let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
                let rank = c.rank();
                let padded: Vec<f32> = (0..world * chunk)
                    .map(|i| (((i * 37 + rank * 11) % 97) as f32 / 48.0 - 1.0) * 0.01)
                    .collect();
                let mut exact = vec![0.0f32; chunk];
                c.reduce_scatter_equal(&padded, &mut exact, ReduceOp::Sum)
                    .expect("reduce-scatter");
                let h = Hierarchy::new(&c, per_node).expect("hierarchy");
                let (got, (inside, between)) = h.reduce_scatter(&padded, chunk).expect("qgZ");
                (exact, got, inside, between)
            });
            for r in out {
                let (exact, got, inside, between) = r.expect("rank");
                // Each value is rounded to int4 twice: within a step of its group per hop,
                // a step being 2·absmax/16 of values up to 0.01 in magnitude, summed.
                let scale = world as f32 * 0.01;
                let worst = exact
                    .iter()
                    .zip(&got)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(worst <= scale / 4.0, "{per_node}x{world}: {worst}");
                // Across nodes a partition travels as int4 codes and a step per group: at
                // least 6x fewer bytes than the same exchange in f32.
                let nodes = world / per_node;
                if nodes > 1 {
                    let f32_bytes = 4 * nodes * chunk;
                    assert!(
                        6 * between as usize <= f32_bytes,
                        "{between} vs {f32_bytes}"
                    );
                }
                if per_node > 1 {
                    assert!(inside > 0);
                }
            }
        }
    }
}
