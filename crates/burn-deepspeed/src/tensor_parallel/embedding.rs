//! Megatron's vocabulary-parallel embedding (arXiv 1909.08053 §3): the table's rows are cut
//! across the tensor-parallel group, each rank looks up the tokens of its own rows, and the
//! partial embeddings (zero for the other ranks' tokens) are summed over the group.

use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::module::embedding;
use burn::tensor::{Int, Tensor};

use super::linear::{sliced, sliced_already};
use super::{SliceLayout, TensorParallel};
use crate::inference::{QuantizedMatrix, WeightQuantization};
use crate::{DeepSpeedError, Result};

/// The rows of a vocabulary of `vocab` tokens that rank `rank` of `size` holds.
pub(crate) fn vocab_rows(vocab: usize, tp: &TensorParallel) -> std::ops::Range<usize> {
    let rows = vocab / tp.size();
    tp.rank() * rows..(tp.rank() + 1) * rows
}

/// `ids` as this rank's row indices, and a `[..., 1]`-broadcastable f32 mask of the ids
/// this rank holds (the others index row 0, masked out).
pub(crate) fn local_ids<const D: usize>(
    ids: Tensor<D, Int>,
    rows: std::ops::Range<usize>,
) -> (Tensor<D, Int>, Tensor<D>) {
    let local = ids.sub_scalar(rows.start as i64);
    let held = local
        .clone()
        .greater_equal_elem(0)
        .bool_and(local.clone().lower_elem(rows.len() as i64));
    let index = local.mask_fill(held.clone().bool_not(), 0);
    (index, held.float())
}

/// An embedding table whose rows (the vocabulary) are cut across the tensor-parallel group.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    /// This rank's rows of the table, `[vocab / tp, d_model]`.
    pub weight: Param<Tensor<2>>,
    /// The group.
    #[module(skip)]
    pub tp: TensorParallel,
    /// Tokens in the whole vocabulary.
    #[module(skip)]
    pub vocab: usize,
    /// For inference: the table quantized (then `weight` is empty), see
    /// [`quantized`](Self::quantized).
    #[module(skip)]
    pub quantized: Option<QuantizedMatrix>,
}

impl VocabParallelEmbedding {
    /// This rank's rows of `whole` (the same table on every rank), keeping its id.
    ///
    /// # Errors
    /// When the vocabulary does not split evenly over the group.
    pub fn from_embedding(whole: &Embedding, tp: TensorParallel) -> Result<Self> {
        Self::cut_from(&whole.weight, tp)
    }

    /// This (whole) table cut across `tp`.
    ///
    /// # Errors
    /// When the table is a slice already, or the vocabulary does not split evenly.
    pub fn slice(&self, tp: TensorParallel) -> Result<Self> {
        if self.tp.size() != 1 {
            return Err(sliced_already("vocabulary-parallel table"));
        }
        Self::cut_from(&self.weight, tp)
    }

    fn cut_from(weight: &Param<Tensor<2>>, tp: TensorParallel) -> Result<Self> {
        let vocab = weight.lazy_shape().dims::<2>()[0];
        let layout = SliceLayout {
            dim: 0,
            sections: 1,
        };
        Ok(Self {
            weight: sliced(weight, layout, &tp, "vocabulary-parallel embedding rows")?,
            tp,
            vocab,
            quantized: None,
        })
    }

    /// The embeddings `[batch, seq, d_model]` of token ids `[batch, seq]`, whole on every
    /// rank.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.tp.reduce(self.partial(ids))
    }

    /// This rank's share of [`forward`](Self::forward): the rows of the ids it holds, zeros
    /// for the others' (the whole lookup when whole). Summed over the group
    /// ([`TensorParallel::reduce`]) the shares are the embeddings, so a caller that adds
    /// several tables cut over one group (tokens and positions) reduces once.
    pub fn partial(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        if self.tp.size() == 1 {
            return self.lookup(ids);
        }
        let (index, held) = local_ids(ids, vocab_rows(self.vocab, &self.tp));
        let rows = self.lookup(index);
        rows.clone() * held.cast(rows.dtype()).unsqueeze_dim(2)
    }

    /// Rows `ids` of this rank's table (quantized or not), in the module's float dtype (a
    /// quantized table's emptied weight keeps it when the module is cast).
    fn lookup(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        match &self.quantized {
            Some(table) => table.rows(ids).cast(self.weight.val().dtype()),
            None => embedding(self.weight.val(), ids),
        }
    }

    /// This table (whole or a slice) for inference with its rows quantized under `how`: the
    /// codes replace the f32 rows (`weight` is left empty, `[0, 0]`), and a lookup
    /// dequantizes the rows it reads.
    ///
    /// # Errors
    /// When no group fits a row, or the table is quantized already.
    pub fn quantized(&self, how: &WeightQuantization) -> Result<Self> {
        if self.quantized.is_some() {
            return Err(DeepSpeedError::Data(
                "the table is quantized already".into(),
            ));
        }
        let quantized = QuantizedMatrix::quantize(&self.weight.val(), how)?;
        Ok(Self {
            weight: Param::from_tensor(Tensor::empty([0, 0], &self.weight.device())),
            tp: self.tp.clone(),
            vocab: self.vocab,
            quantized: Some(quantized),
        })
    }

    /// Bytes of the quantized table (0 when not quantized).
    pub fn quantized_bytes(&self) -> u64 {
        self.quantized.as_ref().map_or(0, QuantizedMatrix::bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use burn::nn::EmbeddingConfig;
    use burn::tensor::{Device, TensorData};
    use burn_deepspeed_strategies::device::HostCollectives;

    use super::super::test_util::{close, read};
    use super::*;
    use crate::launch::launch;

    /// A table of 12 rows cut over 2, 3 and 4 ranks: the embeddings are the whole table's,
    /// and each rank's rows get the whole table's gradient (zero for the rows it looked up
    /// for no token).
    #[test]
    fn a_vocabulary_parallel_table_matches_the_whole_one() {
        let device = Device::flex().autodiff();
        let (vocab, d) = (12, 5);
        let whole = EmbeddingConfig::new(vocab, d).init(&device);
        let ids = TensorData::new(vec![0i64, 11, 3, 3, 7, 5, 4, 8], [2, 4]);
        let run = |f: &dyn Fn(Tensor<2, Int>) -> Tensor<3>| {
            let y = f(Tensor::from_data(ids.clone(), &device));
            let weights = Tensor::<3>::from_data(
                TensorData::new((0..2 * 4 * d).map(|i| i as f32 / 7.0).collect(), [2, 4, d]),
                &device,
            );
            let grads = (y.clone() * weights).sum().backward();
            (read(y), grads)
        };
        let (whole_y, grads) = run(&|ids| whole.forward(ids));
        let whole_g = whole.weight.grad(&grads).expect("the table's gradient");
        for world in [2usize, 3, 4] {
            let (_, ranks) = launch(world, Duration::from_secs(60), |comm| {
                let tp = TensorParallel::new(Arc::new(HostCollectives::new(comm)));
                let table = VocabParallelEmbedding::from_embedding(&whole, tp.clone())
                    .expect("the vocabulary splits");
                let (y, grads) = run(&|ids| table.forward(ids));
                if let Some(e) = tp.take_error() {
                    panic!("{e}");
                }
                let g = read(table.weight.grad(&grads).expect("the slice's gradient"));
                Ok((tp.rank(), y, g))
            })
            .expect("the ranks run");
            let rows = vocab / world;
            for (r, y, g) in ranks {
                close(&y, &whole_y, "embeddings");
                let slice = whole_g.clone().slice([r * rows..(r + 1) * rows, 0..d]);
                close(&g, &read(slice), "the rows' gradient");
            }
        }
    }
}
