//! The generation driver of the example: one call per rank, the GPT sliced over the world's
//! ranks (tensor parallelism for inference), with the figures DeepSpeed-Inference reports.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};
use burn_deepspeed::checkpoint::read_model;
use burn_deepspeed::comm::Communicator;
use burn_deepspeed::flat::ParamLayout;
use burn_deepspeed::grid::Grid;
use burn_deepspeed::inference::{
    CausalLm, GenerateOptions, InferenceDtype, Sampler, Sampling, generate, next_tokens,
};
use burn_deepspeed::inference::{Scheme, WeightQuantization};
use burn_deepspeed::precision::cast_module;
use burn_deepspeed::tensor_parallel::SliceLayout;
use burn_deepspeed::{DeepSpeedError, Result};
use serde::Serialize;

use crate::data::{WindowBatcher, windows};
use crate::model::{Gpt, GptShape};

/// What one generation run does.
#[derive(Debug, Clone)]
pub struct GenerateSpec {
    /// Model size.
    pub shape: GptShape,
    /// The whole model's parameters, flat in layout order (from a checkpoint or a run).
    pub params: Arc<Vec<f32>>,
    /// The prompts, as token ids (bytes).
    pub prompts: Vec<Vec<u32>>,
    /// Tokens to generate and how.
    pub options: GenerateOptions,
    /// The dtype the model serves in: f32, 16-bit, or INT8/INT4 weights.
    pub dtype: InferenceDtype,
    /// INT8/INT4: the largest group (values per step and offset); the dtype's default when
    /// `None`.
    pub quant_group: Option<usize>,
    /// INT8/INT4: the scheme; the dtype's default (INT8 symmetric, INT4 asymmetric) when
    /// `None`.
    pub quant_scheme: Option<Scheme>,
    /// Held-out bytes: the report gives the model's mean next-byte loss over their
    /// non-overlapping windows of the context length.
    pub eval: Option<Arc<Vec<u8>>>,
    /// Also time greedy generation by full recomputation (the whole sequence again for each
    /// token, no cache), for the speed-up and the token-for-token check (prompts of one
    /// length).
    pub compare_recompute: bool,
}

impl GenerateSpec {
    /// The parameters of checkpoint `dir` (its latest) for a GPT of `shape`, refused with the
    /// reason when the checkpoint holds another model.
    pub fn params_from_checkpoint(dir: &Path, shape: GptShape) -> Result<Vec<f32>> {
        let (meta, params) = read_model(dir, None)?;
        let layout = ParamLayout::of(&Gpt::new(shape, 0, &Device::flex()));
        let shapes: Vec<Vec<usize>> = layout.slots.iter().map(|s| s.shape.clone()).collect();
        if meta.shapes != shapes {
            return Err(DeepSpeedError::Checkpoint(format!(
                "{} holds {} tensors of {} values; a GPT of this shape has {} of {} (pass \
                 the --model it was trained with)",
                dir.display(),
                meta.shapes.len(),
                params.len(),
                shapes.len(),
                layout.numel
            )));
        }
        Ok(params)
    }
}

/// The JSON summary of a generation.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateReport {
    /// Tensor-parallel ranks (the world).
    pub tp: usize,
    /// The dtype the model served in.
    pub dtype: String,
    /// INT8/INT4: the largest group asked for (values per step and offset; each weight takes
    /// the largest that fits its rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quant_group: Option<usize>,
    /// Parameters of the whole model (Ψ).
    pub parameters: u64,
    /// `"threads"` or `"mpi"`.
    pub backend: String,
    /// The generated text of each prompt (bytes, lossily as UTF-8).
    pub text: Vec<String>,
    /// The generated tokens of each prompt.
    pub tokens: Vec<Vec<u32>>,
    /// Prompt tokens processed per second in the prefill.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second after the first (all prompts together).
    pub decode_tokens_per_s: f64,
    /// Seconds to the first generated token (the prefill).
    pub time_to_first_token_s: f64,
    /// Median seconds per decode step.
    pub token_latency_p50_s: f64,
    /// 99th percentile of the seconds per decode step.
    pub token_latency_p99_s: f64,
    /// Bytes of this rank's weights (its slices: f32 or 16-bit tensors, or codes with their
    /// steps and offsets), measured on what it holds.
    pub weight_bytes_per_rank: u64,
    /// Mean next-byte cross-entropy over the held-out windows, when given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout_loss: Option<f64>,
    /// Tokens the held-out loss averages over.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout_tokens: Option<usize>,
    /// In another dtype than fp32: the mean KL divergence of its next-byte distributions
    /// from the fp32 model's over the held-out windows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout_kl_from_fp32: Option<f64>,
    /// Bytes of this rank's key/value caches.
    pub cache_bytes_per_rank: u64,
    /// Generated tokens per second by full recomputation, when compared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recompute_tokens_per_s: Option<f64>,
    /// Whether full recomputation produced the same tokens, when compared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matches_recompute: Option<bool>,
}

fn percentile(mut v: Vec<Duration>, p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort();
    let at = ((v.len() - 1) as f64 * p).round() as usize;
    v[at].as_secs_f64()
}

/// Generates `spec` on this rank: the GPT cut over `comm`'s ranks, each rank its slice.
/// Every rank returns the same tokens.
pub fn generate_rank(spec: &GenerateSpec, comm: Arc<dyn Communicator>) -> Result<GenerateReport> {
    let device = Device::flex();
    let (tp, backend) = (comm.world_size(), comm.backend().to_string());
    let grid = Grid::new(comm, 1, tp, &device)?;
    // A GPT-MoE's experts are cut over the group too: each rank runs its share of them.
    let model = Gpt::from_params(spec.shape, &spec.params, &device)?
        .sliced(grid.tensor_parallel())?
        .with_sliced_experts(grid.tensor_parallel())?;
    let (served, quant_group) = serving(model.clone(), spec)?;
    let heldout = match &spec.eval {
        Some(bytes) => {
            let reference = (spec.dtype != InferenceDtype::F32).then_some(&model);
            Some(heldout(&served, reference, bytes, spec.shape.seq_len)?)
        }
        None => None,
    };
    let model = served;
    let generation = generate(&model, &spec.prompts, &spec.options, &device)?;
    let batch = spec.prompts.len();
    let prompt_tokens: usize = spec.prompts.iter().map(Vec::len).sum();
    let decode: Duration = generation.steps.iter().sum();
    let decoded = batch * generation.steps.len();
    let (recompute_tokens_per_s, matches_recompute) = match spec.compare_recompute {
        true => {
            let (tokens, secs) = recompute(&model, &spec.prompts, spec.options.max_new_tokens)?;
            let per_s = (batch * spec.options.max_new_tokens) as f64 / secs;
            (Some(per_s), Some(tokens == generation.tokens))
        }
        false => (None, None),
    };
    Ok(GenerateReport {
        tp,
        backend,
        dtype: spec.dtype.to_string(),
        quant_group,
        parameters: spec.params.len() as u64,
        text: generation
            .tokens
            .iter()
            .map(|t| {
                String::from_utf8_lossy(&t.iter().map(|&b| b as u8).collect::<Vec<_>>()).into()
            })
            .collect(),
        tokens: generation.tokens.clone(),
        prefill_tokens_per_s: prompt_tokens as f64 / generation.prefill.as_secs_f64(),
        decode_tokens_per_s: decoded as f64 / decode.as_secs_f64().max(f64::MIN_POSITIVE),
        time_to_first_token_s: generation.prefill.as_secs_f64(),
        token_latency_p50_s: percentile(generation.steps.clone(), 0.5),
        token_latency_p99_s: percentile(generation.steps, 0.99),
        weight_bytes_per_rank: model.weight_bytes(),
        heldout_loss: heldout.map(|h| h.loss),
        heldout_tokens: heldout.map(|h| h.tokens),
        heldout_kl_from_fp32: heldout.and_then(|h| h.kl_from_reference),
        cache_bytes_per_rank: generation.cache_bytes,
        recompute_tokens_per_s,
        matches_recompute,
    })
}

/// `model` in `spec`'s dtype, with its `--quant-group` and `--quant-scheme`.
fn serving(model: Gpt, spec: &GenerateSpec) -> Result<(Gpt, Option<usize>)> {
    let how = spec.dtype.quantization().map(|mut how| {
        if let Some(group) = spec.quant_group {
            how = how.with_group(group);
        }
        if let Some(scheme) = spec.quant_scheme {
            how = how.with_scheme(scheme);
        }
        how
    });
    let group = how.as_ref().map(|h| h.group);
    Ok((in_dtype(model, spec.dtype, how.as_ref())?, group))
}

/// `model` served in `dtype`: under INT8/INT4 its weight matrices quantized from f32 (`how`,
/// or the dtype's defaults), and the rest (layer norms, biases, activations, caches) cast to
/// the dtype's float: fp16 under INT8/INT4, as DeepSpeed serves them.
///
/// # Errors
/// When a group does not fit a weight.
pub fn in_dtype(
    model: Gpt,
    dtype: InferenceDtype,
    how: Option<&WeightQuantization>,
) -> Result<Gpt> {
    let model = match dtype.quantization() {
        Some(default) => model.quantized(how.unwrap_or(&default))?,
        None => model,
    };
    Ok(match dtype.float() {
        Some(float) => cast_module(model, float),
        None => model,
    })
}

/// A model's quality on held-out bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Heldout {
    /// Mean next-byte cross-entropy.
    pub loss: f64,
    /// Tokens it averages over.
    pub tokens: usize,
    /// Mean KL(reference ‖ model) of the next-byte distributions, when a reference was given:
    /// how far the model's predictions moved from the reference's (0 when they are the same,
    /// never below).
    pub kl_from_reference: Option<f64>,
}

/// `model`'s [`Heldout`] figures over the non-overlapping windows of `seq_len + 1` bytes in
/// `bytes`, and its distance from `reference` (the same model in f32, say). A collective over
/// the model's group: every rank of it calls it.
///
/// # Errors
/// When the bytes hold no window, or a tensor-parallel collective failed.
pub fn heldout(
    model: &Gpt,
    reference: Option<&Gpt>,
    bytes: &[u8],
    seq_len: usize,
) -> Result<Heldout> {
    let windows = windows(bytes, seq_len);
    if windows.is_empty() {
        return Err(DeepSpeedError::Data(format!(
            "the held-out data has {} bytes, less than one window of {}",
            bytes.len(),
            seq_len + 1
        )));
    }
    let group = model.vocab_group().clone();
    let whole = |logits: Tensor<3>| -> Result<Tensor<2>> {
        let [b, t, v] = logits.dims();
        let layout = SliceLayout {
            dim: 1,
            sections: 1,
        };
        let flat = logits.reshape([b * t, v]).cast(FloatDType::F32);
        group
            .gather(flat, layout)
            .map_err(|e| DeepSpeedError::Data(format!("held-out logits: {e}")))
    };
    let (mut sum, mut kl, mut tokens) = (0.0f64, 0.0f64, 0usize);
    let device = model
        .devices()
        .into_iter()
        .next()
        .unwrap_or_else(Device::flex);
    for chunk in windows.chunks(8) {
        let batch = WindowBatcher
            .batch(chunk.to_vec(), &device)
            .with_vocab_group(group.clone());
        let logits = model.forward(batch.inputs.clone());
        let n = chunk.len() * seq_len;
        if let Some(reference) = reference {
            let p = log_softmax(whole(reference.forward(batch.inputs.clone()))?, 1);
            let q = log_softmax(whole(logits.clone())?, 1);
            let d = (p.clone().exp() * (p - q)).sum().into_scalar::<f32>();
            kl += f64::from(d);
        }
        let (loss, _, _) = batch.cross_entropy(logits, &group);
        sum += f64::from(loss.into_scalar::<f32>()) * n as f64;
        tokens += n;
    }
    if let Some(e) = group.take_error() {
        return Err(DeepSpeedError::Data(format!(
            "a tensor-parallel collective failed in the held-out loss: {e}"
        )));
    }
    Ok(Heldout {
        loss: sum / tokens as f64,
        tokens,
        kl_from_reference: reference.map(|_| kl / tokens as f64),
    })
}

/// Greedy tokens of `prompts` (one length) by running every sequence whole again for each
/// new token, and the seconds it took.
fn recompute(model: &Gpt, prompts: &[Vec<u32>], new: usize) -> Result<(Vec<Vec<u32>>, f64)> {
    let len = prompts[0].len();
    if prompts.iter().any(|p| p.len() != len) {
        return Err(DeepSpeedError::Data(
            "the recomputation baseline takes prompts of one length".into(),
        ));
    }
    let batch = prompts.len();
    let mut seqs: Vec<Vec<i64>> = prompts
        .iter()
        .map(|p| p.iter().map(|&t| i64::from(t)).collect())
        .collect();
    let mut sampler = Sampler::new(Sampling::Greedy);
    let group = model.vocab_group().clone();
    let start = Instant::now();
    for _ in 0..new {
        let n = seqs[0].len();
        let flat: Vec<i64> = seqs.iter().flatten().copied().collect();
        let input = Tensor::<2, Int>::from_data(TensorData::new(flat, [batch, n]), &Device::flex());
        let next = next_tokens(&group, model.forward(input), &mut sampler)?;
        for (seq, t) in seqs.iter_mut().zip(next) {
            seq.push(i64::from(t));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let tokens = seqs
        .into_iter()
        .map(|s| s[len..].iter().map(|&t| t as u32).collect())
        .collect();
    Ok((tokens, secs))
}
