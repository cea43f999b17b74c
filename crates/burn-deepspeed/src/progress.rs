//! Rank 0's progress bar (step, loss, tokens/s); hidden on other ranks and when stderr is not
//! a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A training progress bar shown by rank 0 only.
#[derive(Debug)]
pub struct TrainProgress {
    bar: ProgressBar,
}

impl TrainProgress {
    /// A bar for `total_steps` optimizer steps on `rank`.
    pub fn new(rank: usize, total_steps: u64) -> Self {
        let bar = if rank == 0 {
            ProgressBar::with_draw_target(Some(total_steps), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed}, eta {eta})",
            )
            .expect("the template is valid")
            .progress_chars("=> "),
        );
        Self { bar }
    }

    /// Records step `step` with its loss and throughput.
    pub fn update(&self, step: u64, loss: f64, tokens_per_s: f64) {
        self.bar.set_position(step);
        self.bar
            .set_message(format!("loss {loss:.4} | {tokens_per_s:.0} tok/s"));
    }

    /// Prints a line above the bar (rank 0 only).
    pub fn println(&self, line: impl AsRef<str>) {
        self.bar.println(line);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
