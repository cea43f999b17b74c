//! Hostile and damaged checkpoints: every tampering is refused with a message naming the file
//! and the reason, by every rank, before anything changes; nothing outside the checkpoint
//! directory is read.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::checkpoint::sha256_hex;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunSpec, run_rank};

use crate::common;

const SHAPE: GptShape = GptShape {
    d_model: 32,
    layers: 1,
    heads: 2,
    seq_len: 16,
    moe: None,
};

fn config(stage: u8, layers: usize) -> (DeepSpeedConfig, GptShape) {
    let text = format!(
        r#"{{"train_batch_size": 4, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
            "zero_optimization": {{"stage": {stage}}}}}"#
    );
    let config = DeepSpeedConfig::from_json_str(&text).expect("valid").0;
    (config, GptShape { layers, ..SHAPE })
}

/// Trains 2 steps at `stage` on 2 ranks and saves into `dir`; returns the tag directory.
fn saved(dir: &Path, stage: u8, layers: usize) -> PathBuf {
    let (config, shape) = config(stage, layers);
    let mut spec = common::spec(config, shape, 2, 1, 2);
    spec.save_dir = Some(dir.to_path_buf());
    common::train(2, &spec);
    dir.join("global_step2")
}

/// Resuming from `dir` on 2 ranks: every rank's error (all must fail).
fn resume_errors(dir: &Path, stage: u8) -> Vec<String> {
    let (config, shape) = config(stage, 1);
    let mut spec: RunSpec = common::spec(config, shape, 3, 1, 2);
    spec.resume_from = Some(dir.to_path_buf());
    let (tx, rx) = std::sync::mpsc::channel();
    let _ = launch(2, Duration::from_secs(60), |comm| {
        let result = run_rank(&spec, comm);
        tx.send(result.as_ref().err().map(|e| e.to_string()))
            .expect("collector alive");
        result
    });
    drop(tx);
    let errors: Vec<Option<String>> = rx.iter().collect();
    assert_eq!(errors.len(), 2);
    errors
        .into_iter()
        .map(|e| e.expect("every rank refuses the checkpoint"))
        .collect()
}

/// Rewrites `meta.json` with `edit` and a matching `meta.sha256` (what an attacker who
/// knows the format would do).
fn edit_meta(tag_dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = tag_dir.join("meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&fs::read(&path).expect("meta")).expect("json");
    edit(&mut meta);
    let text = serde_json::to_vec_pretty(&meta).expect("json");
    fs::write(&path, &text).expect("write meta");
    fs::write(tag_dir.join("meta.sha256"), sha256_hex(&text)).expect("write sum");
}

/// The entry of file `name` in `meta.json`'s list.
fn listed<'a>(meta: &'a mut serde_json::Value, name: &str) -> &'a mut serde_json::Value {
    let files = meta["files"].as_array_mut().expect("files");
    files
        .iter_mut()
        .find(|f| f["name"] == name)
        .expect("listed")
}

fn assert_refused(dir: &Path, stage: u8, needles: &[&str], what: &str) {
    for (rank, err) in resume_errors(dir, stage).iter().enumerate() {
        for needle in needles {
            assert!(
                err.contains(needle),
                "{what}: rank {rank}: `{needle}` not in: {err}"
            );
        }
    }
}

#[test]
fn damaged_files_are_refused_by_every_rank() {
    for stage in [0u8, 2] {
        let shard = if stage == 0 {
            "optim.bin"
        } else {
            "zero_pp_rank_1_optim_states.bin"
        };
        // A truncated file.
        let dir = tempfile::tempdir().expect("tempdir");
        let tag = saved(dir.path(), stage, 1);
        let bytes = fs::read(tag.join(shard)).expect("read");
        fs::write(tag.join(shard), &bytes[..bytes.len() / 2]).expect("truncate");
        assert_refused(
            dir.path(),
            stage,
            &[shard, "is corrupt", "truncated"],
            "truncated",
        );
        // A flipped byte in a shard.
        let dir = tempfile::tempdir().expect("tempdir");
        let tag = saved(dir.path(), stage, 1);
        let mut bytes = fs::read(tag.join(shard)).expect("read");
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x10;
        fs::write(tag.join(shard), &bytes).expect("flip");
        assert_refused(dir.path(), stage, &[shard, "SHA-256"], "flipped shard byte");
        // A flipped byte in meta.json.
        let dir = tempfile::tempdir().expect("tempdir");
        let tag = saved(dir.path(), stage, 1);
        let mut bytes = fs::read(tag.join("meta.json")).expect("read");
        let at = bytes
            .iter()
            .position(|&b| b == b'7')
            .unwrap_or(bytes.len() / 2);
        bytes[at] ^= 0x01;
        fs::write(tag.join("meta.json"), &bytes).expect("flip");
        assert_refused(
            dir.path(),
            stage,
            &["meta.json", "meta.sha256"],
            "flipped meta byte",
        );
    }
}

#[test]
fn names_that_leave_the_directory_are_refused_before_any_read() {
    let outside = tempfile::tempdir().expect("tempdir");
    let secret = outside.path().join("secret");
    fs::write(&secret, b"not a checkpoint").expect("secret");
    for target in [
        "../x",
        "/etc/passwd",
        secret.to_str().expect("utf-8"),
        ".hidden",
        "",
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        saved(dir.path(), 0, 1);
        fs::write(dir.path().join("latest"), target).expect("latest");
        assert_refused(
            dir.path(),
            0,
            &["latest", "plain"],
            &format!("latest = {target:?}"),
        );
    }
    // A file name in meta.json that points outside, with a matching meta.sha256.
    for name in ["../../secret", "/etc/passwd", "sub/model.bin"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let tag = saved(dir.path(), 2, 1);
        edit_meta(&tag, |m| m["files"][0]["name"] = name.into());
        assert_refused(dir.path(), 2, &["meta.json", "file name", "plain"], name);
    }
    // A symbolic link instead of a state file.
    #[cfg(unix)]
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let tag = saved(dir.path(), 0, 1);
        fs::remove_file(tag.join("optim.bin")).expect("remove");
        std::os::unix::fs::symlink(&secret, tag.join("optim.bin")).expect("symlink");
        assert_refused(
            dir.path(),
            0,
            &["optim.bin", "not a regular file"],
            "symlink",
        );
    }
}

#[test]
fn foreign_or_inconsistent_metadata_is_refused() {
    // A shard of another model (two layers instead of one), with its length and SHA-256
    // written into meta.json.
    let other = tempfile::tempdir().expect("tempdir");
    let other_tag = saved(other.path(), 2, 2);
    let dir = tempfile::tempdir().expect("tempdir");
    let tag = saved(dir.path(), 2, 1);
    let shard = "zero_pp_rank_0_optim_states.bin";
    let foreign = fs::read(other_tag.join(shard)).expect("read");
    fs::write(tag.join(shard), &foreign).expect("replace");
    edit_meta(&tag, |m| {
        let f = listed(m, shard);
        f["bytes"] = foreign.len().into();
        f["sha256"] = sha256_hex(&foreign).into();
    });
    assert_refused(dir.path(), 2, &[shard], "shard of another model");

    // Duplicate parameter ids.
    let dir = tempfile::tempdir().expect("tempdir");
    let tag = saved(dir.path(), 2, 1);
    edit_meta(&tag, |m| {
        let ids = m["param_ids"].as_array_mut().expect("ids");
        ids[1] = ids[0].clone();
    });
    assert_refused(
        dir.path(),
        2,
        &["meta.json", "parameter id", "twice"],
        "duplicate ids",
    );

    // A file listed twice, and shapes whose element count overflows.
    let dir = tempfile::tempdir().expect("tempdir");
    let tag = saved(dir.path(), 2, 1);
    edit_meta(&tag, |m| {
        let first = m["files"][0].clone();
        m["files"].as_array_mut().expect("files").push(first);
    });
    assert_refused(dir.path(), 2, &["meta.json", "twice"], "file listed twice");
    let dir = tempfile::tempdir().expect("tempdir");
    let tag = saved(dir.path(), 2, 1);
    edit_meta(&tag, |m| {
        m["shapes"][0] = serde_json::json!([u64::MAX, u64::MAX]);
    });
    assert_refused(
        dir.path(),
        2,
        &["meta.json", "overflow"],
        "overflowing shapes",
    );
}

/// The files are found by name: a `meta.json` whose list is reordered (its checksum
/// recomputed) resumes exactly as the checkpoint as written, where taking the files by
/// position gave each rank the other's optimizer slice; a slice listed with a length its
/// shapes cannot explain (a huge sparse file) is refused before anything is read.
#[test]
fn files_are_found_by_name_and_their_lengths_bounded() {
    let resume = |dir: &Path| {
        let (config, shape) = config(2, 1);
        let mut spec: RunSpec = common::spec(config, shape, 4, 1, 2);
        spec.resume_from = Some(dir.to_path_buf());
        common::train(2, &spec).losses
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let tag = saved(dir.path(), 2, 1);
    let as_written = resume(dir.path());
    // model.bin, then the ranks' slices: the slices trade places.
    edit_meta(&tag, |m| {
        m["files"].as_array_mut().expect("files").swap(1, 2);
    });
    assert_eq!(resume(dir.path()), as_written, "reordered meta.json");

    let shard = "zero_pp_rank_1_optim_states.bin";
    let huge = 1u64 << 40;
    fs::File::options()
        .write(true)
        .open(tag.join(shard))
        .and_then(|f| f.set_len(huge))
        .expect("sparse");
    edit_meta(&tag, |m| listed(m, shard)["bytes"] = huge.into());
    assert_refused(
        dir.path(),
        2,
        &["meta.json", shard, "at most"],
        "huge slice",
    );
}

/// Every rank reads the checkpoint's files itself: ranks that read different checkpoints
/// under one tag (here rank 0 and rank 1 resume from two directories holding runs of other
/// seeds) are refused on every rank, where each used to load its own.
#[test]
fn ranks_that_read_different_checkpoints_are_refused() {
    let (a, b) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    for (dir, seed) in [(a.path(), 2), (b.path(), 3)] {
        let (config, shape) = config(2, 1);
        let mut spec = common::spec(config, shape, 2, 1, seed);
        spec.save_dir = Some(dir.to_path_buf());
        common::train(2, &spec);
    }
    let (config, shape) = config(2, 1);
    let errors = launch(2, Duration::from_secs(60), |comm| {
        let device = burn::tensor::Device::flex().autodiff();
        let model = burn_deepspeed_example_gpt::model::Gpt::new(shape, 2, &device);
        let mut engine = burn_deepspeed::DeepSpeedEngine::new(model, config.clone(), comm.clone())?;
        let dir = if comm.rank() == 0 { a.path() } else { b.path() };
        Ok(engine.load_checkpoint(dir, None).map_err(|e| e.to_string()))
    })
    .expect("every rank returns");
    for e in errors.1 {
        let e = e.expect_err("refused");
        assert!(
            e.contains("rank 1's checkpoint metadata (meta.json) differs"),
            "{e}"
        );
    }
}
