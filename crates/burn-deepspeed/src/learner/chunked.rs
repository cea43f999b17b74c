//! Burn's checkpointer at ZeRO stage 3 in the Learner strategy: the optimizer state of
//! chunks, joined into whole tensors for a save and cut back into chunks on resume.
//!
//! At stage 3 (arXiv 1910.02054 §5.3) each rank's `Learner` optimizer steps its padded chunk
//! of every partitioned tensor, so its state tensors (Adam's moments, for example) have the
//! chunk's shape. A save joins every rank's chunks of each state tensor in rank order, drops
//! the padding and gives it the parameter's shape: the record is an unpartitioned run's, as
//! at stages 1-2. On resume each rank cuts its chunk out of the whole record Burn loaded.

use std::collections::HashMap;

use burn::optim::OptimizerRecord;
use burn_deepspeed_strategies::zero::ShardPlan;

use super::checkpoint::{Entries, StateTensor, record_error};
use crate::Result;
use crate::flat::ParamLayout;
use crate::zero3::chunk_shape;

/// A partitioned parameter: its whole shape and place, and each rank's chunk.
#[derive(Debug, Clone)]
struct Chunked {
    /// The tensor's index in the layout.
    t: usize,
    shape: Vec<usize>,
    offset: usize,
    numel: usize,
    /// Elements each rank holds (padded).
    chunk: usize,
}

/// The partitioned parameters of a stage-3 model prepared for the Learner strategy, by
/// parameter id.
#[derive(Debug, Clone)]
pub(super) struct ChunkPlan {
    /// The prepared model's id (its gather keys, see [`prepared_id`](crate::zero3::prepared_id)).
    pub id: u64,
    tensors: HashMap<u64, Chunked>,
}

impl ChunkPlan {
    /// The partitioned tensors of `layout` as `plan` cuts them.
    pub(super) fn new(id: u64, layout: &ParamLayout, plan: &ShardPlan) -> Self {
        let tensors = layout.slots.iter().enumerate().zip(plan.tensors());
        let tensors = tensors
            .filter(|(_, shard)| !shard.persistent)
            .map(|((t, slot), shard)| {
                let chunked = Chunked {
                    t,
                    shape: slot.shape.clone(),
                    offset: slot.offset,
                    numel: slot.numel,
                    chunk: shard.chunk,
                };
                (slot.id.val(), chunked)
            });
        Self {
            id,
            tensors: tensors.collect(),
        }
    }

    /// The partitioned tensors' values out of the whole flat parameters, by layout index.
    pub(super) fn wholes(&self, flat: &[f32]) -> Vec<(usize, burn::tensor::TensorData)> {
        let values = |c: &Chunked| flat[c.offset..c.offset + c.numel].to_vec();
        let wholes = self.tensors.values();
        let wholes = wholes.map(|c| {
            (
                c.t,
                burn::tensor::TensorData::new(values(c), c.shape.clone()),
            )
        });
        wholes.collect()
    }

    /// The parameter of a state tensor of `shape`, when it is partitioned and `shape` is
    /// its chunk's (`whole`: its whole shape).
    fn chunked(&self, tensor: &StateTensor, whole: bool) -> Option<&Chunked> {
        let c = self.tensors.get(&tensor.id?)?;
        let shape = match whole {
            true => c.shape.clone(),
            false => chunk_shape(c.chunk, c.shape.len()),
        };
        (tensor.shape == shape).then_some(c)
    }
}

/// One record from every rank's (burnpack bytes, in rank order): the chunks of each state
/// tensor of a partitioned parameter joined into the whole, everything else from rank 0.
pub(super) fn join_chunks(parts: &[Vec<u8>], plan: &ChunkPlan) -> Result<OptimizerRecord> {
    let mut joined = Entries::default();
    let mut pieces: Vec<(StateTensor, Chunked)> = Vec::new();
    for (at, part) in parts.iter().enumerate() {
        let mut entries = Entries::read(part)?;
        for tensor in std::mem::take(&mut entries.tensors) {
            match plan.chunked(&tensor, false) {
                Some(c) => match pieces.iter_mut().find(|(p, _)| p.name == tensor.name) {
                    Some((piece, _)) => piece.bytes.extend(tensor.bytes),
                    None => pieces.push((tensor, c.clone())),
                },
                None if at == 0 => joined.tensors.push(tensor),
                None => {}
            }
        }
        if at == 0 {
            joined.scalars = entries.scalars;
            joined.metadata = entries.metadata;
        }
    }
    for (mut tensor, c) in pieces {
        let size = tensor.dtype.size();
        if tensor.bytes.len() != parts.len() * c.chunk * size {
            return Err(record_error(
                "join",
                format!(
                    "`{}` has {} bytes of chunks from {} ranks, not {} chunks of {} elements",
                    tensor.name,
                    tensor.bytes.len(),
                    parts.len(),
                    parts.len(),
                    c.chunk
                ),
            ));
        }
        tensor.bytes.truncate(c.numel * size);
        tensor.shape = c.shape;
        joined.tensors.push(tensor);
    }
    joined.into_record()
}

/// `rank`'s part of a whole record (burnpack bytes): each state tensor of a partitioned
/// parameter cut to the rank's chunk (padded with zeros), everything else as it is.
pub(super) fn cut_chunks(bytes: &[u8], rank: usize, plan: &ChunkPlan) -> Result<OptimizerRecord> {
    let mut entries = Entries::read(bytes)?;
    for tensor in &mut entries.tensors {
        let Some(c) = plan.chunked(tensor, true) else {
            continue;
        };
        let size = tensor.dtype.size();
        if tensor.bytes.len() != c.numel * size {
            return Err(record_error(
                "cut",
                format!(
                    "`{}` holds {} bytes for {} elements",
                    tensor.name,
                    tensor.bytes.len(),
                    c.numel
                ),
            ));
        }
        let start = (rank * c.chunk).min(c.numel) * size;
        let end = ((rank + 1) * c.chunk).min(c.numel) * size;
        let mut piece = tensor.bytes[start..end].to_vec();
        piece.resize(c.chunk * size, 0);
        tensor.bytes = piece;
        tensor.shape = chunk_shape(c.chunk, c.shape.len());
    }
    entries.into_record()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::DType;

    /// A plan of one partitioned parameter (id 7, shape [2, 3], chunks of 4 over 2 ranks).
    fn plan() -> ChunkPlan {
        let chunked = Chunked {
            t: 0,
            shape: vec![2, 3],
            offset: 0,
            numel: 6,
            chunk: 4,
        };
        ChunkPlan {
            id: 1,
            tensors: HashMap::from([(7, chunked)]),
        }
    }

    /// A record with parameter 7's moment of `values` in `shape`, and a scalar.
    fn record(values: &[f32], shape: &[usize]) -> Vec<u8> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let tensor = StateTensor {
            name: "7.moment_1".into(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            id: Some(7),
            bytes,
        };
        let mut entries = Entries {
            tensors: vec![tensor],
            ..Entries::default()
        };
        entries
            .scalars
            .insert("7.time".into(), burn_pack::Scalar::from(3usize));
        let record = entries.into_record().expect("a record");
        record.into_bytes().expect("bytes").to_vec()
    }

    /// The moment of a record: its values and shape.
    fn moment(record: OptimizerRecord) -> (Vec<f32>, Vec<usize>) {
        let bytes = record.into_bytes().expect("bytes").to_vec();
        let entries = Entries::read(&bytes).expect("entries");
        assert!(entries.scalars.contains_key("7.time"), "the scalar is kept");
        let t = &entries.tensors[0];
        let values = t
            .bytes
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4")));
        (values.collect(), t.shape.clone())
    }

    /// Two ranks' chunks join into the whole tensor without the padding, and each rank cuts
    /// its own chunk back out of it, padded with zeros.
    #[test]
    fn chunks_join_into_the_whole_and_cut_back() {
        let ranks = [
            record(&[1.0, 2.0, 3.0, 4.0], &[4, 1]),
            record(&[5.0, 6.0, 0.0, 0.0], &[4, 1]),
        ];
        let joined = join_chunks(&ranks, &plan()).expect("joined");
        let (values, shape) = moment(joined);
        assert_eq!(
            (values.as_slice(), shape.as_slice()),
            (&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0][..], &[2, 3][..])
        );
        let whole = record(&values, &shape);
        for (rank, want) in [(0, [1.0, 2.0, 3.0, 4.0]), (1, [5.0, 6.0, 0.0, 0.0])] {
            let (values, shape) = moment(cut_chunks(&whole, rank, &plan()).expect("cut"));
            assert_eq!(
                (values.as_slice(), shape.as_slice()),
                (&want[..], &[4, 1][..])
            );
        }
        // A rank's record without the chunk is refused, naming the tensor.
        let short = [ranks[0].clone(), record(&[], &[0])];
        let e = join_chunks(&short, &plan()).expect_err("a chunk missing");
        assert!(e.to_string().contains("7.moment_1"), "{e}");
    }
}
