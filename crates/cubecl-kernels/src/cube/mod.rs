//! The CubeCL kernels: the same ops as the CPU path, for every CubeCL runtime built (wgpu,
//! which runs on a CPU through Mesa's lavapipe, and CUDA). They take a [`Client`] and device
//! buffers ([`Handle`]s), so they serve Burn's `Cube` backend (see [`crate::ext`]) and any
//! other CubeCL program alike.
//!
//! [`Client`]: cubecl::client::Client
//! [`Handle`]: cubecl::server::Handle

pub mod adam;
pub mod copy;
mod grid;
pub mod lamb;
pub mod qmatmul;
pub mod quantize;
mod reduce;
pub mod sign;

pub use grid::{download, upload};

#[cfg(test)]
pub(crate) mod tests {
    use cubecl::client::Client;
    use cubecl::ir::{ElemType, FloatKind};

    /// A client of every runtime this build links. With the `cuda` feature a CUDA device
    /// must be present: these tests fail rather than skip without one.
    #[allow(clippy::vec_init_then_push)]
    pub(crate) fn clients() -> Vec<(String, Client)> {
        #[allow(unused_mut)]
        let mut out: Vec<(String, Client)> = Vec::new();
        #[cfg(feature = "wgpu")]
        out.push((
            "wgpu".into(),
            cubecl::Device::Wgpu(Default::default()).client(),
        ));
        #[cfg(feature = "cuda")]
        {
            let device =
                cubecl::Device::cuda(0).expect("the `cuda` feature's tests need a CUDA device");
            out.push(("cuda".into(), device.client()));
        }
        assert!(!out.is_empty(), "a runtime feature is needed");
        for (name, client) in &out {
            println!("runtime {name}: {}", client.name());
        }
        out
    }

    /// Every kernel refuses a buffer smaller than its `n` values (handles are untyped bytes,
    /// so the launch would read and write past it), naming the op and the argument.
    #[test]
    fn undersized_buffers_are_refused_by_every_op() {
        use super::grid::upload;
        use super::{adam, copy, lamb, quantize, sign};
        use crate::adam::AdamParams;
        use crate::lamb::LambParams;
        use crate::quantize::{Bits, Quantizer, Scheme};

        for (name, client) in clients() {
            let n = 100;
            let full = upload(&client, &vec![0.5f32; n]);
            let short = upload(&client, &vec![0.5f32; n - 1]);
            let words = upload(&client, &vec![0u32; n.div_ceil(32)]);
            let few = upload(&client, &vec![0u32; n.div_ceil(32) - 1]);
            let adam = AdamParams::adamw(1e-3, 0.0);
            let lamb = LambParams {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
                weight_decay: 0.0,
                bias_correction: true,
                trust_clip: None,
            };
            let refusals: Vec<(&str, Result<(), crate::KernelError>)> = vec![
                (
                    "`m` holds 396 bytes",
                    adam::adam_step::<f32>(&client, &adam, 1, n, [&full, &full, &short, &full]),
                ),
                (
                    "segments must cover",
                    adam::adam_step_multi::<f32>(
                        &client,
                        &adam,
                        &[(n - 1, 1)],
                        n,
                        [&full, &full, &full, &full],
                    ),
                ),
                (
                    "`g` holds",
                    adam::adam_step_multi::<f32>(
                        &client,
                        &adam,
                        &[(n, 1)],
                        n,
                        [&full, &short, &full, &full],
                    ),
                ),
                ("`dst` holds", copy::copy(&client, n, &full, &short)),
                (
                    "`v` holds",
                    lamb::lamb_step(&client, &lamb, 1, n, [&full, &full, &full, &short])
                        .map(|_| ()),
                ),
                (
                    "`p` holds",
                    lamb::lamb_apply(&client, &lamb, 1, 1.0, n, [&short, &full, &full]),
                ),
                ("`packed` holds", sign::pack_signs(&client, n, &full, &few)),
                ("`x` holds", sign::pack_signs(&client, n, &short, &words)),
                (
                    "`out` holds",
                    sign::unpack_signs(&client, n, &words, 1.0, &short),
                ),
                (
                    "`error` holds",
                    sign::onebit_compress(&client, n, &full, &short, &words).map(|_| ()),
                ),
            ];
            for (needle, result) in refusals {
                let e = result.expect_err(needle).to_string();
                assert!(e.contains(needle), "{name}: {e}");
            }
            let q = Quantizer::new(Bits::Int8, Scheme::Symmetric, 10).expect("group of 10");
            let e = quantize::quantize(&client, &q, &short, n).expect_err("short x");
            assert!(e.to_string().contains("`x` holds"), "{name}: {e}");
            let dq = quantize::quantize(&client, &q, &full, n).expect("sized");
            let (codes, steps, offsets) = dq.into_parts();
            let e = quantize::DeviceQuantized::from_parts(q, 2 * n, codes, steps, offsets)
                .expect_err("codes for n values, not 2n");
            assert!(e.to_string().contains("`codes` holds"), "{name}: {e}");
        }
    }

    /// Whether the runtime behind `client` stores and computes with `P`.
    pub(crate) fn supports<P: 'static>(client: &Client) -> bool {
        let kind = if std::any::TypeId::of::<P>() == std::any::TypeId::of::<half::f16>() {
            FloatKind::F16
        } else if std::any::TypeId::of::<P>() == std::any::TypeId::of::<half::bf16>() {
            FloatKind::BF16
        } else {
            FloatKind::F32
        };
        client.properties().supports_type(ElemType::Float(kind))
    }
}
