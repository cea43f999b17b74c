//! Training data: the bytes of a file (or the embedded corpus), cut into random windows.

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::model::{GptBatch, SplitMix64};
use burn_deepspeed::tensor_parallel::TensorParallel;

/// The corpus used when no `--data` is given: a snapshot of burn-deepspeed's own Rust sources
/// and documentation (text we wrote, so it can ship with the example).
pub const EMBEDDED_CORPUS: &[u8] = include_bytes!("../data/corpus.txt");

/// Random windows of a byte corpus, the same on every rank for the same seed and step.
#[derive(Debug, Clone)]
pub struct ByteCorpus {
    bytes: std::sync::Arc<Vec<u8>>,
    seed: u64,
}

impl ByteCorpus {
    /// A corpus of `bytes`, sampled with `seed`.
    pub fn new(bytes: Vec<u8>, seed: u64) -> Self {
        Self {
            bytes: std::sync::Arc::new(bytes),
            seed,
        }
    }

    /// Corpus length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// True when the corpus is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Start offset of sequence `index` of the global batch of optimizer step `step`.
    fn offset(&self, step: u64, index: u64, seq_len: usize) -> usize {
        let span = (self.bytes.len() - seq_len - 1) as u64;
        let mut rng = SplitMix64::new(
            self.seed
                ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03)
                ^ index.wrapping_mul(0x8CB9_2BA7_2F3D_8DD7),
        );
        (rng.next_u64() % (span + 1)) as usize
    }

    /// The micro-batch of `micro` sequences starting at global index `first` of step `step`.
    pub fn batch(
        &self,
        step: u64,
        first: u64,
        micro: usize,
        seq_len: usize,
        device: &Device,
    ) -> GptBatch {
        let windows = (0..micro as u64).map(|i| {
            let o = self.offset(step, first + i, seq_len);
            &self.bytes[o..o + seq_len + 1]
        });
        batch_of_windows(windows, micro, seq_len, device)
    }
}

/// A [`GptBatch`] of `n` windows of `seq_len + 1` bytes: each window's first `seq_len` bytes
/// are the inputs and its last `seq_len` the targets.
fn batch_of_windows<'a>(
    windows: impl Iterator<Item = &'a [u8]>,
    n: usize,
    seq_len: usize,
    device: &Device,
) -> GptBatch {
    let mut inputs = Vec::with_capacity(n * seq_len);
    let mut targets = Vec::with_capacity(n * seq_len);
    for w in windows {
        assert_eq!(w.len(), seq_len + 1, "windows of one batch have one length");
        inputs.extend(w[..seq_len].iter().map(|&b| b as i64));
        targets.extend(w[1..].iter().map(|&b| b as i64));
    }
    let make = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [n, seq_len]), device);
    GptBatch {
        layer_drop: None,
        soft_targets: None,
        vocab_group: TensorParallel::none(),
        inputs: make(inputs),
        targets: make(targets),
    }
}

/// Batches byte windows of `seq_len + 1` bytes into a [`GptBatch`], for Burn's data loaders
/// (and so for `SupervisedTraining`).
#[derive(Debug, Clone, Copy)]
pub struct WindowBatcher;

impl burn::data::dataloader::batcher::Batcher<Vec<u8>, GptBatch> for WindowBatcher {
    fn batch(&self, items: Vec<Vec<u8>>, device: &Device) -> GptBatch {
        let seq = items.first().map_or(0, |w| w.len().saturating_sub(1));
        batch_of_windows(items.iter().map(Vec::as_slice), items.len(), seq, device)
    }
}

/// Non-overlapping windows of `seq_len + 1` bytes covering the corpus.
pub fn windows(bytes: &[u8], seq_len: usize) -> Vec<Vec<u8>> {
    bytes
        .chunks_exact(seq_len + 1)
        .map(|w| w.to_vec())
        .collect()
}
