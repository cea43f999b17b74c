//! One consolidated weights file from a checkpoint, as DeepSpeed's `zero_to_fp32.py` makes
//! one: whatever the ZeRO stage and the world size that wrote it, the whole fp32 parameters
//! go into one safetensors file, each tensor named by its module path
//! (`blocks.0.attn.weight`) with its shape, so that plain Burn loads it with burn-store's
//! `SafetensorsStore` (no burn-deepspeed needed). The optimizer state (moments, 1-bit error
//! buffers) stays behind: the file is the model only.
//!
//! The checkpoint is read with every check a load makes (plain names, sizes, SHA-256). The
//! file is written beside `out` under a temporary name, synced, and renamed into place, so
//! `out` is either absent, the old file, or the complete new one.
//!
//! burn-store writes safetensors only from a live module; this command has no model, so it
//! writes the file with the `safetensors` crate (the one burn-store reads it with).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use safetensors::Dtype;
use safetensors::tensor::{TensorView, View};

use super::{
    CheckpointMeta, check_tag, io_bar, io_err, read_files, read_latest, read_meta, refuse,
    sync_dir, unique_suffix,
};
use crate::progress::TaskProgress;
use crate::{DeepSpeedError, Result};

/// What [`consolidate`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consolidated {
    /// The checkpoint's tag.
    pub tag: String,
    /// Its optimizer step.
    pub global_step: u64,
    /// Tensors written.
    pub tensors: usize,
    /// Values written (f32).
    pub values: usize,
    /// Size of the file, in bytes.
    pub bytes: u64,
}

/// Checkpoint `tag` of `dir` (default: the one `dir/latest` names), read with every check
/// a load makes: its tag, its metadata and its `model.bin` bytes (the whole fp32 parameters,
/// flat in layout order).
fn read_model_bytes(dir: &Path, tag: Option<&str>) -> Result<(String, CheckpointMeta, Vec<u8>)> {
    let tag = match tag {
        Some(t) => {
            check_tag(t)?;
            t.to_string()
        }
        None => read_latest(dir)?,
    };
    // Only `model.bin` is read; the optimizer's files are checked in the metadata alone.
    let meta = read_meta(dir, &tag)?;
    let model = read_files(dir, &tag, &meta, 1, true)?
        .pop()
        .ok_or_else(|| refuse(&dir.join(&tag), "has no model.bin"))?;
    Ok((tag, meta, model))
}

/// The whole fp32 parameters (flat in layout order) and the metadata of checkpoint `tag` of
/// `dir` (default: the one `dir/latest` names), whatever the ZeRO stage, the world size or
/// the grid that wrote it: what inference loads (one process, no communicator).
pub fn read_model(dir: &Path, tag: Option<&str>) -> Result<(CheckpointMeta, Vec<f32>)> {
    let (_, meta, model) = read_model_bytes(dir, tag)?;
    Ok((meta, super::f32_values(&model, "model.bin")?))
}

/// Writes checkpoint `tag` of `dir` (default: the one `dir/latest` names) as one safetensors
/// file at `out` (see the module docs).
pub fn consolidate(dir: &Path, tag: Option<&str>, out: &Path) -> Result<Consolidated> {
    let (tag, meta, model) = read_model_bytes(dir, tag)?;
    let root = dir.join(&tag);
    let model = &model;
    let tensors = named_tensors(&meta, model).map_err(|why| refuse(&root, why))?;
    let values = model.len() / 4;
    let mut info = HashMap::new();
    info.insert("format".to_string(), "pt".to_string());
    info.insert("producer".to_string(), "burn-deepspeed".to_string());
    info.insert("checkpoint_tag".to_string(), tag.clone());
    info.insert("global_step".to_string(), meta.global_step.to_string());
    info.insert("zero_stage".to_string(), meta.zero_stage.to_string());
    info.insert("world_size".to_string(), meta.world_size.to_string());
    let count = tensors.len();
    let bar = io_bar("consolidate", model.len() as u64, true);
    let counted = tensors
        .into_iter()
        .map(|(name, view)| (name, Counted { view, bar: &bar }));
    write_atomically(out, counted, info)?;
    bar.finish();
    let bytes = std::fs::metadata(out).map_err(|e| io_err(out, e))?.len();
    Ok(Consolidated {
        tag,
        global_step: meta.global_step,
        tensors: count,
        values,
        bytes,
    })
}

/// The parameters of `model.bin` (f32 little-endian, layout order) cut by the recorded shapes
/// and named by the recorded module paths.
fn named_tensors<'a>(
    meta: &CheckpointMeta,
    model: &'a [u8],
) -> std::result::Result<Vec<(String, TensorView<'a>)>, String> {
    if meta.paths.is_empty() {
        return Err(
            "records no module paths (written before they were recorded): load it into a \
             DeepSpeedEngine and save it again"
                .into(),
        );
    }
    let mut out = Vec::with_capacity(meta.shapes.len());
    let mut at = 0usize;
    for (path, shape) in meta.paths.iter().zip(&meta.shapes) {
        // The shapes' total was checked against overflow when the meta was read.
        let len = 4 * shape.iter().product::<usize>();
        let bytes = model
            .get(at..at + len)
            .ok_or_else(|| format!("model.bin ends before `{path}`"))?;
        let view = TensorView::new(Dtype::F32, shape.clone(), bytes)
            .map_err(|e| format!("`{path}`: {e}"))?;
        out.push((path.clone(), view));
        at += len;
    }
    if at != model.len() {
        return Err(format!(
            "model.bin holds {} bytes where the shapes take {at}",
            model.len()
        ));
    }
    Ok(out)
}

/// A tensor of the output, counted on the progress bar when the writer takes its bytes
/// (safetensors asks for each tensor's data once, in order, as it writes it).
struct Counted<'a> {
    view: TensorView<'a>,
    bar: &'a TaskProgress,
}

impl View for Counted<'_> {
    fn dtype(&self) -> Dtype {
        self.view.dtype()
    }
    fn shape(&self) -> &[usize] {
        self.view.shape()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        self.bar.inc(self.view.data_len() as u64);
        Cow::Borrowed(self.view.data())
    }
    fn data_len(&self) -> usize {
        self.view.data_len()
    }
}

/// Writes the file under a temporary name beside `out`, syncs it, and renames it into place.
fn write_atomically<V: View>(
    out: &Path,
    tensors: impl IntoIterator<Item = (String, V)>,
    info: HashMap<String, String>,
) -> Result<()> {
    let name = out
        .file_name()
        .ok_or_else(|| refuse(out, "is not a file path"))?
        .to_string_lossy()
        .into_owned();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => Path::new(".").to_path_buf(),
    };
    // The file is written inside a folder made for it (a new name, `mkdir` never follows a
    // link or reuses a folder), so that nothing planted at a predictable name is followed or
    // overwritten.
    let staging = parent.join(format!(".{name}.partial-{:016x}", unique_suffix()));
    std::fs::create_dir(&staging).map_err(|e| io_err(&staging, e))?;
    let scratch = staging.join(&name);
    let written = safetensors::serialize_to_file(tensors, Some(info), &scratch)
        .map_err(|e| DeepSpeedError::Checkpoint(format!("{}: {e}", scratch.display())))
        .and_then(|()| {
            File::open(&scratch)
                .and_then(|f| f.sync_all())
                .map_err(|e| io_err(&scratch, e))
        })
        .and_then(|()| std::fs::rename(&scratch, out).map_err(|e| io_err(out, e)));
    let _ = std::fs::remove_file(&scratch);
    let _ = std::fs::remove_dir(&staging);
    written?;
    sync_dir(&parent)
}

#[cfg(test)]
mod tests {
    use super::super::{CHECKPOINT_FORMAT, CHECKPOINT_VERSION, f32_bytes};
    use super::*;

    fn meta(paths: &[&str]) -> CheckpointMeta {
        CheckpointMeta {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            global_step: 3,
            skipped_steps: 0,
            world_size: 2,
            zero_stage: 2,
            optimizer: "AdamW".into(),
            compressing: None,
            param_ids: vec![1, 2],
            shapes: vec![vec![2, 3], vec![3]],
            paths: paths.iter().map(|p| p.to_string()).collect(),
            loss_scaler: None,
            dtype: None,
            ep_size: None,
            files: Vec::new(),
        }
    }

    #[test]
    fn cuts_the_flat_parameters_by_shape_and_names_them() {
        let values: Vec<f32> = (0..9).map(|i| i as f32).collect();
        let bytes = f32_bytes(&values);
        let tensors = named_tensors(&meta(&["fc.weight", "fc.bias"]), &bytes).expect("fits");
        let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["fc.weight", "fc.bias"]);
        assert_eq!(tensors[0].1.shape(), [2, 3]);
        assert_eq!(tensors[1].1.data(), &bytes[24..]);
    }

    #[test]
    fn refuses_what_does_not_fit() {
        let bytes = f32_bytes(&[0.0; 9]);
        let e = named_tensors(&meta(&[]), &bytes).expect_err("no paths");
        assert!(e.contains("module paths"), "{e}");
        let e = named_tensors(&meta(&["a", "b"]), &bytes[..32]).expect_err("short");
        assert!(e.contains("ends before `b`"), "{e}");
        let long = f32_bytes(&[0.0; 10]);
        let e = named_tensors(&meta(&["a", "b"]), &long).expect_err("long");
        assert!(e.contains("40 bytes"), "{e}");
    }
}
