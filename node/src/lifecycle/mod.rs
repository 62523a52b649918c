//! Job lifecycle rules (26.12–26.19) as sans-IO state machines: events in,
//! verdicts out, time as an input. The network wiring comes with the
//! lifecycle issue; these are the rules it will run.

pub mod claims;
pub mod fence;
pub mod penalty;
pub mod tracker;
