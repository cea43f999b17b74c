//! [`DynamicLossScaler`]: DeepSpeed's fp16 loss scale, step for step.
//!
//! fp16 gradients underflow to zero below 2^-24, so the loss is multiplied by a scale before
//! backward and the gradients divided by it before the step (Micikevicius et al., arXiv
//! 1710.03740). The scale is as large as the gradients allow: an overflow (inf or NaN anywhere,
//! agreed across ranks) skips the step and shrinks it, and a run of overflow-free steps grows
//! it. The rule is DeepSpeed's `DynamicLossScaler.update_scale`:
//!
//! - on an overflow, when the hysteresis is used up (`hysteresis` 1, or the count left is 1)
//!   the scale halves, floored at `min_loss_scale`; at the floor already, the run stops with an
//!   error (DeepSpeed's `raise_error_at_min_scale`); otherwise one unit of hysteresis is spent.
//!   The iteration is remembered as the last overflow;
//! - on an overflow-free step, with `consecutive_hysteresis` the hysteresis is refilled; and
//!   when the clean steps since the last overflow, not counting this one
//!   (`cur_iter - last_overflow_iter - 1`, the last overflow at iteration -1 at the start),
//!   are a positive multiple of `loss_scale_window`, the scale doubles, refilling the
//!   hysteresis when not consecutive. With no overflow and a window of 1000, the first
//!   doubling comes on the 1001st update, as in DeepSpeed 0.19.
//!
//! A config with `loss_scale` > 0 gets a static scale that never changes (DeepSpeed's
//! `LossScaler`); its overflows still skip the step.
//!
//! DeepSpeed's stage-0 `FP16_Optimizer` keeps a simpler rule of its own (no hysteresis; it
//! grows after `window` clean steps counted from the step after the last overflow). This
//! scaler applies the ZeRO rule above at every stage.
//!
//! **Where this differs from DeepSpeed.** When an `fp16` section writes none of
//! `initial_scale_power`, `loss_scale_window`, `min_loss_scale`, `hysteresis` and
//! `consecutive_hysteresis`, DeepSpeed's ZeRO optimizers start at 2^32 with hysteresis 1
//! (DeepSpeed issues #697 and #931: the first 16 steps are skipped while it comes down).
//! Here the documented defaults always apply: 2^16, window 1000, hysteresis 2, minimum 1.

use serde::{Deserialize, Serialize};

use crate::config::Fp16Config;
use crate::{DeepSpeedError, Result};

/// The scaler's settings: DeepSpeed's `DynamicLossScaler` constructor arguments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaleSettings {
    /// The first scale.
    pub init_scale: f64,
    /// What an overflow divides the scale by, and a stable window multiplies it by (2).
    pub scale_factor: f64,
    /// Overflow-free steps, counted from the last overflow, between two growths.
    pub scale_window: u64,
    /// The smallest scale.
    pub min_scale: f64,
    /// Overflows absorbed before the scale shrinks (DeepSpeed's `delayed_shift`,
    /// the config's `hysteresis`).
    pub hysteresis: u32,
    /// Refill the hysteresis on every overflow-free step, not only when the scale grows.
    pub consecutive_hysteresis: bool,
    /// An overflow at the minimum scale, with no hysteresis left, is an error.
    pub raise_error_at_min_scale: bool,
}

impl LossScaleSettings {
    /// The dynamic settings of an `fp16` section (its `loss_scale` aside).
    pub fn from_config(c: &Fp16Config) -> Result<Self> {
        validate(c)?;
        Ok(Self {
            init_scale: 2f64.powi(c.initial_scale_power as i32),
            scale_factor: 2.0,
            scale_window: c.loss_scale_window,
            min_scale: c.min_loss_scale,
            hysteresis: c.hysteresis,
            consecutive_hysteresis: c.consecutive_hysteresis,
            raise_error_at_min_scale: true,
        })
    }
}

/// Refuses `fp16` values no scaler can run with, naming the key.
pub fn validate(c: &Fp16Config) -> Result<()> {
    let bad = |key: &str, message: String| {
        Err(DeepSpeedError::InvalidValue {
            path: format!("fp16.{key}"),
            message,
        })
    };
    // The scale multiplies an f32 loss: it must be a finite f32 (3.4e38 at most).
    let fits_f32 = |v: f64| (v as f32).is_finite() && (v == 0.0 || v as f32 > 0.0);
    if !(c.loss_scale >= 0.0 && fits_f32(c.loss_scale)) {
        return bad(
            "loss_scale",
            format!(
                "must be 0 (dynamic) or a static scale > 0 that fits an f32 (at most 3.4e38), \
                 found {}",
                c.loss_scale
            ),
        );
    }
    if c.initial_scale_power > 126 {
        return bad(
            "initial_scale_power",
            format!(
                "2^{} does not fit an f32; at most 126",
                c.initial_scale_power
            ),
        );
    }
    if c.loss_scale_window == 0 {
        return bad("loss_scale_window", "must be at least 1, found 0".into());
    }
    if c.hysteresis == 0 {
        return bad("hysteresis", "must be at least 1, found 0".into());
    }
    if !(c.min_loss_scale > 0.0 && fits_f32(c.min_loss_scale)) {
        return bad(
            "min_loss_scale",
            format!(
                "must be a number > 0 that fits an f32 (at most 3.4e38), found {}",
                c.min_loss_scale
            ),
        );
    }
    Ok(())
}

/// The scaler's position, as a checkpoint holds it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// The current scale.
    pub cur_scale: f64,
    /// Updates made so far.
    pub cur_iter: u64,
    /// The iteration of the last overflow (-1 before any).
    pub last_overflow_iter: i64,
    /// Hysteresis left.
    pub cur_hysteresis: u32,
}

/// DeepSpeed's fp16 loss scaler (see the module docs): dynamic, or static when the config's
/// `loss_scale` is above 0.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    settings: LossScaleSettings,
    dynamic: bool,
    state: LossScalerState,
}

impl DynamicLossScaler {
    /// A dynamic scaler with `settings`.
    pub fn with_settings(settings: LossScaleSettings) -> Self {
        Self {
            settings,
            dynamic: true,
            state: LossScalerState {
                cur_scale: settings.init_scale,
                cur_iter: 0,
                last_overflow_iter: -1,
                cur_hysteresis: settings.hysteresis,
            },
        }
    }

    /// A static scale that [`update`](Self::update) never changes.
    pub fn fixed(scale: f64) -> Self {
        let settings = LossScaleSettings {
            init_scale: scale,
            scale_factor: 1.0,
            scale_window: 1,
            min_scale: scale,
            hysteresis: 1,
            consecutive_hysteresis: false,
            raise_error_at_min_scale: false,
        };
        Self {
            dynamic: false,
            ..Self::with_settings(settings)
        }
    }

    /// The scaler an `fp16` section asks for: static when `loss_scale` > 0, else dynamic.
    pub fn new(config: &Fp16Config) -> Result<Self> {
        let settings = LossScaleSettings::from_config(config)?;
        Ok(if config.loss_scale > 0.0 {
            Self::fixed(config.loss_scale)
        } else {
            Self::with_settings(settings)
        })
    }

    /// The scale to multiply the loss by.
    pub fn scale(&self) -> f32 {
        self.state.cur_scale as f32
    }

    /// Whether the scale adapts to overflows.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic
    }

    /// The scaler's settings.
    pub fn settings(&self) -> &LossScaleSettings {
        &self.settings
    }

    /// Records one optimizer step's outcome: `overflow` when the gradient had an inf or a NaN
    /// (the step is skipped). Errors when the scale is at its minimum already and cannot
    /// shrink (DeepSpeed stops the run there too).
    pub fn update(&mut self, overflow: bool) -> Result<()> {
        if !self.dynamic {
            return Ok(());
        }
        let s = &self.settings;
        let st = &mut self.state;
        if overflow {
            if s.hysteresis == 1 || st.cur_hysteresis == 1 {
                if st.cur_scale == s.min_scale && s.raise_error_at_min_scale {
                    return Err(DeepSpeedError::LossScale(format!(
                        "the gradient overflowed at iteration {} with the scale at its minimum \
                         ({}); it cannot shrink further (lower fp16.min_loss_scale, or train \
                         in bf16)",
                        st.cur_iter, s.min_scale
                    )));
                }
                st.cur_scale = (st.cur_scale / s.scale_factor).max(s.min_scale);
            } else {
                st.cur_hysteresis -= 1;
            }
            st.last_overflow_iter = st.cur_iter as i64;
        } else {
            if s.consecutive_hysteresis {
                st.cur_hysteresis = s.hysteresis;
            }
            let stable = st.cur_iter as i64 - st.last_overflow_iter - 1;
            if stable > 0 && stable % s.scale_window as i64 == 0 {
                if !s.consecutive_hysteresis {
                    st.cur_hysteresis = s.hysteresis;
                }
                st.cur_scale *= s.scale_factor;
            }
        }
        st.cur_iter += 1;
        Ok(())
    }

    /// DeepSpeed's combined divisor for gradients of the scaled loss whose global norm is
    /// `scaled_norm`: the scale, times the clipping factor when `clip` > 0 and the unscaled
    /// norm (plus 1e-6) exceeds it. Dividing by it unscales and clips in one pass.
    pub fn combined_scale(&self, scaled_norm: f64, clip: f64) -> f64 {
        let scale = self.state.cur_scale;
        if clip > 0.0 {
            let factor = (scaled_norm / scale + 1e-6) / clip;
            if factor > 1.0 {
                return factor * scale;
            }
        }
        scale
    }

    /// The scaler's position, for a checkpoint.
    pub fn state(&self) -> LossScalerState {
        self.state
    }

    /// Continues from a checkpoint's position.
    pub fn restore(&mut self, state: LossScalerState) -> Result<()> {
        let valid = state.cur_scale.is_finite()
            && state.cur_scale > 0.0
            && state.last_overflow_iter >= -1
            && state.last_overflow_iter < state.cur_iter as i64 + 1
            && state.cur_hysteresis >= 1
            && state.cur_hysteresis <= self.settings.hysteresis;
        if !valid {
            return Err(DeepSpeedError::LossScale(format!(
                "the saved scaler state {state:?} does not fit this scaler (hysteresis {})",
                self.settings.hysteresis
            )));
        }
        if self.dynamic {
            self.state = state;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(init: f64, window: u64, hysteresis: u32, consecutive: bool) -> LossScaleSettings {
        LossScaleSettings {
            init_scale: init,
            scale_factor: 2.0,
            scale_window: window,
            min_scale: 1.0,
            hysteresis,
            consecutive_hysteresis: consecutive,
            raise_error_at_min_scale: true,
        }
    }

    /// The scale after each update of `pattern` ('O' overflow, '.' clean).
    fn scales(s: LossScaleSettings, pattern: &str) -> Vec<f64> {
        let mut scaler = DynamicLossScaler::with_settings(s);
        pattern
            .chars()
            .map(|c| {
                scaler.update(c == 'O').expect("above the minimum");
                scaler.state().cur_scale
            })
            .collect()
    }

    /// The reference's hand-worked vectors (`deepspeed-algorithms.md` section 4, checked there
    /// against DeepSpeed 0.19.8's own scaler): `O O . . . O . . O O O`, start 16, window 2,
    /// floored at 1 without an error.
    #[test]
    fn the_worked_sequences() {
        let pattern = "OO...O..OOO";
        let floored = |hysteresis| LossScaleSettings {
            raise_error_at_min_scale: false,
            ..settings(16.0, 2, hysteresis, false)
        };
        assert_eq!(
            scales(floored(2), pattern),
            [16., 8., 8., 8., 16., 16., 16., 16., 8., 4., 2.]
        );
        assert_eq!(
            scales(floored(1), pattern),
            [8., 4., 4., 4., 8., 4., 4., 4., 2., 1., 1.]
        );
    }

    /// Tables worked by hand from DeepSpeed's rule, one per behaviour the issue names.
    #[test]
    fn tables_of_overflow_patterns() {
        // No overflow, window 3: doubles on updates 4 and 7 (3 clean steps before each).
        assert_eq!(
            scales(settings(4.0, 3, 2, false), "........."),
            [4., 4., 4., 8., 8., 8., 16., 16., 16.]
        );
        // Every fourth step, window 2, hysteresis 2: one unit of hysteresis absorbs each
        // overflow and the growth between them refills it.
        assert_eq!(
            scales(settings(8.0, 2, 2, false), "...O...O...O"),
            [8., 8., 16., 16., 16., 16., 32., 32., 32., 32., 64., 64.]
        );
        // Every third step: two clean steps never reach a window of 2 (the first clean step
        // after an overflow does not count), so the hysteresis is never refilled.
        assert_eq!(
            scales(settings(8.0, 2, 2, false), "..O..O..O"),
            [8., 8., 8., 8., 8., 4., 4., 4., 2.]
        );
        // A burst of four, hysteresis 3: two absorbed, then halving each time; four clean
        // steps are not yet a window of 4.
        assert_eq!(
            scales(settings(64.0, 4, 3, false), "OOOO....."),
            [64., 64., 32., 16., 16., 16., 16., 16., 32.]
        );
        // Alternating, hysteresis 2, not consecutive: the hysteresis is spent once and only a
        // growth refills it, which a window of 3 never reaches.
        assert_eq!(
            scales(settings(32.0, 3, 2, false), "O.O.O.O."),
            [32., 32., 16., 16., 8., 8., 4., 4.]
        );
        // The same with consecutive hysteresis: every clean step refills it, so every
        // overflow is absorbed.
        assert_eq!(
            scales(settings(32.0, 3, 2, true), "O.O.O.O."),
            [32., 32., 32., 32., 32., 32., 32., 32.]
        );
        // A minimum above 1: the scale floors at 4 and the next overflow at 4 is an error.
        let mut s = settings(16.0, 100, 1, false);
        s.min_scale = 4.0;
        assert_eq!(scales(s, "OO"), [8., 4.]);
        let mut scaler = DynamicLossScaler::with_settings(s);
        for _ in 0..2 {
            scaler.update(true).expect("above the minimum");
        }
        let e = scaler.update(true).expect_err("at the minimum");
        assert!(e.to_string().contains("minimum (4)"), "{e}");
        // A minimum that is not a power of two: 12 -> 6 -> 5 (floored), then an error.
        let mut s = settings(12.0, 100, 1, false);
        s.min_scale = 5.0;
        assert_eq!(scales(s, "OO"), [6., 5.]);
    }

    /// With no overflow and window 1000, the first doubling comes on the 1001st update.
    #[test]
    fn the_first_growth_comes_after_a_full_window() {
        let mut scaler = DynamicLossScaler::with_settings(settings(65536.0, 1000, 2, false));
        for i in 1..=1001 {
            scaler.update(false).expect("no overflow");
            let want = if i < 1001 { 65536.0 } else { 131072.0 };
            assert_eq!(scaler.scale(), want, "after update {i}");
        }
    }

    /// A 10% random pattern against a second, literal transcription of the rule (integers
    /// for the iterations, as Python's), for windows 1-5, hysteresis 1-3, consecutive on and
    /// off.
    #[test]
    fn random_overflows_follow_the_rule() {
        // SplitMix64, for a fixed pattern.
        let mut seed = 11u64;
        let mut next_f64 = move || {
            seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        for window in 1..=5 {
            for hysteresis in 1..=3 {
                for consecutive in [false, true] {
                    let s = settings(2f64.powi(20), window, hysteresis, consecutive);
                    let mut scaler = DynamicLossScaler::with_settings(s);
                    let (mut scale, mut it, mut last, mut hyst) =
                        (s.init_scale, 0i64, -1i64, hysteresis);
                    for _ in 0..400 {
                        let overflow = next_f64() < 0.1;
                        scaler.update(overflow).expect("far above the minimum");
                        if overflow {
                            if hysteresis == 1 || hyst == 1 {
                                scale = f64::max(scale / 2.0, 1.0);
                            } else {
                                hyst -= 1;
                            }
                            last = it;
                        } else {
                            if consecutive {
                                hyst = hysteresis;
                            }
                            let stable = it - last - 1;
                            if stable > 0 && stable % window as i64 == 0 {
                                if !consecutive {
                                    hyst = hysteresis;
                                }
                                scale *= 2.0;
                            }
                        }
                        it += 1;
                        let st = scaler.state();
                        assert_eq!(
                            (
                                st.cur_scale,
                                st.cur_iter as i64,
                                st.last_overflow_iter,
                                st.cur_hysteresis
                            ),
                            (scale, it, last, hyst),
                            "window {window}, hysteresis {hysteresis}, consecutive {consecutive}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_static_scale_never_moves() {
        let (c, _) = crate::DeepSpeedConfig::from_json_str(
            r#"{"fp16": {"enabled": true, "loss_scale": 128}}"#,
        )
        .expect("valid");
        let mut scaler = DynamicLossScaler::new(&c.fp16).expect("valid");
        assert!(!scaler.is_dynamic());
        for overflow in [true, true, false, true] {
            scaler.update(overflow).expect("static");
        }
        assert_eq!(scaler.scale(), 128.0);
    }

    #[test]
    fn the_config_defaults_and_refusals() {
        let (c, _) =
            crate::DeepSpeedConfig::from_json_str(r#"{"fp16": {"enabled": true}}"#).expect("valid");
        let scaler = DynamicLossScaler::new(&c.fp16).expect("valid");
        assert!(scaler.is_dynamic());
        assert_eq!(scaler.scale(), 65536.0);
        assert_eq!(scaler.settings().hysteresis, 2);
        assert_eq!(scaler.settings().scale_window, 1000);
        for (extra, key) in [
            (r#""loss_scale": -1"#, "fp16.loss_scale"),
            (r#""initial_scale_power": 200"#, "fp16.initial_scale_power"),
            (r#""loss_scale_window": 0"#, "fp16.loss_scale_window"),
            (r#""hysteresis": 0"#, "fp16.hysteresis"),
            (r#""min_loss_scale": 0"#, "fp16.min_loss_scale"),
            // Finite in f64, infinite (or 0) in the f32 the scale multiplies.
            (r#""loss_scale": 1e39"#, "fp16.loss_scale"),
            (r#""loss_scale": 1e-50"#, "fp16.loss_scale"),
            (r#""min_loss_scale": 1e39"#, "fp16.min_loss_scale"),
        ] {
            let (c, _) = crate::DeepSpeedConfig::from_json_str(&format!(
                r#"{{"fp16": {{"enabled": true, {extra}}}}}"#
            ))
            .expect("parses");
            let e = DynamicLossScaler::new(&c.fp16)
                .expect_err(extra)
                .to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
    }

    #[test]
    fn unscaling_and_clipping_fold_into_one_divisor() {
        let scaler = DynamicLossScaler::with_settings(settings(1024.0, 10, 2, false));
        // Unscaled norm 0.5 under a clip of 1: the divisor is the scale alone.
        assert_eq!(scaler.combined_scale(512.0, 1.0), 1024.0);
        // Unscaled norm 4 under a clip of 1: the scale times (4 + 1e-6).
        let d = scaler.combined_scale(4096.0, 1.0);
        assert!((d - 1024.0 * (4.0 + 1e-6)).abs() < 1e-9, "{d}");
        // No clipping.
        assert_eq!(scaler.combined_scale(4096.0, 0.0), 1024.0);
    }

    #[test]
    fn the_state_round_trips_and_bad_states_are_refused() {
        let mut a = DynamicLossScaler::with_settings(settings(256.0, 3, 2, false));
        for overflow in [true, false, true, true, false] {
            a.update(overflow).expect("above the minimum");
        }
        let mut b = DynamicLossScaler::with_settings(settings(256.0, 3, 2, false));
        b.restore(a.state()).expect("valid");
        for overflow in [false, false, true, false, false, false] {
            a.update(overflow).expect("ok");
            b.update(overflow).expect("ok");
            assert_eq!(a.state(), b.state());
        }
        let mut bad = a.state();
        bad.cur_scale = f64::NAN;
        assert!(b.restore(bad).is_err());
        let mut bad = a.state();
        bad.cur_hysteresis = 5;
        assert!(b.restore(bad).is_err());
    }
}
