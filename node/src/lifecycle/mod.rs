//! Job lifecycle rules (26.12–26.19) as sans-IO state machines: events in,
//! verdicts out, time as an input. `jobs/` is the async shell that runs
//! them: the gateway's [`tracker::JobTracker`] (with [`claims`] and
//! [`fence`] inside) and the worker's [`worker_job::WorkerJob`].

pub mod claims;
pub mod fence;
pub mod membership;
pub mod penalty;
pub mod tracker;
pub mod worker_job;
