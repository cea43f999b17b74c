//! What the entry points refuse of ZeRO-Offload and ZeRO-Infinity (`offload_optimizer`,
//! `offload_param`), by key.

use super::support::{EntryPoint, refuse};
use super::{DeepSpeedConfig, OffloadDevice, OptimizerKind, ZeroStage};
use crate::Result;

/// ZeRO-Offload and ZeRO-Infinity's optimizer offload: where it applies and what it needs.
pub(super) fn check_offload(config: &DeepSpeedConfig, entry: EntryPoint) -> Result<()> {
    let z = &config.zero_optimization;
    if config.aio.use_gds {
        return refuse(
            "aio.use_gds",
            "GPUDirect Storage is not available; swap files go through host memory (set it \
             to false)",
        );
    }
    let device = z.optimizer_offload();
    if device == OffloadDevice::None {
        return Ok(());
    }
    let key = match z.offload_optimizer {
        Some(_) => "zero_optimization.offload_optimizer.device",
        None => "zero_optimization.cpu_offload",
    };
    if z.stage == ZeroStage::Disabled {
        return refuse(
            key,
            "optimizer offload needs ZeRO stage 1, 2 or 3 (as in DeepSpeed); set \
             zero_optimization.stage",
        );
    }
    match (entry, device) {
        (EntryPoint::Engine, _) => {}
        // The Learner's own optimizer steps fp32 masters in host memory: any Burn optimizer.
        (EntryPoint::Strategy { .. }, OffloadDevice::Cpu) => {}
        (EntryPoint::Strategy { .. }, _) => {
            return refuse(
                key,
                "the Learner strategy offloads the optimizer to host memory (\"cpu\"); swap \
                 files (\"nvme\") run in DeepSpeedEngine, which steps its own Adam on them",
            );
        }
        (EntryPoint::Pipeline, _) => {
            return refuse(
                key,
                "optimizer offload runs in DeepSpeedEngine (and with \"cpu\" in the Learner \
                 strategy); the pipeline engine steps its stages' optimizers in place",
            );
        }
    }
    if let Some(o) = &config.optimizer
        && entry == EntryPoint::Engine
        && !matches!(o.kind, OptimizerKind::Adam | OptimizerKind::AdamW)
    {
        return refuse(
            "optimizer.type",
            format!(
                "optimizer offload steps Adam or AdamW (DeepSpeed's CPU Adam); {:?} cannot be \
                 offloaded",
                o.kind
            ),
        );
    }
    let Some(o) = &z.offload_optimizer else {
        return Ok(());
    };
    if o.ratio != 1.0 {
        return refuse(
            "zero_optimization.offload_optimizer.ratio",
            "partial optimizer offload is not implemented; set it to 1.0",
        );
    }
    if device == OffloadDevice::Nvme {
        let Some(path) = o.nvme_path.as_deref() else {
            return refuse(
                "zero_optimization.offload_optimizer.nvme_path",
                "device \"nvme\" needs a folder on a fast disk for the swap files",
            );
        };
        check_nvme_path("zero_optimization.offload_optimizer.nvme_path", path)?;
    }
    Ok(())
}

/// ZeRO-Infinity's parameter offload: stage 3 in the engine, with a writable NVMe folder.
pub(super) fn check_param_offload(config: &DeepSpeedConfig, entry: EntryPoint) -> Result<()> {
    let z = &config.zero_optimization;
    let Some(o) = &z.offload_param else {
        return Ok(());
    };
    if o.device == OffloadDevice::None {
        return Ok(());
    }
    let key = "zero_optimization.offload_param.device";
    if z.stage != ZeroStage::Parameters {
        return refuse(
            key,
            "parameter offload needs ZeRO stage 3 (as in DeepSpeed); set zero_optimization.stage \
             to 3",
        );
    }
    if !matches!(entry, EntryPoint::Engine) {
        return refuse(
            key,
            "parameter offload runs in DeepSpeedEngine, which writes the stepped pieces to their \
             store; this entry point steps another optimizer",
        );
    }
    if o.device == OffloadDevice::Nvme {
        let Some(path) = o.nvme_path.as_deref() else {
            return refuse(
                "zero_optimization.offload_param.nvme_path",
                "device \"nvme\" needs a folder on a fast disk for the swap files",
            );
        };
        check_nvme_path("zero_optimization.offload_param.nvme_path", path)?;
    }
    if o.buffer_count == 0 || o.buffer_size == 0 {
        return refuse(
            "zero_optimization.offload_param.buffer_count",
            "the read-ahead needs at least one buffer of at least one element",
        );
    }
    Ok(())
}

/// An NVMe swap folder must exist and be a writable folder (its free space is checked
/// against the state's size when the swap files are created).
fn check_nvme_path(key: &str, path: &str) -> Result<()> {
    let dir = std::path::Path::new(path);
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() && !m.permissions().readonly() => Ok(()),
        Ok(m) if m.is_dir() => refuse(key, format!("{path} is not writable")),
        Ok(_) => refuse(key, format!("{path} is not a folder")),
        Err(e) => refuse(key, format!("{path} cannot be used: {e}")),
    }
}
