//! The fused ops on Burn tensors (`#[backend_extension]`) against the CPU path: on Flex
//! (plain and autodiff devices) always, and on the wgpu runtime (the `Cube` arm, lavapipe in
//! CI) with the `wgpu` feature.

use burn::backend::DType;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_deepspeed_cubecl_kernels::adam::{AdamParams, adam_step};
use burn_deepspeed_cubecl_kernels::ext::{
    fused_adam, fused_lamb, onebit_compress, quantize_groups, unpack_signs,
};
use burn_deepspeed_cubecl_kernels::fill::uniform;
use burn_deepspeed_cubecl_kernels::lamb::{LambParams, lamb_step};
use burn_deepspeed_cubecl_kernels::quantize::{Bits, Quantizer, Scheme};
use burn_deepspeed_cubecl_kernels::words::to_bytes as bytes;
use burn_deepspeed_cubecl_kernels::{KernelError, sign};

const N: usize = 65537;

fn floats(t: Tensor<1>) -> Vec<f32> {
    t.cast(DType::F32)
        .into_data()
        .try_into_vec::<f32>()
        .expect("f32 values")
}

fn words(t: Tensor<1, Int>) -> Vec<u32> {
    t.into_data().try_into_vec::<u32>().expect("u32 words")
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs() / (y as f64).abs().max(1e-3))
        .fold(0.0, f64::max)
}

/// Ten fused Adam steps through the extension against ten of the CPU path, for one dtype.
fn adam_on(device: &Device, dtype: DType, tolerance: f64) {
    let h = AdamParams::adamw(1e-2, 0.1);
    let to = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [N]), device);
    let mut p = to(uniform(N, 1)).cast(dtype);
    let (mut m, mut v) = (to(vec![0.0; N]), to(vec![0.0; N]));
    // The CPU path on the same values, rounded to the dtype as stored.
    let round = |x: Vec<f32>| floats(to(x).cast(dtype));
    let mut cp = round(uniform(N, 1));
    let (mut cm, mut cv) = (vec![0.0; N], vec![0.0; N]);
    for step in 1..=10 {
        let g = round(uniform(N, 100 + step as u64));
        let gt = to(g.clone()).cast(dtype);
        let kept = p.clone();
        (p, m, v) = fused_adam(p, gt, m, v, &h, step).expect("valid arguments");
        // A clone taken before the step still holds the old values.
        assert_eq!(
            floats(kept),
            cp,
            "{dtype:?}: the step wrote into a shared buffer"
        );
        match dtype {
            DType::F32 => adam_step(&h, step, &mut cp, &g, &mut cm, &mut cv),
            _ => {
                // bf16/f16 arithmetic as the fused step does it: f32 math, rounded storage.
                adam_step(&h, step, &mut cp, &g, &mut cm, &mut cv);
                cp = round(cp);
            }
        }
    }
    let dp = floats(p.clone());
    let err = max_rel(&dp, &cp);
    assert!(err <= tolerance, "{dtype:?}: fused step vs CPU path {err}");
    assert!(max_rel(&floats(m), &cm) <= 1e-5);
}

fn lamb_on(device: &Device) {
    let h = LambParams {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-6,
        weight_decay: 0.01,
        bias_correction: true,
        trust_clip: Some((0.01, 10.0)),
    };
    let to = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [N]), device);
    let mut p = to(uniform(N, 3));
    let (mut m, mut v) = (to(vec![0.0; N]), to(vec![0.0; N]));
    let mut cp = uniform(N, 3);
    let (mut cm, mut cv) = (vec![0.0; N], vec![0.0; N]);
    for step in 1..=10 {
        let g = uniform(N, 50 + step as u64);
        (p, m, v) = fused_lamb(p, to(g.clone()), m, v, &h, step).expect("valid");
        lamb_step(&h, step, &mut cp, &g, &mut cm, &mut cv);
    }
    let err = max_rel(&floats(p), &cp);
    assert!(err <= 1e-4, "LAMB vs CPU path {err}");
    let _ = (m, v);
}

fn quantize_on(device: &Device) {
    let x: Vec<f32> = uniform(N, 5).iter().map(|v| v * 3.0 + 0.5).collect();
    for bits in [Bits::Int8, Bits::Int4] {
        for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
            let q = Quantizer::new(bits, scheme, 64).expect("valid");
            let cpu = q.quantize(&x);
            let t = Tensor::<1>::from_data(TensorData::new(x.clone(), [N]), device);
            let dq = quantize_groups(t, &q).expect("f32");
            let codes = bytes(&words(dq.codes.clone()), bits.bytes_for(N));
            let differ = codes.iter().zip(&cpu.codes).filter(|(a, b)| a != b).count();
            // Codes may differ only on rounding ties (none of these values sit on one, so
            // a handful at most).
            assert!(
                differ <= N / 1000,
                "{bits:?} {scheme:?}: {differ} code bytes differ"
            );
            assert_eq!(floats(dq.steps.clone()), cpu.steps, "{bits:?} {scheme:?}");
            let y = floats(dq.dequantize().expect("consistent fields"));
            let expected = cpu.dequantize();
            let step_max = cpu.steps.iter().cloned().fold(0.0f32, f32::max) as f64;
            let worst = y
                .iter()
                .zip(&expected)
                .map(|(a, b)| (a - b).abs() as f64)
                .fold(0.0, f64::max);
            assert!(worst <= step_max * 1.0001, "{bits:?} {scheme:?}: {worst}");
            // Fields that do not fit together are refused.
            let mut longer = dq.clone();
            longer.len = N * 2;
            let e = longer.dequantize().expect_err("too few codes");
            assert!(e.to_string().contains("code words"), "{e}");
        }
    }
}

/// The fused dequantize-matmul through the extension: the product of the tensors'
/// quantized weight against the CPU path's on the same codes, within 1e-5 of its largest
/// value; a wrong inner size and a non-f32 `x` are refused.
fn qmatmul_on(device: &Device) {
    use burn_deepspeed_cubecl_kernels::qmatmul::dequant_matmul;
    let (m, k, n) = (5, 96, 320);
    let w: Vec<f32> = uniform(k * n, 3).iter().map(|v| v * 0.2).collect();
    let x = uniform(m * k, 4);
    for bits in [Bits::Int8, Bits::Int4] {
        let q = Quantizer::new(bits, Scheme::Asymmetric, 64).expect("valid");
        let t = Tensor::<1>::from_data(TensorData::new(w.clone(), [k * n]), device);
        let dq = quantize_groups(t, &q).expect("f32");
        let xt = Tensor::<2>::from_data(TensorData::new(x.clone(), [m, k]), device);
        let y = dq.matmul(xt.clone(), n).expect("shapes");
        assert_eq!(y.dims(), [m, n]);
        let y = floats(y.reshape([m * n]));
        let cpu = burn_deepspeed_cubecl_kernels::quantize::Quantized {
            quantizer: q,
            len: k * n,
            codes: bytes(&words(dq.codes.clone()), bits.bytes_for(k * n)),
            steps: floats(dq.steps.clone()),
            offsets: floats(dq.offsets.clone()),
        };
        let mut want = vec![0.0f32; m * n];
        dequant_matmul(&x, m, &cpu, k, n, &mut want).expect("shapes");
        let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * scale, "{bits:?}: {a} vs {b}");
        }
        let e = dq
            .matmul(xt.clone(), n + 1)
            .expect_err("k · (n + 1) values");
        assert!(e.to_string().contains("dequant_matmul"), "{e}");
        let e = dq.matmul(xt.cast(DType::F16), n).expect_err("f16 x");
        assert!(e.to_string().contains("must be f32"), "{e}");
    }
}

fn onebit_on(device: &Device) {
    let x = uniform(N, 7);
    let e0: Vec<f32> = uniform(N, 8).iter().map(|v| v * 0.1).collect();
    let to = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v, [N]), device);
    let (packed, scale, error) = onebit_compress(to(x.clone()), to(e0.clone())).expect("f32");
    let mut ce = e0;
    let mut cpacked = vec![0u8; sign::packed_len(N)];
    let cscale = sign::onebit_compress(&x, &mut ce, &mut cpacked);
    assert!(
        (scale - cscale).abs() <= 1e-6 * cscale,
        "{scale} vs {cscale}"
    );
    assert_eq!(bytes(&words(packed.clone()), sign::packed_len(N)), cpacked);
    assert!(max_rel(&floats(error), &ce) <= 1e-5);
    // More signs than the words hold are refused, not read past the buffer.
    let e = unpack_signs(
        packed.clone(),
        scale,
        32 * packed.shape().num_elements() + 1,
    )
    .expect_err("too few words");
    assert!(e.to_string().contains("u32 words"), "{e}");
    let y = floats(unpack_signs(packed, scale, N).expect("enough words"));
    let mut cy = vec![0.0; N];
    sign::unpack_signs(&cpacked, scale, &mut cy);
    assert_eq!(y, cy);
}

/// Every op on `device`, the fused Adam in each of `dtypes` (with its tolerance: one unit
/// in the last place of the half types, whose rounding an FMA may flip).
fn all_ops_on(device: &Device, dtypes: &[DType]) {
    for &dtype in dtypes {
        let tolerance = match dtype {
            DType::BF16 => 8e-3,
            DType::F16 => 1e-3,
            _ => 1e-5,
        };
        adam_on(device, dtype, tolerance);
    }
    lamb_on(device);
    quantize_on(device);
    qmatmul_on(device);
    onebit_on(device);
}

#[test]
fn flex_arm_matches_the_cpu_path() {
    all_ops_on(&Device::flex(), &[DType::F32, DType::BF16, DType::F16]);
}

#[test]
fn autodiff_tensors_are_stepped_through_their_inner_values() {
    all_ops_on(&Device::flex().autodiff(), &[DType::F32]);
}

#[test]
fn bad_arguments_are_refused_with_the_reason() {
    let device = Device::flex();
    let a = Tensor::<1>::zeros([4], &device);
    let b = Tensor::<1>::zeros([5], &device);
    let h = AdamParams::adamw(1e-3, 0.0);
    let e = fused_adam(a.clone(), b, a.clone(), a.clone(), &h, 1).expect_err("shape mismatch");
    assert!(
        matches!(
            e,
            KernelError::Arguments {
                op: "fused_adam",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("shapes"), "{e}");
    let half_m = a.clone().cast(DType::F16);
    let e = fused_adam(a.clone(), a.clone(), half_m, a.clone(), &h, 1).expect_err("f16 moment");
    assert!(e.to_string().contains("moments must be f32"), "{e}");
}

#[cfg(feature = "wgpu")]
#[test]
fn cube_arm_on_wgpu_matches_the_cpu_path() {
    let device = Device::from(burn::backend::wgpu::WgpuDevice::default());
    // WGSL has no bf16: the wgpu runtime offers f32 and f16 (lavapipe has shader-f16).
    all_ops_on(&device, &[DType::F32, DType::F16]);
}
