//! [`RunSpec`]: what one run trains (config, model, data, device, teacher), and
//! [`run_in_threads`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::{Device, Int, Tensor};
use burn_deepspeed::distill::DistillationConfig;
use burn_deepspeed::launch::launch;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedError, Result};

use super::{data_parallel::*, report::*};
use crate::data::ByteCorpus;
use crate::generate::GenerateSpec;
use crate::model::{Gpt, GptShape, LongContext, SoftTargets};

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
    /// How the model keeps its activations over long sequences (blockwise attention, tiled
    /// MLP and loss).
    pub long_context: LongContext,
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
    pub(crate) fn soft_targets(&self, inputs: &Tensor<2, Int>, device: &Device) -> SoftTargets {
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
            long_context: LongContext::default(),
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
