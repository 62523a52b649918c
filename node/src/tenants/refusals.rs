//! Usage records refused from peers, by reason: `gcs_usage_refused_total`
//! on /metrics (a fixed label set, so a peer cannot grow it).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::RefusedDelta;

/// Why a usage record from a peer was refused (the metric's `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UsageRefusal {
    /// A deletion: a usage record is never deleted by a peer.
    Tombstone,
    /// Undecodable, a bad signature, or another message than a usage record.
    Envelope,
    /// Filed under another job's key.
    Misfiled,
    /// Of a tenant this gateway does not serve.
    TenantNotServed,
    /// Of a tenant whose membership key this gateway does not hold.
    TenantUntrusted,
    /// Signed by a gateway without a live `tenant_gateway` certificate.
    GatewayNotAdmitted,
    /// For an API key of another tenant.
    ForeignKey,
    /// Its clock out of bounds (too far ahead, counter too large).
    Clock,
    /// The peer is over its delta quota.
    Quota,
    /// Anything else (the store failed).
    Other,
}

impl UsageRefusal {
    /// Every reason, in metric order.
    pub const ALL: [UsageRefusal; 10] = [
        UsageRefusal::Tombstone,
        UsageRefusal::Envelope,
        UsageRefusal::Misfiled,
        UsageRefusal::TenantNotServed,
        UsageRefusal::TenantUntrusted,
        UsageRefusal::GatewayNotAdmitted,
        UsageRefusal::ForeignKey,
        UsageRefusal::Clock,
        UsageRefusal::Quota,
        UsageRefusal::Other,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            UsageRefusal::Tombstone => "tombstone",
            UsageRefusal::Envelope => "envelope",
            UsageRefusal::Misfiled => "misfiled",
            UsageRefusal::TenantNotServed => "tenant_not_served",
            UsageRefusal::TenantUntrusted => "tenant_untrusted",
            UsageRefusal::GatewayNotAdmitted => "gateway_not_admitted",
            UsageRefusal::ForeignKey => "foreign_key",
            UsageRefusal::Clock => "clock",
            UsageRefusal::Quota => "quota",
            UsageRefusal::Other => "other",
        }
    }

    /// The reason of a refused usage delta.
    pub fn of(e: &RefusedDelta) -> Self {
        match e {
            RefusedDelta::UsageDeleted | RefusedDelta::Tombstone => UsageRefusal::Tombstone,
            RefusedDelta::Envelope(_)
            | RefusedDelta::NotUsage
            | RefusedDelta::WrongType { .. }
            | RefusedDelta::NotTheAuthor(_) => UsageRefusal::Envelope,
            RefusedDelta::Misfiled { .. } => UsageRefusal::Misfiled,
            RefusedDelta::TenantNotServed(_) => UsageRefusal::TenantNotServed,
            RefusedDelta::TenantUntrusted(_) => UsageRefusal::TenantUntrusted,
            RefusedDelta::GatewayNotAdmitted(_) => UsageRefusal::GatewayNotAdmitted,
            RefusedDelta::ForeignKey(_) => UsageRefusal::ForeignKey,
            _ => UsageRefusal::Other,
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|r| *r == self).unwrap_or(Self::ALL.len() - 1)
    }
}

/// One counter per [`UsageRefusal`].
#[derive(Debug, Default)]
pub struct UsageRefusals([AtomicU64; UsageRefusal::ALL.len()]);

impl UsageRefusals {
    /// Counts one refusal; returns the total so far.
    pub fn count(&self, why: UsageRefusal) -> u64 {
        self.0[why.index()].fetch_add(1, Ordering::Relaxed);
        self.total()
    }

    /// Refusals of one reason.
    pub fn of(&self, why: UsageRefusal) -> u64 {
        self.0[why.index()].load(Ordering::Relaxed)
    }

    /// Refusals of every reason.
    pub fn total(&self) -> u64 {
        self.0.iter().map(|c| c.load(Ordering::Relaxed)).fold(0, u64::saturating_add)
    }

    /// The metric family, every reason listed (zeros too).
    pub fn metrics(&self) -> String {
        let mut out = String::from(
            "# HELP gcs_usage_refused_total Usage records refused from peers, by reason.\n\
             # TYPE gcs_usage_refused_total counter\n",
        );
        for r in UsageRefusal::ALL {
            out.push_str(&format!(
                "gcs_usage_refused_total{{reason=\"{}\"}} {}\n",
                r.as_str(),
                self.of(r)
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_its_own_counter_and_line() {
        let c = UsageRefusals::default();
        assert_eq!(c.count(UsageRefusal::GatewayNotAdmitted), 1);
        assert_eq!(c.count(UsageRefusal::GatewayNotAdmitted), 2);
        assert_eq!(c.count(UsageRefusal::Quota), 3);
        assert_eq!((c.of(UsageRefusal::GatewayNotAdmitted), c.of(UsageRefusal::Other)), (2, 0));
        let text = c.metrics();
        assert!(text.contains("gcs_usage_refused_total{reason=\"gateway_not_admitted\"} 2\n"));
        assert!(text.contains("gcs_usage_refused_total{reason=\"quota\"} 1\n"));
        assert_eq!(text.matches("gcs_usage_refused_total{").count(), UsageRefusal::ALL.len());
        let labels: std::collections::BTreeSet<_> =
            UsageRefusal::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), UsageRefusal::ALL.len(), "distinct labels");
        assert_eq!(UsageRefusal::of(&RefusedDelta::UsageDeleted), UsageRefusal::Tombstone);
        assert_eq!(
            UsageRefusal::of(&RefusedDelta::ForeignKey("k".into())),
            UsageRefusal::ForeignKey
        );
    }
}
