//! Admission control per API key: requests per minute (counted in jobs: a
//! request of n choices or of many embedding batches is that many jobs on
//! the network), tokens per minute and a lifetime token budget, answered at once with 429 + Retry-After
//! (never queued). Token use is reserved at admission with an estimate
//! (prompt bytes / 4 + the requested completion budget) and settled with the
//! metered count when the request ends.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::error::ApiError;
use crate::keys::KeyRecord;

const MINUTE_MS: u64 = 60_000;

#[derive(Debug, Default)]
struct Window {
    /// (admitted at, ticket id, tokens, jobs) in the last minute.
    events: VecDeque<(u64, u64, u64, u32)>,
    /// Tokens metered over the key's life (loaded from usage records once).
    spent: Option<u64>,
    /// Estimates of admitted requests not yet settled.
    reserved: u64,
}

/// One admitted request, to settle when it ends.
#[derive(Debug)]
pub struct Ticket {
    key_id: String,
    id: u64,
    estimate: u64,
}

/// Per-key limits.
#[derive(Debug, Default)]
pub struct Limiter {
    windows: Mutex<HashMap<String, Window>>,
    next: std::sync::atomic::AtomicU64,
}

impl Limiter {
    /// Admits a request of `jobs` jobs and `estimate` tokens for `key` at
    /// `now_ms`, or says why not. `spent` reads the key's metered lifetime use the first time
    /// a budgeted key is seen (after a restart, from its usage records).
    pub fn admit(
        &self,
        key: &KeyRecord,
        estimate: u64,
        jobs: u32,
        now_ms: u64,
        spent: impl FnOnce() -> u64,
    ) -> Result<Ticket, ApiError> {
        let mut all = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        let w = all.entry(key.id.clone()).or_default();
        while w.events.front().is_some_and(|e| e.0 + MINUTE_MS <= now_ms) {
            w.events.pop_front();
        }
        let retry = |w: &Window| {
            w.events.front().map_or(1, |e| (e.0 + MINUTE_MS).saturating_sub(now_ms).div_ceil(1000))
        };
        if let Some(rpm) = key.rpm {
            let used = w.events.iter().fold(0u64, |a, e| a.saturating_add(u64::from(e.3)));
            if used.saturating_add(u64::from(jobs)) > u64::from(rpm) {
                return Err(ApiError::rate_limited(
                    "rate_limit_exceeded",
                    format!(
                        "Rate limit reached: {rpm} requests per minute for this key ({used} \
                         used, this request is {jobs} jobs)."
                    ),
                    retry(w),
                ));
            }
        }
        if let Some(tpm) = key.tpm {
            let used = w.events.iter().fold(0u64, |a, e| a.saturating_add(e.2));
            if used > 0 && used.saturating_add(estimate) > tpm {
                return Err(ApiError::rate_limited(
                    "rate_limit_exceeded",
                    format!(
                        "Rate limit reached: {tpm} tokens per minute for this key ({used} used, \
                         this request may use {estimate})."
                    ),
                    retry(w),
                ));
            }
        }
        if let Some(budget) = key.budget_tokens {
            let spent = *w.spent.get_or_insert_with(spent);
            if spent.saturating_add(w.reserved).saturating_add(estimate) > budget {
                // A budget does not refill: retrying later helps only once
                // in-flight requests settle below their estimates.
                return Err(ApiError::rate_limited(
                    "insufficient_quota",
                    format!(
                        "This key's token budget of {budget} is exhausted ({spent} used, {} \
                         reserved by requests in flight, this request may use {estimate}).",
                        w.reserved
                    ),
                    60,
                ));
            }
        }
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        w.events.push_back((now_ms, id, estimate, jobs));
        w.reserved = w.reserved.saturating_add(estimate);
        Ok(Ticket { key_id: key.id.clone(), id, estimate })
    }

    /// Admits a batch request: only the key's budget applies (its
    /// per-minute windows are left to interactive requests).
    pub fn admit_budget(
        &self,
        key: &KeyRecord,
        estimate: u64,
        spent: impl FnOnce() -> u64,
    ) -> Result<Ticket, ApiError> {
        let mut all = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        let w = all.entry(key.id.clone()).or_default();
        if let Some(budget) = key.budget_tokens {
            let spent = *w.spent.get_or_insert_with(spent);
            if spent.saturating_add(w.reserved).saturating_add(estimate) > budget {
                return Err(ApiError::rate_limited(
                    "insufficient_quota",
                    format!("This key's token budget of {budget} is exhausted ({spent} used)."),
                    60,
                ));
            }
        }
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        w.reserved = w.reserved.saturating_add(estimate);
        Ok(Ticket { key_id: key.id.clone(), id, estimate })
    }

    /// The request ended having used `actual` tokens.
    pub fn settle(&self, ticket: Ticket, actual: u64) {
        let mut all = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        let Some(w) = all.get_mut(&ticket.key_id) else { return };
        if let Some(e) = w.events.iter_mut().find(|e| e.1 == ticket.id) {
            e.2 = actual;
        }
        w.reserved = w.reserved.saturating_sub(ticket.estimate);
        if let Some(s) = w.spent.as_mut() {
            *s = s.saturating_add(actual);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn key(rpm: Option<u32>, tpm: Option<u64>, budget: Option<u64>) -> KeyRecord {
        KeyRecord {
            id: "key_1".into(),
            hash: String::new(),
            prefix: String::new(),
            tenant_id: "t".into(),
            project_id: "p".into(),
            models: vec![],
            routing: vec![],
            rpm,
            tpm,
            budget_tokens: budget,
            first_token_timeout_ms: None,
            idle_timeout_ms: None,
            wall_timeout_ms: None,
            created_at_ms: 0,
            expires_at_ms: None,
            revoked_at_ms: None,
        }
    }

    #[test]
    fn requests_per_minute_slide() {
        let l = Limiter::default();
        let k = key(Some(2), None, None);
        l.admit(&k, 1, 1, 0, || 0).unwrap();
        l.admit(&k, 1, 1, 10_000, || 0).unwrap();
        let e = l.admit(&k, 1, 1, 20_000, || 0).unwrap_err();
        assert_eq!(e.status.as_u16(), 429);
        assert_eq!(e.retry_after, Some(40));
        l.admit(&k, 1, 1, 60_000, || 0).unwrap();
    }

    #[test]
    fn requests_per_minute_count_jobs() {
        let l = Limiter::default();
        let k = key(Some(5), None, None);
        l.admit(&k, 1, 3, 0, || 0).unwrap();
        let e = l.admit(&k, 1, 3, 1, || 0).unwrap_err();
        assert_eq!(e.code, "rate_limit_exceeded", "3 + 3 jobs > 5");
        l.admit(&k, 1, 2, 2, || 0).unwrap();
        assert!(l.admit(&k, 1, 1, 3, || 0).is_err());
    }

    #[test]
    fn tokens_per_minute_count_settled_use() {
        let l = Limiter::default();
        let k = key(None, Some(100), None);
        let t = l.admit(&k, 90, 1, 0, || 0).unwrap();
        assert!(l.admit(&k, 20, 1, 1, || 0).is_err());
        l.settle(t, 10);
        l.admit(&k, 20, 1, 2, || 0).unwrap();
    }

    #[test]
    fn batch_requests_leave_the_windows_alone_but_spend_the_budget() {
        let l = Limiter::default();
        let k = key(Some(1), Some(10), Some(100));
        for _ in 0..5 {
            let t = l.admit_budget(&k, 10, || 0).unwrap();
            l.settle(t, 10);
        }
        l.admit(&k, 5, 1, 0, || unreachable!()).unwrap();
        assert!(l.admit_budget(&k, 50, || 0).is_err(), "50 spent + 5 reserved + 50 > 100");
    }

    #[test]
    fn a_budget_counts_past_use_and_in_flight_reservations() {
        let l = Limiter::default();
        let k = key(None, None, Some(100));
        let t = l.admit(&k, 30, 1, 0, || 50).unwrap();
        let e = l.admit(&k, 30, 1, 1, || unreachable!()).unwrap_err();
        assert_eq!(e.code, "insufficient_quota");
        l.settle(t, 5);
        l.admit(&k, 40, 1, 2, || unreachable!()).unwrap();
        assert!(l.admit(&k, 10, 1, 3, || 0).is_err(), "55 spent + 40 reserved + 10 > 100");
    }
}
