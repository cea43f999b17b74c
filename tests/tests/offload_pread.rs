//! ZeRO-Infinity's optimizer offload on the `pread`/`pwrite` fallback, the engine chosen
//! where io_uring is unavailable (seccomp, old kernels): forced here by `BURN_DEEPSPEED_AIO`,
//! it steps bit-identically to the in-memory run at stages 1-3, and with the stage-3
//! parameters on disk too (GPT_MINI, 2 ranks, 8 steps, tiles of 2,999 elements: several per
//! rank). The process picks its engine once: `scripts/test.sh` runs this
//! module in a process of its own, and the test holds `process.rs`'s lock, so that setting the
//! variable races with no other test.

use burn_deepspeed::swap::IO_ENGINE_ENV;
use burn_deepspeed_example_gpt::run::{RunSpec, run_in_threads};
use burn_deepspeed_tests::GPT_MINI;
use burn_deepspeed_tests::offload::{offload_config, same_run, with_params_offloaded};

#[test]
fn the_pread_fallback_steps_bit_identically_at_stages_1_to_3() {
    let _alone = crate::alone();
    // SAFETY: `alone` keeps every other test of this binary, and so any other reader of the
    // environment, from running meanwhile.
    unsafe { std::env::set_var(IO_ENGINE_ENV, "pread") };
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |config| {
        let spec = RunSpec::on_embedded_corpus(config, GPT_MINI, 8, 5, 9);
        run_in_threads(2, &spec, std::time::Duration::from_secs(300)).expect("trains")
    };
    for stage in 1..=3u8 {
        let base = run(offload_config(stage, "fp32", None));
        let nvme = run(offload_config(
            stage,
            "fp32",
            Some(("nvme", dir.path(), 2_999, stage != 2)),
        ));
        same_run(&base, &nvme, &format!("stage {stage} nvme on pread"));
        let swap = nvme.swap.expect("swap figures");
        println!("stage {stage}: {swap:?}");
        assert_eq!(swap.engine, "pread");
        if stage == 3 {
            let config = offload_config(3, "fp32", Some(("nvme", dir.path(), 2_999, true)));
            let params = run(with_params_offloaded(config, "nvme", dir.path(), 3, 2_500));
            same_run(&base, &params, "stage 3, parameters and optimizer on pread");
            let store = params.param_store.expect("a parameter store");
            assert_eq!(store.swap.expect("a swap file").engine, "pread");
        }
    }
}
