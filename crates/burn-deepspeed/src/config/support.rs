//! What this version refuses to run, in one place: every entry point (the engine, the
//! pipeline engine, the Learner strategy) calls [`check_supported`] once, after
//! [`DeepSpeedConfig::resolve`]. Each refusal names the key and what to do instead; settings
//! that merely load with a warning are in `DeepSpeedConfig::load`'s warnings.

use super::offload_support::{check_offload, check_param_offload};
use super::{DeepSpeedConfig, ZeroStage};
use crate::{DeepSpeedError, Result};

/// Which entry point is about to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryPoint {
    /// [`DeepSpeedEngine`](crate::DeepSpeedEngine): data parallelism with ZeRO 0-3, 1-bit
    /// optimizers and progressive layer dropping.
    Engine,
    /// [`PipelineEngine`](crate::pipe::PipelineEngine): pipeline x data parallelism.
    Pipeline,
    /// [`DeepSpeedStrategy`](crate::learner::DeepSpeedStrategy) inside Burn's
    /// `SupervisedTraining`; `checkpointer` says whether the Learner checkpoints.
    Strategy {
        /// The `SupervisedTraining` has a checkpointer.
        checkpointer: bool,
    },
}

pub(super) fn refuse(key: &str, reason: impl Into<String>) -> Result<()> {
    Err(DeepSpeedError::Unsupported {
        key: key.into(),
        reason: reason.into(),
    })
}

/// MoQ runs in the data-parallel engine (and the Learner strategy on it) at ZeRO stages 0-2.
fn check_moq(config: &DeepSpeedConfig, entry: EntryPoint) -> Result<()> {
    let Some(moq) = config.moq()? else {
        return Ok(());
    };
    let key = match moq.groups[0].name.as_str() {
        "quantize_training" => "quantize_training.enabled",
        _ => "compression_training.weight_quantization.shared_parameters.enabled",
    };
    if entry == EntryPoint::Pipeline {
        return refuse(
            key,
            "MoQ is not implemented in the pipeline engine; train with DeepSpeedEngine",
        );
    }
    if config.zero_optimization.stage == ZeroStage::Parameters {
        return refuse(
            key,
            "MoQ quantizes the weights the model holds, which ZeRO stage 3 keeps as              partitions; use stage 0, 1 or 2",
        );
    }
    Ok(())
}

/// Refuses, with the key and the alternative, what `entry` cannot run under `config`.
pub fn check_supported(config: &DeepSpeedConfig, entry: EntryPoint) -> Result<()> {
    check_zero_keys(config)?;
    check_offload(config, entry)?;
    check_param_offload(config, entry)?;
    check_precision(config, entry)?;
    check_activation_checkpointing(config)?;
    check_optimizer(config, entry)?;
    check_moq(config, entry)?;
    let stage = config.zero_optimization.stage;
    let pipelined = config
        .pipeline
        .as_ref()
        .and_then(|p| p.stage_count())
        .unwrap_or(1)
        > 1;
    match entry {
        EntryPoint::Engine if pipelined => refuse(
            "pipeline.stages",
            "DeepSpeedEngine is data-parallel only; train a pipeline with \
             `burn_deepspeed::pipe::PipelineEngine`",
        ),
        EntryPoint::Engine => Ok(()),
        EntryPoint::Pipeline => {
            if config.sp_size() > 1 {
                return refuse(
                    "sequence_parallel_size",
                    "sequence parallelism runs beside data parallelism in DeepSpeedEngine, \
                     not in a pipeline",
                );
            }
            if config
                .pipeline
                .as_ref()
                .is_some_and(|p| p.stage_count().is_none())
            {
                return refuse(
                    "pipeline.stages",
                    "\"auto\" has no model to size the pipeline from here; give the number \
                     of stages",
                );
            }
            match stage {
                ZeroStage::Disabled | ZeroStage::OptimizerStates => {}
                _ => {
                    return refuse(
                        "zero_optimization.stage",
                        "ZeRO stages 2 and 3 cannot be combined with pipeline parallelism (as \
                         in DeepSpeed: gradients are accumulated across micro-batches on each \
                         stage); set the stage to 0",
                    );
                }
            }
            if config.progressive_layer_drop.enabled {
                return refuse(
                    "progressive_layer_drop.enabled",
                    "the pipeline engine does not hand θ to its layers yet; progressive layer \
                     dropping runs in `DeepSpeedEngine`",
                );
            }
            Ok(())
        }
        EntryPoint::Strategy { .. } => {
            if config.sp_size() > 1 {
                return refuse(
                    "sequence_parallel_size",
                    "sequence parallelism needs the model's attention to exchange heads with \
                     its group, which the Learner strategy cannot arrange; train with \
                     `DeepSpeedEngine::with_grid` and the grid's `sequence_parallel()` group",
                );
            }
            if config.tp_size() > 1 {
                return refuse(
                    "tensor_parallel.tp_size",
                    "the Learner strategy trains data-parallel replicas of the Learner's \
                     model; train a sliced model with `DeepSpeedEngine::with_grid`",
                );
            }
            if config.progressive_layer_drop.enabled {
                return refuse(
                    "progressive_layer_drop.enabled",
                    "the Learner strategy cannot hand θ to the Learner's model; drive the \
                     model with `DeepSpeedEngine::pld_theta`",
                );
            }
            Ok(())
        }
    }
}

/// The optimizers each entry point steps.
fn check_optimizer(config: &DeepSpeedConfig, entry: EntryPoint) -> Result<()> {
    let Some(optimizer) = &config.optimizer else {
        return Ok(());
    };
    let kind = optimizer.kind;
    if kind.is_one_bit() {
        return match entry {
            EntryPoint::Engine => Ok(()),
            EntryPoint::Pipeline => refuse(
                "optimizer.type",
                format!(
                    "{kind:?} compresses the data-parallel exchange and runs in \
                     `DeepSpeedEngine` (ZeRO stage 0, no pipeline); use Adam, AdamW or Lamb here"
                ),
            ),
            EntryPoint::Strategy { .. } => refuse(
                "optimizer.type",
                format!(
                    "the Learner strategy steps the Learner's own optimizer; {kind:?} runs in \
                     `DeepSpeedEngine`"
                ),
            ),
        };
    }
    if optimizer.params.bias_correction == Some(false) {
        return refuse(
            "optimizer.params.bias_correction",
            "Burn's Adam, AdamW and LAMB always correct the bias; remove the key or set it to \
             true",
        );
    }
    Ok(())
}

/// The `zero_optimization` settings no entry point runs yet. Everything else is honoured (see
/// the book's ZeRO chapter for what each key does here).
fn check_zero_keys(config: &DeepSpeedConfig) -> Result<()> {
    let z = &config.zero_optimization;
    for (key, on) in [
        ("zero_quantized_weights", z.zero_quantized_weights),
        ("zero_hpz_partition_size", z.zero_hpz_partition_size > 1),
        ("zero_quantized_gradients", z.zero_quantized_gradients),
    ] {
        if on && z.stage != ZeroStage::Parameters {
            return refuse(
                &format!("zero_optimization.{key}"),
                "ZeRO++ changes ZeRO stage 3's gathers and gradient reduction; set stage 3, or \
                 leave it at its default",
            );
        }
    }
    if z.zero_quantized_nontrainable_weights {
        return refuse(
            "zero_optimization.zero_quantized_nontrainable_weights",
            "keeping frozen parameters quantized is not implemented; set it to false",
        );
    }
    if z.mics_shard_size > 0 {
        return refuse(
            "zero_optimization.mics_shard_size",
            "MiCS is not implemented; set it to -1",
        );
    }
    Ok(())
}

/// Mixed precision: fp16 and bf16 with fp32 masters run in the engine (stages 0-3, the 1-bit
/// optimizers), the pipeline engine, and the Learner strategy (stages 0-3; with Burn's
/// checkpointer in bf16 only).
fn check_precision(config: &DeepSpeedConfig, entry: EntryPoint) -> Result<()> {
    if config.fp16.enabled && config.fp16.auto_cast {
        return refuse(
            "fp16.auto_cast",
            "Burn has no autocast: the model's parameters are cast to f16, and the model makes \
             its own float inputs in their dtype (`x.dtype()`); set auto_cast to false",
        );
    }
    if config.working_dtype().is_none() {
        return Ok(());
    }
    let key = format!("{}.enabled", config.precision_name());
    match entry {
        EntryPoint::Engine | EntryPoint::Pipeline => Ok(()),
        EntryPoint::Strategy { checkpointer: true } if config.fp16.enabled => refuse(
            &key,
            "Burn's checkpointer has no place for fp16's dynamic loss scale, so a resumed run \
             would start again from the initial scale: train with bf16, without the \
             checkpointer, or with DeepSpeedEngine's checkpoints",
        ),
        EntryPoint::Strategy { .. } => Ok(()),
    }
}

/// What of `activation_checkpointing` Burn can honour: host checkpoints, boundary
/// synchronization and profiling. The rest needs what is not here.
fn check_activation_checkpointing(config: &DeepSpeedConfig) -> Result<()> {
    let Some(ac) = &config.activation_checkpointing else {
        return Ok(());
    };
    if ac.partition_activations {
        return refuse(
            "activation_checkpointing.partition_activations",
            "it splits each checkpoint across the tensor-parallel ranks, and there is no \
             tensor slicing yet; set it to false",
        );
    }
    if ac.contiguous_memory_optimization {
        return refuse(
            "activation_checkpointing.contiguous_memory_optimization",
            "Burn's allocator owns device memory, so there is no preallocated buffer to copy \
             checkpoints into; set it to false",
        );
    }
    if ac.number_checkpoints.is_some() {
        return refuse(
            "activation_checkpointing.number_checkpoints",
            "it sizes the contiguous checkpoint buffer, which is not built here; remove it",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> DeepSpeedConfig {
        let (mut c, _) = DeepSpeedConfig::from_json_str(text).expect("valid");
        c.resolve(1).expect("resolves");
        c
    }

    fn refused_key(c: &DeepSpeedConfig, entry: EntryPoint) -> Option<String> {
        match check_supported(c, entry) {
            Err(DeepSpeedError::Unsupported { key, reason }) => {
                assert!(!reason.is_empty());
                Some(key)
            }
            Err(e) => panic!("not an Unsupported error: {e}"),
            Ok(()) => None,
        }
    }

    /// Every refusal names its key, at the entry points that cannot run it, and only there.
    #[test]
    fn refusals_name_the_key_per_entry_point() {
        let base =
            r#""train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}"#;
        let strategy = EntryPoint::Strategy {
            checkpointer: false,
        };
        let cases: &[(&str, &str, [bool; 3])] = &[
            (
                r#""fp16": {"enabled": true}"#,
                "fp16.enabled",
                [false, false, false],
            ),
            (
                r#""bf16": {"enabled": true}"#,
                "bf16.enabled",
                [false, false, false],
            ),
            (
                r#""zero_optimization": {"offload_param": {"device": "cpu"}}"#,
                "zero_optimization.offload_param.device",
                [true; 3],
            ),
            (
                r#""pipeline": {"stages": 2}"#,
                "pipeline.stages",
                [true, false, false],
            ),
            (
                r#""zero_optimization": {"stage": 2}"#,
                "zero_optimization.stage",
                [false, true, false],
            ),
            (
                r#""progressive_layer_drop": {"enabled": true}"#,
                "progressive_layer_drop.enabled",
                [false, true, true],
            ),
            (
                r#""activation_checkpointing": {"partition_activations": true}"#,
                "activation_checkpointing.partition_activations",
                [true; 3],
            ),
            (
                r#""activation_checkpointing": {"contiguous_memory_optimization": true}"#,
                "activation_checkpointing.contiguous_memory_optimization",
                [true; 3],
            ),
            (
                r#""activation_checkpointing": {"number_checkpoints": 4}"#,
                "activation_checkpointing.number_checkpoints",
                [true; 3],
            ),
            (
                r#""activation_checkpointing": {"cpu_checkpointing": true, "profile": true,
                    "synchronize_checkpoint_boundary": true}"#,
                "-",
                [false; 3],
            ),
        ];
        for (extra, key, refused) in cases {
            let c = config(&format!("{{{base}, {extra}}}"));
            for (entry, want) in [EntryPoint::Engine, EntryPoint::Pipeline, strategy]
                .into_iter()
                .zip(refused)
            {
                let got = refused_key(&c, entry);
                assert_eq!(got.is_some(), *want, "{extra} at {entry:?}: {got:?}");
                if *want {
                    assert_eq!(got.as_deref(), Some(*key), "{extra} at {entry:?}");
                }
            }
        }
        let onebit = config(
            r#"{"train_batch_size": 4, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}"#,
        );
        assert_eq!(refused_key(&onebit, EntryPoint::Engine), None);
        assert_eq!(
            refused_key(&onebit, strategy).as_deref(),
            Some("optimizer.type")
        );
        // Burn's checkpointer: every stage.
        for zero in 0..=3 {
            let staged = config(&format!(
                r#"{{{base}, "zero_optimization": {{"stage": {zero}}}}}"#
            ));
            let got = refused_key(&staged, EntryPoint::Strategy { checkpointer: true });
            assert_eq!(got, None, "stage {zero}");
        }
        // 16-bit in the Learner strategy: stages 0-3; with Burn's checkpointer bf16 only.
        for (precision, zero, checkpointer, refused) in [
            ("bf16", 2, false, false),
            ("bf16", 3, false, false),
            ("bf16", 2, true, false),
            ("bf16", 3, true, false),
            ("fp16", 0, true, true),
            ("fp16", 1, false, false),
        ] {
            let c = config(&format!(
                r#"{{{base}, "{precision}": {{"enabled": true}}, "zero_optimization": {{"stage": {zero}}}}}"#
            ));
            let got = refused_key(&c, EntryPoint::Strategy { checkpointer });
            let want = refused.then(|| format!("{precision}.enabled"));
            assert_eq!(
                got, want,
                "{precision} stage {zero}, checkpointer {checkpointer}"
            );
            assert_eq!(refused_key(&c, EntryPoint::Engine), None);
        }
    }

    /// Optimizer offload runs in the engine at stages 1-3 with Adam or AdamW, with a
    /// writable NVMe folder, and in the Learner strategy to host memory with any optimizer;
    /// everything else is refused naming the key.
    #[test]
    fn offload_is_checked_where_it_runs() {
        let dir = std::env::temp_dir();
        let dir = dir.to_string_lossy();
        let engine = |extra: &str, optimizer: &str| {
            let c = config(&format!(
                r#"{{"train_batch_size": 4, "optimizer": {{"type": "{optimizer}"}}, {extra}}}"#
            ));
            refused_key(&c, EntryPoint::Engine)
        };
        let zero = |stage: u8, offload: &str| {
            format!(r#""zero_optimization": {{"stage": {stage}, "offload_optimizer": {offload}}}"#)
        };
        let nvme = format!(r#"{{"device": "nvme", "nvme_path": "{dir}"}}"#);
        for stage in 1..=3 {
            assert_eq!(engine(&zero(stage, r#"{"device": "cpu"}"#), "AdamW"), None);
            assert_eq!(engine(&zero(stage, &nvme), "Adam"), None);
        }
        let cpu_offload = r#""zero_optimization": {"stage": 2, "cpu_offload": true}"#;
        assert_eq!(engine(cpu_offload, "AdamW"), None);
        let device = Some("zero_optimization.offload_optimizer.device".to_string());
        assert_eq!(engine(&zero(0, r#"{"device": "cpu"}"#), "AdamW"), device);
        let c = config(&format!(
            r#"{{"train_batch_size": 4, {}}}"#,
            zero(2, r#"{"device": "cpu"}"#)
        ));
        assert_eq!(refused_key(&c, EntryPoint::Pipeline), device);
        // The Learner strategy offloads to host memory with any optimizer, not to swap files.
        for checkpointer in [false, true] {
            let strategy = EntryPoint::Strategy { checkpointer };
            assert_eq!(refused_key(&c, strategy), None);
            let lamb = config(&format!(
                r#"{{"train_batch_size": 4, "optimizer": {{"type": "Lamb"}}, {}}}"#,
                zero(1, r#"{"device": "cpu"}"#)
            ));
            assert_eq!(refused_key(&lamb, strategy), None);
            let swap = config(&format!(r#"{{"train_batch_size": 4, {}}}"#, zero(2, &nvme)));
            assert_eq!(refused_key(&swap, strategy), device);
            let partial = zero(3, r#"{"device": "cpu", "ratio": 0.5}"#);
            let partial = config(&format!(r#"{{"train_batch_size": 4, {partial}}}"#));
            assert_eq!(
                refused_key(&partial, strategy).as_deref(),
                Some("zero_optimization.offload_optimizer.ratio")
            );
        }
        assert_eq!(
            engine(&zero(2, &nvme), "Lamb").as_deref(),
            Some("optimizer.type")
        );
        let path = Some("zero_optimization.offload_optimizer.nvme_path".to_string());
        assert_eq!(engine(&zero(1, r#"{"device": "nvme"}"#), "AdamW"), path);
        let missing = r#"{"device": "nvme", "nvme_path": "/no/such/folder"}"#;
        assert_eq!(engine(&zero(1, missing), "AdamW"), path);
        let partial = r#"{"device": "cpu", "ratio": 0.5}"#;
        assert_eq!(
            engine(&zero(3, partial), "AdamW").as_deref(),
            Some("zero_optimization.offload_optimizer.ratio")
        );
        assert_eq!(
            engine(r#""aio": {"use_gds": true}"#, "AdamW").as_deref(),
            Some("aio.use_gds")
        );
        let aio =
            config(r#"{"train_batch_size": 4, "aio": {"block_size": 262144, "thread_count": 2}}"#)
                .aio;
        assert_eq!((aio.block_size, aio.intra_op_parallelism), (262_144, 2));
        assert!(DeepSpeedConfig::from_json_str(r#"{"aio": {"queue_dpeth": 4}}"#).is_err());
    }

    /// Parameter offload runs in the engine at stage 3, to `cpu` or a writable NVMe folder,
    /// with or without optimizer offload; everything else is refused naming the key.
    #[test]
    fn parameter_offload_is_checked_where_it_runs() {
        let dir = std::env::temp_dir();
        let dir = dir.to_string_lossy();
        let with = |stage: u8, param: &str| {
            config(&format!(
                r#"{{"train_batch_size": 4, "optimizer": {{"type": "AdamW"}},
                    "zero_optimization": {{"stage": {stage}, "offload_param": {param}}}}}"#
            ))
        };
        let nvme = format!(r#"{{"device": "nvme", "nvme_path": "{dir}"}}"#);
        for param in [r#"{"device": "cpu"}"#, &nvme, r#"{"device": "none"}"#] {
            assert_eq!(refused_key(&with(3, param), EntryPoint::Engine), None);
        }
        let device = Some("zero_optimization.offload_param.device".to_string());
        for stage in 0..=2 {
            let c = with(stage, r#"{"device": "cpu"}"#);
            assert_eq!(refused_key(&c, EntryPoint::Engine), device, "stage {stage}");
        }
        let c = with(3, &nvme);
        let strategy = EntryPoint::Strategy {
            checkpointer: false,
        };
        assert_eq!(refused_key(&c, strategy), device);
        let path = Some("zero_optimization.offload_param.nvme_path".to_string());
        for bad in [
            r#"{"device": "nvme"}"#.to_string(),
            r#"{"device": "nvme", "nvme_path": "/no/such/folder"}"#.to_string(),
        ] {
            assert_eq!(
                refused_key(&with(3, &bad), EntryPoint::Engine),
                path,
                "{bad}"
            );
        }
        let none = r#"{"device": "cpu", "buffer_count": 0}"#;
        assert_eq!(
            refused_key(&with(3, none), EntryPoint::Engine).as_deref(),
            Some("zero_optimization.offload_param.buffer_count")
        );
    }
}
