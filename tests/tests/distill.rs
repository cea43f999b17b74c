//! Mixture-of-Students (DeepSpeed-MoE, arXiv 2201.05596 §5): a GPT-MoE student with half the
//! teacher's layers learns from a trained GPT-MoE teacher's next-token distributions, staged
//! (the teacher's term stops partway). The teacher's checkpoint is written at `ep_size` 2;
//! the student trains at `ep_size` 2 beside it.

use crate::common;

use std::sync::Arc;

use burn_deepspeed::DeepSpeedConfig;
use burn_deepspeed::distill::DistillationConfig;
use burn_deepspeed_example_gpt::DEFAULT_CONFIG;
use burn_deepspeed_example_gpt::data::{ByteCorpus, EMBEDDED_CORPUS};
use burn_deepspeed_example_gpt::model::GptShape;
use burn_deepspeed_example_gpt::run::{RunReport, RunSpec, Teacher};

/// The teacher: `tiny-moe`'s blocks (4, experts in blocks 2 and 4) at a quarter of its width
/// and an eighth of its context, so that 150 steps train it in seconds.
const TEACHER: GptShape = GptShape {
    d_model: 32,
    heads: 2,
    seq_len: 16,
    ..GptShape::TINY_MOE
};

/// The bytes the students are judged on: the corpus's last 7,538, which they never see.
const HELDOUT: usize = 7_538;

fn spec(shape: GptShape, steps: u64) -> RunSpec {
    // The example's default config: AdamW at 1e-3 after 20 warm-up steps, batch 16.
    let config = DeepSpeedConfig::from_json_str(DEFAULT_CONFIG)
        .expect("valid config")
        .0;
    let mut spec = common::spec(config, shape, steps, 3, 7);
    let cut = EMBEDDED_CORPUS.len() - HELDOUT;
    spec.corpus = ByteCorpus::new(EMBEDDED_CORPUS[..cut].to_vec(), 3);
    spec.heldout = Some(Arc::new(EMBEDDED_CORPUS[cut..].to_vec()));
    spec.ep_size = 2;
    spec
}

fn student(steps: u64, teacher: Option<Teacher>) -> RunReport {
    let shape = GptShape {
        layers: 2,
        ..TEACHER
    };
    let mut spec = spec(shape, steps);
    spec.teacher = teacher;
    common::train(2, &spec)
}

/// A teacher (4 blocks, 2 of them MoE) trained and saved at `ep_size` 2; its student (2 blocks,
/// one of them MoE) trained alone, with the teacher's term weighted 0 (exactly the run
/// alone), and distilled until 85% of its steps: the distilled steps report the KL on top of
/// the cross-entropy, and the distilled student ends with the lower held-out loss.
#[test]
fn a_distilled_student_ends_below_the_same_student_alone() {
    const TEACHER_STEPS: u64 = 150;
    const STEPS: u64 = 40;
    const STOP: u64 = 34;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut teacher_spec = spec(TEACHER, TEACHER_STEPS);
    teacher_spec.save_dir = Some(dir.path().to_path_buf());
    let trained = common::train(2, &teacher_spec);
    let teacher = |distill: DistillationConfig| {
        Teacher::from_checkpoint(dir.path(), TEACHER, distill).expect("the teacher")
    };

    let alone = student(STEPS, None);
    let silent = student(
        4,
        Some(teacher(DistillationConfig::new().with_beta_kd(0.0))),
    );
    assert_eq!(
        silent.losses,
        alone.losses[..4],
        "a teacher weighted 0 changes nothing"
    );

    let staged = DistillationConfig::new().with_stop_step(Some(STOP));
    let distilled = student(STEPS, Some(teacher(staged)));
    assert_eq!(distilled.distilled_steps, STOP);
    assert!(
        distilled.losses[0] > alone.losses[0] + 0.1,
        "the first step adds the KL to the same cross-entropy: {} vs {}",
        distilled.losses[0],
        alone.losses[0]
    );
    let (a, d, t) = (
        alone.heldout_loss.expect("held out"),
        distilled.heldout_loss.expect("held out"),
        trained.heldout_loss.expect("held out"),
    );
    println!(
        "held-out loss: teacher {t:.4} ({TEACHER_STEPS} steps), student alone {a:.4}, \
         distilled {d:.4} ({STEPS} steps, the teacher's term for {STOP})"
    );
    assert!(d < a, "distilled {d} against alone {a}");
}

/// Bad distillation settings and a teacher of another shape are refused with the reason.
#[test]
fn a_wrong_teacher_is_refused() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut spec = spec(GptShape::TINY_MOE, 1);
    spec.save_dir = Some(dir.path().to_path_buf());
    common::train(2, &spec);
    let err = Teacher::from_checkpoint(dir.path(), GptShape::TINY, DistillationConfig::new())
        .expect_err("another model")
        .to_string();
    assert!(err.contains("--model"), "{err}");
    let err = Teacher::from_checkpoint(
        dir.path(),
        GptShape::TINY_MOE,
        DistillationConfig::new().with_temperature(-1.0),
    )
    .expect_err("a negative temperature")
    .to_string();
    assert!(err.contains("distillation.temperature"), "{err}");
}
