//! The processing queue of 26.2 and 26.22 (specs/batch.md, "Processing
//! queue"): [`queue`] is its sans-IO core. Its shell (tasks, subtasks and
//! locks in the keyspace under `/gcs/processing/*`, workers locking
//! subtasks) is not built yet.

pub mod queue;
#[cfg(test)]
mod queue_tests;
