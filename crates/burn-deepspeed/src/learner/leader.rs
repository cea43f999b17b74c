//! Rank 0's side of the Learner strategy: Burn's event processor, the validation split on the
//! whole model, and the `Learner`'s checkpointer, fed by the events of rank 0's epochs.

use std::sync::Arc;

use burn::train::InferenceStep;
use burn::train::{
    EventProcessorTraining, Learner, LearnerEvent, LearnerModel, SupervisedTrainingEventProcessor,
    TrainingItem, ValidLoader,
};

/// What rank 0's epoch loop tells its leader.
pub(super) enum EpochEvent<'a, M: LearnerModel> {
    Start(usize, usize),
    ShouldStop,
    Item(TrainingItem<<M as burn::train::TrainStep>::Output>),
    /// The epoch, the learner, and its model whole (for validation).
    End(usize, &'a Learner<M>, M),
}

/// Rank 0's side of training: the event processor, validation and checkpoints.
pub(super) struct LeaderEvents<M: LearnerModel> {
    pub processor: SupervisedTrainingEventProcessor<M>,
    pub interrupter: burn::train::Interrupter,
    pub checkpointer: Option<burn::train::LearningCheckpointer<M>>,
    pub event_store: Arc<burn::train::metric::store::EventStoreClient>,
    pub valid: ValidLoader<M>,
}

impl<M: LearnerModel> LeaderEvents<M> {
    /// Handles one of rank 0's events; false asks the ranks to stop.
    pub fn on(&mut self, event: EpochEvent<'_, M>) -> bool {
        let (processor, interrupter) = (&mut self.processor, &self.interrupter);
        match event {
            EpochEvent::Start(epoch, items) => {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: items,
                }));
            }
            EpochEvent::ShouldStop => return interrupter.should_stop(),
            EpochEvent::Item(item) => {
                interrupter
                    .fail_on_error(processor.process_train(LearnerEvent::ProcessedItem(item)));
            }
            EpochEvent::End(epoch, learner, whole) => {
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
                self.validate(epoch, whole);
                let (processor, interrupter) = (&mut self.processor, &self.interrupter);
                interrupter.fail_on_error(processor.process_train(LearnerEvent::EndEpoch(epoch)));
                if let Some(c) = &mut self.checkpointer {
                    c.checkpoint(learner, epoch, &self.event_store);
                }
            }
        }
        true
    }

    /// Runs the validation split on the whole model.
    fn validate(&mut self, epoch: usize, whole: M) {
        let (processor, interrupter) = (&mut self.processor, &self.interrupter);
        interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
            epoch_number: epoch,
            total_items: self.valid.num_items(),
        }));
        let model = whole.valid();
        let mut it = self.valid.iter();
        let mut iteration = 0;
        while let Some(item) = it.next() {
            let item = match item {
                Ok(item) => item,
                Err(e) => {
                    // Rank 0 alone validates: the error stops every rank at the next step's
                    // agreement, and `fit` reports it.
                    interrupter.fail(e);
                    break;
                }
            };
            iteration += 1;
            let out = InferenceStep::step(&model, item);
            let item = TrainingItem::new(out, it.progress(), Some(iteration), None);
            interrupter.fail_on_error(processor.process_valid(LearnerEvent::ProcessedItem(item)));
        }
        interrupter.fail_on_error(processor.process_valid(LearnerEvent::EndSplit(epoch)));
    }
}
