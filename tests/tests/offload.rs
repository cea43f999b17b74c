//! ZeRO-Offload and ZeRO-Infinity's optimizer offload on the GPT example: with the optimizer
//! state in host memory (`cpu`) or in swap files (`nvme`, stepped tile by tile), training
//! follows the in-memory run bit for bit at ZeRO stages 1-3, in fp32 and with 16-bit working
//! copies; the state on disk is measured; checkpoints of offloaded runs resume exactly (and at
//! another world size within 1e-4); a bad
//! `nvme_path` is refused by name.
//!
//! The I/O engine is the process's (io_uring here when the kernel allows it); the
//! `offload_pread` test binary runs the same comparison on the `pread` fallback.

use crate::common;

use std::time::Duration;

use burn::tensor::Device;
use burn_deepspeed::launch::launch;
use burn_deepspeed::{DeepSpeedConfig, DeepSpeedEngine};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};
use burn_deepspeed_example_gpt::run::RunReport;
use burn_deepspeed_tests::offload::{offload_config, same_run, train_steps};

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 2,
    heads: 2,
    seq_len: 16,
    moe: None,
};

fn run(config: DeepSpeedConfig, shape: GptShape, steps: u64) -> RunReport {
    common::train(2, &common::spec(config, shape, steps, 5, 9))
}

/// The file's GPT (about 43k parameters, so about 21k per rank), 2 ranks, 8 steps, stages
/// 1-3: `cpu` and `nvme` give the in-memory run's losses, parameters and moments bit for bit,
/// with odd tiles that cut each rank's state into a few tiles (4,999 elements, pipelined) and
/// into dozens (617, not pipelined), so that every tile boundary and the short last tile are
/// crossed each step.
#[test]
fn offloaded_optimizer_steps_are_bit_identical_at_stages_1_to_3() {
    const STEPS: u64 = 8;
    let dir = tempfile::tempdir().expect("temp dir");
    for stage in 1..=3u8 {
        let base = run(offload_config(stage, "fp32", None), SHAPE, STEPS);
        let cpu = run(
            offload_config(stage, "fp32", Some(("cpu", dir.path(), 0, false))),
            SHAPE,
            STEPS,
        );
        same_run(&base, &cpu, &format!("stage {stage} cpu"));
        assert_eq!(cpu.offload_optimizer, "cpu");
        for (tile, pipelined) in [(4_999, true), (617, false)] {
            let nvme = run(
                offload_config(stage, "fp32", Some(("nvme", dir.path(), tile, pipelined))),
                SHAPE,
                STEPS,
            );
            let what = format!("stage {stage} nvme, tile {tile}, pipelined {pipelined}");
            same_run(&base, &nvme, &what);
            let swap = nvme
                .swap
                .as_ref()
                .expect("an nvme run reports its swap file");
            println!("{what}: {swap:?}; losses {:?}", &nvme.losses[..3]);
            if burn_deepspeed::swap::io_uring_available() {
                assert_eq!(swap.engine, "io_uring");
            }
            assert!(swap.bytes_read > 0 && swap.bytes_written > 0);
            // The tile buffers (up to three tiles when pipelined) cannot hold the rank's whole
            // state: it is stepped in several tiles.
            assert!(swap.disk_bytes > swap.buffer_bytes, "{what}: {swap:?}");
            // Every step reads and writes each tile once (masters, m, v).
            assert_eq!(swap.bytes_written % swap.disk_bytes, 0, "{what}");
            assert!(swap.bytes_written >= STEPS * swap.disk_bytes, "{what}");
        }
    }
    assert!(
        std::fs::read_dir(dir.path().join("zero_stage_1/optimizer"))
            .expect("the swap folder")
            .next()
            .is_none(),
        "the swap files are removed when the engine is dropped"
    );
}

/// With a 16-bit working copy the swapped optimizer holds the fp32 masters itself: bf16 at
/// stage 2 and fp16 (with loss scaling) at stage 3 follow their in-memory runs exactly.
#[test]
fn offloaded_masters_follow_the_in_memory_mixed_precision_runs() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (stage, precision) in [(2u8, "bf16"), (3, "fp16"), (1, "fp16")] {
        let base = run(offload_config(stage, precision, None), SHAPE, 12);
        let nvme = run(
            offload_config(stage, precision, Some(("nvme", dir.path(), 777, true))),
            SHAPE,
            12,
        );
        same_run(&base, &nvme, &format!("stage {stage} {precision} nvme"));
        assert_eq!(nvme.dtype, precision);
    }
}

/// What a rank holds in memory with its optimizer on disk: the tile buffers, not m and v;
/// the swap file's size is reported apart (`offloaded`).
#[test]
fn the_offloaded_state_is_measured_on_disk_not_in_memory() {
    let dir = tempfile::tempdir().expect("temp dir");
    let held = |offload| {
        let config = offload_config(3, "fp32", offload);
        let (_, states) = launch(2, Duration::from_secs(120), |comm| {
            let device = Device::flex().autodiff();
            let engine = DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config.clone(), comm)?;
            Ok((engine.model_state_bytes(), engine.swap()))
        })
        .expect("engines build");
        states.into_iter().next().expect("rank 0")
    };
    let (ram, none) = held(None);
    let (disk, swap) = held(Some(("nvme", dir.path(), 1000, true)));
    assert!(none.is_none());
    let swap = swap.expect("swapped");
    println!("in memory {ram:?}; offloaded {disk:?}; {swap:?}");
    assert_eq!((ram.params, ram.grads), (disk.params, disk.grads));
    assert_eq!(disk.offloaded, swap.disk_bytes);
    assert_eq!(disk.optimizer, swap.buffer_bytes);
    // The file holds fp32 masters beside m and v: at least the 8 bytes per element that
    // memory held, plus 4 for the masters.
    let elems = ram.optimizer / 8;
    assert!(
        swap.disk_bytes >= 12 * elems,
        "{} for {elems}",
        swap.disk_bytes
    );
    assert_eq!(ram.offloaded, 0);
}

/// A checkpoint of an offloaded run holds the state read back from the swap files: resumed
/// offloaded, or in memory, the run continues with the uninterrupted run's losses.
#[test]
fn checkpoints_of_offloaded_runs_resume_exactly_on_or_off_disk() {
    let swap_dir = tempfile::tempdir().expect("temp dir");
    let ckpt = tempfile::tempdir().expect("temp dir");
    let nvme = offload_config(2, "bf16", Some(("nvme", swap_dir.path(), 333, true)));
    let whole = train_steps(&nvme, SHAPE, 2, 0..8, ckpt.path(), Some(3), false);
    let resumed = train_steps(&nvme, SHAPE, 2, 4..8, ckpt.path(), None, true);
    let memory = offload_config(2, "bf16", None);
    let in_memory = train_steps(&memory, SHAPE, 2, 4..8, ckpt.path(), None, true);
    println!("offloaded {whole:?}; resumed offloaded {resumed:?}; in memory {in_memory:?}");
    assert_eq!(&whole[4..], &resumed[..]);
    assert_eq!(&whole[4..], &in_memory[..]);
}

/// An offloaded stage-3 checkpoint saved on 2 ranks loads on 1 rank, offloaded: the state is
/// re-cut for the new world and written to the new swap file, and the run continues within
/// 1e-4 of the uninterrupted one (the reductions sum in another order).
#[test]
fn an_offloaded_checkpoint_resumes_at_another_world_size() {
    let swap_dir = tempfile::tempdir().expect("temp dir");
    let ckpt = tempfile::tempdir().expect("temp dir");
    let config = offload_config(3, "fp32", Some(("nvme", swap_dir.path(), 999, true)));
    let whole = train_steps(&config, SHAPE, 2, 0..8, ckpt.path(), Some(3), false);
    let resumed = train_steps(&config, SHAPE, 1, 4..8, ckpt.path(), None, true);
    println!("2 ranks {whole:?}; resumed on 1 rank {resumed:?}");
    for (a, b) in whole[4..].iter().zip(&resumed) {
        assert!((a - b).abs() <= 1e-4 * a.abs(), "{a} vs {b}");
    }
}

/// `nvme_path` must name a writable folder: a file in its place is refused by key.
#[test]
fn a_bad_nvme_path_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("not-a-folder");
    std::fs::write(&file, b"x").expect("write");
    let config = offload_config(2, "fp32", Some(("nvme", &file, 1000, false)));
    let e = launch(1, Duration::from_secs(60), |comm| {
        let device = Device::flex().autodiff();
        DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), config.clone(), comm).map(|_| ())
    })
    .expect_err("refused")
    .to_string();
    assert!(
        e.contains("zero_optimization.offload_optimizer.nvme_path") && e.contains("not a folder"),
        "{e}"
    );
}

/// A disk that fails (ENOSPC, EIO) while a load writes a checkpoint's state into the swap
/// file, or while a step writes its tiles back, leaves the file part old, part new: every
/// later step and save is refused, naming the cause and saying to load the last checkpoint,
/// and after that load the run continues with the uninterrupted run's losses.
#[test]
fn a_failing_disk_refuses_every_later_step_until_a_checkpoint_is_loaded() {
    use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
    use burn_deepspeed_strategies::swap::{SwapFault, inject_swap_fault};
    let (swap_dir, ckpt) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let config = offload_config(2, "fp32", Some(("nvme", swap_dir.path(), 333, false)));
    let whole = train_steps(&config, SHAPE, 1, 0..6, ckpt.path(), Some(2), false);
    let faulty_dir = tempfile::tempdir().unwrap();
    let faulty = offload_config(2, "fp32", Some(("nvme", faulty_dir.path(), 333, false)));
    let corpus = ByteCorpus::new(EMBEDDED_CORPUS.to_vec(), 7);
    let batch = |step| {
        let batch = corpus.batch(step, 0, 16, SHAPE.seq_len, &Device::flex());
        std::iter::once(batch)
    };
    let refused = |e: burn_deepspeed::DeepSpeedError, cause: &str| {
        let e = e.to_string();
        assert!(e.contains("inconsistent") && e.contains(cause), "{e}");
        assert!(e.contains("load the last checkpoint"), "{e}");
    };
    launch(1, Duration::from_secs(120), |comm| {
        let device = Device::flex().autodiff();
        let mut engine = DeepSpeedEngine::new(Gpt::new(SHAPE, 5, &device), faulty.clone(), comm)?;
        // The load's fifth tile write finds the disk full.
        inject_swap_fault(
            faulty_dir.path(),
            SwapFault::parse("write:5:ENOSPC").unwrap(),
        );
        let e = engine.load_checkpoint(ckpt.path(), None).unwrap_err();
        assert!(e.to_string().contains("No space left"), "{e}");
        refused(engine.train_batch(batch(3)).unwrap_err(), "No space left");
        let elsewhere = tempfile::tempdir().unwrap();
        refused(
            engine.save_checkpoint(elsewhere.path(), None).unwrap_err(),
            "No space left",
        );
        engine.load_checkpoint(ckpt.path(), None)?;
        let mut losses = Vec::new();
        for step in 3..5 {
            losses.push(engine.train_batch(batch(step))?.loss);
        }
        assert_eq!(losses, whole[3..5], "resumed after the failed load");
        // The next step's third tile write fails.
        inject_swap_fault(faulty_dir.path(), SwapFault::parse("write:3:EIO").unwrap());
        let e = engine.train_batch(batch(5)).unwrap_err();
        assert!(e.to_string().contains("Input/output error"), "{e}");
        refused(
            engine.train_batch(batch(5)).unwrap_err(),
            "Input/output error",
        );
        engine.load_checkpoint(ckpt.path(), None)?;
        assert_eq!(
            engine.train_batch(batch(3))?.loss,
            whole[3],
            "resumed after the failed step"
        );
        Ok(())
    })
    .expect("the run recovers from both failures");
}
