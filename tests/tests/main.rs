//! The integration suite: one test binary (one link of Burn, wgpu and MPI), one module per
//! concern. `scripts/test.sh` runs each module in a process of its own, one group line each.
//! The few tests that use process-wide state (the heap's counters, the environment) are in
//! `process.rs`, a binary of their own.

mod common;

mod book;
mod checkpoint_faults;
mod config_fuzz;
mod consolidate;
mod crash;
mod data_parallel;
mod device;
mod distill;
mod engine_fuzz;
mod faults;
mod grid_checkpoint;
mod inference;
mod learner_strategy;
mod moe;
mod moe_user_model;
mod moq;
mod observability;
mod offload;
mod offload_cgroup;
mod offload_params;
mod onebit;
mod pipeline;
mod precision;
mod profiler;
mod resume_cgroup;
mod sequence;
mod soak;
mod tensor_parallel;
mod tensor_parallel_user_model;
mod zero;
