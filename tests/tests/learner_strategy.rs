//! `DeepSpeedStrategy` inside Burn's `SupervisedTraining`: two data-parallel ranks train the
//! GPT example through the Learner API, at ZeRO stages 0 to 3.

use std::sync::Arc;
use std::time::Duration;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder, DataLoaderIterator, Progress};
use burn::data::dataset::{DatasetError, InMemDataset};
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::store::ModuleRecord;
use burn::tensor::Device;
use burn::train::{Learner, SupervisedTraining, TrainingError, TrainingStrategy};
use burn_deepspeed::flat::{ParamLayout, params_to_flat};
use burn_deepspeed::launch::launch;
use burn_deepspeed::learner::DeepSpeedStrategy;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::data::{EMBEDDED_CORPUS, WindowBatcher, windows};
use burn_deepspeed_example_gpt::model::{Gpt, GptBatch, GptShape};
use burn_deepspeed_tests::gpt_eval_loss;

const SHAPE: GptShape = GptShape {
    d_model: 64,
    layers: 2,
    heads: 4,
    seq_len: 32,
    moe: None,
};

fn eval_loss(model: &Gpt) -> f64 {
    gpt_eval_loss(model, SHAPE.seq_len, 16)
}

/// The Learner's AdamW on 2 ranks for `epochs`, at ZeRO `stage`.
fn train_at_stage(stage: u8, epochs: usize) -> Gpt {
    train_with(
        &format!(r#"{{"stage": {stage}, "reduce_bucket_size": 2000}}"#),
        epochs,
    )
}

/// The Learner's AdamW on 2 ranks for `epochs` with `zero` as `zero_optimization`.
fn train_with(zero: &str, epochs: usize) -> Gpt {
    train_with_extra(zero, "", epochs)
}

/// [`train_with`], with `extra` (`, "key": value` pairs) added to the config.
fn train_with_extra(zero: &str, extra: &str, epochs: usize) -> Gpt {
    train_on(Device::flex(), zero, extra, epochs)
}

/// [`train_with_extra`] with the model and the batches on `device`.
fn train_on(device: Device, zero: &str, extra: &str, epochs: usize) -> Gpt {
    train_on_devices(device, None, zero, extra, epochs)
}

/// [`train_on`], with the model and the loaders on `device`, and the strategy's ranks on
/// `ranks_on` when given (`DeepSpeedStrategy::on_devices`), else 2 ranks on the model's device.
fn train_on_devices(
    device: Device,
    ranks_on: Option<Vec<Device>>,
    zero: &str,
    extra: &str,
    epochs: usize,
) -> Gpt {
    let data = windows(&EMBEDDED_CORPUS[..33 * 96], SHAPE.seq_len);
    let train = DataLoaderBuilder::new(WindowBatcher)
        .batch_size(4)
        .set_device(device.clone())
        .build(InMemDataset::new(data[..80].to_vec()));
    let valid = DataLoaderBuilder::new(WindowBatcher)
        .batch_size(4)
        .set_device(device.clone())
        .build(InMemDataset::new(data[80..].to_vec()));
    let model = Gpt::new(SHAPE, 5, &device.autodiff());
    let (config, _) = DeepSpeedConfig::from_json_str(&format!(
        r#"{{"gradient_clipping": 1.0, "train_batch_size": 8, "zero_optimization": {zero}{extra}}}"#
    ))
    .expect("valid config");
    let strategy = match ranks_on {
        Some(devices) => DeepSpeedStrategy::on_devices(config, devices),
        None => DeepSpeedStrategy::new(config, 2),
    };
    // Stage 3 shards the model before the Learner holds it (a no-op at stages 0-2).
    let model = strategy.prepare_model(model);
    let dir = tempfile::tempdir().expect("temp dir");
    let result = SupervisedTraining::new(dir.path(), train, valid)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .num_epochs(epochs)
        .launch(Learner::new(model, AdamWConfig::new().init(), 3e-3));
    assert!(result.error.is_none(), "{:?}", result.error);
    result.model
}

/// ZeRO stages 1 to 3 in the strategy: at stages 1-2 each rank steps its own whole tensors
/// with the Learner's optimizer, at stage 3 its chunks (with every tensor partitioned, and
/// with small tensors kept whole and a prefetch bucket); the model equals stage 0's.
#[test]
fn zero_stages_in_the_strategy_match_stage_0() {
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));
    let base = flat(&train_at_stage(0, 1));
    let runs = [
        ("stage 1", r#"{"stage": 1, "reduce_bucket_size": 2000}"#),
        ("stage 2", r#"{"stage": 2, "reduce_bucket_size": 2000}"#),
        (
            "stage 3",
            r#"{"stage": 3, "stage3_param_persistence_threshold": 0}"#,
        ),
        (
            "stage 3, persistent below 100, prefetch 5000",
            r#"{"stage": 3, "stage3_param_persistence_threshold": 100,
                "stage3_prefetch_bucket_size": 5000}"#,
        ),
    ];
    for (name, zero) in runs {
        let z = flat(&train_with(zero, 1));
        assert_eq!(z.len(), base.len(), "{name}: the model comes back whole");
        let diff = base
            .iter()
            .zip(&z)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        println!("{name}: max parameter difference to stage 0 {diff:e}");
        assert!(diff <= 1e-5, "{name}: {diff}");
    }
}

/// Stages 0, 2 and 3 as the device tests run them.
const STAGES_0_2_3: [&str; 3] = [
    r#"{"stage": 0}"#,
    r#"{"stage": 2, "reduce_bucket_size": 2000}"#,
    r#"{"stage": 3, "stage3_param_persistence_threshold": 100}"#,
];

/// The largest element-wise difference of two parameter vectors.
fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

/// Ranks given as devices, as Burn's strategies take them: two ranks listed on the one Flex
/// device train exactly as `DeepSpeedStrategy::new(config, 2)` does; with wgpu, a model and
/// loaders built on Flex train on two wgpu ranks (each forks its Learner there and loads its
/// part of the data there) and end within wgpu's rounding of the Flex run.
#[test]
fn ranks_given_as_devices_train_there() {
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));
    for zero in STAGES_0_2_3 {
        let base = flat(&train_with(zero, 1));
        let two = vec![Device::flex(), Device::flex()];
        let listed = flat(&train_on_devices(Device::flex(), Some(two), zero, "", 1));
        assert_eq!(base, listed, "{zero}: [flex, flex] vs 2 ranks");
        #[cfg(feature = "wgpu")]
        {
            let wgpu = Device::from(burn::backend::wgpu::WgpuDevice::default());
            let moved = flat(&train_on_devices(
                Device::flex(),
                Some(vec![wgpu.clone(), wgpu]),
                zero,
                "",
                1,
            ));
            let diff = max_difference(&base, &moved);
            println!("{zero}: Flex model on [wgpu, wgpu] ranks: max difference to Flex {diff:e}");
            assert!(diff <= 1e-4, "{zero}: {diff:e}");
        }
    }
}

/// The strategy with the model on a wgpu device (lavapipe in CI): every rank forks the
/// Learner onto that device, and at stages 0, 2 and 3 the trained model follows the same run
/// on Flex within 1e-4 (the devices sum in other orders).
#[cfg(feature = "wgpu")]
#[test]
fn the_strategy_trains_on_wgpu() {
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));
    for zero in STAGES_0_2_3 {
        let flex = flat(&train_with(zero, 1));
        let device = Device::from(burn::backend::wgpu::WgpuDevice::default());
        let wgpu = flat(&train_on(device, zero, "", 1));
        let diff = max_difference(&flex, &wgpu);
        println!("{zero} on wgpu: max parameter difference to Flex {diff:e}");
        assert_eq!(flex.len(), wgpu.len(), "{zero}: the model comes back whole");
        assert!(diff <= 1e-4, "{zero}: wgpu vs Flex {diff:e}");
    }
}

/// `offload_optimizer: cpu` in the strategy: the fp32 masters and the Learner's optimizer
/// state live in host memory and the optimizer steps there, at stages 2 and 3 (stage 1 is
/// stage 2's step), in fp32 and bf16. On Flex the model is in host memory already and the run is the one without
/// offload, bit for bit; with wgpu the model computes on the device, the optimizer on the
/// host, and the trained model follows the Flex run within the devices' rounding.
#[test]
fn the_optimizer_offloads_to_host_memory() {
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));
    let offload = r#", "offload_optimizer": {"device": "cpu"}}"#;
    let runs = [
        (r#"{"stage": 2, "reduce_bucket_size": 2000"#, ""),
        (r#"{"stage": 2"#, r#", "bf16": {"enabled": true}"#),
        (
            r#"{"stage": 3, "stage3_param_persistence_threshold": 100"#,
            "",
        ),
    ];
    for (zero, extra) in runs {
        let plain = flat(&train_with_extra(&format!("{zero}}}"), extra, 1));
        let offloaded = flat(&train_with_extra(&format!("{zero}{offload}"), extra, 1));
        assert_eq!(plain, offloaded, "{zero}{extra}: on Flex nothing moves");
        // wgpu has no bf16.
        #[cfg(feature = "wgpu")]
        if extra.is_empty() {
            let device = Device::from(burn::backend::wgpu::WgpuDevice::default());
            let wgpu = flat(&train_on(device, &format!("{zero}{offload}"), extra, 1));
            let diff = max_difference(&plain, &wgpu);
            println!("{zero}{extra}, offloaded from wgpu: max difference to Flex {diff:e}");
            assert!(diff <= 1e-4, "{zero}{extra}: {diff:e}");
        }
    }
}

/// bf16, and fp16 with dynamic loss scaling, in the strategy at stages 0, 2 and 3: the
/// Learner's AdamW steps fp32 masters (at stage 3 this rank's chunks), the model that comes
/// back is the masters (in f32), its held-out loss follows fp32's, and the stages agree.
#[test]
fn the_strategy_trains_in_16_bit_with_fp32_masters() {
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));
    let fp32 = train_with(r#"{"stage": 0}"#, 1);
    let base = eval_loss(&fp32);
    for extra in [
        r#", "bf16": {"enabled": true}"#,
        r#", "fp16": {"enabled": true, "initial_scale_power": 10}"#,
    ] {
        let mut by_stage = Vec::new();
        for stage in [0, 2, 3] {
            let zero = match stage {
                // Small tensors whole, and a prefetch bucket that reads the 16-bit chunks.
                3 => r#"{"stage": 3, "stage3_param_persistence_threshold": 100,
                          "stage3_prefetch_bucket_size": 5000}"#
                    .to_string(),
                _ => format!(r#"{{"stage": {stage}, "reduce_bucket_size": 2000}}"#),
            };
            let model = train_with_extra(&zero, extra, 1);
            struct AllF32(bool);
            impl burn::module::ModuleVisitor for AllF32 {
                fn visit_float<const D: usize>(
                    &mut self,
                    p: &burn::module::Param<burn::tensor::Tensor<D>>,
                ) {
                    self.0 &= p.val().dtype() == burn::tensor::DType::F32;
                }
            }
            let mut all = AllF32(true);
            burn::module::Module::visit(&model, &mut all);
            assert!(all.0, "{extra}: the masters come back in f32");
            let loss = eval_loss(&model);
            let rel = (loss - base).abs() / base;
            println!(
                "{extra} stage {stage}: held-out loss {loss:.4} vs fp32 {base:.4} ({rel:.1e})"
            );
            assert!(rel < 1e-2, "{extra} stage {stage}: {loss} vs {base}");
            by_stage.push(flat(&model));
        }
        for (stage, other) in [2, 3].into_iter().zip(&by_stage[1..]) {
            let diff = by_stage[0]
                .iter()
                .zip(other)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            println!("{extra}: stage {stage} vs stage 0: max parameter difference {diff:e}");
            assert!(diff <= 1e-5, "{extra}: stage {stage} vs stage 0: {diff}");
        }
    }
}

/// A short training of an unprepared model on 2 ranks with `config` and the Learner's own
/// AdamW; returns the error the strategy reported, if any.
fn launch_unprepared(config: &str, checkpointers: bool) -> Option<String> {
    launch_with(config, checkpointers, 4, 16, None, |_, model| {
        Ok(Learner::new(model, AdamWConfig::new().init(), 3e-3))
    })
}

/// Trains the GPT on `items` windows in loader batches of `batch` for one epoch on 2 ranks,
/// with the Learner `learner` builds; returns the reported error, if any.
fn launch_with(
    config: &str,
    checkpointers: bool,
    batch: usize,
    items: usize,
    grad_accumulation: Option<usize>,
    learner: impl FnOnce(&DeepSpeedStrategy, Gpt) -> burn_deepspeed::Result<Learner<Gpt>>,
) -> Option<String> {
    let device = Device::flex().autodiff();
    let data = windows(&EMBEDDED_CORPUS[..33 * items], SHAPE.seq_len);
    let loader = || {
        DataLoaderBuilder::new(WindowBatcher)
            .batch_size(batch)
            .set_device(Device::flex())
            .build(InMemDataset::new(data.clone()))
    };
    let (config, _) = DeepSpeedConfig::from_json_str(config).expect("valid config");
    let strategy = DeepSpeedStrategy::new(config, 2);
    let learner = learner(&strategy, Gpt::new(SHAPE, 5, &device)).expect("a learner");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut training = SupervisedTraining::new(dir.path(), loader(), loader())
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .num_epochs(1);
    if let Some(g) = grad_accumulation {
        training = training.grads_accumulation(g);
    }
    if checkpointers {
        training = training.with_default_checkpointers();
    }
    let result = training.launch(learner);
    result.error.map(|e| e.to_string())
}

/// Asserts that `error` was reported and mentions `needle`.
fn assert_refused(error: Option<String>, needle: &str) {
    let error = error.unwrap_or_else(|| panic!("expected an error mentioning {needle}"));
    assert!(error.contains(needle), "{error}");
    println!("refused: {error}");
}

/// Stage 3 needs the model prepared before the Learner is built.
#[test]
fn stage_3_without_prepare_model_is_refused() {
    let e = launch_unprepared(r#"{"zero_optimization": {"stage": 3}}"#, false);
    assert_refused(e, "DeepSpeedStrategy::prepare_model");
}

#[test]
fn supervised_training_with_two_ranks_learns() {
    let before = eval_loss(&Gpt::new(SHAPE, 5, &Device::flex().autodiff()));
    let after = eval_loss(&train_at_stage(0, 3));
    println!("held-out loss {before:.4} -> {after:.4}");
    assert!(after < before - 0.3, "loss {before} -> {after}");
}

/// Trains the GPT on 2 ranks on `device` with Burn's default checkpointers in `dir` until
/// epoch `epochs`, resuming from the checkpoint of epoch `resume` when given.
fn train_checkpointed_on(
    device: Device,
    dir: &std::path::Path,
    config: &str,
    epochs: usize,
    resume: Option<usize>,
) -> Gpt {
    let data = windows(&EMBEDDED_CORPUS[..33 * 40], SHAPE.seq_len);
    let loader = |items: &[_]| {
        DataLoaderBuilder::new(WindowBatcher)
            .batch_size(4)
            .set_device(device.clone())
            .build(InMemDataset::new(items.to_vec()))
    };
    let (config, _) = DeepSpeedConfig::from_json_str(config).expect("valid config");
    let from_config = config.optimizer.is_some();
    let strategy = DeepSpeedStrategy::new(config, 2);
    let model = Gpt::new(SHAPE, 5, &device.clone().autodiff());
    // The config's optimizer and schedule, or the Learner's own; at stage 3 the model is
    // sharded before the Learner is built (a no-op below).
    let learner = match from_config {
        true => strategy.learner(model).expect("a Learner from the config"),
        false => Learner::new(
            strategy.prepare_model(model),
            AdamWConfig::new().init(),
            3e-3,
        ),
    };
    let mut training = SupervisedTraining::new(dir, loader(&data[..24]), loader(&data[24..]))
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
        .with_default_checkpointers()
        .num_epochs(epochs);
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    let result = training.launch(learner);
    assert!(result.error.is_none(), "{:?}", result.error);
    result.model
}

/// Burn's checkpointer at ZeRO stages 1-3, in fp32 and bf16, and with the optimizer
/// offloaded to host memory: a run checkpointed after its first epoch, stopped and resumed
/// for the second ends with the parameters of the run that was not stopped (the checkpoint
/// holds every rank's optimizer state and the whole fp32 parameters; at stage 3 the ranks'
/// chunks joined).
#[test]
fn learner_checkpoints_resume_at_stages_1_to_3() {
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));
    let bf16 = r#", "bf16": {"enabled": true}"#;
    let from_config = r#", "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 3e-3}}"#;
    let offload = r#", "offload_optimizer": {"device": "cpu"}"#;
    let mut runs = vec![
        (Device::flex(), 1, "", ""),
        (Device::flex(), 2, "", ""),
        (Device::flex(), 1, bf16, ""),
        (Device::flex(), 2, bf16, ""),
        (Device::flex(), 3, "", ""),
        (Device::flex(), 3, bf16, ""),
        // The config's optimizer and schedule (a Learner from `DeepSpeedStrategy::learner`).
        (Device::flex(), 3, from_config, ""),
    ];
    // The optimizer offloaded from a device to host memory (wgpu has no bf16): its state is
    // saved and resumed from there.
    #[cfg(feature = "wgpu")]
    {
        let wgpu = Device::from(burn::backend::wgpu::WgpuDevice::default());
        runs.push((wgpu, 2, "", offload));
    }
    runs.push((Device::flex(), 2, bf16, offload));
    runs.push((Device::flex(), 3, bf16, offload));
    for (device, stage, precision, offload) in runs {
        // At stage 3 every tensor over 100 elements is partitioned (the default threshold
        // would keep this model's tensors whole).
        let persist = match stage {
            3 => r#", "stage3_param_persistence_threshold": 100"#,
            _ => "",
        };
        let config = format!(
            r#"{{"train_batch_size": 8, "zero_optimization": {{"stage": {stage}{persist}{offload}}}{precision}}}"#
        );
        let (straight, stopped) = (
            tempfile::tempdir().expect("dir"),
            tempfile::tempdir().expect("dir"),
        );
        let run = |dir: &tempfile::TempDir, epochs, resume| {
            flat(&train_checkpointed_on(
                device.clone(),
                dir.path(),
                &config,
                epochs,
                resume,
            ))
        };
        let whole = run(&straight, 2, None);
        let first = run(&stopped, 1, None);
        let name = format!("stage {stage}{precision}{offload} on {device:?}");
        // The saved model is the whole fp32 model, as an unpartitioned run saves it: it loads
        // into a plain GPT, with the values the first run ended with.
        let file = stopped.path().join("checkpoint").join("model-1.bpk");
        let record = ModuleRecord::load(&file).expect("the checkpoint's model record");
        let plain = Gpt::new(SHAPE, 6, &Device::flex()).load_record(record);
        assert_eq!(
            flat(&plain),
            first,
            "{name}: the checkpoint holds the whole model"
        );
        let resumed = run(&stopped, 2, Some(1));
        assert!(
            max_difference(&first, &whole) > 1e-4,
            "{name}: the second epoch trained"
        );
        let diff = max_difference(&resumed, &whole);
        println!("{name}: resumed against not stopped: max difference {diff:e}");
        assert_eq!(
            diff, 0.0,
            "{name}: the resumed run must end where the other does"
        );
    }
}

/// Every key is honoured or refused: the config's batch numbers must match the loader and
/// `SupervisedTraining`, and its optimizer and schedule need a Learner built from them.
#[test]
fn config_keys_the_strategy_cannot_honour_are_refused() {
    let own = |_: &DeepSpeedStrategy, model: Gpt| {
        Ok(Learner::new(model, AdamWConfig::new().init(), 3e-3))
    };
    let cases: &[(&str, usize, Option<usize>, &str)] = &[
        // The loader's batches hold 4 items; the config wants 8 per rank.
        (
            r#"{"train_batch_size": 16}"#,
            4,
            None,
            "train_micro_batch_size_per_gpu is 8",
        ),
        // 2 micro-batches per step from the config, 3 from SupervisedTraining.
        (
            r#"{"gradient_accumulation_steps": 2}"#,
            4,
            Some(3),
            "grad_accumulation is 3",
        ),
        (
            r#"{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}"#,
            4,
            None,
            "`optimizer`",
        ),
        (
            r#"{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}"#,
            4,
            None,
            "`scheduler`",
        ),
        (r#"{"gradient_clipping": -1}"#, 4, None, "gradient_clipping"),
    ];
    for (config, batch, accumulation, needle) in cases {
        let e = launch_with(config, false, *batch, 16, *accumulation, own);
        assert_refused(e, needle);
    }
    // fp16 with Burn's checkpointer: the checkpoint has no place for the loss scale.
    let e = launch_with(r#"{"fp16": {"enabled": true}}"#, true, 4, 16, None, own);
    assert_refused(e, "fp16.enabled");
    // A batch size that agrees trains.
    let e = launch_with(r#"{"train_batch_size": 8}"#, false, 4, 16, None, own);
    assert!(e.is_none(), "{e:?}");
}

/// Fewer training items than ranks, or too few for one step, is an error, not 0 steps.
#[test]
fn too_little_data_is_an_error() {
    let own = |_: &DeepSpeedStrategy, model: Gpt| {
        Ok(Learner::new(model, AdamWConfig::new().init(), 3e-3))
    };
    assert_refused(
        launch_with("{}", false, 4, 1, None, own),
        "1 items for 2 ranks",
    );
    // 2 items per rank, in batches of 2: one micro-batch, where a step needs 3.
    let e = launch_with(
        r#"{"gradient_accumulation_steps": 3}"#,
        false,
        2,
        4,
        None,
        own,
    );
    assert_refused(e, "took no optimizer step");
}

/// A loader's error stops every rank and comes back as Burn's dataset error.
#[test]
fn a_loader_error_is_an_error_not_the_end_of_the_data() {
    let device = Device::flex().autodiff();
    let data = windows(&EMBEDDED_CORPUS[..33 * 16], SHAPE.seq_len);
    let failing = Arc::new(FailingLoader {
        inner: DataLoaderBuilder::new(WindowBatcher)
            .batch_size(2)
            .set_device(Device::flex())
            .build(InMemDataset::new(data.clone())),
        fail_at: 2,
    });
    let valid = DataLoaderBuilder::new(WindowBatcher)
        .batch_size(2)
        .set_device(Device::flex())
        .build(InMemDataset::new(data));
    let (config, _) = DeepSpeedConfig::from_json_str("{}").expect("valid config");
    let dir = tempfile::tempdir().expect("temp dir");
    let result = SupervisedTraining::new(dir.path(), failing, valid)
        .with_training_strategy(TrainingStrategy::Custom(Arc::new(DeepSpeedStrategy::new(
            config, 2,
        ))))
        .num_epochs(1)
        .launch(Learner::new(
            Gpt::new(SHAPE, 5, &device),
            AdamWConfig::new().init(),
            3e-3,
        ));
    let error = result.error.expect("the loader's error is reported");
    assert!(
        matches!(*error, TrainingError::Dataset(_)),
        "a dataset error: {error}"
    );
    assert!(error.to_string().contains("disk went away"), "{error}");
}

/// A training loader whose every slice fails at its `fail_at`-th batch.
struct FailingLoader {
    inner: Arc<dyn DataLoader<GptBatch>>,
    fail_at: usize,
}

struct FailingIter<'a> {
    inner: Box<dyn DataLoaderIterator<GptBatch> + 'a>,
    left: usize,
}

impl Iterator for FailingIter<'_> {
    type Item = Result<GptBatch, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return Some(Err(DatasetError::new(std::io::Error::other(
                "disk went away",
            ))));
        }
        self.left -= 1;
        self.inner.next()
    }
}

impl DataLoaderIterator<GptBatch> for FailingIter<'_> {
    fn progress(&self) -> Progress {
        self.inner.progress()
    }
}

impl DataLoader<GptBatch> for FailingLoader {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<GptBatch> + 'a> {
        Box::new(FailingIter {
            inner: self.inner.iter(),
            left: self.fail_at,
        })
    }

    fn num_items(&self) -> usize {
        self.inner.num_items()
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<GptBatch>> {
        Arc::new(Self {
            inner: self.inner.to_device(device),
            fail_at: self.fail_at,
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<GptBatch>> {
        Arc::new(Self {
            inner: self.inner.slice(start, end),
            fail_at: self.fail_at,
        })
    }
}

/// The config's optimizer and schedule, through `DeepSpeedStrategy::learner`, step what
/// `DeepSpeedEngine` steps: on the same config and the same micro-batches, the Learner
/// strategy and the engine end with the same parameters (and a warm-up changes them).
#[test]
fn the_configs_optimizer_and_schedule_match_the_engine() {
    let text = r#"{"train_batch_size": 8, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0,
            "warmup_max_lr": 3e-3, "warmup_num_steps": 3, "total_num_steps": 10}}}"#;
    let (config, _) = DeepSpeedConfig::from_json_str(text).expect("valid config");
    let data = windows(&EMBEDDED_CORPUS[..33 * 80], SHAPE.seq_len);
    let flat = |m: &Gpt| params_to_flat(m, &ParamLayout::of(m));

    // The Learner strategy: 80 items, 40 per rank, batches of 4: 10 steps.
    let device = Device::flex().autodiff();
    let strategy = DeepSpeedStrategy::new(config.clone(), 2);
    let learner = strategy
        .learner(Gpt::new(SHAPE, 5, &device))
        .expect("a learner");
    let loader = |items: Vec<Vec<u8>>| {
        DataLoaderBuilder::new(WindowBatcher)
            .batch_size(4)
            .set_device(Device::flex())
            .build(InMemDataset::new(items))
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let result =
        SupervisedTraining::new(dir.path(), loader(data.clone()), loader(data[..8].to_vec()))
            .with_training_strategy(TrainingStrategy::Custom(Arc::new(strategy)))
            .num_epochs(1)
            .launch(learner);
    assert!(result.error.is_none(), "{:?}", result.error);
    let via_learner = flat(&result.model);

    // The engine on each rank's slice, in the same order.
    let engine_run = |config: DeepSpeedConfig| {
        let (_, params) = launch(2, Duration::from_secs(120), |comm| {
            let rank = comm.rank();
            let device = Device::flex().autodiff();
            let mut engine =
                DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config.clone(), comm)?;
            for step in 0..10 {
                let at = rank * 40 + step * 4;
                let batch = WindowBatcher.batch(data[at..at + 4].to_vec(), &Device::flex());
                engine.train_batch([batch])?;
            }
            engine.flat_params()
        })
        .expect("the engine trains");
        params.into_iter().next().expect("rank 0's parameters")
    };
    let via_engine = engine_run(config.clone());
    let diff = max_diff(&via_learner, &via_engine);
    println!("Learner strategy vs engine: max parameter difference {diff:e}");
    assert!(diff <= 1e-5, "{diff}");
    // The schedule matters: without the warm-up the parameters differ.
    let mut constant = config;
    constant.scheduler = None;
    let apart = max_diff(&via_learner, &engine_run(constant));
    assert!(apart > 1e-4, "{apart}");
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
