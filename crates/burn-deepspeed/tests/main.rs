//! This crate's integration tests in one binary (one link), one module per file;
//! `scripts/test.sh` runs each module in a process of its own.

mod config_fuzz;
