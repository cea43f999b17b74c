//! One optimizer step's micro-batches at a time from a rank's loader ([`StepReader`]).

use burn::data::dataloader::{DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;

/// One optimizer step's micro-batches at a time from a rank's loader, each checked against
/// the configured micro-batch size (Burn's loaders report their progress in items, so each
/// batch's size is the progress it adds).
pub(super) struct StepReader<'a, O> {
    iter: Box<dyn DataLoaderIterator<O> + 'a>,
    micro_batch: Option<usize>,
    /// Items the loader had given before the batch being read.
    seen: usize,
    /// A batch read ahead, to tell the epoch's last batch from one in the middle.
    ahead: Option<Option<Result<O, DatasetError>>>,
}

/// What [`StepReader::next_step`] read.
pub(super) enum Read<O> {
    /// One step's micro-batches.
    Step(Vec<O>),
    /// The epoch's data ended (an incomplete last step, or a shorter last batch, is dropped).
    End,
    /// The loader failed (its error, when it gave one), or gave a batch of the wrong size.
    Failed(String, Option<DatasetError>),
}

impl<'a, O> StepReader<'a, O> {
    pub(super) fn new(
        iter: Box<dyn DataLoaderIterator<O> + 'a>,
        micro_batch: Option<usize>,
    ) -> Self {
        Self {
            iter,
            micro_batch,
            seen: 0,
            ahead: None,
        }
    }

    pub(super) fn progress(&self) -> Progress {
        self.iter.progress()
    }

    pub(super) fn next_step(&mut self, per_step: usize) -> Read<O> {
        let mut micro = Vec::with_capacity(per_step);
        while micro.len() < per_step {
            let item = match self.ahead.take().unwrap_or_else(|| self.iter.next()) {
                None => return Read::End,
                Some(Err(e)) => {
                    return Read::Failed(format!("the training data loader failed: {e}"), Some(e));
                }
                Some(Ok(item)) => item,
            };
            let now = self.iter.progress().items_processed;
            let size = now.saturating_sub(self.seen);
            self.seen = now;
            if let Some(want) = self.micro_batch
                && size != want
            {
                if size < want {
                    let next = self.iter.next();
                    let last = next.is_none();
                    self.ahead = Some(next);
                    if last {
                        return Read::End;
                    }
                }
                return Read::Failed(
                    format!(
                        "train_micro_batch_size_per_gpu is {want}, but the training loader \
                         gave a batch of {size} items; build its DataLoader with \
                         batch_size({want}), or change the key"
                    ),
                    None,
                );
            }
            micro.push(item);
        }
        Read::Step(micro)
    }
}
