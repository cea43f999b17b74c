//! Mixed precision: the fp16 loss scaler (and, as they land, the working-dtype casts and the
//! fp32 master weights). See Micikevicius et al., "Mixed Precision Training" (arXiv
//! 1710.03740), and ZeRO (arXiv 1910.02054) §3 for the 2Ψ + 2Ψ + 12Ψ model states it assumes.

mod cast;
mod loss_scaler;

pub use cast::*;
pub use loss_scaler::*;
