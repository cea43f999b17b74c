//! Fault injection in the thread world: a rank that fails makes the others fail at once with
//! its reason; a step precondition that fails on one rank fails every rank; a non-finite
//! gradient on one rank skips the step on every rank, at every ZeRO stage and with 1-bit Adam,
//! and the run goes on exactly as if it had never seen that batch.

use std::time::{Duration, Instant};

use burn::tensor::Device;
use burn_deepspeed::launch::launch;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine, DeepSpeedError};
use burn_deepspeed_tests::{Toy, toy_batch};

const ROWS: usize = 2;

fn config(extra: &str) -> DeepSpeedConfig {
    let text = format!(
        r#"{{"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": {ROWS},
            "gradient_clipping": 1.0 {extra}}}"#
    );
    DeepSpeedConfig::from_json_str(&text)
        .expect("valid config")
        .0
}

fn adamw() -> &'static str {
    r#", "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}"#
}

/// What one rank saw of a run.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    losses: Vec<f64>,
    overflows: Vec<bool>,
    skipped: u64,
    params: Vec<f32>,
}

/// Trains `Toy` for the data steps `steps` on `world` ranks; `poison(step, rank, micro)`
/// names the micro-batches whose first input is replaced.
fn train(
    world: usize,
    config: &DeepSpeedConfig,
    steps: &[u64],
    poison: impl Fn(u64, usize, u64) -> Option<f32> + Sync,
) -> Vec<Seen> {
    let (_, seen) = launch(world, Duration::from_secs(60), |comm| {
        let device = Device::flex().autodiff();
        let rank = comm.rank();
        let mut engine = DeepSpeedEngine::new(Toy::new(5, &device), config.clone(), comm)?;
        // Batches on the plain device, as the GPT example's (the model's device may be a
        // checkpointing one at stage 3).
        let device = device.inner();
        let gas = engine.batch().gradient_accumulation_steps;
        let (mut losses, mut overflows) = (Vec::new(), Vec::new());
        for &step in steps {
            let batches =
                (0..gas).map(|k| toy_batch(step, rank, k, ROWS, poison(step, rank, k), &device));
            let report = engine.train_batch(batches)?;
            losses.push(report.loss);
            overflows.push(report.overflow);
        }
        Ok(Seen {
            losses,
            overflows,
            skipped: engine.skipped_steps(),
            params: engine.flat_params()?,
        })
    })
    .expect("training runs");
    seen
}

fn nan_step_is_skipped_everywhere(extra: &str, what: &str) {
    let config = config(extra);
    let poisoned_step = 4;
    for poison in [f32::NAN, f32::INFINITY] {
        let all: Vec<u64> = (0..10).collect();
        let without: Vec<u64> = all
            .iter()
            .copied()
            .filter(|&s| s != poisoned_step)
            .collect();
        // Rank 1's second micro-batch of step 4 carries the NaN/inf.
        let hit = move |step, rank, micro| {
            (step == poisoned_step && rank == 1 && micro == 1).then_some(poison)
        };
        let poisoned = train(2, &config, &all, hit);
        let clean = train(2, &config, &without, |_, _, _| None);
        for (rank, (p, c)) in poisoned.iter().zip(&clean).enumerate() {
            assert_eq!(p.skipped, 1, "{what} {poison}: rank {rank} skipped steps");
            let flagged: Vec<usize> = (p.overflows.iter().enumerate())
                .filter(|(_, o)| **o)
                .map(|(i, _)| i)
                .collect();
            assert_eq!(flagged, vec![poisoned_step as usize], "{what} {poison}");
            let mut kept = p.losses.clone();
            kept.remove(poisoned_step as usize);
            assert_eq!(kept, c.losses, "{what} {poison}: rank {rank} losses");
            assert_eq!(
                p.params, c.params,
                "{what} {poison}: rank {rank} parameters"
            );
            assert!(p.params.iter().all(|v| v.is_finite()));
        }
    }
}

#[test]
fn a_nan_gradient_on_one_rank_skips_the_step_at_stage_0() {
    nan_step_is_skipped_everywhere(adamw(), "stage 0");
}

#[test]
fn a_nan_gradient_on_one_rank_skips_the_step_at_stages_1_to_3() {
    for stage in 1..=3 {
        let extra = format!(r#"{} , "zero_optimization": {{"stage": {stage}}}"#, adamw());
        nan_step_is_skipped_everywhere(&extra, &format!("stage {stage}"));
    }
}

#[test]
fn a_nan_gradient_on_one_rank_skips_the_step_with_one_bit_adam() {
    // Warm-up for 2 steps, then compression: the poisoned step 4 falls in the compression
    // stage, where each rank clips its own gradient and the error buffers would keep a NaN.
    let extra =
        r#", "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 2}}"#;
    nan_step_is_skipped_everywhere(extra, "1-bit Adam");
}

/// Runs `world` ranks of `Toy` where `rank_body` decides what each rank does at step 2;
/// returns each rank's outcome and how long it took.
fn with_faulty_rank(
    world: usize,
    body: impl Fn(&mut DeepSpeedEngine<Toy>, usize, &Device) -> burn_deepspeed::Result<()> + Sync,
) -> Vec<(String, Duration)> {
    with_faulty_rank_in(world, &config(adamw()), body)
}

/// [`with_faulty_rank`] with `config`.
fn with_faulty_rank_in(
    world: usize,
    config: &DeepSpeedConfig,
    body: impl Fn(&mut DeepSpeedEngine<Toy>, usize, &Device) -> burn_deepspeed::Result<()> + Sync,
) -> Vec<(String, Duration)> {
    let start = Instant::now();
    let outcomes = std::thread::scope(|scope| {
        // Each rank's own result, as `launch` returns only the first error.
        let (tx, rx) = std::sync::mpsc::channel();
        let body = &body;
        scope.spawn(move || {
            let _ = launch(world, Duration::from_secs(300), |comm| {
                let device = Device::flex().autodiff();
                let rank = comm.rank();
                let result = (|| {
                    let model = Toy::new(5, &device);
                    let device = device.clone().inner();
                    let mut engine = DeepSpeedEngine::new(model, config.clone(), comm)?;
                    let gas = engine.batch().gradient_accumulation_steps;
                    for step in 0..2 {
                        let batches =
                            (0..gas).map(|k| toy_batch(step, rank, k, ROWS, None, &device));
                        engine.train_batch(batches)?;
                    }
                    body(&mut engine, rank, &device)
                })();
                let text = match &result {
                    Ok(()) => "ok".to_string(),
                    Err(e) => e.to_string(),
                };
                tx.send((rank, text, start.elapsed()))
                    .expect("collector alive");
                result
            });
        });
        let mut outcomes: Vec<_> = rx.iter().take(world).collect();
        outcomes.sort_by_key(|o| o.0);
        outcomes
    });
    outcomes.into_iter().map(|(_, t, d)| (t, d)).collect()
}

#[test]
fn a_rank_that_returns_an_error_mid_run_fails_the_others_within_5_s() {
    let outcomes = with_faulty_rank(3, |engine, rank, device| {
        if rank == 1 {
            return Err(DeepSpeedError::Data("the disk is on fire".into()));
        }
        let batches = (0..engine.batch().gradient_accumulation_steps)
            .map(|k| toy_batch(2, rank, k, ROWS, None, device));
        engine.train_batch(batches).map(|_| ())
    });
    for (rank, (text, took)) in outcomes.iter().enumerate() {
        assert!(text.contains("the disk is on fire"), "rank {rank}: {text}");
        assert!(*took < Duration::from_secs(5), "rank {rank} took {took:?}");
        if rank != 1 {
            assert!(
                text.contains("rank 1"),
                "rank {rank} names the failed rank: {text}"
            );
        }
    }
}

/// Under stage 2's `overlap_comm` a rank that fails between two micro-batches, while its
/// communication thread still reduces the first one's buckets, fails the others at once with
/// its reason (the thread's queued reductions are dropped unrun).
#[test]
fn a_rank_that_fails_mid_accumulation_under_overlap_comm_fails_the_others_within_5_s() {
    let extra = format!(
        r#"{}, "zero_optimization": {{"stage": 2, "overlap_comm": true,
                                      "reduce_bucket_size": 8}}"#,
        adamw()
    );
    let outcomes = with_faulty_rank_in(3, &config(&extra), |engine, rank, device| {
        engine.forward_backward(toy_batch(2, rank, 0, ROWS, None, device));
        if rank == 1 {
            return Err(DeepSpeedError::Data("the disk is on fire".into()));
        }
        engine.forward_backward(toy_batch(2, rank, 1, ROWS, None, device));
        engine.step().map(|_| ())
    });
    for (rank, (text, took)) in outcomes.iter().enumerate() {
        assert!(text.contains("the disk is on fire"), "rank {rank}: {text}");
        assert!(*took < Duration::from_secs(5), "rank {rank} took {took:?}");
    }
}

#[test]
fn a_step_precondition_that_fails_on_one_rank_fails_every_rank() {
    // Rank 0 hands train_batch one micro-batch too few; the others a full batch.
    let outcomes = with_faulty_rank(3, |engine, rank, device| {
        let gas = engine.batch().gradient_accumulation_steps - u64::from(rank == 0);
        let batches = (0..gas).map(|k| toy_batch(2, rank, k, ROWS, None, device));
        engine.train_batch(batches).map(|_| ())
    });
    for (rank, (text, took)) in outcomes.iter().enumerate() {
        assert!(text.contains("micro-batches"), "rank {rank}: {text}");
        assert!(*took < Duration::from_secs(5), "rank {rank} took {took:?}");
    }
    // step() before any forward_backward, on one rank only.
    let outcomes = with_faulty_rank(2, |engine, rank, device| {
        if rank == 1 {
            engine.forward_backward(toy_batch(2, rank, 0, ROWS, None, device));
        }
        engine.step().map(|_| ())
    });
    for (rank, (text, took)) in outcomes.iter().enumerate() {
        assert!(
            text.contains("before any forward_backward"),
            "rank {rank}: {text}"
        );
        assert!(*took < Duration::from_secs(5), "rank {rank} took {took:?}");
    }
}

#[test]
fn progressive_layer_drop_at_stage_3_matches_stage_0() {
    use burn_deepspeed_example_gpt::model::GptShape;
    let shape = GptShape {
        d_model: 32,
        layers: 4,
        heads: 4,
        seq_len: 16,
        moe: None,
    };
    let pld = r#", "progressive_layer_drop": {"enabled": true, "theta": 0.5, "gamma": 0.5}"#;
    let run = |stage: u8| {
        // Threshold 0: every tensor is partitioned and gathered when used.
        let zero = format!(r#""stage": {stage}, "stage3_param_persistence_threshold": 0"#);
        let extra = format!(r#"{}{pld}, "zero_optimization": {{{zero}}}"#, adamw());
        let spec = common::spec(config(&extra), shape, 8, 3, 7);
        common::train(2, &spec)
    };
    let (zero, three) = (run(0), run(3));
    let diff = common::max_rel_diff(&zero.losses, &three.losses);
    assert!(diff < 1e-4, "stage 3 vs 0 with layer drop: {diff:e}");
}

use crate::common;

/// The flight recorder, on by default in `launch`: rank 2 of 4 skips one all-gather and goes
/// on with the all-reduce after it; the run fails within the timeout, and the error names
/// rank 2 and the collective where the ranks parted ways (#6, the fourth step's all-gather).
#[test]
fn a_rank_that_skips_an_all_gather_is_named_by_the_flight_recorder() {
    use burn_deepspeed::comm::{CommunicatorExt, ReduceOp};
    let start = Instant::now();
    let e = launch(4, Duration::from_secs(5), |comm| {
        for step in 0..5 {
            if !(comm.rank() == 2 && step == 3) {
                let mut all = [0f32; 64];
                comm.all_gather_equal(&[comm.rank() as f32; 16], &mut all)?;
            }
            comm.all_reduce(&mut [1f32; 8], ReduceOp::Sum)?;
        }
        Ok(())
    })
    .expect_err("the ranks part ways")
    .to_string();
    println!("{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(
        e.contains("flight recorder") && e.contains("[2] out of step"),
        "{e}"
    );
    assert!(e.contains("is #6, all_gather of 64 f32"), "{e}");
    assert!(e.contains("rank 2 called all_reduce of 8 f32"), "{e}");
}

/// Ranks given different configs (here another bucket size on rank 1) are refused when the
/// engine is built, on every rank, naming the rank, instead of pairing collectives of
/// different lengths later.
#[test]
fn ranks_with_different_configs_are_refused() {
    let (_, errors) = launch(2, Duration::from_secs(30), |comm| {
        let bucket = 1000 + 10 * comm.rank();
        let c = config(&format!(
            r#"{} , "zero_optimization": {{"stage": 2, "reduce_bucket_size": {bucket}}}"#,
            adamw()
        ));
        let device = Device::flex().autodiff();
        Ok(DeepSpeedEngine::new(Toy::new(1, &device), c, comm)
            .err()
            .map(|e| e.to_string()))
    })
    .expect("every rank returns");
    for e in errors {
        let e = e.expect("refused");
        assert!(
            e.contains("rank 1's resolved config differs from rank 0's"),
            "{e}"
        );
    }
}
