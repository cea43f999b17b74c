//! [`NvmeOffload`]: the swap files of a ZeRO regime's optimizer state, from the config's
//! `offload_optimizer`, `sub_group_size` and `aio` sections (ZeRO-Offload, arXiv 2101.06840;
//! ZeRO-Infinity, arXiv 2104.07857).

use std::path::PathBuf;

use burn_deepspeed_strategies::swap::{AioOptions, IoEngine, SwapOptions, SwapStore, TilePlan};

use crate::Result;
use crate::config::{AioConfig, DeepSpeedConfig, OffloadDevice};
use crate::zero3::{ParamStore, ParamSwapOptions};

/// The swap files of an NVMe offload.
#[derive(Debug, Clone, PartialEq)]
pub struct NvmeOffload {
    /// The folder that holds them (`nvme_path`).
    pub dir: PathBuf,
    /// The ZeRO stage, which names the subfolder as in DeepSpeed (`zero_stage_N`).
    pub stage: u8,
    /// Elements per tile (`sub_group_size`).
    pub tile: usize,
    /// How tiles are moved (`aio`, `pipeline_read`, `pipeline_write`).
    pub swap: SwapOptions,
}

impl NvmeOffload {
    /// The swap files a resolved, [checked](crate::config::check_supported) config asks for:
    /// `Some` under `offload_optimizer.device: "nvme"`. (`cpu` keeps the state in host memory,
    /// where it is on Flex anyway.) Chooses the I/O engine: io_uring, or `pread` where it is
    /// unavailable or `BURN_DEEPSPEED_AIO=pread`.
    pub fn of(config: &DeepSpeedConfig) -> Result<Option<Self>> {
        let z = &config.zero_optimization;
        if z.optimizer_offload() != OffloadDevice::Nvme {
            return Ok(None);
        }
        let o = z.offload_optimizer.clone().unwrap_or_default();
        let aio = aio_options(&config.aio);
        Ok(Some(Self {
            dir: PathBuf::from(o.nvme_path.unwrap_or_default()),
            stage: super::ZeroPlan::of(config).number(),
            tile: z.sub_group_size as usize,
            swap: SwapOptions {
                aio,
                engine: IoEngine::select()?,
                pipeline_read: o.pipeline_read,
                pipeline_write: o.pipeline_write,
            },
        }))
    }

    /// The swap file of `rank`'s optimizer state: `len` elements of fp32 masters, m and v,
    /// in `nvme_path/zero_stage_N/optimizer/rankR.swp`.
    pub fn store(&self, rank: usize, len: usize) -> Result<SwapStore> {
        let stage = self.stage;
        let dir = self
            .dir
            .join(format!("zero_stage_{stage}"))
            .join("optimizer");
        create_dir(&dir)?;
        let plan = TilePlan::new(len, self.tile, 3);
        Ok(SwapStore::create(
            &dir.join(format!("rank{rank}.swp")),
            plan,
            self.swap,
        )?)
    }
}

fn aio_options(a: &AioConfig) -> AioOptions {
    AioOptions {
        block_size: a.block_size as usize,
        queue_depth: a.queue_depth as usize,
        intra_op_parallelism: a.intra_op_parallelism as usize,
        single_submit: a.single_submit,
        overlap_events: a.overlap_events,
    }
}

fn create_dir(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| {
        burn_deepspeed_strategies::CommError::Swap {
            path: dir.to_path_buf(),
            op: "create",
            source,
        }
        .into()
    })
}

/// Where a stage-3 rank's parameter pieces live under `offload_param` (ZeRO-Infinity,
/// arXiv 2104.07857): host memory (`cpu`), or a swap file read ahead of the gathers (`nvme`).
#[derive(Debug, Clone, PartialEq)]
pub struct ParamOffload {
    /// The folder of the swap files (`nvme`), or `None` for host memory (`cpu`).
    pub dir: Option<PathBuf>,
    /// The read-ahead and `max_in_cpu` (`nvme`).
    pub options: Option<ParamSwapOptions>,
}

impl ParamOffload {
    /// The store a resolved, [checked](crate::config::check_supported) config asks for:
    /// `Some` under `offload_param.device` `cpu` or `nvme`. Under `nvme`, chooses the I/O
    /// engine as [`NvmeOffload::of`] does.
    pub fn of(config: &DeepSpeedConfig) -> Result<Option<Self>> {
        let Some(o) = &config.zero_optimization.offload_param else {
            return Ok(None);
        };
        Ok(match o.device {
            OffloadDevice::None => None,
            OffloadDevice::Cpu => Some(Self {
                dir: None,
                options: None,
            }),
            OffloadDevice::Nvme => Some(Self {
                dir: Some(PathBuf::from(o.nvme_path.clone().unwrap_or_default())),
                options: Some(ParamSwapOptions {
                    buffer_count: o.buffer_count as usize,
                    buffer_elems: (o.buffer_count.saturating_mul(o.buffer_size)) as usize,
                    max_in_cpu: o.max_in_cpu as usize,
                    swap: SwapOptions {
                        aio: aio_options(&config.aio),
                        engine: IoEngine::select()?,
                        pipeline_read: false,
                        pipeline_write: false,
                    },
                }),
            }),
        })
    }

    /// The store of `rank`'s pieces of `lens[t]` elements (see [`ParamStore`]); the swap
    /// file is `nvme_path/zero_stage_3/params/rankR.swp`.
    pub fn store(&self, rank: usize, lens: &[Option<usize>]) -> Result<ParamStore> {
        match (&self.dir, self.options) {
            (Some(dir), Some(options)) => {
                let dir = dir.join("zero_stage_3").join("params");
                create_dir(&dir)?;
                let path = dir.join(format!("rank{rank}.swp"));
                Ok(ParamStore::nvme(&path, lens, options)?)
            }
            _ => Ok(ParamStore::host(lens)),
        }
    }
}
