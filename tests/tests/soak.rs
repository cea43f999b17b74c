//! A long run with periodic checkpoints: 2,000 steps of GPT tiny at ZeRO stage 2 on 2 ranks,
//! saving every 100 steps and stopping at step 1,950; resumed from the last checkpoint (step
//! 1,900), the run finishes with exactly the losses and parameters of the uninterrupted one.

use std::time::Duration;

use burn::tensor::Device;
use burn_deepspeed::DeepSpeedEngine;
use burn_deepspeed::launch::launch;
use burn_deepspeed_example_gpt::model::Gpt;
use burn_deepspeed_example_gpt::run::train_step;
use burn_deepspeed_tests::crash_spec;

use crate::common;

const STEPS: u64 = 2_000;
const EVERY: u64 = 100;
const STOP: u64 = 1_950;

#[test]
fn two_thousand_steps_with_checkpoints_resume_exactly() {
    let whole = common::train(2, &crash_spec(2, STEPS));
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = crash_spec(2, STOP);
    let (_, interrupted) = launch(2, Duration::from_secs(120), |comm| {
        let device = Device::flex().autodiff();
        let model = Gpt::new(spec.shape, spec.seed, &device);
        let mut engine = DeepSpeedEngine::new(model, spec.config.clone(), comm)?;
        let inner = device.inner();
        let mut losses = Vec::new();
        for step in 0..STOP {
            losses.push(train_step(&mut engine, &spec, step, &inner)?.loss);
            if (step + 1) % EVERY == 0 {
                engine.save_checkpoint(dir.path(), None)?;
            }
        }
        Ok(losses)
    })
    .expect("the interrupted run");
    assert_eq!(interrupted[0], whole.losses[..STOP as usize]);

    let mut rest = crash_spec(2, STEPS);
    rest.resume_from = Some(dir.path().to_path_buf());
    let resumed = common::train(2, &rest);
    let last = STOP / EVERY * EVERY;
    assert_eq!(resumed.first_step, last);
    assert_eq!(resumed.losses, whole.losses[last as usize..]);
    assert_eq!(resumed.final_params, whole.final_params);
    assert_eq!(resumed.final_moments, whole.final_moments);
    common::assert_learns(&whole.losses, "soak");
}
