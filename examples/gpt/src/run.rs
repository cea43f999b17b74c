//! The training driver of the example: one call per rank (SPMD).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::{Device, Int, Tensor};
use burn_deepspeed::comm::{Communicator, CommunicatorExt, OpKind};
use burn_deepspeed::distill::DistillationConfig;
use burn_deepspeed::flat::{ParamLayout, params_to_flat};
use burn_deepspeed::grid::{AxisBytes, Grid};
use burn_deepspeed::launch::launch;
use burn_deepspeed::pipe::PipelineEngine;
use burn_deepspeed::progress::TrainProgress;
use burn_deepspeed::transfer::{host_device_bytes, staged_collective_bytes};
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine, DeepSpeedError, Result, StepReport};
use serde::Serialize;

use crate::data::ByteCorpus;
use crate::generate::GenerateSpec;
use crate::model::{Gpt, GptShape, LayerDrop, SoftTargets, SplitMix64};

/// What one run trains.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// The DeepSpeed config (batch sizes, optimizer, schedule, ZeRO...).
    pub config: DeepSpeedConfig,
    /// Model size.
    pub shape: GptShape,
    /// Optimizer steps.
    pub steps: u64,
    /// Training data.
    pub corpus: ByteCorpus,
    /// Seed of the initialization.
    pub seed: u64,
    /// Show the progress bar (rank 0).
    pub progress: bool,
    /// Save a checkpoint here after the last step (pipelined runs: at ZeRO stage 1, loadable
    /// on any grid).
    pub save_dir: Option<PathBuf>,
    /// Resume from the latest checkpoint here; training continues at the saved step, on the
    /// batches an uninterrupted run would see.
    pub resume_from: Option<PathBuf>,
    /// Gather the whole parameters and moments after the last step into the report (for
    /// tests' comparisons; a model larger than memory must not).
    pub keep_final_state: bool,
    /// Where the model trains.
    pub device: ModelDevice,
    /// Expert parallelism of a GPT-MoE: ranks that split each MoE layer's experts (1: every
    /// rank holds every expert).
    pub ep_size: usize,
    /// Knowledge distillation from a trained teacher (Mixture-of-Students), if any.
    pub teacher: Option<Teacher>,
    /// Held-out bytes: the report's held-out loss after the last step, over their
    /// non-overlapping windows.
    pub heldout: Option<Arc<Vec<u8>>>,
}

/// A trained teacher and how a student learns from it (DeepSpeed-MoE's Mixture-of-Students,
/// arXiv 2201.05596 §5; see [`burn_deepspeed::distill`]). The teacher runs whole on every
/// rank, in evaluation mode on the host, beside the engine: the engine never sees it.
#[derive(Debug, Clone)]
pub struct Teacher {
    /// The teacher, on plain Flex (no autodiff).
    pub model: Gpt,
    /// How the student learns from it.
    pub distill: Arc<DistillationConfig>,
}

impl Teacher {
    /// The GPT of `shape` in checkpoint `dir` (its latest, written at any world size, ZeRO
    /// stage or `ep_size`) as a teacher, refused with the reason when the checkpoint holds
    /// another model or `distill` is invalid.
    pub fn from_checkpoint(
        dir: &Path,
        shape: GptShape,
        distill: DistillationConfig,
    ) -> Result<Self> {
        distill.validate()?;
        let params = GenerateSpec::params_from_checkpoint(dir, shape)?;
        Ok(Self {
            model: Gpt::from_params(shape, &params, &Device::flex())?,
            distill: Arc::new(distill),
        })
    }

    /// The teacher's logits for `inputs`, on `device` (constants for the student's loss).
    fn soft_targets(&self, inputs: &Tensor<2, Int>, device: &Device) -> SoftTargets {
        let logits = self
            .model
            .forward(inputs.clone().to_device(&Device::flex()));
        SoftTargets {
            logits: logits.to_device(device),
            distill: self.distill.clone(),
        }
    }
}

/// The device a rank's model trains on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelDevice {
    /// Burn's Flex, on the CPU (host memory: no host/device copies).
    #[default]
    Flex,
    /// The default wgpu adapter (Vulkan, Metal, DX12; Mesa's lavapipe on a CPU); feature
    /// `wgpu`.
    Wgpu,
    /// CUDA GPU `rank` (one GPU per rank); feature `cuda`.
    Cuda,
}

impl ModelDevice {
    /// The device named `name` (`flex`, `wgpu`, `cuda`), refused with the reason when this
    /// build lacks its feature.
    pub fn parse(name: &str) -> Result<Self> {
        let device = match name {
            "flex" => Self::Flex,
            "wgpu" => Self::Wgpu,
            "cuda" => Self::Cuda,
            other => {
                return Err(DeepSpeedError::Data(format!(
                    "unknown device `{other}`: expected flex, wgpu or cuda"
                )));
            }
        };
        let built = match device {
            Self::Flex => true,
            Self::Wgpu => cfg!(feature = "wgpu"),
            Self::Cuda => cfg!(feature = "cuda"),
        };
        if !built {
            return Err(DeepSpeedError::Data(format!(
                "device `{name}` needs this example built with `--features {name}`"
            )));
        }
        Ok(device)
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Flex => "flex",
            Self::Wgpu => "wgpu",
            Self::Cuda => "cuda",
        }
    }

    /// Rank `rank`'s autodiff device.
    pub fn device(self, rank: usize) -> Device {
        let _ = rank;
        let device = match self {
            Self::Flex => Device::flex(),
            #[cfg(feature = "wgpu")]
            Self::Wgpu => Device::from(burn::backend::wgpu::WgpuDevice::default()),
            // Ranks share the GPUs round-robin (NCCL then needs one rank per GPU; ranks that
            // share one stage their collectives through the host).
            #[cfg(feature = "cuda")]
            Self::Cuda => Device::cuda(rank % burn_deepspeed::device::cuda_device_count().max(1)),
            #[allow(unreachable_patterns)]
            other => unreachable!("ModelDevice::parse refuses {other:?} without its feature"),
        };
        device.autodiff()
    }
}

impl RunSpec {
    /// `steps` steps of `shape` with `config` on the embedded corpus (windows drawn from
    /// `data_seed`, initialization from `seed`), without progress bar or checkpoints.
    pub fn on_embedded_corpus(
        config: DeepSpeedConfig,
        shape: GptShape,
        steps: u64,
        data_seed: u64,
        seed: u64,
    ) -> Self {
        Self {
            config,
            shape,
            steps,
            corpus: ByteCorpus::new(crate::data::EMBEDDED_CORPUS.to_vec(), data_seed),
            seed,
            progress: false,
            save_dir: None,
            resume_from: None,
            keep_final_state: true,
            device: ModelDevice::Flex,
            ep_size: 1,
            teacher: None,
            heldout: None,
        }
    }
}

/// Runs `spec` on `world` thread ranks and returns rank 0's report.
pub fn run_in_threads(world: usize, spec: &RunSpec, timeout: Duration) -> Result<RunReport> {
    let (_, reports) = launch(world, timeout, |comm| run_rank(spec, comm))?;
    reports
        .into_iter()
        .next()
        .ok_or_else(|| DeepSpeedError::Data("no rank reported".into()))
}

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
    fn words(&self) -> [f64; 8] {
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

    fn from_words(w: [f64; 8]) -> Self {
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
    fn add(&mut self, report: &StepReport, wall: Duration) {
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
    fn mean(&self, steps: u64) -> Self {
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
    fn record(&mut self, step: crate::model::MoeTally, exchanged: u64) {
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

/// Trains on this rank: data parallel, or through the pipeline engine when the config has
/// `"pipeline": {"stages": S}` (S stages x world/S replicas). Every rank returns the same
/// report.
pub fn run_rank(spec: &RunSpec, comm: Arc<dyn Communicator>) -> Result<RunReport> {
    check_corpus(spec)?;
    if spec
        .config
        .pipeline
        .as_ref()
        .and_then(|p| p.stage_count())
        .is_some()
    {
        return run_pipelined(spec, comm);
    }
    let device = spec.device.device(comm.rank());
    let (rank, world) = (comm.rank(), comm.world_size());
    // ANCHOR: engine_loop
    // The grid of `tensor_parallel.tp_size` slices x the data-parallel replicas; each rank
    // builds the whole model from the seed and keeps its slice.
    let grid = Grid::from_config(&spec.config, comm.clone(), &device)?
        .with_expert_parallel(spec.ep_size, &device)?;
    // A GPT-MoE keeps its experts of the expert-parallel group; each data-parallel rank
    // routes with its own draws.
    if spec.teacher.is_some() && grid.topology().tensor > 1 {
        return Err(DeepSpeedError::Unsupported {
            key: "tensor_parallel.tp_size".into(),
            reason: "a student learns from its teacher over the whole vocabulary: train it \
                     without tensor slicing"
                .into(),
        });
    }
    let model = Gpt::new(spec.shape, spec.seed, &device)
        .with_activation_checkpointing(spec.config.activation_checkpointing.is_some())
        .sliced(grid.tensor_parallel())
        .with_experts(grid.expert_parallel(), moe_seed(spec, rank))?;
    let moe_log = model.moe_log().clone();
    let mut engine = DeepSpeedEngine::with_grid(model, spec.config.clone(), &grid)?;
    if let Some(dir) = &spec.resume_from {
        engine.load_checkpoint(dir, None)?;
    }
    let batch = engine.batch();
    let seq = spec.shape.seq_len;
    engine.set_tokens_per_sample(seq as u64);
    // `flops_profiler`: the forward of one micro-batch, for the profile at `profile_step`.
    let micro = batch.train_micro_batch_size_per_gpu as usize;
    engine.set_profile_forward(move |m: &Gpt, device: &Device| {
        drop(m.forward(Tensor::<2, Int>::zeros([micro, seq], device)));
    });
    let gas = batch.gradient_accumulation_steps;
    let progress = TrainProgress::new(if spec.progress { rank } else { usize::MAX }, spec.steps);
    let inner = device.clone().inner();
    let first_step = engine.global_step();
    if first_step > spec.steps {
        return Err(DeepSpeedError::Data(format!(
            "--steps {} is below the step the checkpoint resumes from ({first_step}); ask for \
             at least {first_step} steps",
            spec.steps
        )));
    }
    // Capacity for what a report keeps, not a blind allocation of `--steps` entries.
    let mut losses = Vec::with_capacity((spec.steps - first_step).min(1 << 16) as usize);
    let mut grad_norms = Vec::with_capacity(losses.capacity());
    let mut moq_bits = Vec::new();
    let (mut per_step_bytes, mut per_sample, mut compressed) = (Vec::new(), Vec::new(), 0);
    let mut per_step_model_bytes = Vec::new();
    let (mut fb_seconds, mut optimizer_seconds) = (Vec::new(), Vec::new());
    let (mut host_device, mut staged) = (Vec::new(), Vec::new());
    let (mut breakdown, mut timed_steps) = (StepBreakdown::default(), 0u64);
    let mut pld_theta = None;
    let mut loss_scale = Vec::new();
    let mut peak_activation = None;
    let mut moe = spec.shape.moe.map(|_| MoeReport::default());
    let all_to_all = || {
        grid.expert_parallel()
            .ep_group()
            .map_or(0, |c| c.stats().total_sent())
    };
    let start = Instant::now();
    for step in first_step..spec.steps {
        let step_start = Instant::now();
        let (copied, staged_before) = (host_device_bytes(), staged_collective_bytes());
        let exchanged = all_to_all();
        let report = train_step(&mut engine, spec, step, &inner)?;
        // ANCHOR_END: engine_loop
        if let Some(moe) = &mut moe {
            moe.record(moe_log.drain(), all_to_all() - exchanged);
        }
        host_device.push(host_device_bytes() - copied);
        staged.push(staged_collective_bytes() - staged_before);
        losses.push(report.loss);
        grad_norms.push(report.grad_norm);
        moq_bits.extend(report.moq_bits);
        per_step_bytes.push(report.bytes_sent);
        per_step_model_bytes.push(report.model_bytes_sent);
        let wall = step_start.elapsed();
        per_sample.push(wall.as_secs_f64() / batch.train_batch_size as f64);
        // The first step warms up (allocations, the optimizer's state): not in the means.
        if step > first_step {
            breakdown.add(&report, wall);
            timed_steps += 1;
        }
        fb_seconds.push(report.forward_backward.as_secs_f64());
        optimizer_seconds.push(report.optimizer.as_secs_f64());
        compressed += u64::from(report.compressed);
        pld_theta = report.pld_theta;
        loss_scale.extend(report.loss_scale);
        peak_activation = peak_activation.max(report.peak_activation_bytes);
        let elapsed = start.elapsed().as_secs_f64();
        let tokens = (step + 1 - first_step) * batch.train_batch_size * seq as u64;
        progress.update(step + 1, report.loss, tokens as f64 / elapsed);
        let every = engine.config().steps_per_print.max(1);
        if (step + 1) % every == 0 {
            tracing::info!(step = step + 1, loss = report.loss, lr = report.lr, "step");
        }
    }
    if let Some(dir) = &spec.save_dir {
        engine.save_checkpoint(dir, None)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    progress.finish();
    // Before the figures' own collective, which runs on the world beneath the logger.
    let comms = CommsReport::of(&grid);
    let figures = gather_figures(
        comm.as_ref(),
        RankFigures {
            axis: grid.bytes_sent_per_axis(),
            sent: comm.stats().total_sent(),
            model_sent: comm.stats().total_model_sent(),
            state: engine.model_state_bytes().total(),
            formula: engine.model_state_bytes_formula(),
            peak_state: engine.peak_model_state_bytes(),
            rss: peak_rss_bytes(),
            bubble: 0.0,
            live_activations: 0,
            breakdown: breakdown.mean(timed_steps),
        },
    )?;
    // Collectives for the held-out loss and the tests' comparisons, after the traffic
    // figures were taken.
    let heldout = match &spec.heldout {
        Some(bytes) => Some(crate::generate::heldout(
            &burn::module::Module::valid(engine.model()),
            None,
            bytes,
            spec.shape.seq_len,
        )?),
        None => None,
    };
    let moments = match spec.keep_final_state {
        true => engine
            .optimizer_moments()?
            .map(|s| (FlatParams(s.m), FlatParams(s.v))),
        false => None,
    };
    Ok(RunReport {
        world,
        backend: comm.backend().to_string(),
        zero_stage: engine.config().zero_optimization.stage.into(),
        params: engine.model_params(),
        steps: spec.steps,
        first_step,
        losses,
        grad_norms,
        moq_bits,
        tokens_per_s: ((spec.steps - first_step) * batch.train_batch_size * seq as u64) as f64
            / elapsed,
        train_batch_size: batch.train_batch_size,
        gradient_accumulation_steps: gas,
        model_state_bytes_per_rank: figures.iter().map(|f| f.state).max().unwrap_or(0),
        peak_model_state_bytes_per_rank: figures.iter().map(|f| f.peak_state).max().unwrap_or(0),
        model_state_bytes_formula: engine.model_state_bytes_formula(),
        comm_bytes_per_rank: figures.iter().map(|f| f.sent).collect(),
        comm_bytes_model_per_rank: figures.iter().map(|f| f.model_sent).collect(),
        comm_bytes_per_axis: figures.iter().map(|f| f.axis).collect(),
        comm_bytes_per_step: per_step_bytes,
        comm_bytes_model_per_step: per_step_model_bytes,
        compressed_steps: compressed,
        dtype: engine.config().precision_name().into(),
        loss_scale,
        skipped_steps: engine.skipped_steps(),
        peak_activation_bytes: peak_activation,
        activation_checkpointing: engine.config().activation_checkpointing.is_some(),
        pld_theta,
        step_seconds_per_sample: per_sample,
        forward_backward_seconds: fb_seconds,
        optimizer_seconds,
        breakdown_per_rank: figures.iter().map(|f| f.breakdown).collect(),
        peak_rss_bytes: figures.iter().map(|f| f.rss).max().unwrap_or(0),
        device: spec.device.name().into(),
        host_device_bytes_per_step: host_device,
        staged_collective_bytes_per_step: staged,
        pipeline_stages: 1,
        data_parallel: grid.topology().data,
        tensor_parallel: grid.topology().tensor,
        bubble_fraction: None,
        peak_live_activations_per_stage: None,
        gather_stats: engine.gather_stats(),
        offload_optimizer: engine
            .config()
            .zero_optimization
            .optimizer_offload()
            .name()
            .into(),
        swap: engine.swap().map(SwapReport::from),
        offload_param: engine
            .config()
            .zero_optimization
            .offload_param
            .as_ref()
            .map_or("none", |o| o.device.name())
            .into(),
        param_store: engine.param_store().map(ParamStoreReport::from),
        disk_baseline: None,
        final_params: match spec.keep_final_state {
            true => FlatParams(engine.flat_params()?),
            false => FlatParams::default(),
        },
        final_moments: moments,
        ep_size: grid.expert_parallel().size(),
        heldout_loss: heldout.map(|h| h.loss),
        heldout_tokens: heldout.map(|h| h.tokens),
        distilled_steps: spec.teacher.as_ref().map_or(0, |t| {
            (first_step..spec.steps)
                .filter(|&s| t.distill.teaches_at(s))
                .count() as u64
        }),
        moe,
        comms,
    })
}

// ANCHOR: train_step
/// One data-parallel optimizer step on this rank: the rank's micro-batches of global step
/// `step` (with θ(t) in each batch when progressive layer dropping is on), through the engine.
pub fn train_step(
    engine: &mut DeepSpeedEngine<Gpt>,
    spec: &RunSpec,
    step: u64,
    device: &Device,
) -> Result<StepReport> {
    let (rank, world) = (
        engine.comm().rank() as u64,
        engine.comm().world_size() as u64,
    );
    let batch = engine.batch();
    let micro = batch.train_micro_batch_size_per_gpu;
    // Progressive layer dropping: θ(t) travels in the batch, as DeepSpeed passes it to the
    // model's forward.
    let theta = engine.pld_theta();
    // The MoE layers draw from (seed, step): a resumed run draws as an uninterrupted one.
    engine
        .model()
        .reseed_experts(moe_seed(spec, rank as usize), step);
    // Global sequence index of (micro-step k, rank r, row i) = (k·world + r)·micro + i: the
    // ranks hold disjoint shards of each global batch.
    let micro_batches = (0..batch.gradient_accumulation_steps).map(|k| {
        let first = (k * world + rank) * micro;
        // One draw per micro-step, the same on every rank: the ranks drop the same blocks,
        // which ZeRO-3 needs (a dropped block is not gathered, so ranks that dropped
        // different blocks would pair different gathers).
        let layer_drop = theta.map(|theta| LayerDrop {
            theta,
            seed: SplitMix64::new(spec.seed ^ (step << 32) ^ k).next_u64(),
        });
        let batch = spec
            .corpus
            .batch(step, first, micro as usize, spec.shape.seq_len, device)
            .with_layer_drop(layer_drop);
        // Mixture-of-Students: the teacher's logits for this micro-batch while it teaches.
        let soft = spec
            .teacher
            .as_ref()
            .filter(|t| t.distill.teaches_at(step))
            .map(|t| t.soft_targets(&batch.inputs, device));
        batch.with_soft_targets(soft)
    });
    engine.train_batch(micro_batches)
}
// ANCHOR_END: train_step

/// Data-parallel rank `rank`'s seed of the MoE layers' draws (each rank routes with its own,
/// as each DeepSpeed rank has its own generator).
fn moe_seed(spec: &RunSpec, rank: usize) -> u64 {
    spec.seed ^ (rank as u64) << 40
}

fn check_corpus(spec: &RunSpec) -> Result<()> {
    let seq = spec.shape.seq_len;
    if spec.corpus.len() <= seq + 1 {
        return Err(DeepSpeedError::Data(format!(
            "the corpus has {} bytes; at least {} are needed for sequences of {seq}",
            spec.corpus.len(),
            seq + 2
        )));
    }
    Ok(())
}

/// Trains one stage of the pipelined GPT on this rank.
fn run_pipelined(spec: &RunSpec, comm: Arc<dyn Communicator>) -> Result<RunReport> {
    if spec.shape.moe.is_some() || spec.ep_size > 1 {
        return Err(DeepSpeedError::Unsupported {
            key: "pipeline.stages".into(),
            reason: "the GPT-MoE presets train without pipeline parallelism".into(),
        });
    }
    if spec.teacher.is_some() || spec.heldout.is_some() {
        return Err(DeepSpeedError::Unsupported {
            key: "pipeline.stages".into(),
            reason: "a teacher and a held-out loss need the whole model's logits on every \
                     rank: train without pipeline parallelism"
                .into(),
        });
    }
    let device = spec.device.device(comm.rank());
    let rank = comm.rank();
    let world = comm.world_size();
    // ANCHOR: pipe_loop
    // The 3D grid: `pipeline.stages` x the replicas x `tensor_parallel.tp_size` slices.
    let grid = Grid::from_config(&spec.config, comm.clone(), &device)?;
    let tp = grid.tensor_parallel().clone();
    let layers = Gpt::new(spec.shape, spec.seed, &device)
        .sliced(&tp)
        .into_layers();
    let mut engine = PipelineEngine::with_grid(layers, spec.config.clone(), &grid, device.clone())?;
    // A checkpoint written on any grid continues here, on the batches an uninterrupted run
    // would see.
    let first_step = match &spec.resume_from {
        Some(dir) => engine.load_checkpoint(dir, None)?,
        None => 0,
    };
    if first_step > spec.steps {
        return Err(DeepSpeedError::Data(format!(
            "--steps {} is below the step the checkpoint resumes from ({first_step})",
            spec.steps
        )));
    }
    let batch = engine.batch();
    let topo = engine.topology();
    let replica = engine.replica();
    engine.set_tokens_per_sample(spec.shape.seq_len as u64);
    let seq = spec.shape.seq_len;
    let micro = batch.train_micro_batch_size_per_gpu as usize;
    let progress = TrainProgress::new(if spec.progress { rank } else { usize::MAX }, spec.steps);
    let inner = device.clone().inner();
    let mut losses = Vec::with_capacity(spec.steps.min(1 << 16) as usize);
    let mut grad_norms = Vec::with_capacity(losses.capacity());
    let mut loss_scale = Vec::new();
    let (mut compute, mut scheduled, mut live) = (0.0f64, 0.0f64, 0usize);
    let (mut host_device, mut staged) = (Vec::new(), Vec::new());
    let start = Instant::now();
    for step in first_step..spec.steps {
        let (copied, staged_before) = (host_device_bytes(), staged_collective_bytes());
        // Replica d's micro-batch k holds the rows a data-parallel rank d would train on.
        let report = engine.train_batch(|k| {
            let first = (k as u64 * topo.replicas as u64 + replica as u64) * micro as u64;
            spec.corpus
                .batch(step, first, micro, seq, &inner)
                .with_vocab_group(tp.clone())
        })?;
        // ANCHOR_END: pipe_loop
        host_device.push(host_device_bytes() - copied);
        staged.push(staged_collective_bytes() - staged_before);
        losses.push(report.loss);
        grad_norms.push(report.grad_norm);
        loss_scale.extend(report.loss_scale);
        compute += report.compute_time.as_secs_f64();
        scheduled += report.schedule_time.as_secs_f64();
        live = live.max(report.peak_live_activations);
        let tokens = (step + 1 - first_step) * batch.train_batch_size * seq as u64;
        progress.update(
            step + 1,
            report.loss,
            tokens as f64 / start.elapsed().as_secs_f64(),
        );
    }
    if let Some(dir) = &spec.save_dir {
        engine.save_checkpoint(dir, None)?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    progress.finish();
    let state = engine.model_state_bytes().total();
    let (sent, model_sent) = engine.bytes_sent();
    let comms = CommsReport::of(&grid);
    let figures = gather_figures(
        comm.as_ref(),
        RankFigures {
            axis: engine.grid().bytes_sent_per_axis(),
            sent,
            model_sent,
            state,
            // This rank's stage slice as Ψ (ZeRO stage 1: the optimizer state over dp).
            formula: engine.model_state_bytes_formula(),
            peak_state: state,
            rss: peak_rss_bytes(),
            bubble: if scheduled > 0.0 {
                1.0 - compute / scheduled
            } else {
                0.0
            },
            live_activations: live as u64,
            breakdown: StepBreakdown::default(),
        },
    )?;
    Ok(RunReport {
        world,
        backend: comm.backend().to_string(),
        zero_stage: engine.config().zero_optimization.stage.into(),
        params: engine.total_params(),
        steps: spec.steps,
        first_step,
        losses,
        grad_norms,
        moq_bits: Vec::new(),
        tokens_per_s: ((spec.steps - first_step) * batch.train_batch_size * seq as u64) as f64
            / elapsed,
        train_batch_size: batch.train_batch_size,
        gradient_accumulation_steps: batch.gradient_accumulation_steps,
        model_state_bytes_per_rank: figures.iter().map(|f| f.state).max().unwrap_or(0),
        peak_model_state_bytes_per_rank: figures.iter().map(|f| f.peak_state).max().unwrap_or(0),
        model_state_bytes_formula: figures.iter().map(|f| f.formula).max().unwrap_or(0),
        comm_bytes_per_rank: figures.iter().map(|f| f.sent).collect(),
        comm_bytes_model_per_rank: figures.iter().map(|f| f.model_sent).collect(),
        comm_bytes_per_axis: figures.iter().map(|f| f.axis).collect(),
        comm_bytes_per_step: Vec::new(),
        comm_bytes_model_per_step: Vec::new(),
        compressed_steps: 0,
        dtype: engine.config().precision_name().into(),
        loss_scale,
        skipped_steps: engine.skipped_steps(),
        peak_activation_bytes: None,
        activation_checkpointing: engine
            .config()
            .pipeline
            .as_ref()
            .is_some_and(|p| p.activation_checkpoint_interval > 0),
        pld_theta: None,
        step_seconds_per_sample: Vec::new(),
        forward_backward_seconds: Vec::new(),
        optimizer_seconds: Vec::new(),
        breakdown_per_rank: Vec::new(),
        peak_rss_bytes: figures.iter().map(|f| f.rss).max().unwrap_or(0),
        device: spec.device.name().into(),
        host_device_bytes_per_step: host_device,
        staged_collective_bytes_per_step: staged,
        pipeline_stages: topo.stages,
        data_parallel: topo.replicas,
        tensor_parallel: grid.topology().tensor,
        bubble_fraction: Some(figures.iter().map(|f| f.bubble).sum::<f64>() / world as f64),
        peak_live_activations_per_stage: Some(
            (0..topo.stages)
                // Stage s's first rank: replica 0, slice 0 (the tensor axis fastest).
                .map(|s| {
                    figures[s * topo.replicas * grid.topology().tensor].live_activations as usize
                })
                .collect(),
        ),
        gather_stats: None,
        offload_optimizer: "none".into(),
        swap: None,
        offload_param: "none".into(),
        param_store: None,
        disk_baseline: None,
        // This rank's pipeline stage only (rank 0: the first stage's layers).
        final_params: match spec.keep_final_state {
            true => FlatParams(
                engine
                    .layers()
                    .iter()
                    .flat_map(|l| params_to_flat(l, &ParamLayout::of(l)))
                    .collect(),
            ),
            false => FlatParams::default(),
        },
        final_moments: None,
        ep_size: 1,
        heldout_loss: None,
        heldout_tokens: None,
        distilled_steps: 0,
        moe: None,
        comms,
    })
}

/// One rank's end-of-run figures.
struct RankFigures {
    axis: AxisBytes,
    sent: u64,
    model_sent: u64,
    state: u64,
    /// The formula's model state (pipelined runs: this stage's).
    formula: u64,
    peak_state: u64,
    rss: u64,
    bubble: f64,
    live_activations: u64,
    /// Data-parallel runs: the mean phase times.
    breakdown: StepBreakdown,
}

/// Every rank's figures, in rank order (moved as little-endian bytes: the communicator
/// moves u8).
fn gather_figures(comm: &dyn Communicator, mine: RankFigures) -> Result<Vec<RankFigures>> {
    let words = [
        mine.sent,
        mine.model_sent,
        mine.state,
        mine.formula,
        mine.peak_state,
        mine.rss,
        mine.bubble.to_bits(),
        mine.live_activations,
        mine.axis.tensor,
        mine.axis.pipe,
        mine.axis.data,
        mine.axis.other,
    ]
    .into_iter()
    .chain(mine.breakdown.words().map(f64::to_bits))
    .collect::<Vec<u64>>();
    let bytes: Vec<u8> = words.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut all = vec![0u8; bytes.len() * comm.world_size()];
    comm.all_gather_equal(&bytes, &mut all)?;
    Ok(all
        .chunks(bytes.len())
        .map(|c| {
            let v = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            RankFigures {
                sent: v(0),
                model_sent: v(1),
                state: v(2),
                formula: v(3),
                peak_state: v(4),
                rss: v(5),
                bubble: f64::from_bits(v(6)),
                live_activations: v(7),
                axis: AxisBytes {
                    tensor: v(8),
                    pipe: v(9),
                    data: v(10),
                    other: v(11),
                },
                breakdown: StepBreakdown::from_words(std::array::from_fn(|i| {
                    f64::from_bits(v(12 + i))
                })),
            }
        })
        .collect())
}

/// The process's peak resident set size (`VmHWM`), or 0 where `/proc` is unavailable.
pub fn peak_rss_bytes() -> u64 {
    burn_deepspeed::monitor::peak_rss_bytes().unwrap_or(0)
}
