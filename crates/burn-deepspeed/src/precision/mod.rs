//! Mixed precision: the fp16 loss scaler and its scaled backward, and the working-dtype casts
//! (the fp32 master weights live in the [`sync`](crate::sync) regimes). See
//! Micikevicius et al., "Mixed Precision Training" (arXiv 1710.03740), and ZeRO (arXiv 1910.02054) §3 for the 2Ψ + 2Ψ + 12Ψ model states it assumes.

mod backward;
mod cast;
mod loss_scaler;

pub use backward::{backward, current_loss_scale};
pub(crate) use backward::{take_backward_time, unscaled_backward_message, with_loss_scale};
pub use cast::*;
pub use loss_scaler::*;
