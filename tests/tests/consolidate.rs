//! `checkpoint consolidate`: a checkpoint written at any ZeRO stage and world size becomes one
//! safetensors file that plain Burn loads (burn-store's `SafetensorsStore`, no burn-deepspeed
//! involved), giving the model the engine trained: the same parameters and the same loss.

use std::time::Duration;

use burn::module::Module;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::Device;
use burn_deepspeed::checkpoint::{Consolidated, consolidate};
use burn_deepspeed::flat::{ParamLayout, params_to_flat};
use burn_deepspeed::launch::{launch, rank_pool_threads};
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use burn_deepspeed_tests::gpt_eval_loss;

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 16,
    moe: None,
};

fn eval_loss(model: &Gpt) -> f64 {
    gpt_eval_loss(model, SHAPE.seq_len, 8)
}

/// Runs `f` on a rayon pool the size of a thread rank's in a world of `world` (Flex runs its
/// kernels on the calling thread's pool).
fn on_rank_pool<R: Send>(world: usize, f: impl FnOnce() -> R + Send) -> R {
    let threads = rank_pool_threads(world)
        .expect("the rank pool's size")
        .unwrap_or_else(rayon::current_num_threads);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a pool")
        .install(f)
}

/// Trains 3 steps at `stage` on `world` ranks, saves, and returns rank 0's whole parameters
/// and evaluation loss after training (on the plain device).
fn train_and_save(stage: u8, world: usize, dir: &std::path::Path) -> (Vec<f32>, f64) {
    let (config, _) = DeepSpeedConfig::from_json_str(&format!(
        r#"{{"train_batch_size": {}, "zero_optimization": {{"stage": {stage},
            "stage3_param_persistence_threshold": 0}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01}}}}}}"#,
        4 * world
    ))
    .expect("valid config");
    let corpus = ByteCorpus::new(EMBEDDED_CORPUS.to_vec(), 7);
    let (_, out) = launch(world, Duration::from_secs(120), |comm| {
        let rank = comm.rank();
        let device = Device::flex().autodiff();
        let mut engine = DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config.clone(), comm)?;
        for step in 0..3 {
            let batch = corpus.batch(step, rank as u64 * 4, 4, SHAPE.seq_len, &Device::flex());
            engine.train_batch([batch])?;
        }
        engine.save_checkpoint(dir, Some("trained"))?;
        let model = engine.into_model()?;
        let flat = params_to_flat(&model, &ParamLayout::of(&model));
        // Evaluated without autodiff, as plain Burn evaluates the file below (under autodiff
        // the GPT's GELU is the fused pass, within 2e-7 of Burn's and not bit-identical).
        Ok((flat, eval_loss(&model.valid())))
    })
    .expect("training runs");
    out.into_iter().next().expect("rank 0")
}

#[test]
fn plain_burn_loads_the_consolidated_checkpoint_of_every_stage() {
    for (stage, world) in [(0, 2), (1, 2), (2, 3), (3, 2)] {
        let dir = tempfile::tempdir().expect("temp dir");
        let (params, loss) = train_and_save(stage, world, dir.path());
        let file = dir.path().join("model.safetensors");
        let report: Consolidated = consolidate(dir.path(), None, &file).expect("consolidates");
        assert_eq!(report.tag, "trained");
        assert_eq!(report.values, params.len());

        // Plain Burn: a fresh model (other initial weights) loads the file by module path.
        let mut plain = Gpt::new(SHAPE, 123, &Device::flex());
        let applied = plain
            .load_from(&mut SafetensorsStore::from_file(&file))
            .expect("burn-store loads it");
        assert!(applied.is_success(), "stage {stage}: {applied:?}");
        assert_eq!(applied.applied.len(), report.tensors, "stage {stage}");
        let loaded = params_to_flat(&plain, &ParamLayout::of(&plain));
        assert_eq!(loaded, params, "stage {stage}: the same parameters");
        // Rank 0 evaluated on its rank's compute pool; so does plain Burn here, with as many
        // threads: Flex splits its sums by the pool's size, and the loss is then bit-identical.
        let plain_loss = on_rank_pool(world, || eval_loss(&plain));
        println!(
            "stage {stage}, {world} ranks: {} tensors, {} bytes; engine loss {loss:.6}, plain \
             Burn loss {plain_loss:.6}",
            report.tensors, report.bytes
        );
        assert_eq!(plain_loss, loss, "stage {stage}: the same loss");
    }
}

#[test]
fn a_tampered_checkpoint_is_not_consolidated() {
    let dir = tempfile::tempdir().expect("temp dir");
    train_and_save(0, 1, dir.path());
    let model = dir.path().join("trained").join("model.bin");
    let mut bytes = std::fs::read(&model).expect("model.bin");
    bytes[10] ^= 1;
    std::fs::write(&model, bytes).expect("rewrite");
    let out = dir.path().join("model.safetensors");
    let e = consolidate(dir.path(), Some("trained"), &out)
        .expect_err("checksum")
        .to_string();
    assert!(e.contains("model.bin"), "{e}");
    assert!(!out.exists(), "nothing written");
    let e = consolidate(dir.path(), Some("../x"), &out)
        .expect_err("tag")
        .to_string();
    assert!(e.contains("../x"), "{e}");
}

/// The file is written under a name nobody can plant in advance: a link at the name the
/// scratch file used to have (`.NAME.PID.tmp`) is neither followed nor overwritten, and what
/// it points to keeps its contents.
#[test]
fn a_planted_link_is_not_followed() {
    let dir = tempfile::tempdir().expect("temp dir");
    train_and_save(0, 1, dir.path());
    let victim = dir.path().join("victim.txt");
    std::fs::write(&victim, b"keep me").expect("write");
    let out = dir.path().join("model.safetensors");
    let planted = dir
        .path()
        .join(format!(".model.safetensors.{}.tmp", std::process::id()));
    std::os::unix::fs::symlink(&victim, &planted).expect("link");
    consolidate(dir.path(), Some("trained"), &out).expect("consolidates");
    assert_eq!(std::fs::read(&victim).expect("victim"), b"keep me");
    assert!(std::fs::symlink_metadata(&out).expect("written").is_file());
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
