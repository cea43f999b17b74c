//! The pipeline engine on a small MLP with tied input and output layers: every stage count
//! and schedule follows the one-stage trajectory, and the tied copies stay equal.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_strategies::comm::{Communicator, ThreadWorld, ThreadWorldOptions};

use super::*;
use crate::DeepSpeedConfig;
use crate::flat::{ParamLayout, params_to_flat};

const D: usize = 6;

#[derive(Module, Debug)]
enum Toy {
    In(Linear),
    Mid(Linear),
    Out(Linear),
}

#[derive(Debug, Clone)]
struct ToyBatch {
    x: Tensor<3>,
    y: Tensor<3>,
}

impl PipeLayer<ToyBatch> for Toy {
    fn forward(&self, input: LayerInput<'_, ToyBatch>) -> Tensor<3> {
        match (self, input) {
            // The batch in the parameters' dtype (f16 or bf16 under mixed precision).
            (Toy::In(l), LayerInput::Batch(b)) => {
                l.forward(b.x.clone().cast(l.weight.val().dtype())).tanh()
            }
            (Toy::Mid(l), input) => l.forward(input.hidden("Mid")).tanh(),
            (Toy::Out(l), input) => l.forward(input.hidden("Out")),
            (Toy::In(_), LayerInput::Hidden(_)) => panic!("In must come first"),
        }
    }
    fn type_name(&self) -> String {
        format!("{self:?}")
            .split('(')
            .next()
            .unwrap_or_default()
            .to_string()
    }
    fn tie_key(&self) -> Option<String> {
        matches!(self, Toy::In(_) | Toy::Out(_)).then(|| "io".to_string())
    }
}

impl PipeBatch for ToyBatch {
    fn loss(&self, out: Tensor<3>) -> Tensor<1> {
        (out.cast(burn::tensor::FloatDType::F32) - self.y.clone())
            .powf_scalar(2.0)
            .mean()
    }
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0) - 1.0)
        .collect()
}

fn linear(seed: u64, device: &Device) -> Linear {
    let w = values(D * D, seed)
        .into_iter()
        .map(|v| v * 0.5)
        .collect::<Vec<_>>();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [D, D]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(values(D, seed + 1), [D]),
            device,
        ))),
    }
}

/// The same values in every call. In and Out start different: the engine makes the tied
/// copies equal (to In's).
fn toy_layers(device: &Device) -> Vec<Toy> {
    vec![
        Toy::In(linear(1, device)),
        Toy::Mid(linear(2, device)),
        Toy::Mid(linear(3, device)),
        Toy::Out(linear(4, device)),
    ]
}

fn batch(step: u64, k: usize, replica: usize, device: &Device) -> ToyBatch {
    let seed = step * 1000 + (k * 8 + replica) as u64;
    let t = |s| Tensor::from_data(TensorData::new(values(2 * 3 * D, s), [2, 3, D]), device);
    ToyBatch {
        x: t(seed),
        y: t(seed + 500),
    }
}

struct Outcome {
    losses: Vec<f64>,
    /// (stage, flat parameters of each of its layers).
    layers: Vec<(usize, Vec<Vec<f32>>)>,
    peak_live: Vec<usize>,
    /// Activation checkpoints recomputed on every rank.
    recomputes: u64,
}

/// Trains the toy for `steps` on `stages x replicas` thread ranks. Every rank builds the same
/// initial layers (rank 0's values are broadcast as Burn's init is random per process).
fn train(stages: usize, replicas: usize, kind: ScheduleKind, steps: u64) -> Outcome {
    train_with(stages, replicas, kind, steps, 0, "")
}

/// [`train`], with `pipeline.activation_checkpoint_interval` set to `interval` and `extra`
/// (`, "key": value` pairs) added to the config.
fn train_with(
    stages: usize,
    replicas: usize,
    kind: ScheduleKind,
    steps: u64,
    interval: u64,
    extra: &str,
) -> Outcome {
    let config = DeepSpeedConfig::from_json_str(&format!(
        r#"{{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
            "gradient_clipping": 0.5, "pipeline": {{"stages": {stages}, "partition": "uniform",
            "activation_checkpoint_interval": {interval}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}{extra}}}"#
    ))
    .expect("valid")
    .0;
    let device = Device::flex().autodiff();
    let template = toy_layers(&device);
    let results = ThreadWorld::run(
        stages * replicas,
        ThreadWorldOptions::default(),
        |c| -> (Vec<f64>, usize, Vec<Vec<f32>>, usize, u64) {
            let comm: Arc<dyn Communicator> = Arc::new(c);
            let device = Device::flex().autodiff();
            let mut engine =
                PipelineEngine::new(template.clone(), config.clone(), comm, device.clone())
                    .expect("engine")
                    .with_schedule(kind);
            let replica = engine.replica();
            let mut losses = Vec::new();
            let mut peak = 0;
            // Evaluation of step 0's batch before training equals step 0's training loss.
            let eval = engine
                .eval_batch(|k| batch(0, k, replica, &device))
                .expect("eval");
            for step in 0..steps {
                let r = engine
                    .train_batch(|k| batch(step, k, replica, &device))
                    .expect("step");
                losses.push(r.loss);
                peak = peak.max(r.peak_live_activations);
            }
            assert!(
                (eval - losses[0]).abs() <= 1e-6 * losses[0].abs(),
                "eval {eval} vs first training loss {}",
                losses[0]
            );
            let stage = engine.pipe_stage();
            let flats = engine
                .layers()
                .iter()
                .map(|l| params_to_flat(l, &ParamLayout::of(l)))
                .collect();
            let recomputes = crate::activation::take_stats().recomputes;
            (losses, stage, flats, peak, recomputes)
        },
    );
    let results: Vec<_> = results.into_iter().map(|r| r.expect("rank ok")).collect();
    let mut peak_live = vec![0; stages];
    for (_, s, _, p, _) in &results {
        peak_live[*s] = peak_live[*s].max(*p);
    }
    Outcome {
        losses: results[0].0.clone(),
        layers: results
            .iter()
            .map(|(_, s, f, _, _)| (*s, f.clone()))
            .collect(),
        peak_live,
        recomputes: results.iter().map(|r| r.4).sum(),
    }
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(1e-12))
        .fold(0.0, f64::max)
}

fn tied_copies(o: &Outcome, stages: usize) -> (Vec<f32>, Vec<f32>) {
    let first = o.layers.iter().find(|(s, _)| *s == 0).expect("stage 0");
    let last = o
        .layers
        .iter()
        .find(|(s, _)| *s == stages - 1)
        .expect("last stage");
    (first.1[0].clone(), last.1.last().expect("a layer").clone())
}

#[test]
fn every_stage_count_follows_one_stage_and_tied_copies_stay_equal() {
    let reference = train(1, 1, ScheduleKind::OneFOneB, 6);
    let (a, b) = tied_copies(&reference, 1);
    assert_eq!(a, b, "tied copies equal on one stage");
    assert!(
        reference.losses[5] < reference.losses[0],
        "{:?}",
        reference.losses
    );
    for stages in [2, 3, 4] {
        let o = train(stages, 1, ScheduleKind::OneFOneB, 6);
        let d = max_rel(&o.losses, &reference.losses);
        assert!(d < 1e-5, "{stages} stages: {d} ({:?})", o.losses);
        let (a, b) = tied_copies(&o, stages);
        assert_eq!(a, b, "tied copies equal across {stages} stages");
        for (s, &p) in o.peak_live.iter().enumerate() {
            assert!(p <= (stages - s).min(4), "stage {s} held {p} activations");
        }
    }
    // GPipe: same trajectory, all four micro-batches in flight on every stage.
    let g = train(2, 1, ScheduleKind::GPipe, 6);
    assert!(max_rel(&g.losses, &reference.losses) < 1e-5);
    assert_eq!(g.peak_live, vec![4, 4]);
}

#[test]
fn activation_checkpoint_intervals_keep_the_trajectory() {
    for stages in [1, 2] {
        let plain = train(stages, 1, ScheduleKind::OneFOneB, 4);
        for interval in [1, 2] {
            let o = train_with(stages, 1, ScheduleKind::OneFOneB, 4, interval, "");
            assert_eq!(
                o.losses, plain.losses,
                "{stages} stages, interval {interval}"
            );
            assert_eq!(
                o.layers, plain.layers,
                "{stages} stages, interval {interval}"
            );
            // 3 layers after the embedding, in runs of `interval`, per micro-batch and step.
            let runs = if stages == 1 {
                3u64.div_ceil(interval)
            } else {
                3 - interval + 1
            };
            assert_eq!(
                o.recomputes,
                4 * 4 * runs,
                "{stages} stages, interval {interval}"
            );
        }
    }
}

#[test]
fn sixteen_bit_pipelines_follow_fp32_at_every_stage_count() {
    let steps = 6;
    let fp32 = train(1, 1, ScheduleKind::OneFOneB, steps);
    for (extra, tolerance) in [
        (r#", "bf16": {"enabled": true}"#, 2e-2),
        (
            r#", "fp16": {"enabled": true, "initial_scale_power": 8}"#,
            2e-3,
        ),
    ] {
        let one = train_with(1, 1, ScheduleKind::OneFOneB, steps, 0, extra);
        let d = max_rel(&one.losses, &fp32.losses);
        println!("{extra}: largest relative loss difference to fp32 {d:.2e}");
        assert!(
            d < tolerance,
            "{extra}: {d} ({:?} vs {:?})",
            one.losses,
            fp32.losses
        );
        // Two and three stages (activations and gradients sent in the working dtype) and two
        // replicas follow the one-stage run of the same precision.
        for (stages, replicas) in [(2, 1), (3, 1), (2, 2)] {
            let o = train_with(stages, replicas, ScheduleKind::OneFOneB, steps, 0, extra);
            let reference = if replicas == 1 {
                one.losses.clone()
            } else {
                train_with(1, replicas, ScheduleKind::OneFOneB, steps, 0, extra).losses
            };
            let d = max_rel(&o.losses, &reference);
            println!("{extra}: {stages} stages x {replicas} replicas vs 1 stage: {d:.2e}");
            assert!(d < 1e-5, "{extra}: {stages}x{replicas}: {d}");
            let (a, b) = tied_copies(&o, stages);
            assert_eq!(a, b, "{extra}: tied copies equal across {stages} stages");
        }
    }
}

#[test]
fn replicas_average_like_data_parallelism() {
    // Two replicas see different data: the trajectory differs from one replica but is the
    // same with one or two stages.
    let one = train(1, 2, ScheduleKind::OneFOneB, 4);
    let two = train(2, 2, ScheduleKind::OneFOneB, 4);
    assert!(
        max_rel(&one.losses, &two.losses) < 1e-5,
        "{:?} {:?}",
        one.losses,
        two.losses
    );
    let single = train(1, 1, ScheduleKind::OneFOneB, 4);
    assert!(max_rel(&one.losses, &single.losses) > 1e-4);
}

#[test]
fn bad_layouts_are_refused() {
    let device = Device::flex().autodiff();
    let run = |json: &str, world: usize| -> String {
        let config = DeepSpeedConfig::from_json_str(json).expect("valid").0;
        let template = toy_layers(&device);
        let out = ThreadWorld::run(world, ThreadWorldOptions::default(), |c| {
            let comm: Arc<dyn Communicator> = Arc::new(c);
            PipelineEngine::<Toy, ToyBatch>::new(
                template.clone(),
                config.clone(),
                comm,
                device.clone(),
            )
            .err()
            .map(|e| e.to_string())
        });
        out.into_iter()
            .next()
            .expect("rank 0")
            .expect("no panic")
            .expect("an error")
    };
    let base = r#""train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2"#;
    let e = run(&format!(r#"{{{base}, "pipeline": {{"stages": 4}}}}"#), 6);
    assert!(
        e.contains("6 ranks cannot be split into 4 pipeline stages"),
        "{e}"
    );
    let e = run(&format!(r#"{{{base}, "pipeline": {{"stages": 5}}}}"#), 5);
    assert!(e.contains("4 layers cannot fill 5 stages"), "{e}");
    let e = run(
        &format!(r#"{{{base}, "pipeline": {{"stages": "auto"}}}}"#),
        2,
    );
    assert!(e.contains("pipeline.stages"), "{e}");
    let e = run(
        &format!(r#"{{{base}, "pipeline": {{"stages": 2}}, "zero_optimization": {{"stage": 2}}}}"#),
        2,
    );
    assert!(
        e.contains("cannot be combined with pipeline parallelism"),
        "{e}"
    );
    let e = run(
        &format!(r#"{{{base}, "pipeline": {{"stages": 2, "partition": "type:conv"}}}}"#),
        2,
    );
    assert!(e.contains("matches none of the layer types"), "{e}");
}
