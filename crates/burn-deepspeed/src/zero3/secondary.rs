//! ZeRO++'s hierarchical partition, hpZ (arXiv 2306.10209 §3.2): after a forward gather, each
//! rank keeps a secondary slice of the whole tensor cut over its node's ranks, and the
//! backward gathers the tensor from those slices over the node alone, so that no backward
//! gather crosses a slow link between nodes.
//!
//! The node is a block of `zero_hpz_partition_size` consecutive ranks, as in DeepSpeed (not
//! detected from the topology: the launcher's `--map-by slot` numbers a node's ranks
//! consecutively). A forward gather refreshes the slices (from the prefetch cache too), and
//! the regime drops them whenever the parameters change, so a backward never sees parameters
//! older than its own micro-batch's forward; a tensor without a slice is gathered world-wide.

use std::collections::HashMap;
use std::sync::Arc;

use burn_deepspeed_strategies::CommError;
use burn_deepspeed_strategies::comm::Communicator;

use super::wire::fetch_as_set;
use burn::tensor::FloatDType;

/// One rank's secondary slices and the communicator of its node.
pub(crate) struct Secondary {
    /// The ranks of this rank's node.
    node: Arc<dyn Communicator>,
    /// Per tensor, this rank's slice of the zero-padded whole.
    slices: HashMap<usize, Vec<f32>>,
}

impl std::fmt::Debug for Secondary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secondary")
            .field("node_ranks", &self.node.world_size())
            .field("tensors", &self.slices.len())
            .finish()
    }
}

impl Secondary {
    /// Slices kept over `node`, the communicator of this rank's node.
    pub(crate) fn new(node: Arc<dyn Communicator>) -> Self {
        Self {
            node,
            slices: HashMap::new(),
        }
    }

    /// The length of a slice of a tensor padded to `padded` elements (a multiple of the
    /// world size, and so of the node's).
    fn slice_len(&self, padded: usize) -> usize {
        padded / self.node.world_size()
    }

    /// Keeps this rank's slice of tensor `t`, gathered `whole` (`numel` values) and padded to
    /// `padded` with zeros.
    pub(crate) fn keep(&mut self, t: usize, whole: &[f32], padded: usize) {
        let len = self.slice_len(padded);
        let start = self.node.rank() * len;
        let mut slice = vec![0.0f32; len];
        if start < whole.len() {
            let end = (start + len).min(whole.len());
            slice[..end - start].copy_from_slice(&whole[start..end]);
        }
        self.slices.insert(t, slice);
    }

    /// Tensor `t` whole (`numel` values) from the node's slices, if this rank keeps one: the
    /// node's ranks all kept theirs in the same forward. The gather travels as the primary
    /// ones do (int8 codes under qwZ, else the wire dtype). Returns the bytes this rank sent.
    pub(crate) fn gather(
        &self,
        t: usize,
        numel: usize,
        quantized: bool,
        wire: Option<FloatDType>,
    ) -> Option<Result<(Vec<f32>, u64), CommError>> {
        let slice = self.slices.get(&t)?;
        let mut whole = vec![0.0f32; slice.len() * self.node.world_size()];
        let before = self.node.stats().total_sent();
        let result = fetch_as_set(
            self.node.as_ref(),
            quantized,
            wire,
            false,
            slice,
            &mut whole,
        );
        let sent = self.node.stats().total_sent() - before;
        Some(result.map(|()| {
            whole.truncate(numel);
            (whole, sent)
        }))
    }

    /// Drops every slice: the parameters changed (a step, a load), and a backward must not
    /// gather older values.
    pub(crate) fn forget(&mut self) {
        self.slices.clear();
    }

    /// Elements held in slices.
    pub(crate) fn elems(&self) -> usize {
        self.slices.values().map(Vec::len).sum()
    }
}
