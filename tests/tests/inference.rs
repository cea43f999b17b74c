//! Generation from key/value caches (issue 21): greedy decoding from the caches gives exactly
//! the tokens of full recomputation, for one prompt and for a batch of prompts of different
//! lengths, and a GPT sliced over 2 and 4 ranks generates the same tokens as the whole one.

use crate::common;

use std::time::Duration;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::flat::{ParamLayout, params_from_flat};
use burn_deepspeed::grid::Grid;
use burn_deepspeed::inference::{GenerateOptions, Sampling, generate};
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::data::EMBEDDED_CORPUS;
use burn_deepspeed_example_gpt::generate::{GenerateSpec, heldout};
use burn_deepspeed_example_gpt::model::{Gpt, GptShape};

const SHAPE: GptShape = GptShape {
    d_model: 64,
    layers: 2,
    heads: 4,
    seq_len: 96,
    moe: None,
};
const NEW_TOKENS: usize = 48;

/// The GPT trained for 60 steps on the embedded corpus (peaked next-token distributions,
/// so that greedy choices are not ties), as flat parameters.
fn trained() -> Vec<f32> {
    let config = DeepSpeedConfig::from_json_str(
        r#"{"train_batch_size": 8, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}"#,
    )
    .expect("valid")
    .0;
    common::train(1, &common::spec(config, SHAPE, 60, 5, 3))
        .final_params
        .0
}

/// The trained model on Flex without autodiff.
fn model(params: &[f32]) -> Gpt {
    let whole = Gpt::new(SHAPE, 3, &Device::flex());
    let layout = ParamLayout::of(&whole);
    params_from_flat(whole, &layout, params)
}

fn prompts() -> Vec<Vec<u32>> {
    [(100, 17), (900, 9), (2000, 30)]
        .iter()
        .map(|&(at, len)| {
            EMBEDDED_CORPUS[at..at + len]
                .iter()
                .map(|&b| u32::from(b))
                .collect()
        })
        .collect()
}

/// Greedy tokens by running the whole sequence again for every new token.
fn recomputed(model: &Gpt, prompt: &[u32]) -> Vec<u32> {
    let mut seq: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    let mut out = Vec::new();
    for _ in 0..NEW_TOKENS {
        let n = seq.len();
        let input =
            Tensor::<2, Int>::from_data(TensorData::new(seq.clone(), [1, n]), &Device::flex());
        let logits = model.forward(input).slice([0..1, n - 1..n]).reshape([256]);
        let row = logits.into_data().try_to_vec::<f32>().expect("f32");
        let mut best = 0;
        for (i, v) in row.iter().enumerate() {
            if *v > row[best] {
                best = i;
            }
        }
        out.push(best as u32);
        seq.push(best as i64);
    }
    out
}

/// A config of `tp` tensor-parallel ranks.
fn tp_config(tp: usize) -> DeepSpeedConfig {
    DeepSpeedConfig::from_json_str(&format!(r#"{{"tensor_parallel": {{"tp_size": {tp}}}}}"#))
        .expect("valid")
        .0
}

const GREEDY: GenerateOptions = GenerateOptions {
    max_new_tokens: NEW_TOKENS,
    sampling: Sampling::Greedy,
};

#[test]
fn cached_decoding_gives_the_tokens_of_full_recomputation() {
    let params = trained();
    let gpt = model(&params);
    let prompts = prompts();
    let want: Vec<Vec<u32>> = prompts.iter().map(|p| recomputed(&gpt, p)).collect();
    // One prompt at a time, then the three together (left-padded to the longest).
    for (p, w) in prompts.iter().zip(&want) {
        let got =
            generate(&gpt, std::slice::from_ref(p), &GREEDY, &Device::flex()).expect("generates");
        assert_eq!(&got.tokens[0], w, "one prompt");
    }
    let batch = generate(&gpt, &prompts, &GREEDY, &Device::flex()).expect("generates");
    assert_eq!(
        batch.tokens, want,
        "a batch of prompts of different lengths"
    );
    assert_eq!(batch.steps.len(), NEW_TOKENS - 1);
    // A token count whose cache size overflows is refused (it overflowed `longest + n`).
    let huge = GenerateOptions {
        max_new_tokens: usize::MAX,
        ..GREEDY
    };
    let e = generate(&gpt, &prompts, &huge, &Device::flex()).unwrap_err();
    assert!(e.to_string().contains("max_new_tokens"), "{e}");
    let text =
        String::from_utf8_lossy(&want[0].iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned();
    println!("prompt 0 continues with {text:?}");

    // Sliced over 2 and 4 ranks: the same tokens.
    for tp in [2usize, 4] {
        let config = tp_config(tp);
        let (_, ranks) = launch(tp, Duration::from_secs(120), |comm| {
            let grid = Grid::from_config(&config, comm, &Device::flex())?;
            let sliced = model(&params).sliced(grid.tensor_parallel())?;
            generate(&sliced, &prompts, &GREEDY, &Device::flex())
        })
        .expect("the ranks generate");
        for r in ranks {
            assert_eq!(r.tokens, want, "tp {tp}");
        }
    }
}

/// Seeded sampling repeats, and differs from greedy.
#[test]
fn seeded_sampling_repeats() {
    let gpt = model(&trained());
    let options = GenerateOptions {
        max_new_tokens: 16,
        sampling: Sampling::Random {
            temperature: 1.5,
            top_k: 40,
            top_p: 0.95,
            seed: 9,
        },
    };
    let a = generate(&gpt, &prompts(), &options, &Device::flex()).expect("generates");
    let b = generate(&gpt, &prompts(), &options, &Device::flex()).expect("generates");
    assert_eq!(a.tokens, b.tokens);
    let greedy = generate(
        &gpt,
        &prompts(),
        &GenerateOptions {
            max_new_tokens: 16,
            ..GREEDY
        },
        &Device::flex(),
    )
    .expect("generates");
    assert_ne!(
        a.tokens, greedy.tokens,
        "sampling at temperature 1.5 is not greedy"
    );
}

/// INT8 and INT4 weights (whole and sliced over 2 ranks), served as `generate --dtype` serves
/// them (the rest in fp16): the loss within 1% and 5% of f32's, the predictions close (KL),
/// the weight bytes per rank within 5% of Ψ/tp (INT8) and of Ψ/(2·tp) plus an f32 step and
/// offset per 64 values (INT4, 8%).
#[test]
fn quantized_weights_keep_the_loss_and_shrink_the_bytes() {
    use burn_deepspeed::inference::InferenceDtype;
    use burn_deepspeed_example_gpt::generate::{heldout, in_dtype};

    let params = trained();
    let text = &EMBEDDED_CORPUS[EMBEDDED_CORPUS.len() - 2000..];
    for tp in [1usize, 2] {
        let config = tp_config(tp);
        let (_, ranks) = launch(tp, Duration::from_secs(120), |comm| {
            let grid = Grid::from_config(&config, comm, &Device::flex())?;
            let f32_model = model(&params).sliced(grid.tensor_parallel())?;
            let base = heldout(&f32_model, None, text, SHAPE.seq_len)?;
            let mut out = vec![(base.loss, 0.0, f32_model.weight_bytes())];
            for dtype in [InferenceDtype::Int8, InferenceDtype::Int4] {
                let q = in_dtype(f32_model.clone(), dtype, None)?;
                let h = heldout(&q, Some(&f32_model), text, SHAPE.seq_len)?;
                let kl = h.kl_from_reference.expect("a reference");
                out.push((h.loss, kl, q.weight_bytes()));
            }
            Ok(out)
        })
        .expect("the ranks evaluate");
        for r in &ranks {
            assert_eq!(r, &ranks[0], "every rank reports the same");
        }
        let [
            (f32_loss, _, f32_bytes),
            (int8, kl8, bytes8),
            (int4, kl4, bytes4),
        ] = ranks[0][..]
        else {
            panic!("three dtypes");
        };
        println!(
            "tp {tp}: loss f32 {f32_loss:.5}, int8 {int8:.5} (KL {kl8:.2e}), int4 {int4:.5} \
             (KL {kl4:.2e}); bytes {f32_bytes} / {bytes8} / {bytes4}"
        );
        assert!(
            (int8 / f32_loss - 1.0).abs() < 0.01,
            "tp {tp} int8: {int8} vs {f32_loss}"
        );
        assert!(
            (int4 / f32_loss - 1.0).abs() < 0.05,
            "tp {tp} int4: {int4} vs {f32_loss}"
        );
        assert!(kl8 > 0.0 && kl8 < kl4, "KL int8 {kl8:e}, int4 {kl4:e}");
        // Ψ/tp bytes for INT8 (plus a step per group and the fp16 rest), Ψ/(2·tp) plus an f32
        // step and offset per 64 values for INT4: within 5%.
        let psi = params.len() as f64 / tp as f64;
        let int8_ratio = bytes8 as f64 / psi;
        let int4_ratio = bytes4 as f64 / (psi / 2.0 + psi / 64.0 * 8.0);
        println!("tp {tp}: int8 {int8_ratio:.4} of Ψ/tp, int4 {int4_ratio:.4} of Ψ/(2·tp) + steps");
        assert!(
            (1.0..1.05).contains(&int8_ratio),
            "tp {tp} int8 bytes: {int8_ratio}"
        );
        // INT4 within 8% here: a slice of this d-64 model's q|k|v is 96 wide, so its groups
        // are 48 values (more steps than 64's); GPT `small`'s rows take 64 (BENCHMARKS.md).
        assert!(
            (1.0..1.08).contains(&int4_ratio),
            "tp {tp} int4 bytes: {int4_ratio}"
        );
    }
}

/// On wgpu (lavapipe in CI) the INT8 and INT4 GPT multiplies with the CubeCL kernel (its
/// codes on the device, dequantized as they are loaded) and scores the held-out bytes as the
/// same model on Flex does, with the CPU's kernel.
#[cfg(feature = "wgpu")]
#[test]
fn quantized_weights_on_wgpu_score_as_on_flex() {
    use burn::module::Module;
    use burn_deepspeed::inference::InferenceDtype;
    use burn_deepspeed_example_gpt::generate::{heldout, in_dtype};

    let params = trained();
    let text = &EMBEDDED_CORPUS[EMBEDDED_CORPUS.len() - 1000..];
    let wgpu = Device::from(burn::backend::wgpu::WgpuDevice::default());
    for dtype in [InferenceDtype::Int8, InferenceDtype::Int4] {
        let on_flex = in_dtype(model(&params), dtype, None).expect("quantizes");
        let on_wgpu = in_dtype(model(&params).to_device(&wgpu), dtype, None).expect("quantizes");
        let flex = heldout(&on_flex, None, text, SHAPE.seq_len).expect("scores");
        let gpu = heldout(&on_wgpu, None, text, SHAPE.seq_len).expect("scores");
        println!(
            "{dtype}: held-out loss flex {:.6}, wgpu {:.6}",
            flex.loss, gpu.loss
        );
        assert!(
            (gpu.loss / flex.loss - 1.0).abs() < 1e-4,
            "{dtype}: wgpu {} vs flex {}",
            gpu.loss,
            flex.loss
        );
    }
}

/// MoE inference: a GPT-MoE trained at `ep_size` 2 and saved (the checkpoint holds every
/// expert) is served whole, and sliced over 2 and 4 ranks with its experts cut over the
/// group as well (each rank runs its share on the tokens every rank sees): the same greedy
/// tokens and the same held-out loss, each rank holding a quarter of the experts at tp 4.
#[test]
fn a_gpt_moe_trained_at_ep_2_serves_with_its_experts_sliced() {
    let shape = GptShape {
        moe: GptShape::TINY_MOE.moe,
        ..SHAPE
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = DeepSpeedConfig::from_json_str(
        r#"{"train_batch_size": 8, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}"#,
    )
    .expect("valid")
    .0;
    let mut spec = common::spec(config, shape, 40, 5, 3);
    spec.ep_size = 2;
    spec.save_dir = Some(dir.path().to_path_buf());
    common::train(2, &spec);
    let params = GenerateSpec::params_from_checkpoint(dir.path(), shape).expect("the whole model");
    let load = || Gpt::from_params(shape, &params, &Device::flex()).expect("the whole model");
    let gpt = load();
    let prompts = prompts();
    let heldout_bytes = &EMBEDDED_CORPUS[60_000..64_000];
    let want = generate(&gpt, &prompts, &GREEDY, &Device::flex()).expect("generates");
    let loss = heldout(&gpt, None, heldout_bytes, shape.seq_len).expect("held out");
    for tp in [2usize, 4] {
        let config = tp_config(tp);
        let (_, ranks) = launch(tp, Duration::from_secs(120), |comm| {
            let grid = Grid::from_config(&config, comm, &Device::flex())?;
            let sliced = load()
                .sliced(grid.tensor_parallel())?
                .with_sliced_experts(grid.tensor_parallel())?;
            let experts = burn::module::Module::num_params(&sliced);
            let tokens = generate(&sliced, &prompts, &GREEDY, &Device::flex())?.tokens;
            let loss = heldout(&sliced, None, heldout_bytes, shape.seq_len)?;
            Ok((tokens, loss, experts))
        })
        .expect("the ranks serve");
        for (tokens, got, held) in ranks {
            assert_eq!(tokens, want.tokens, "tp {tp}");
            let diff = (got.loss - loss.loss).abs();
            println!(
                "tp {tp}: held-out loss {:.6} vs {:.6}, {held} parameters held",
                got.loss, loss.loss
            );
            assert!(diff < 1e-5, "tp {tp}: {diff}");
            assert!(
                held < params.len() / tp + params.len() / 4,
                "tp {tp}: {held}"
            );
        }
    }
}
