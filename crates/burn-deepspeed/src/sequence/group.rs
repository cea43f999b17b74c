//! [`SequenceParallel`]: one rank's place in a DeepSpeed-Ulysses sequence-parallel group, and
//! the all-to-alls that move attention's inputs from a cut of the sequence to a cut of the
//! heads and back (arXiv 2309.14509 §3.1; DeepSpeed's `DistributedAttention`).

use std::sync::Arc;

use burn::tensor::kind::Basic;
use burn::tensor::{Device, Tensor};
use burn_deepspeed_strategies::comm::Communicator;

use crate::grid::consecutive_groups;
use crate::tensor_parallel::TensorParallel;
use crate::{DeepSpeedError, Result};

/// The config key that sets the group size.
pub const SEQUENCE_PARALLEL_KEY: &str = "sequence_parallel_size";

/// A sequence-parallel group: `sp` consecutive data-parallel ranks that share every sequence,
/// rank `r` holding positions `[r · seq/sp, (r + 1) · seq/sp)`. The parameters are whole on
/// every rank (replicated over the group, as in DeepSpeed), so the engine reduces gradients
/// over the data-parallel and sequence-parallel ranks together. Cloning shares the group;
/// [`SequenceParallel::none`] (`sp` 1) keeps every sequence whole and its exchanges are the
/// identity.
#[derive(Clone, Default)]
pub struct SequenceParallel {
    /// The ranks that share a sequence (the all-to-alls' group).
    exchange: TensorParallel,
    /// The same group as a host communicator (its traffic counts the exchanges).
    group: Option<Arc<dyn Communicator>>,
}

impl std::fmt::Debug for SequenceParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceParallel")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish()
    }
}

impl SequenceParallel {
    /// The groups of `sp_size` consecutive ranks of `data` (a grid's
    /// [`data`](crate::grid::Grid::data) group); their all-to-alls run on `device`'s
    /// collectives. A collective: every rank of `data` calls it.
    ///
    /// # Errors
    /// When `sp_size` is 0 or does not divide the ranks, naming `sequence_parallel_size`.
    pub fn new(data: &Arc<dyn Communicator>, sp_size: usize, device: &Device) -> Result<Self> {
        let groups = consecutive_groups(data, sp_size, device, SEQUENCE_PARALLEL_KEY, |world| {
            format!(
                "{sp_size} must divide the {world} data-parallel ranks: each \
                 sequence-parallel group is that many consecutive ranks"
            )
        })?;
        Ok(match groups {
            None => Self::none(),
            Some((group, exchange)) => Self {
                exchange,
                group: Some(group),
            },
        })
    }

    /// `sp` 1: every rank holds whole sequences.
    pub fn none() -> Self {
        Self::default()
    }

    /// This rank's index in its group: its block of every sequence.
    pub fn rank(&self) -> usize {
        self.exchange.rank()
    }

    /// Ranks that share a sequence.
    pub fn size(&self) -> usize {
        self.exchange.size()
    }

    /// The group as a host communicator, whose traffic counts the exchanges (`None` at `sp`
    /// 1).
    pub fn group(&self) -> Option<&Arc<dyn Communicator>> {
        self.group.as_ref()
    }

    /// The position of this rank's first token, when each rank holds `local` positions.
    pub fn first_position(&self, local: usize) -> usize {
        self.rank() * local
    }

    /// Refuses attention with `heads` heads when they do not split over the group.
    ///
    /// # Errors
    /// Naming `sequence_parallel_size` and the head count.
    pub fn check_heads(&self, heads: usize) -> Result<()> {
        match heads.is_multiple_of(self.size()) {
            true => Ok(()),
            false => Err(DeepSpeedError::Unsupported {
                key: SEQUENCE_PARALLEL_KEY.into(),
                reason: format!(
                    "{heads} attention heads do not split over {} sequence-parallel ranks; \
                     choose a size that divides the heads",
                    self.size()
                ),
            }),
        }
    }

    /// This rank's block of `x` along `dim` (the sequence): block `rank` of `size` equal ones.
    ///
    /// # Errors
    /// When the length along `dim` does not split evenly, naming `sequence_parallel_size`.
    pub fn shard<const D: usize, K: Basic>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
    ) -> Result<Tensor<D, K>> {
        let (len, size) = (x.dims()[dim], self.size());
        if !len.is_multiple_of(size) {
            return Err(DeepSpeedError::Unsupported {
                key: SEQUENCE_PARALLEL_KEY.into(),
                reason: format!(
                    "a sequence of {len} positions does not split over {size} ranks; choose \
                     a sequence length that the size divides"
                ),
            });
        }
        let local = len / size;
        Ok(x.narrow(dim, self.rank() * local, local))
    }

    /// Before attention: `x` `[batch, heads, seq / sp, d_head]` (this rank's positions of
    /// every head) becomes `[batch, heads / sp, seq, d_head]` (every position of this rank's
    /// heads): rank `r` sends head block `j` to rank `j` and places what it receives from
    /// rank `s` at positions `[s · seq/sp, ..)`. Its backward is the inverse exchange. The
    /// heads must split over the group ([`check_heads`](Self::check_heads)).
    pub fn heads_from_sequence(&self, x: Tensor<4>) -> Tensor<4> {
        let p = self.size();
        if p == 1 {
            return x;
        }
        let [b, h, s, d] = x.dims();
        assert!(
            h.is_multiple_of(p),
            "{h} heads over {p} ranks: check_heads refuses this"
        );
        // [p (head block, the destination), b, h/p, s, d], exchanged along the first axis:
        // the result's first axis is the source rank, that is, the block of positions.
        let blocks = x.reshape([b, p, h / p, s, d]).permute([1, 0, 2, 3, 4]);
        let received = self.exchange.exchange(blocks);
        received
            .permute([1, 2, 0, 3, 4])
            .reshape([b, h / p, p * s, d])
    }

    /// After attention: the inverse of [`heads_from_sequence`](Self::heads_from_sequence),
    /// `[batch, heads / sp, seq, d_head]` back to `[batch, heads, seq / sp, d_head]`.
    pub fn sequence_from_heads(&self, x: Tensor<4>) -> Tensor<4> {
        let p = self.size();
        if p == 1 {
            return x;
        }
        let [b, hp, s, d] = x.dims();
        // [p (block of positions, the destination), b, h/p, s/p, d]; received: the source
        // rank's axis is the head block.
        let blocks = x.reshape([b, hp, p, s / p, d]).permute([2, 0, 1, 3, 4]);
        let received = self.exchange.exchange(blocks);
        received
            .permute([1, 0, 2, 3, 4])
            .reshape([b, p * hp, s / p, d])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::launch;
    use burn::tensor::TensorData;
    use std::time::Duration;

    const B: usize = 2;
    const H: usize = 4;
    const S: usize = 8;
    const D: usize = 3;

    /// A `[B, H, S, D]` tensor whose value at each index is a distinct function of it.
    fn values(scale: f32) -> Vec<f32> {
        (0..B * H * S * D).map(|i| scale * i as f32 + 0.5).collect()
    }

    /// Element `[b, h, s, d]` of a `[B, H, S, D]` row-major vector.
    fn at(v: &[f32], b: usize, h: usize, s: usize, d: usize) -> f32 {
        v[((b * H + h) * S + s) * D + d]
    }

    /// The block of `v` with heads `heads` and positions `positions`, as a row-major vector.
    fn block(
        v: &[f32],
        heads: std::ops::Range<usize>,
        positions: std::ops::Range<usize>,
    ) -> Vec<f32> {
        let mut out = Vec::new();
        for b in 0..B {
            for h in heads.clone() {
                for s in positions.clone() {
                    out.extend((0..D).map(|d| at(v, b, h, s, d)));
                }
            }
        }
        out
    }

    /// At 2 and 4 ranks, each holding its block of positions of a `[B, H, S, D]` tensor:
    /// the exchange before attention gives each rank every position of its heads, the one
    /// after gives the positions back, and the backward sends each gradient to the rank and
    /// place its value came from (checked against the blocks cut by hand).
    #[test]
    fn the_exchanges_trade_positions_for_heads_and_back() {
        for p in [2, 4] {
            let (_, ranks) = launch(p, Duration::from_secs(60), |comm| {
                let device = Device::flex().autodiff();
                let sp = SequenceParallel::new(&comm, p, &device)?;
                let r = sp.rank();
                let (hp, sl) = (H / p, S / p);
                let x = values(1.0);
                let w = values(-0.25);
                let mine = TensorData::new(block(&x, 0..H, r * sl..(r + 1) * sl), [B, H, sl, D]);
                let local = Tensor::<4>::from_data(mine, &device).require_grad();
                let heads = sp.heads_from_sequence(local.clone());
                let got = heads.clone().into_data().try_to_vec::<f32>().expect("f32");
                assert_eq!(
                    got,
                    block(&x, r * hp..(r + 1) * hp, 0..S),
                    "heads at rank {r}"
                );
                let back = sp.sequence_from_heads(heads.clone());
                assert_eq!(
                    back.into_data(),
                    local.clone().into_data(),
                    "back at rank {r}"
                );
                // d/dx of Σ heads · w_r is w_r, sent back to where each value came from.
                let weights = block(&w, r * hp..(r + 1) * hp, 0..S);
                let weights =
                    Tensor::<4>::from_data(TensorData::new(weights, [B, hp, S, D]), &device);
                let grads = (heads * weights).sum().backward();
                let grad = local.grad(&grads).expect("a gradient");
                let grad = grad.into_data().try_to_vec::<f32>().expect("f32");
                assert_eq!(
                    grad,
                    block(&w, 0..H, r * sl..(r + 1) * sl),
                    "gradient at rank {r}"
                );
                Ok(())
            })
            .expect("every rank");
            assert_eq!(ranks.len(), p);
        }
    }

    /// What one exchange sends, as the group's communicator counts an all-to-all (its whole
    /// input, the block that stays included): the rank's whole tensor, so an attention's four
    /// exchanges (q, k, v before it, the output after) count `4 · b · (s/p) · d_model` values
    /// per rank each way, Ulysses' `4 · b · s · d_model / p` (arXiv 2309.14509 §3.2); the
    /// `1/p` of it that stays on the rank never leaves it.
    #[test]
    fn an_exchange_counts_ulysses_volume() {
        for p in [2, 4] {
            let (_, sent) = launch(p, Duration::from_secs(60), |comm| {
                let device = Device::flex();
                let sp = SequenceParallel::new(&comm, p, &device)?;
                let group = sp.group().expect("a group of p ranks").clone();
                let x = Tensor::<4>::ones([B, H, S / p, D], &device);
                let before = group.stats().total_sent();
                let heads = sp.heads_from_sequence(x);
                let middle = group.stats().total_sent();
                drop(sp.sequence_from_heads(heads));
                let after = group.stats().total_sent();
                Ok((middle - before, after - middle))
            })
            .expect("every rank");
            // One of the four tensors of an attention: b · (s/p) · d_model f32 values.
            let want = (B * (S / p) * H * D * 4) as u64;
            for (to_heads, to_sequence) in sent {
                assert_eq!((to_heads, to_sequence), (want, want), "{p} ranks");
            }
        }
    }

    /// Heads and sequences that do not split over the group are refused by the key's name.
    #[test]
    fn what_does_not_split_is_refused_by_name() {
        let (_, ranks) = launch(4, Duration::from_secs(60), |comm| {
            let device = Device::flex();
            let e = SequenceParallel::new(&comm, 3, &device).expect_err("3 does not divide 4");
            assert!(e.to_string().contains(SEQUENCE_PARALLEL_KEY), "{e}");
            let sp = SequenceParallel::new(&comm, 2, &device)?;
            let e = sp.check_heads(3).expect_err("3 heads over 2 ranks");
            assert!(e.to_string().contains("3 attention heads"), "{e}");
            assert!(sp.check_heads(4).is_ok());
            let tokens = Tensor::<2, burn::tensor::Int>::zeros([2, 5], &device);
            let e = sp.shard(tokens, 1).expect_err("5 positions over 2 ranks");
            assert!(e.to_string().contains(SEQUENCE_PARALLEL_KEY), "{e}");
            assert_eq!(sp.first_position(16), 16 * (comm.rank() % 2));
            Ok(())
        })
        .expect("every rank");
        assert_eq!(ranks.len(), 4);
    }
}
