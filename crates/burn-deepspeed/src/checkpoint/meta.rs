//! The checkpoint's `meta.json`: what a checkpoint holds, and the checks a load makes of it
//! before reading any state file.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::files::name_problem;

/// Name of the format in `meta.json`.
pub const CHECKPOINT_FORMAT: &str = "burn-deepspeed-checkpoint";
/// Version of the format written (2: SHA-256 checksums, `meta.sha256`, `skipped_steps`).
pub const CHECKPOINT_VERSION: u32 = 2;
/// The largest `meta.json` a load reads.
pub const MAX_META_BYTES: u64 = 64 << 20;
/// The largest `latest` file a load reads.
pub(crate) const MAX_LATEST_BYTES: u64 = 4096;

/// One state file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointFile {
    /// File name inside the tag directory.
    pub name: String,
    /// Length in bytes.
    pub bytes: u64,
    /// SHA-256 of the contents, hex.
    pub sha256: String,
}

/// `meta.json`: what a checkpoint holds and what it needs to be loaded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Always [`CHECKPOINT_FORMAT`].
    pub format: String,
    /// [`CHECKPOINT_VERSION`] when written.
    pub version: u32,
    /// Optimizer steps taken (skipped ones included).
    pub global_step: u64,
    /// Steps skipped because the gradient norm was not finite.
    #[serde(default)]
    pub skipped_steps: u64,
    /// World size that wrote it.
    pub world_size: usize,
    /// ZeRO stage that wrote it.
    pub zero_stage: u8,
    /// The optimizer type, as in the config.
    pub optimizer: String,
    /// For 1-bit optimizers: whether the compression stage had begun.
    pub compressing: Option<bool>,
    /// Parameter ids in layout order (restored into the model, so the optimizer state, which
    /// Burn keys by id, finds its parameters).
    pub param_ids: Vec<u64>,
    /// Parameter shapes in layout order.
    pub shapes: Vec<Vec<usize>>,
    /// Module paths of the parameters in layout order (`blocks.0.attn.weight`, the names
    /// Burn's stores use), for `burn-deepspeed checkpoint consolidate`.
    #[serde(default)]
    pub paths: Vec<String>,
    /// fp16: the loss scaler's position (absent from fp32 and bf16 checkpoints; an fp16 run
    /// that loads one of those starts a fresh scaler, and a run without fp16 ignores it).
    #[serde(default)]
    pub loss_scaler: Option<crate::precision::LossScalerState>,
    /// The working dtype of a 16-bit run (`fp16` or `bf16`; absent in fp32). `model.bin`
    /// always holds fp32 values: the masters of a 16-bit run.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Expert parallelism's `ep_size` when it wrote (absent at 1). Its files hold the whole
    /// model all the same, every expert with its optimizer state, flat at every stage.
    #[serde(default)]
    pub ep_size: Option<usize>,
    /// The state files.
    pub files: Vec<CheckpointFile>,
}

impl CheckpointMeta {
    /// What every driver's checkpoint states alike: the format, the step protocol's position,
    /// the ZeRO stage (`zero_stage`, as the regime's builder reads it), the optimizer and the
    /// working dtype. The caller fills in the world, the tensors and the rest.
    pub(crate) fn of_run(
        config: &crate::config::DeepSpeedConfig,
        zero_stage: u8,
        position: crate::step::core::StepPosition,
    ) -> Self {
        Self {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            global_step: position.global_step,
            skipped_steps: position.skipped_steps,
            world_size: 1,
            zero_stage,
            optimizer: format!("{:?}", config.optimizer_kind()),
            compressing: None,
            param_ids: Vec::new(),
            shapes: Vec::new(),
            paths: Vec::new(),
            loss_scaler: position.loss_scaler,
            dtype: config
                .working_dtype()
                .map(|_| config.precision_name().into()),
            ep_size: None,
            files: Vec::new(),
        }
    }

    /// The step protocol's position this checkpoint resumes at.
    pub(crate) fn position(&self) -> crate::step::core::StepPosition {
        crate::step::core::StepPosition {
            global_step: self.global_step,
            skipped_steps: self.skipped_steps,
            loss_scaler: self.loss_scaler,
        }
    }
}

/// Checks what `meta.json` says about itself: plain and distinct file names, distinct
/// parameter ids, one shape per id, and element counts that fit in memory.
pub(crate) fn check_meta(meta: &CheckpointMeta) -> std::result::Result<(), String> {
    let mut names = HashSet::new();
    for f in &meta.files {
        if let Some(why) = name_problem("file name", &f.name) {
            return Err(why);
        }
        if !names.insert(f.name.as_str()) {
            return Err(format!("lists the file `{}` twice", f.name));
        }
    }
    let mut ids = HashSet::new();
    if let Some(dup) = meta.param_ids.iter().find(|id| !ids.insert(**id)) {
        return Err(format!("lists the parameter id {dup} twice"));
    }
    if meta.param_ids.len() != meta.shapes.len() {
        return Err(format!(
            "lists {} parameter ids for {} shapes",
            meta.param_ids.len(),
            meta.shapes.len()
        ));
    }
    if meta.world_size == 0 {
        return Err("records a world size of 0".into());
    }
    if meta.skipped_steps > meta.global_step {
        return Err(format!(
            "records {} skipped steps of {} steps taken",
            meta.skipped_steps, meta.global_step
        ));
    }
    if !meta.paths.is_empty() {
        if meta.paths.len() != meta.param_ids.len() {
            return Err(format!(
                "lists {} module paths for {} parameters",
                meta.paths.len(),
                meta.param_ids.len()
            ));
        }
        let mut seen = HashSet::new();
        if let Some(dup) = meta.paths.iter().find(|p| !seen.insert(p.as_str())) {
            return Err(format!("lists the module path `{dup}` twice"));
        }
    }
    numel_of(&meta.shapes).ok_or_else(|| "its shapes overflow the element count".to_string())?;
    let expected = expected_files(meta)?;
    for f in &meta.files {
        match expected.iter().find(|e| e.name == f.name) {
            None => {
                return Err(format!(
                    "lists the file `{}`, which a checkpoint of ZeRO stage {} on {} rank(s) \
                     does not have",
                    f.name, meta.zero_stage, meta.world_size
                ));
            }
            Some(e) if f.bytes > e.most || (e.exact && f.bytes != e.most) => {
                return Err(format!(
                    "records {} bytes for `{}`, which holds {} {} bytes for these shapes",
                    f.bytes,
                    f.name,
                    if e.exact { "exactly" } else { "at most" },
                    e.most
                ));
            }
            Some(_) => {}
        }
    }
    if let Some(e) = expected.iter().find(|e| !names.contains(e.name.as_str())) {
        return Err(format!("does not list the file `{}`", e.name));
    }
    Ok(())
}

/// A state file a checkpoint must hold, and the bytes it may have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExpectedFile {
    /// Its name in the tag directory.
    pub name: String,
    /// Its largest length (its only one when `exact`).
    pub most: u64,
    /// Whether the length is known exactly.
    pub exact: bool,
}

/// The state files a checkpoint of `meta`'s stage, world size and shapes holds, in the order
/// a load uses them: `model.bin` (4 bytes per element, exactly), then `optim.bin` at stage 0
/// or each rank's slice at stages 1-3. Files are looked up by these names, never by their
/// position in `meta.json`, and a length above the bound is refused before anything is read
/// or allocated.
pub(crate) fn expected_files(
    meta: &CheckpointMeta,
) -> std::result::Result<Vec<ExpectedFile>, String> {
    let numel = numel_of(&meta.shapes).ok_or("its shapes overflow the element count")? as u64;
    let tensors = meta.shapes.len() as u64;
    let model = ExpectedFile {
        name: "model.bin".into(),
        most: numel
            .checked_mul(4)
            .ok_or("its shapes overflow the byte count")?,
        exact: true,
    };
    // A slice holds at most every tensor's step and every element's two moments.
    let slice = (8 * numel).saturating_add(4 * tensors + 12);
    let mut files = vec![model];
    match meta.zero_stage {
        // Burn's optimizer record (ids and shapes beside two moments), a flat state, or a
        // 1-bit optimizer's (its moments and frozen coefficients).
        0 => files.push(ExpectedFile {
            name: "optim.bin".into(),
            most: (16 * numel).saturating_add(4096 * tensors + (1 << 20)),
            exact: false,
        }),
        1..=3 => {
            if meta.world_size > meta.files.len() {
                return Err(format!(
                    "records a world size of {} but lists {} files",
                    meta.world_size,
                    meta.files.len()
                ));
            }
            files.extend((0..meta.world_size).map(|r| ExpectedFile {
                name: super::partition_file(r),
                most: slice,
                exact: false,
            }));
        }
        s => return Err(format!("records ZeRO stage {s}; stages 0-3 exist")),
    }
    Ok(files)
}

/// The total element count of `shapes`, `None` when it overflows.
pub fn numel_of(shapes: &[Vec<usize>]) -> Option<usize> {
    shapes.iter().try_fold(0usize, |acc, s| {
        let n = s.iter().try_fold(1usize, |p, &d| p.checked_mul(d))?;
        acc.checked_add(n)
    })
}
