//! [`NvmeOffload`]: the swap files of a ZeRO regime's optimizer state, from the config's
//! `offload_optimizer`, `sub_group_size` and `aio` sections (ZeRO-Offload, arXiv 2101.06840;
//! ZeRO-Infinity, arXiv 2104.07857).

use std::path::PathBuf;

use burn_deepspeed_strategies::swap::{
    AioOptions, IoEngine, SwapOptions, SwapStore, TilePlan, fresh_dir,
};

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
    /// in `nvme_path/zero_stage_N/optimizer/rankR-P-K/rankR.swp`, a folder made for this
    /// store alone (`P` the process, `K` a number: see [`fresh_dir`]), removed with it.
    pub fn store(&self, rank: usize, len: usize) -> Result<SwapStore> {
        let stage = self.stage;
        let parent = self
            .dir
            .join(format!("zero_stage_{stage}"))
            .join("optimizer");
        let dir = fresh_dir(&parent, &format!("rank{rank}"))?;
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
    /// file is `nvme_path/zero_stage_3/params/rankR-P-K/rankR.swp`, in a folder made for this
    /// store alone as [`NvmeOffload::store`]'s.
    pub fn store(&self, rank: usize, lens: &[Option<usize>]) -> Result<ParamStore> {
        match (&self.dir, self.options) {
            (Some(dir), Some(options)) => {
                let parent = dir.join("zero_stage_3").join("params");
                let dir = fresh_dir(&parent, &format!("rank{rank}"))?;
                let path = dir.join(format!("rank{rank}.swp"));
                Ok(ParamStore::nvme(&path, lens, options)?)
            }
            _ => Ok(ParamStore::host(lens)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two stores of the same rank under one `nvme_path` (the tensor-parallel ranks of one
    /// job, whose data-parallel ranks have the same numbers, or two jobs launched with one
    /// config) keep their own state, one's end leaves the other's file, and nothing stays
    /// behind once both are gone.
    #[test]
    fn stores_sharing_a_folder_keep_their_own_state() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = format!(
            r#"{{"zero_optimization": {{"stage": 2, "sub_group_size": 256,
                "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}}}}"#,
            dir.path().display()
        );
        let (config, _) = DeepSpeedConfig::from_json_str(&config).expect("config");
        let nvme = NvmeOffload::of(&config).expect("offload").expect("nvme");
        let len = 1000;
        let fields = |v: f32| vec![v; len];
        let (ones, twos, nines) = (fields(1.0), fields(2.0), fields(9.0));
        let mut a = nvme.store(0, len).expect("store a");
        a.write_all(&[Some(&ones), Some(&twos), None])
            .expect("write a");
        let mut b = nvme.store(0, len).expect("store b");
        b.write_all(&[Some(&nines), Some(&nines), Some(&nines)])
            .expect("write b");
        assert_ne!(a.file().path(), b.file().path());
        let read = |s: &SwapStore| s.read_fields(&[0, 1]).expect("read");
        assert_eq!(
            read(&a),
            [ones.clone(), twos.clone()],
            "b wrote over a's state"
        );
        drop(b);
        assert!(a.file().path().exists(), "b's end removed a's file");
        assert_eq!(read(&a), [ones, twos]);
        drop(a);
        let left: Vec<_> = std::fs::read_dir(dir.path().join("zero_stage_2/optimizer"))
            .expect("the optimizer folder")
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }
}
