//! Hybrid logical clock: wall-clock milliseconds plus a logical counter, so
//! causally later writes always carry larger timestamps even when clocks
//! disagree, while staying close to real time. Time is an input.

use serde::{Deserialize, Serialize};

use crate::error::KeyspaceError;

/// An HLC timestamp; ordered by wall time, then logical counter.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct Hlc {
    /// Milliseconds since the Unix epoch.
    pub wall_ms: u64,
    /// Tie-breaking counter within one millisecond.
    pub logical: u32,
}

/// A node's clock.
#[derive(Debug, Clone)]
pub struct HlcClock {
    last: Hlc,
    max_drift_ms: u64,
}

impl HlcClock {
    /// A clock that refuses remote timestamps more than `max_drift_ms` ahead.
    pub fn new(max_drift_ms: u64) -> Self {
        Self { last: Hlc::default(), max_drift_ms }
    }

    /// The timestamp for a local event at physical time `now_ms`.
    pub fn tick(&mut self, now_ms: u64) -> Hlc {
        let next = if now_ms > self.last.wall_ms {
            Hlc { wall_ms: now_ms, logical: 0 }
        } else {
            Hlc { wall_ms: self.last.wall_ms, logical: self.last.logical.saturating_add(1) }
        };
        self.last = next;
        next
    }

    /// Folds in a remote timestamp so later local ticks exceed it. A remote
    /// clock too far ahead is refused rather than dragging ours forward.
    pub fn observe(&mut self, remote: Hlc, now_ms: u64) -> Result<(), KeyspaceError> {
        if remote.wall_ms > now_ms.saturating_add(self.max_drift_ms) {
            return Err(KeyspaceError::ClockDrift { remote_ms: remote.wall_ms, now_ms });
        }
        if remote > self.last {
            self.last = remote;
        }
        Ok(())
    }

    /// The last timestamp issued or observed.
    pub fn last(&self) -> Hlc {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_strictly_increasing_even_when_wall_clock_goes_back() {
        let mut c = HlcClock::new(1000);
        let a = c.tick(100);
        let b = c.tick(90);
        let d = c.tick(100);
        assert!(a < b && b < d);
        assert_eq!(c.tick(200), Hlc { wall_ms: 200, logical: 0 });
    }

    #[test]
    fn observe_moves_past_remote_and_refuses_far_future() {
        let mut c = HlcClock::new(1000);
        c.observe(Hlc { wall_ms: 500, logical: 7 }, 100).unwrap();
        assert!(c.tick(100) > Hlc { wall_ms: 500, logical: 7 });
        assert!(matches!(
            c.observe(Hlc { wall_ms: 5000, logical: 0 }, 100),
            Err(KeyspaceError::ClockDrift { .. })
        ));
    }
}
