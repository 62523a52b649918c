//! The `gcs-node` subcommands and the run of a node; `main.rs` keeps the
//! top-level command line and the process setup.

pub mod args;
pub mod batches;
pub mod gpu_check;
pub mod keys;
pub mod models;
pub mod run;
