//! The fused CPU AdamW against Burn's own `AdamW` (through `ModuleOptimizer` on Flex): ten
//! steps with fresh gradients, at the sizes that exercise the vector tails and the parallel
//! chunks.

use burn::module::{Module, Param};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_deepspeed_cubecl_kernels::adam::{AdamParams, adam_step};
use burn_deepspeed_cubecl_kernels::fill::uniform as values;

#[derive(Module, Debug)]
struct Flat {
    w: Param<Tensor<1>>,
}

#[test]
fn fused_adamw_follows_burns_adamw_for_ten_steps() {
    let (lr, wd) = (1e-2f32, 0.1f32);
    let h = AdamParams::adamw(lr, wd);
    let device = Device::flex();
    for n in [1usize, 7, 22, 64, 1000, 65537] {
        let start = values(n, n as u64);
        let mut module = Flat {
            w: Param::from_tensor(Tensor::<1>::from_data(
                TensorData::new(start.clone(), [n]),
                &device.clone().autodiff(),
            )),
        };
        let id = module.w.id;
        let mut optim = AdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.999)
            .with_epsilon(1e-8)
            .with_weight_decay(wd)
            .init();
        let mut p = start;
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        for step in 1..=10u32 {
            let g = values(n, 1000 + step as u64);
            let mut grads = GradientsParams::new();
            grads.register::<1>(
                id,
                Tensor::<1>::from_data(TensorData::new(g.clone(), [n]), &device),
            );
            module = optim.step(lr as f64, module, grads);
            adam_step(&h, step, &mut p, &g, &mut m, &mut v);
        }
        let burn: Vec<f32> = module
            .w
            .val()
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 values");
        let diff: f64 = p
            .iter()
            .zip(&burn)
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = burn.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
        println!("n {n}: ‖Δp‖/‖p‖ = {:e}", diff / norm);
        assert!(
            diff / norm <= 1e-6,
            "n {n}: relative difference {}",
            diff / norm
        );
    }
}
