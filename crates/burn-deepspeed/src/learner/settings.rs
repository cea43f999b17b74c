//! What the Learner strategy takes from the config, settled before any rank starts: the world
//! size, the micro-batches per optimizer step, the size of each micro-batch, and whether the
//! config's `optimizer` and `scheduler` sections are the ones the `Learner` steps.
//!
//! Every key is either honoured or refused here, with the key named:
//! - `train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`
//!   resolve as in the engine (any two give the third). The accumulation is the step's
//!   number of micro-batches; `SupervisedTraining::grad_accumulation` may give it too, and
//!   the two must agree. The micro-batch size is the loader's batch size, checked on every
//!   batch while training (the loader is the only one who knows it). With neither
//!   `train_batch_size` nor `train_micro_batch_size_per_gpu`, the loader decides.
//! - `optimizer` and `scheduler` are honoured when the `Learner` was built by
//!   [`DeepSpeedStrategy::learner`](super::DeepSpeedStrategy::learner), which builds both from
//!   them; a `Learner` built elsewhere has its own, and the sections are refused rather than
//!   ignored.
//! - Every other value is validated as the engine validates it, and what the strategy cannot
//!   run is refused by [`check_supported`].

use crate::config::{EntryPoint, check_supported, resolve_batch};
use crate::{DeepSpeedConfig, DeepSpeedError, Result};

/// What the strategy knows besides the config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Surroundings {
    /// Data-parallel ranks (the `mpirun` world, or the strategy's threads).
    pub world: usize,
    /// `SupervisedTraining::grad_accumulation`, if it was set.
    pub learner_accumulation: Option<usize>,
    /// `SupervisedTraining` has a checkpointer.
    pub checkpointer: bool,
    /// The `Learner` was built by `DeepSpeedStrategy::learner` from this config.
    pub learner_from_config: bool,
}

/// The config, resolved for the Learner strategy.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// The config with its values resolved and validated.
    pub config: DeepSpeedConfig,
    /// Micro-batches per optimizer step on each rank.
    pub grad_accumulation: usize,
    /// Items in each micro-batch, when the config says.
    pub micro_batch: Option<usize>,
    /// `SupervisedTraining` has a checkpointer (rank 0 saves at the end of every epoch).
    pub checkpointer: bool,
}

fn batch_error(message: String) -> DeepSpeedError {
    DeepSpeedError::BatchSize(message)
}

/// Resolves `config` for the Learner strategy, or names the key it cannot honour.
pub(crate) fn resolve_settings(config: &DeepSpeedConfig, around: Surroundings) -> Result<Settings> {
    if around.world == 0 {
        return Err(DeepSpeedError::LearnerStrategy(
            "the number of ranks must be at least 1 (`DeepSpeedStrategy::new`'s `ranks`)".into(),
        ));
    }
    if around.learner_accumulation == Some(0) {
        return Err(batch_error(
            "SupervisedTraining's grad_accumulation must be at least 1, found 0".into(),
        ));
    }
    let learner = around.learner_accumulation.map(|a| a as u64);
    let gas = match (config.gradient_accumulation_steps, learner) {
        (Some(c), Some(l)) if c != l => {
            return Err(batch_error(format!(
                "gradient_accumulation_steps is {c} in the config but SupervisedTraining's \
                 grad_accumulation is {l}; make them agree or set only one"
            )));
        }
        (c, l) => c.or(l),
    };
    let mut resolved = config.clone();
    let micro_batch =
        if config.train_batch_size.is_none() && config.train_micro_batch_size_per_gpu.is_none() {
            // The loader's batch is the micro-batch.
            resolved.gradient_accumulation_steps = Some(gas.unwrap_or(1));
            None
        } else {
            let batch = resolve_batch(
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            gas,
            around.world as u64,
        )
        .map_err(|e| match (config.gradient_accumulation_steps, learner, e) {
            (None, Some(l), DeepSpeedError::BatchSize(m)) => batch_error(format!(
                "{m} (gradient_accumulation_steps {l} is SupervisedTraining's grad_accumulation)"
            )),
            (_, _, e) => e,
        })?;
            resolved.train_batch_size = Some(batch.train_batch_size);
            resolved.train_micro_batch_size_per_gpu = Some(batch.train_micro_batch_size_per_gpu);
            resolved.gradient_accumulation_steps = Some(batch.gradient_accumulation_steps);
            Some(to_usize(
                "train_micro_batch_size_per_gpu",
                batch.train_micro_batch_size_per_gpu,
            )?)
        };
    let grad_accumulation = to_usize(
        "gradient_accumulation_steps",
        resolved.gradient_accumulation_steps.unwrap_or(1),
    )?;
    resolved.resolve_values()?;
    check_supported(
        &resolved,
        EntryPoint::Strategy {
            checkpointer: around.checkpointer,
        },
    )?;
    if !around.learner_from_config {
        for (key, present) in [
            ("optimizer", resolved.optimizer.is_some()),
            ("scheduler", resolved.scheduler.is_some()),
        ] {
            if present {
                return Err(DeepSpeedError::InvalidValue {
                    path: key.into(),
                    message: format!(
                        "this Learner was built with its own optimizer and schedule, so the \
                         config's `{key}` section would be ignored; build the Learner with \
                         `DeepSpeedStrategy::learner(model)`, which builds both from the \
                         config, or remove the section"
                    ),
                });
            }
        }
    }
    Ok(Settings {
        config: resolved,
        grad_accumulation,
        micro_batch,
        checkpointer: around.checkpointer,
    })
}

fn to_usize(key: &str, value: u64) -> Result<usize> {
    usize::try_from(value).map_err(|_| DeepSpeedError::InvalidValue {
        path: key.into(),
        message: format!("{value} does not fit this machine's usize"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> DeepSpeedConfig {
        DeepSpeedConfig::from_json_str(text).expect("parses").0
    }

    fn around(world: usize, learner_accumulation: Option<usize>) -> Surroundings {
        Surroundings {
            world,
            learner_accumulation,
            checkpointer: false,
            learner_from_config: false,
        }
    }

    fn settle(text: &str, around: Surroundings) -> Result<Settings> {
        resolve_settings(&config(text), around)
    }

    #[test]
    fn batch_keys_set_the_accumulation_and_the_micro_batch() {
        let s = settle(r#"{"train_batch_size": 16}"#, around(2, None)).expect("resolves");
        assert_eq!((s.grad_accumulation, s.micro_batch), (1, Some(8)));
        let s = settle(
            r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}"#,
            around(2, None),
        )
        .expect("resolves");
        assert_eq!((s.grad_accumulation, s.micro_batch), (2, Some(4)));
        // SupervisedTraining's accumulation fills the missing key.
        let s = settle(r#"{"train_batch_size": 16}"#, around(2, Some(4))).expect("resolves");
        assert_eq!((s.grad_accumulation, s.micro_batch), (4, Some(2)));
        assert_eq!(s.config.train_micro_batch_size_per_gpu, Some(2));
        // Without batch keys the loader decides the micro-batch.
        let s = settle("{}", around(3, Some(2))).expect("resolves");
        assert_eq!((s.grad_accumulation, s.micro_batch), (2, None));
        let s = settle(r#"{"gradient_accumulation_steps": 3}"#, around(3, None)).expect("ok");
        assert_eq!((s.grad_accumulation, s.micro_batch), (3, None));
    }

    #[test]
    fn disagreements_name_the_key() {
        let cases: &[(&str, Surroundings, &str)] = &[
            (
                r#"{"gradient_accumulation_steps": 2}"#,
                around(2, Some(3)),
                "grad_accumulation is 3",
            ),
            (
                r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}"#,
                around(2, Some(3)),
                "SupervisedTraining's grad_accumulation",
            ),
            (
                r#"{"train_batch_size": 15}"#,
                around(2, None),
                "train_batch_size",
            ),
            ("{}", around(0, None), "ranks"),
            ("{}", around(2, Some(0)), "grad_accumulation"),
            (
                r#"{"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}"#,
                around(2, None),
                "`optimizer`",
            ),
            (
                r#"{"scheduler": {"type": "WarmupLR", "params": {}}}"#,
                around(2, None),
                "`scheduler`",
            ),
            (
                r#"{"gradient_clipping": -1}"#,
                around(2, None),
                "gradient_clipping",
            ),
            (
                r#"{"fp16": {"enabled": true, "auto_cast": true}}"#,
                around(2, None),
                "fp16.auto_cast",
            ),
            (
                r#"{"progressive_layer_drop": {"enabled": true}}"#,
                around(2, None),
                "progressive_layer_drop",
            ),
        ];
        for (text, around, needle) in cases {
            let e = settle(text, *around).expect_err(text).to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn optimizer_and_scheduler_sections_need_a_learner_built_from_them() {
        let text = r#"{"optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}"#;
        let mut a = around(2, None);
        a.learner_from_config = true;
        let s = settle(text, a).expect("honoured");
        assert!(s.config.optimizer.is_some() && s.config.scheduler.is_some());
        // The Learner's own optimizer with no sections is fine too.
        assert!(settle(r#"{"gradient_clipping": 1.0}"#, around(2, None)).is_ok());
        // Values are validated even when the section is honoured.
        let bad = r#"{"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": -1}}}"#;
        let e = settle(bad, a).expect_err("eps").to_string();
        assert!(e.contains("eps"), "{e}");
    }
}
