//! What a run's model states take, measured and estimated: the meter the regimes report
//! their bytes through, the heap counter behind activation peaks, a caching host allocator,
//! and DeepSpeed's `estimate_zero*_model_states_mem_needs`.

pub mod caching;
pub mod estimate;
pub mod heap;
mod meter;

pub use estimate::*;
pub use meter::*;
