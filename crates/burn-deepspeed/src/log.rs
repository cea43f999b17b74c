//! What a run tells its user: the library logs through [`tracing`] (a step's line every
//! `steps_per_print` steps at `INFO`, a skipped step or a refused setting at `WARN`), and
//! [`launch`](crate::launch::launch) runs each rank (its thread and its compute pool's threads)
//! under [`StderrLog`] when the program has installed no global subscriber, so that those
//! lines reach stderr, a terminal or a batch job's log file alike, one line per event.
//!
//! A program that installs its own global subscriber before `launch` keeps it (the ranks'
//! default is scoped to their threads, so a subscriber installed later is not refused either).
//! `BURN_DEEPSPEED_LOG` chooses the level of the default one: `info` (the default), `warn`,
//! `error` or `off`.

use std::fmt::Write as _;
use std::io::Write as _;

use tracing::field::{Field, Visit};
use tracing::{Dispatch, Event, Level, Subscriber};
use tracing_subscriber::Registry;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// The environment variable that sets the default subscriber's level.
pub const LOG_ENV: &str = "BURN_DEEPSPEED_LOG";

/// A `tracing` layer that writes each event of the `burn_deepspeed*` crates at or above its
/// level as one line on stderr: `[burn-deepspeed] LEVEL message key=value ...`.
#[derive(Debug, Clone, Copy)]
pub struct StderrLog {
    level: Level,
}

impl StderrLog {
    /// Events at `level` and above.
    pub fn new(level: Level) -> Self {
        Self { level }
    }

    /// The level `BURN_DEEPSPEED_LOG` asks for: `None` for `off`, `INFO` when unset or not
    /// understood.
    pub fn level_from_env() -> Option<Level> {
        match std::env::var(LOG_ENV).ok().as_deref().map(str::trim) {
            Some("off") | Some("none") => None,
            Some("error") => Some(Level::ERROR),
            Some("warn") => Some(Level::WARN),
            Some("debug") => Some(Level::DEBUG),
            Some("trace") => Some(Level::TRACE),
            _ => Some(Level::INFO),
        }
    }

    /// The line an event prints.
    pub fn line(event: &Event<'_>) -> String {
        let mut fields = Fields::default();
        event.record(&mut fields);
        format!(
            "[burn-deepspeed] {} {}{}",
            event.metadata().level(),
            fields.message,
            fields.rest
        )
    }
}

impl<S: Subscriber> Layer<S> for StderrLog {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let meta = event.metadata();
        if *meta.level() > self.level || !meta.target().starts_with("burn_deepspeed") {
            return;
        }
        // One write of the whole line: lines of concurrent ranks do not interleave.
        let _ = writeln!(std::io::stderr().lock(), "{}", Self::line(event));
    }
}

#[derive(Default)]
struct Fields {
    message: String,
    rest: String,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={value}", field.name());
        }
    }
}

/// The dispatcher [`launch`](crate::launch::launch) gives its ranks' threads (the rank
/// threads and their compute pools' threads): [`StderrLog`] at the level `BURN_DEEPSPEED_LOG`
/// chooses. `None` when the program installed a global subscriber or the variable says `off`.
pub fn default_dispatch() -> Option<Dispatch> {
    let level = StderrLog::level_from_env()?;
    if tracing::dispatcher::has_been_set() {
        return None;
    }
    Some(Dispatch::new(
        Registry::default().with(StderrLog::new(level)),
    ))
}

/// Runs `f` with `dispatch` (when there is one) as this thread's default.
pub fn with_dispatch<R>(dispatch: Option<&Dispatch>, f: impl FnOnce() -> R) -> R {
    match dispatch {
        Some(d) => tracing::dispatcher::with_default(d, f),
        None => f(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A layer that keeps the lines [`StderrLog`] would print.
    struct Lines(Arc<Mutex<Vec<String>>>, StderrLog);

    impl<S: Subscriber> Layer<S> for Lines {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let meta = event.metadata();
            if *meta.level() <= self.1.level && meta.target().starts_with("burn_deepspeed") {
                self.0.lock().unwrap().push(StderrLog::line(event));
            }
        }
    }

    #[test]
    fn an_event_is_one_line_with_its_fields() {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let subscriber =
            Registry::default().with(Lines(lines.clone(), StderrLog::new(Level::INFO)));
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "burn_deepspeed::step", step = 3, "step skipped");
            tracing::info!(target: "burn_deepspeed::step", "step 10: loss 1.2345");
            tracing::debug!(target: "burn_deepspeed::step", "below the level");
            tracing::info!(target: "another_crate", "not ours");
        });
        assert_eq!(
            *lines.lock().unwrap(),
            [
                "[burn-deepspeed] WARN step skipped step=3",
                "[burn-deepspeed] INFO step 10: loss 1.2345",
            ]
        );
    }
}
