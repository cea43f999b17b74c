//! The optimizers a `ds_config.json` names, built for the regimes: Burn's optimizers for whole
//! modules, the partitioned kinds for ZeRO's flat slices, and the 1-bit optimizers.

mod build;
mod onebit;

pub use build::*;
pub use onebit::*;
