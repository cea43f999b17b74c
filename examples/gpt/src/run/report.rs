//! [`RunReport`]: what a run measured, as the example's JSON summary prints it.

use std::collections::BTreeMap;
use std::time::Duration;

use burn_deepspeed::StepReport;
use burn_deepspeed::comm::OpKind;
use burn_deepspeed::grid::{AxisBytes, Grid};
use serde::Serialize;

/// A run's communication log (`comms_logger`), taken after the last step.
#[derive(Debug, Clone, Serialize)]
pub struct CommsReport {
    /// The logger's table.
    pub summary: String,
    /// Per kind of operation, `[calls, bytes sent, bytes received]` as the logger filed them.
    pub logged: BTreeMap<String, [u64; 3]>,
    /// The same from the counters of the grid's communicators (world and groups).
    pub measured: BTreeMap<String, [u64; 3]>,
}

impl CommsReport {
    /// The report of `grid`'s log, `None` when its world does not log.
    pub fn of(grid: &Grid) -> Option<Self> {
        let log = grid.world().comms_log()?;
        let traffic = grid.traffic();
        let logged = log
            .totals()
            .into_iter()
            .map(|(op, e)| {
                (
                    op.name().to_string(),
                    [e.count, e.bytes_sent, e.bytes_received],
                )
            })
            .collect();
        let measured = OpKind::ALL
            .into_iter()
            .map(|op| (op, traffic.get(op)))
            .filter(|(_, s)| s.calls > 0)
            .map(|(op, s)| {
                (
                    op.name().to_string(),
                    [s.calls, s.bytes_sent, s.bytes_received],
                )
            })
            .collect();
        Some(Self {
            summary: log.summary(),
            logged,
            measured,
        })
    }
}

/// The JSON summary of a run.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Data-parallel ranks.
    pub world: usize,
    /// `"threads"` or `"mpi"`.
    pub backend: String,
    /// ZeRO stage.
    pub zero_stage: u8,
    /// Parameter count.
    pub params: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// The step training started at (non-zero after a resume).
    pub first_step: u64,
    /// Global mean loss of each optimizer step run.
    pub losses: Vec<f64>,
    /// The global gradient norm (before clipping) of each optimizer step run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub grad_norms: Vec<f64>,
    /// MoQ: the lowest bits a weight was quantized at after each step (empty when off).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub moq_bits: Vec<u32>,
    /// Tokens per second over all ranks (wall clock of the whole run).
    pub tokens_per_s: f64,
    /// Samples per optimizer step over all ranks.
    pub train_batch_size: u64,
    /// Micro-batches per step on each rank.
    pub gradient_accumulation_steps: u64,
    /// Bytes of parameters + gradients + optimizer state a rank holds after the last step,
    /// measured where they are allocated (the largest over ranks).
    pub model_state_bytes_per_rank: u64,
    /// The largest such figure during a step, transient buffers included, measured (the
    /// largest over ranks).
    pub peak_model_state_bytes_per_rank: u64,
    /// What ZeRO's formula gives for the same run (fp32 Adam: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N,
    /// 16Ψ/N; pipelined runs: the largest stage's 16Ψ_stage), not measured.
    pub model_state_bytes_formula: u64,
    /// Bytes each rank's transport sent, in rank order (measured).
    pub comm_bytes_per_rank: Vec<u64>,
    /// Bytes the ring model says each rank sent, in rank order (modelled, for comparison).
    pub comm_bytes_model_per_rank: Vec<u64>,
    /// Bytes each rank sent along each axis of the grid (tensor, pipe, data, other), in rank
    /// order (measured by the communicators).
    pub comm_bytes_per_axis: Vec<AxisBytes>,
    /// Bytes rank 0's transport sent in each optimizer step (data-parallel runs; measured).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub comm_bytes_per_step: Vec<u64>,
    /// Bytes the ring model says rank 0 sent in each optimizer step (data-parallel runs;
    /// modelled).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub comm_bytes_model_per_step: Vec<u64>,
    /// Steps that exchanged 1-bit compressed momenta instead of all-reducing gradients.
    pub compressed_steps: u64,
    /// The working dtype of parameters and gradients: `fp32`, `fp16` or `bf16` (16-bit runs
    /// keep fp32 masters).
    pub dtype: String,
    /// fp16: the loss scale each step's gradients were computed with.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub loss_scale: Vec<f32>,
    /// Steps skipped because the gradient overflowed (DeepSpeed's `skipped_steps`).
    pub skipped_steps: u64,
    /// The most heap one micro-batch's forward and backward held above what was live before
    /// them, over the run (this rank's engine; measured through the counting allocator the
    /// example installs; process-wide, so thread ranks count each other's). Data-parallel
    /// runs only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_activation_bytes: Option<u64>,
    /// Whether the blocks were activation checkpoints (the config's
    /// `activation_checkpointing` section).
    pub activation_checkpointing: bool,
    /// Bytes of activation checkpoints copied to host memory in one step, the most over the
    /// run (`cpu_checkpointing`; this rank's, counted as each copy is made). Data-parallel
    /// runs only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_host_bytes: Option<u64>,
    /// The positions of each sequence (all ranks of a sequence-parallel group together).
    pub seq_len: usize,
    /// How the model kept its activations over long sequences: blockwise attention.
    pub blockwise_attention: bool,
    /// ... and the positions per tile of its MLP and loss (none: whole sequences).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tile: Option<usize>,
    /// Progressive layer dropping: θ of the last step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pld_theta: Option<f64>,
    /// Seconds per sample over all ranks, for each step run (wall clock of the step).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub step_seconds_per_sample: Vec<f64>,
    /// Seconds of forward and backward (all micro-batches) per step, on rank 0.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub forward_backward_seconds: Vec<f64>,
    /// Seconds of the optimizer step (with its swapping, and the write-back of the stepped
    /// parameters) per step, on rank 0.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub optimizer_seconds: Vec<f64>,
    /// Data-parallel runs: each rank's mean time per step in each phase, over the steps
    /// after the first (measured; `other` is the step's wall clock less the phases: batch
    /// creation, the engine's bookkeeping), in rank order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub breakdown_per_rank: Vec<StepBreakdown>,
    /// Peak resident memory of the process (the largest over ranks' processes).
    pub peak_rss_bytes: u64,
    /// The device the model trained on (`flex`, `wgpu`, `cuda`).
    pub device: String,
    /// Bytes rank 0 copied between host memory and the model's device in each step (both
    /// directions, counted where the copies happen, the batch's token upload aside; zero on
    /// Flex, whose tensors are host memory).
    pub host_device_bytes_per_step: Vec<u64>,
    /// The part of `host_device_bytes_per_step` that staged a collective through host memory
    /// (the only path between wgpu ranks): equal to it where training is device-resident.
    pub staged_collective_bytes_per_step: Vec<u64>,
    /// Pipeline stages (1 without pipeline parallelism).
    pub pipeline_stages: usize,
    /// Data-parallel replicas (`world / (pipeline_stages · tensor_parallel)`).
    pub data_parallel: usize,
    /// Tensor-parallel slices of each layer (`tensor_parallel.tp_size`).
    pub tensor_parallel: usize,
    /// Pipelined runs: each stage's idle share of its schedule, 1 − (forward + backward
    /// time) / (schedule time) summed over the run, averaged over every rank.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bubble_fraction: Option<f64>,
    /// Pipelined runs: the most activations each stage held at once, stage 0 first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_live_activations_per_stage: Option<Vec<usize>>,
    /// ZeRO stage 3: rank 0's gather counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gather_stats: Option<burn_deepspeed::zero3::GatherStats>,
    /// Where the optimizer state lived (`zero_optimization.offload_optimizer.device`:
    /// `none`, `cpu` or `nvme`).
    pub offload_optimizer: String,
    /// NVMe offload: rank 0's swap file and its transfers over the run (measured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swap: Option<SwapReport>,
    /// Where the stage-3 parameter pieces lived (`zero_optimization.offload_param.device`).
    pub offload_param: String,
    /// Parameter offload: rank 0's pieces in host memory and swap file, and its transfers
    /// over the run (measured).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub param_store: Option<ParamStoreReport>,
    /// The disk's own `O_DIRECT` bandwidth, measured in the same run before training
    /// (`--measure-disk-gb`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_baseline: Option<DiskBaselineReport>,
    /// `comms_logger`: rank 0's communication log, and its totals beside the
    /// communicators' own counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comms: Option<CommsReport>,
    /// Data-parallel runs: the parameters after the last step, flat in layout order (for
    /// comparisons in tests; not serialized).
    #[serde(skip)]
    pub final_params: FlatParams,
    /// Data-parallel runs at ZeRO stages 1-3: the optimizer's first and second moments after
    /// the last step, whole and flat in layout order (for comparisons in tests; not
    /// serialized).
    #[serde(skip)]
    pub final_moments: Option<(FlatParams, FlatParams)>,
    /// Ranks that split each MoE layer's experts (1 for a dense GPT).
    pub ep_size: usize,
    /// Mean next-byte cross-entropy over the held-out bytes after the last step (with
    /// `RunSpec::heldout`).
    pub heldout_loss: Option<f64>,
    /// Tokens the held-out loss averages over.
    pub heldout_tokens: Option<usize>,
    /// Steps that learned from the teacher (with `RunSpec::teacher`).
    pub distilled_steps: u64,
    /// A GPT-MoE's routing figures (rank 0's), `None` for a dense GPT.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeReport>,
}

/// One rank's mean milliseconds per step in each phase of the step (see
/// [`StepReport`](burn_deepspeed::StepReport)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepBreakdown {
    /// Forward passes (the time in the model's `TrainStep::step` less its backward passes).
    pub forward: f64,
    /// Backward passes.
    pub backward: f64,
    /// Handing each micro-batch's gradients to the regime (copies into its buffers; at
    /// stages 2-3 the bucket reductions that run as buckets fill).
    pub accumulate: f64,
    /// Waiting at the reduction for the slowest rank (measured with `wall_clock_breakdown`
    /// only, else 0).
    pub reduce_wait: f64,
    /// The reduction's own time: moving and summing the gradients.
    pub reduce: f64,
    /// The optimizer step, with the parameters' write-back into the model.
    pub optimizer: f64,
    /// The rest of the step's wall clock.
    pub other: f64,
    /// The whole step.
    pub step: f64,
}

impl StepBreakdown {
    /// As eight numbers, in field order.
    pub(crate) fn words(&self) -> [f64; 8] {
        [
            self.forward,
            self.backward,
            self.accumulate,
            self.reduce_wait,
            self.reduce,
            self.optimizer,
            self.other,
            self.step,
        ]
    }

    pub(crate) fn from_words(w: [f64; 8]) -> Self {
        Self {
            forward: w[0],
            backward: w[1],
            accumulate: w[2],
            reduce_wait: w[3],
            reduce: w[4],
            optimizer: w[5],
            other: w[6],
            step: w[7],
        }
    }

    /// Adds one step (`wall`: its wall clock) to running sums in milliseconds.
    pub(crate) fn add(&mut self, report: &StepReport, wall: Duration) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let forward = report
            .forward
            .unwrap_or(report.forward_backward.saturating_sub(report.accumulate));
        let backward = report.backward.unwrap_or_default();
        let wait = report.reduce_wait.unwrap_or_default();
        let phases =
            forward + backward + report.accumulate + wait + report.reduce + report.optimizer;
        self.forward += ms(forward);
        self.backward += ms(backward);
        self.accumulate += ms(report.accumulate);
        self.reduce_wait += ms(wait);
        self.reduce += ms(report.reduce);
        self.optimizer += ms(report.optimizer);
        self.other += ms(wall.saturating_sub(phases));
        self.step += ms(wall);
    }

    /// The sums divided by `steps`.
    pub(crate) fn mean(&self, steps: u64) -> Self {
        let n = steps.max(1) as f64;
        Self::from_words(self.words().map(|w| w / n))
    }
}

/// A GPT-MoE's routing over the run, on rank 0 (every MoE block and micro-batch of a step
/// together).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MoeReport {
    /// Mean load-balancing loss of the MoE blocks in each step.
    pub l_aux: Vec<f64>,
    /// Tokens dropped (by every choice) in each step, summed over the MoE blocks.
    pub tokens_dropped: Vec<u64>,
    /// Tokens routed in each step, summed over the MoE blocks.
    pub tokens_routed: Vec<u64>,
    /// Load balance of each step: the busiest expert's count over the mean count (1 is
    /// even), averaged over the MoE blocks' forwards.
    pub load_balance: Vec<f64>,
    /// Bytes rank 0 sent over its expert-parallel group in each step: the all-to-alls of
    /// forward and backward (measured by the communicator; 0 at `ep_size` 1).
    pub all_to_all_bytes: Vec<u64>,
}

impl MoeReport {
    pub(crate) fn record(&mut self, step: crate::model::MoeTally, exchanged: u64) {
        self.l_aux
            .push(step.l_aux_sum / step.forwards.max(1) as f64);
        self.tokens_dropped.push(step.dropped as u64);
        self.tokens_routed.push(step.tokens as u64);
        self.load_balance
            .push(step.balance_sum / step.forwards.max(1) as f64);
        self.all_to_all_bytes.push(exchanged);
    }
}

/// The disk's own sequential `O_DIRECT` bandwidth (8 MiB requests, one thread), measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiskBaselineReport {
    /// Bytes written, then read.
    pub bytes: u64,
    /// Write bandwidth (GB/s).
    pub write_gb_per_s: f64,
    /// Read bandwidth (GB/s).
    pub read_gb_per_s: f64,
}

impl From<burn_deepspeed::swap::DiskBaseline> for DiskBaselineReport {
    fn from(b: burn_deepspeed::swap::DiskBaseline) -> Self {
        Self {
            bytes: b.bytes,
            write_gb_per_s: b.write_gb_per_s(),
            read_gb_per_s: b.read_gb_per_s(),
        }
    }
}

/// A parameter store's figures in a report (ZeRO-Infinity's `offload_param`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParamStoreReport {
    /// Bytes of pieces kept in host memory.
    pub host_bytes: u64,
    /// The swap file, under `nvme`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swap: Option<SwapReport>,
    /// Gathers that found their piece read ahead.
    pub read_ahead_hits: u64,
    /// Gathers that read their piece themselves.
    pub reads_on_demand: u64,
}

impl From<burn_deepspeed::zero3::ParamStoreSummary> for ParamStoreReport {
    fn from(s: burn_deepspeed::zero3::ParamStoreSummary) -> Self {
        Self {
            host_bytes: s.host_bytes,
            swap: s.swap.map(SwapReport::from),
            read_ahead_hits: s.read_ahead_hits,
            reads_on_demand: s.reads_on_demand,
        }
    }
}

/// A swap file's figures in a report (ZeRO-Infinity), measured where transfers happen.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SwapReport {
    /// `io_uring` or `pread`.
    pub engine: String,
    /// Whether transfers bypassed the page cache (`O_DIRECT`).
    pub direct: bool,
    /// Bytes of the swap file on disk.
    pub disk_bytes: u64,
    /// Bytes of host memory its tile buffers held.
    pub buffer_bytes: u64,
    /// Bytes read from it.
    pub bytes_read: u64,
    /// Bytes written to it.
    pub bytes_written: u64,
    /// Read throughput: bytes read over the time spent in reads (GB/s).
    pub read_gb_per_s: f64,
    /// Write throughput (GB/s).
    pub write_gb_per_s: f64,
}

impl From<burn_deepspeed::swap::SwapSummary> for SwapReport {
    fn from(s: burn_deepspeed::swap::SwapSummary) -> Self {
        let rate = |bytes: u64, secs: f64| match secs > 0.0 {
            true => bytes as f64 / secs / 1e9,
            false => 0.0,
        };
        Self {
            engine: s.engine.name().into(),
            direct: s.direct,
            disk_bytes: s.disk_bytes,
            buffer_bytes: s.buffer_bytes,
            bytes_read: s.stats.bytes_read,
            bytes_written: s.stats.bytes_written,
            read_gb_per_s: rate(s.stats.bytes_read, s.stats.read_secs),
            write_gb_per_s: rate(s.stats.bytes_written, s.stats.write_secs),
        }
    }
}

impl RunReport {
    /// Tokens per second over the timed steps (all but the first, a warm-up), for sequences
    /// of `seq` tokens.
    pub fn timed_tokens_per_s(&self, seq: usize) -> f64 {
        let timed = self.step_seconds_per_sample.iter().skip(1);
        let secs: f64 = timed.map(|s| s * self.train_batch_size as f64).sum();
        let steps = self.step_seconds_per_sample.len().saturating_sub(1) as u64;
        (steps * self.train_batch_size * seq as u64) as f64 / secs
    }
}

/// Flat parameter values; `Debug` prints only their count.
#[derive(Clone, Default, PartialEq)]
pub struct FlatParams(pub Vec<f32>);

impl std::fmt::Debug for FlatParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{} values]", self.0.len())
    }
}

impl FlatParams {
    /// FNV-1a (64-bit) over the values' bits in order: equal digests mean bit-identical
    /// parameters (up to a hash collision), for comparing runs across builds.
    pub fn digest(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for v in &self.0 {
            for b in v.to_bits().to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        format!("{h:016x}")
    }
}

impl std::ops::Deref for FlatParams {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}
