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

/// The largest logical counter accepted from a peer. A local clock that
/// reaches it moves its wall time on by a millisecond instead, so a peer
/// that sent `u32::MAX` could never freeze our ticks (a saturated counter
/// would issue the same timestamp twice).
pub const MAX_LOGICAL: u32 = 1 << 20;

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
        } else if self.last.logical >= MAX_LOGICAL {
            Hlc { wall_ms: self.last.wall_ms.saturating_add(1), logical: 0 }
        } else {
            Hlc { wall_ms: self.last.wall_ms, logical: self.last.logical + 1 }
        };
        self.last = next;
        next
    }

    /// Folds in a remote timestamp so later local ticks exceed it. A remote
    /// clock too far ahead, or a logical counter out of bounds, is refused
    /// rather than dragging ours forward.
    pub fn observe(&mut self, remote: Hlc, now_ms: u64) -> Result<(), KeyspaceError> {
        check_remote(remote, now_ms, self.max_drift_ms)?;
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

/// Whether a peer's timestamp is within bounds: wall time at most
/// `max_drift_ms` ahead of `now_ms`, logical counter at most
/// [`MAX_LOGICAL`].
pub fn check_remote(remote: Hlc, now_ms: u64, max_drift_ms: u64) -> Result<(), KeyspaceError> {
    if remote.wall_ms > now_ms.saturating_add(max_drift_ms) {
        return Err(KeyspaceError::ClockDrift { remote_ms: remote.wall_ms, now_ms });
    }
    if remote.logical > MAX_LOGICAL {
        return Err(KeyspaceError::ClockLogical(remote.logical));
    }
    Ok(())
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

    #[test]
    fn a_logical_counter_out_of_bounds_is_refused_and_ours_never_saturates() {
        let mut c = HlcClock::new(1000);
        let huge = Hlc { wall_ms: 100, logical: u32::MAX };
        assert!(matches!(c.observe(huge, 100), Err(KeyspaceError::ClockLogical(_))));
        c.observe(Hlc { wall_ms: 100, logical: MAX_LOGICAL }, 100).unwrap();
        let a = c.tick(100);
        let b = c.tick(100);
        assert!(Hlc { wall_ms: 100, logical: MAX_LOGICAL } < a && a < b, "{a:?} {b:?}");
        assert_eq!(a, Hlc { wall_ms: 101, logical: 0 });
        assert!(check_remote(Hlc { wall_ms: 1131, logical: 0 }, 100, 1030).is_err());
        assert!(check_remote(Hlc { wall_ms: 1130, logical: 0 }, 100, 1030).is_ok());
    }
}
