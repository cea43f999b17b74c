//! Pipeline schedules as plain data: DeepSpeed's 1F1B `TrainSchedule`, its `InferenceSchedule`
//! and GPipe for comparison (DeepSpeed `runtime/pipe/schedule.py` semantics).
//!
//! A schedule yields, for one stage, a sequence of steps; each step is a list of
//! [`PipeInstruction`]s. Steps are atomic: a barrier between two steps cannot deadlock.

use std::fmt;

/// One instruction of a pipeline stage. `buffer` is the activation/gradient buffer slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PipeInstruction {
    /// Load a micro-batch into `buffer` (first and last stages).
    LoadMicroBatch {
        /// Buffer slot.
        buffer: usize,
    },
    /// Forward the activations in `buffer`.
    ForwardPass {
        /// Buffer slot.
        buffer: usize,
    },
    /// Backward through the activations in `buffer`.
    BackwardPass {
        /// Buffer slot.
        buffer: usize,
    },
    /// Send the output activations of `buffer` to the next stage.
    SendActivation {
        /// Buffer slot.
        buffer: usize,
    },
    /// Receive input activations into `buffer` from the previous stage.
    RecvActivation {
        /// Buffer slot.
        buffer: usize,
    },
    /// Send the input gradient of `buffer` to the previous stage.
    SendGrad {
        /// Buffer slot.
        buffer: usize,
    },
    /// Receive the output gradient for `buffer` from the next stage.
    RecvGrad {
        /// Buffer slot.
        buffer: usize,
    },
    /// Reduce the gradients of tied layers across the stages that share them.
    ReduceTiedGrads,
    /// Reduce gradients across data-parallel replicas.
    ReduceGrads,
    /// Take the optimizer step.
    OptimizerStep,
}

impl PipeInstruction {
    /// DeepSpeed's name of the instruction.
    pub fn name(&self) -> &'static str {
        match self {
            PipeInstruction::LoadMicroBatch { .. } => "LoadMicroBatch",
            PipeInstruction::ForwardPass { .. } => "ForwardPass",
            PipeInstruction::BackwardPass { .. } => "BackwardPass",
            PipeInstruction::SendActivation { .. } => "SendActivation",
            PipeInstruction::RecvActivation { .. } => "RecvActivation",
            PipeInstruction::SendGrad { .. } => "SendGrad",
            PipeInstruction::RecvGrad { .. } => "RecvGrad",
            PipeInstruction::ReduceTiedGrads => "ReduceTiedGrads",
            PipeInstruction::ReduceGrads => "ReduceGrads",
            PipeInstruction::OptimizerStep => "OptimizerStep",
        }
    }

    /// The buffer slot, for the instructions that have one.
    pub fn buffer(&self) -> Option<usize> {
        match *self {
            PipeInstruction::LoadMicroBatch { buffer }
            | PipeInstruction::ForwardPass { buffer }
            | PipeInstruction::BackwardPass { buffer }
            | PipeInstruction::SendActivation { buffer }
            | PipeInstruction::RecvActivation { buffer }
            | PipeInstruction::SendGrad { buffer }
            | PipeInstruction::RecvGrad { buffer } => Some(buffer),
            _ => None,
        }
    }
}

impl fmt::Display for PipeInstruction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.buffer() {
            Some(b) => write!(f, "{}({b})", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

/// A stage's instruction stream, as a list of steps.
pub trait PipeSchedule {
    /// The instructions of every step, in order.
    fn steps(&self) -> Vec<Vec<PipeInstruction>>;
    /// Buffer slots the stage needs (activations it may hold at once).
    fn num_pipe_buffers(&self) -> usize;
}

/// Which training schedule a pipeline runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScheduleKind {
    /// DeepSpeed's 1F1B [`TrainSchedule`].
    #[default]
    OneFOneB,
    /// [`GPipeSchedule`]: every forward, then every backward.
    GPipe,
}

impl ScheduleKind {
    /// The schedule of `stage_id`.
    pub fn schedule(
        self,
        micro_batches: usize,
        stages: usize,
        stage_id: usize,
    ) -> Box<dyn PipeSchedule> {
        match self {
            ScheduleKind::OneFOneB => Box::new(TrainSchedule::new(micro_batches, stages, stage_id)),
            ScheduleKind::GPipe => Box::new(GPipeSchedule::new(micro_batches, stages, stage_id)),
        }
    }
}

fn check_shape(micro_batches: usize, stages: usize, stage_id: usize) {
    assert!(
        micro_batches > 0 && stages > 0 && stage_id < stages,
        "a schedule needs micro_batches > 0, stages > 0 and stage_id < stages \
         (got {micro_batches}, {stages}, {stage_id})"
    );
}

/// DeepSpeed's 1F1B training schedule for one stage.
///
/// With S stages and M micro-batches it takes 2(M + S − 1) steps; stage `s` uses
/// `max(2, min(S − s, M))` buffers, so at most that many activations are in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainSchedule {
    /// Micro-batches per optimizer step (M).
    pub micro_batches: usize,
    /// Pipeline stages (S).
    pub stages: usize,
    /// This stage (s).
    pub stage_id: usize,
}

impl TrainSchedule {
    /// The schedule of stage `stage_id` of `stages` over `micro_batches`.
    ///
    /// # Panics
    /// When `stages` or `micro_batches` is 0 or `stage_id >= stages`.
    pub fn new(micro_batches: usize, stages: usize, stage_id: usize) -> Self {
        check_shape(micro_batches, stages, stage_id);
        Self {
            micro_batches,
            stages,
            stage_id,
        }
    }

    /// Buffers this stage needs.
    pub fn num_pipe_buffers(&self) -> usize {
        (self.stages - self.stage_id).min(self.micro_batches).max(2)
    }

    /// Number of steps: 2(M + S − 1).
    pub fn total_steps(&self) -> usize {
        2 * (self.micro_batches + self.stages - 1)
    }

    fn valid(&self, mb: i64) -> bool {
        0 <= mb && mb < self.micro_batches as i64
    }

    /// The micro-batch this stage works on at `step` and whether it is a forward, or `None`
    /// for an idle step.
    pub fn micro_batch_at(&self, step: usize) -> Option<(usize, bool)> {
        let (mb, forward) = self.step_to_micro_batch(step);
        self.valid(mb).then_some((mb as usize, forward))
    }

    /// The micro-batch this stage works on at `step`, and whether it is a forward.
    fn step_to_micro_batch(&self, step: usize) -> (i64, bool) {
        let (step, s, stages) = (step as i64, self.stage_id as i64, self.stages as i64);
        let even_step = step % 2 == 0;
        let even_stage = s % 2 == 0;
        match (even_step, even_stage) {
            (true, true) => (step / 2 - s / 2, true),
            (false, false) => ((step - 1) / 2 - s / 2, true),
            (true, false) => (step / 2 - stages + (s + 1) / 2, false),
            (false, true) => ((step - 1) / 2 - stages + 1 + s / 2, false),
        }
    }

    fn buffer(&self, mb: i64) -> usize {
        (mb as usize) % self.num_pipe_buffers()
    }

    /// The instructions of every step, in order.
    pub fn steps(&self) -> Vec<Vec<PipeInstruction>> {
        use PipeInstruction::*;
        let (first, last) = (self.stage_id == 0, self.stage_id == self.stages - 1);
        let mut prev: i64 = -1;
        let mut out = Vec::with_capacity(self.total_steps());
        for step in 0..self.total_steps() {
            let (mb, forward) = self.step_to_micro_batch(step);
            let mut cmds = Vec::new();
            let here = self.valid(mb);
            let prev_valid = self.valid(prev);
            if forward {
                if prev_valid && !first {
                    cmds.push(SendGrad {
                        buffer: self.buffer(prev),
                    });
                }
                if here && !first {
                    cmds.push(RecvActivation {
                        buffer: self.buffer(mb),
                    });
                }
            } else {
                if here && !last {
                    cmds.push(RecvGrad {
                        buffer: self.buffer(mb),
                    });
                }
                if prev_valid && !last {
                    cmds.push(SendActivation {
                        buffer: self.buffer(prev),
                    });
                }
            }
            if here {
                let buffer = self.buffer(mb);
                if forward {
                    if first || last {
                        cmds.push(LoadMicroBatch { buffer });
                    }
                    cmds.push(ForwardPass { buffer });
                } else {
                    cmds.push(BackwardPass { buffer });
                }
            }
            if step == self.total_steps() - 1 {
                cmds.extend([ReduceTiedGrads, ReduceGrads, OptimizerStep]);
            }
            prev = mb;
            out.push(cmds);
        }
        out
    }
}

impl PipeSchedule for TrainSchedule {
    fn steps(&self) -> Vec<Vec<PipeInstruction>> {
        TrainSchedule::steps(self)
    }
    fn num_pipe_buffers(&self) -> usize {
        TrainSchedule::num_pipe_buffers(self)
    }
}

/// DeepSpeed's inference schedule: forwards only, M + S − 1 steps, two buffers used
/// alternately for receiving and sending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InferenceSchedule {
    /// Micro-batches (M).
    pub micro_batches: usize,
    /// Pipeline stages (S).
    pub stages: usize,
    /// This stage (s).
    pub stage_id: usize,
}

impl InferenceSchedule {
    /// The schedule of stage `stage_id` of `stages` over `micro_batches`.
    ///
    /// # Panics
    /// When `stages` or `micro_batches` is 0 or `stage_id >= stages`.
    pub fn new(micro_batches: usize, stages: usize, stage_id: usize) -> Self {
        check_shape(micro_batches, stages, stage_id);
        Self {
            micro_batches,
            stages,
            stage_id,
        }
    }
}

impl PipeSchedule for InferenceSchedule {
    fn num_pipe_buffers(&self) -> usize {
        2
    }

    fn steps(&self) -> Vec<Vec<PipeInstruction>> {
        use PipeInstruction::*;
        let s = self.stage_id;
        let (first, last) = (s == 0, s == self.stages - 1);
        let valid = |mb: i64| 0 <= mb && mb < self.micro_batches as i64;
        (0..self.micro_batches + self.stages - 1)
            .map(|step| {
                let mb = step as i64 - s as i64;
                // Even stages receive into the step's parity and send from the other buffer;
                // odd stages the opposite, so that neighbours' buffers line up.
                let (recv, send) = if s.is_multiple_of(2) {
                    (step % 2, (step + 1) % 2)
                } else {
                    ((step + 1) % 2, step % 2)
                };
                let mut cmds = Vec::new();
                if (first || last) && valid(mb) {
                    cmds.push(LoadMicroBatch { buffer: recv });
                }
                let send_cmd = (!last && valid(mb - 1)).then_some(SendActivation { buffer: send });
                let recv_cmd = (!first && valid(mb)).then_some(RecvActivation { buffer: recv });
                if s.is_multiple_of(2) {
                    cmds.extend(send_cmd);
                    cmds.extend(recv_cmd);
                } else {
                    cmds.extend(recv_cmd);
                    cmds.extend(send_cmd);
                }
                if valid(mb) {
                    cmds.push(ForwardPass { buffer: recv });
                }
                cmds
            })
            .collect()
    }
}

/// GPipe (arXiv 1811.06965), for comparison: every micro-batch forward, then every micro-batch
/// backward. Same 2(M + S − 1) steps as 1F1B, but a stage keeps all M activations alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GPipeSchedule {
    /// Micro-batches (M).
    pub micro_batches: usize,
    /// Pipeline stages (S).
    pub stages: usize,
    /// This stage (s).
    pub stage_id: usize,
}

impl GPipeSchedule {
    /// The schedule of stage `stage_id` of `stages` over `micro_batches`.
    ///
    /// # Panics
    /// When `stages` or `micro_batches` is 0 or `stage_id >= stages`.
    pub fn new(micro_batches: usize, stages: usize, stage_id: usize) -> Self {
        check_shape(micro_batches, stages, stage_id);
        Self {
            micro_batches,
            stages,
            stage_id,
        }
    }
}

impl PipeSchedule for GPipeSchedule {
    fn num_pipe_buffers(&self) -> usize {
        self.micro_batches
    }

    fn steps(&self) -> Vec<Vec<PipeInstruction>> {
        use PipeInstruction::*;
        let (m, stages, s) = (self.micro_batches, self.stages, self.stage_id);
        let (first, last) = (s == 0, s == stages - 1);
        let phase = m + stages - 1;
        let mut out = Vec::with_capacity(2 * phase);
        // Forward phase: stage s forwards micro-batch (step - s).
        for step in 0..phase {
            let mut cmds = Vec::new();
            if let Some(mb) = step.checked_sub(s).filter(|&mb| mb < m) {
                if !first {
                    cmds.push(RecvActivation { buffer: mb });
                }
                if first || last {
                    cmds.push(LoadMicroBatch { buffer: mb });
                }
                cmds.push(ForwardPass { buffer: mb });
                if !last {
                    cmds.push(SendActivation { buffer: mb });
                }
            }
            out.push(cmds);
        }
        // Backward phase: the last stage starts; stage s backwards micro-batch
        // (step - (S - 1 - s)).
        for step in 0..phase {
            let mut cmds = Vec::new();
            if let Some(mb) = step.checked_sub(stages - 1 - s).filter(|&mb| mb < m) {
                if !last {
                    cmds.push(RecvGrad { buffer: mb });
                }
                cmds.push(BackwardPass { buffer: mb });
                if !first {
                    cmds.push(SendGrad { buffer: mb });
                }
            }
            out.push(cmds);
        }
        if let Some(tail) = out.last_mut() {
            tail.extend([ReduceTiedGrads, ReduceGrads, OptimizerStep]);
        }
        out
    }
}
