//! Keyspace replication (specs/network.md): deltas of globally replicated
//! namespaces are gossiped on `gcs.keyspace.deltas`; a late joiner or a node
//! back from a partition catches up by anti-entropy — it sends its
//! per-namespace digests to a peer over a direct stream, and the peer answers
//! with the entries of every namespace whose digest differs. Merge is
//! idempotent and order-free, so over-sending is harmless.
//!
//! After the first exchange with a peer, a node asks only for the peer's
//! delta-log entries after the last one it got (`since`): steady-state
//! anti-entropy then costs what changed, not the size of every namespace
//! that differs. A digest comparison runs on first contact, when the peer's
//! log no longer reaches back that far, or when the cursor is ahead of it.
//!
//! Usage records have tenant-gateway scope: they are gossiped on the
//! tenant's `gcs.usage.<tenant>` topic, which only that tenant's gateways
//! join, and anti-entropy compares one digest per tenant both sides serve.

use gcs_keyspace::{keys, Delta, Digest, Keyspace, KeyspaceError, MergeOutcome, Namespace, Scope};
use serde::{Deserialize, Serialize};

mod authority;
pub mod tenant_digest;

pub use authority::MAX_CLAIMS_PER_JOB;
use authority::{merge_global, record_id};
#[cfg(test)]
use authority::{merge_validated, validate};

/// Most entries answered per namespace in one anti-entropy response.
pub const MAX_ENTRIES_PER_NAMESPACE: usize = 10_000;

/// "Here is what I have": digests of the namespaces both sides replicate.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DigestRequest {
    /// Format version.
    pub version: u8,
    /// (column family name, xor hash, count).
    pub digests: Vec<(String, Vec<u8>, u64)>,
    /// (tenant, digest of its usage records, count) for every tenant the
    /// requester's gateway serves. Absent in requests from older nodes.
    #[serde(default)]
    pub tenants: Vec<(String, Vec<u8>, u64)>,
    /// The responder's log position this requester has everything up to
    /// (from the responder's previous answer); None on first contact.
    #[serde(default)]
    pub since: Option<u64>,
    /// Resume points of a snapshot answered in pages: (column family, last
    /// key received). A request with any is answered from snapshots.
    #[serde(default)]
    pub after: Vec<(String, String)>,
}

/// "Here is what differs."
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DigestResponse {
    /// Format version.
    pub version: u8,
    /// Encoded deltas (keyspace wire form).
    pub deltas: Vec<Vec<u8>>,
    /// Namespaces cut at the per-namespace cap (the requester asks again).
    pub truncated: Vec<String>,
    /// The responder's log position this answer covers: the requester's
    /// next `since`. Absent from older nodes.
    #[serde(default)]
    pub last_seq: Option<u64>,
    /// For each namespace cut at the cap: (column family, last key sent);
    /// the requester asks again with these as `after`.
    #[serde(default)]
    pub resume: Vec<(String, String)>,
    /// The responder had no room for this request (its per-peer rate or
    /// its concurrent answers): nothing else in the answer; ask next round.
    #[serde(default)]
    pub busy: bool,
}

impl DigestResponse {
    /// The answer to a request refused for load.
    pub fn busy() -> Self {
        DigestResponse {
            version: 1,
            deltas: vec![],
            truncated: vec![],
            last_seq: None,
            resume: vec![],
            busy: true,
        }
    }
}

/// Log entries read per answer; a full page means "ask again at once".
pub const LOG_PAGE: usize = 10_000;

/// Encoded delta bytes one answer carries at most: the request-response
/// codec refuses answers over 10 MiB, so a large namespace goes in pages.
pub const RESPONSE_BUDGET: usize = 4 << 20;

/// Namespaces every node replicates.
pub fn global_namespaces() -> impl Iterator<Item = Namespace> {
    Namespace::ALL.iter().copied().filter(|n| n.scope() == Scope::Global)
}

/// The request describing `ks`, with one digest per tenant in `served`.
pub fn digest_request(ks: &Keyspace, served: &[String]) -> Result<DigestRequest, KeyspaceError> {
    let mut digests = vec![];
    for ns in global_namespaces() {
        let d = ks.digest(ns)?;
        digests.push((ns.cf().to_string(), d.hash.to_vec(), d.count));
    }
    let mut tenants = vec![];
    for t in served {
        let (hash, count) = tenant_digest(ks, t)?;
        tenants.push((t.clone(), hash, count));
    }
    Ok(DigestRequest { version: 1, digests, tenants, since: None, after: vec![] })
}

/// Stores a usage record and its entry in the tenant's index
/// (`/gcs/api/jobs_by_tenant/<tenant>/<job>`, 26.23); returns the usage
/// delta, which the caller gossips to the tenant's other gateways. The
/// record is synced to disk before this returns (the index entry first, so
/// the one sync covers both); an error means the job must not be answered.
pub fn record_usage(
    ks: &Keyspace,
    u: &gcs_protocol::UsageRecord,
    now_ms: u64,
) -> Result<Delta, crate::error::NodeError> {
    let bytes = gcs_protocol::encode(u)?;
    let key = keys::usage(&u.job_id);
    let delta = tenant_digest::write(ks, &key, || {
        index_usage(ks, &u.tenant_id, &u.job_id, now_ms)?;
        crate::indexes::index_usage(ks, u, now_ms)?;
        ks.put_durable(&key, bytes, now_ms)
    })?;
    // Metered: restart recovery no longer needs to end it.
    crate::indexes::close_job(ks, &u.job_id, now_ms)?;
    Ok(delta)
}

/// The index entry is derived locally (an empty register: its own CRDT
/// metadata differs per node, so it is never compared or sent; the tenant
/// digest hashes the usage records it points to).
fn index_usage(ks: &Keyspace, tenant: &str, job: &str, now_ms: u64) -> Result<(), KeyspaceError> {
    if !crate::topics::valid_tenant(tenant) {
        tracing::warn!(tenant, job, "tenant id cannot be indexed; usage record kept unindexed");
        return Ok(());
    }
    let key = keys::job_of_tenant(tenant, job);
    if ks.get(&key)?.is_none() {
        ks.put(&key, vec![], now_ms)?;
    }
    Ok(())
}

/// The usage deltas of one tenant, oldest job id first (ids are ULIDs).
fn tenant_deltas(ks: &Keyspace, tenant: &str) -> Result<Vec<Delta>, KeyspaceError> {
    let prefix = keys::jobs_of_tenant(tenant);
    let mut out = vec![];
    for (key, _) in ks.scan_prefix(&prefix)? {
        let key = keys::usage(&key[prefix.len()..]);
        if let Some(value) = ks.get(&key)? {
            out.push(Delta { key, value });
        }
    }
    Ok(out)
}

/// Digest of a tenant's usage records: equal on two replicas exactly when
/// they hold the same records with the same CRDT state. Maintained on every
/// usage write (`tenant_digest`), so a round costs no scan.
pub fn tenant_digest(ks: &Keyspace, tenant: &str) -> Result<(Vec<u8>, u64), KeyspaceError> {
    let d = tenant_digest::get(ks, tenant)?;
    Ok((d.hash.to_vec(), d.count))
}

pub use crate::error::RefusedDelta;

fn misfiled(m: &gcs_protocol::Message, key: &str) -> RefusedDelta {
    RefusedDelta::Misfiled {
        message_type: m.message_type(),
        id: record_id(m).unwrap_or_default().to_string(),
        key: key.chars().take(120).collect(),
    }
}

/// Checks a usage delta from a peer: a signed usage record, stored under
/// its own job id, of a tenant this node's gateway serves.
fn validate_usage(
    delta: &Delta,
    served: &[String],
) -> Result<(gcs_protocol::UsageRecord, String, String), RefusedDelta> {
    let Some(bytes) = delta.value.as_register().and_then(|r| r.value()) else {
        return Err(RefusedDelta::UsageDeleted);
    };
    let limits = gcs_protocol::Limits { max_message_bytes: 64 * 1024, ..Default::default() };
    let m = gcs_protocol::decode(bytes, &limits)?;
    m.verify()?;
    let gcs_protocol::Message::UsageRecord(u) = m else {
        return Err(RefusedDelta::NotUsage);
    };
    if delta.key != keys::usage(&u.job_id) {
        return Err(misfiled(&gcs_protocol::Message::UsageRecord(u), &delta.key));
    }
    if !served.contains(&u.tenant_id) {
        return Err(RefusedDelta::TenantNotServed(u.tenant_id));
    }
    let (tenant, job) = (u.tenant_id.clone(), u.job_id.clone());
    Ok((u, tenant, job))
}

/// Validates and merges one encoded delta of any scope this node takes
/// from peers: global namespaces, and usage records of the tenants in
/// `served`.
pub fn merge_scoped(
    ks: &Keyspace,
    d: Delta,
    served: &[String],
    trust: &crate::tenants::TenantTrust,
    now_ms: u64,
) -> Result<MergeOutcome, RefusedDelta> {
    let ns = Namespace::of_key(&d.key)?;
    if matches!(authority::authority(ns), authority::Authority::Processing) {
        return crate::processing::records::merge(ks, d, trust, now_ms);
    }
    if ns != Namespace::ApiUsage {
        return merge_global(ks, d, now_ms);
    }
    use crate::tenants::records::{authorise_usage, refused};
    let (u, tenant, job) = validate_usage(&d, served).map_err(|e| refused(trust, e, None))?;
    authorise_usage(ks, &u, trust, now_ms).map_err(|e| refused(trust, e, Some(&u)))?;
    let key = d.key.clone();
    let out = tenant_digest::write(ks, &key, || -> Result<MergeOutcome, KeyspaceError> {
        let out = ks.merge(d, now_ms)?;
        index_usage(ks, &tenant, &job, now_ms)?;
        Ok(out)
    })?;
    if matches!(out, MergeOutcome::Changed(_)) {
        crate::indexes::index_stored_usage(ks, &job, now_ms)?;
    }
    Ok(out)
}

/// The answer of `ks` to a peer's digests. Usage records go only for the
/// tenants both sides serve.
pub fn answer(
    ks: &Keyspace,
    req: &DigestRequest,
    served: &[String],
) -> Result<DigestResponse, KeyspaceError> {
    // Tenants whose usage both sides keep.
    let shared: Vec<String> =
        req.tenants.iter().map(|(t, _, _)| t.clone()).filter(|t| served.contains(t)).collect();
    if let Some(since) = req.since.filter(|s| *s <= ks.last_seq() && req.after.is_empty()) {
        if let gcs_keyspace::Since::Deltas(page) = ks.deltas_since(since, LOG_PAGE)? {
            let mut full = page.len() == LOG_PAGE;
            let (mut last, mut bytes, mut deltas) = (since, 0usize, vec![]);
            for (seq, d) in page {
                if in_scope(&d, &shared) {
                    let e = d.encode();
                    if bytes + e.len() > RESPONSE_BUDGET && !deltas.is_empty() {
                        full = true;
                        break;
                    }
                    bytes += e.len();
                    deltas.push(e);
                }
                last = seq;
            }
            // A full page: the requester asks again from `last`.
            let truncated = if full { vec!["log".to_string()] } else { vec![] };
            return Ok(DigestResponse {
                version: 1,
                deltas,
                truncated,
                last_seq: Some(last),
                resume: vec![],
                busy: false,
            });
        }
    }
    // Read before the snapshots: whatever is logged after it comes next
    // time. A later page reports none: the requester keeps the first
    // page's position, so changes under keys already paged are not lost.
    let last_seq = req.after.is_empty().then(|| ks.last_seq());
    let mut deltas = vec![];
    let mut truncated = vec![];
    let mut resume = vec![];
    let mut bytes = 0usize;
    for ns in global_namespaces() {
        let mine = ks.digest(ns)?;
        let theirs =
            req.digests.iter().find(|(cf, _, _)| cf == ns.cf()).map(|(_, h, c)| (h.as_slice(), *c));
        if theirs == Some((mine.hash.as_slice(), mine.count)) || mine == Digest::default() {
            continue;
        }
        let after = req.after.iter().find(|(cf, _)| cf == ns.cf()).map(|(_, k)| k.as_str());
        // Up to the per-namespace cap and the byte budget, read from an
        // iterator at `after`; the rest on the next page, after the last key
        // sent ("" = from the start).
        let after = after.filter(|a| !a.is_empty());
        if bytes >= RESPONSE_BUDGET {
            truncated.push(ns.cf().to_string());
            resume.push((ns.cf().to_string(), after.unwrap_or_default().to_string()));
            continue;
        }
        let (page, more) =
            ks.snapshot_page(ns, after, MAX_ENTRIES_PER_NAMESPACE, RESPONSE_BUDGET - bytes)?;
        let mut last_key = after.map(str::to_string);
        for d in page {
            let e = d.encode();
            bytes += e.len();
            last_key = Some(d.key);
            deltas.push(e);
        }
        if more {
            truncated.push(ns.cf().to_string());
            resume.push((ns.cf().to_string(), last_key.unwrap_or_default()));
        }
    }
    for (tenant, hash, count) in &req.tenants {
        if !served.contains(tenant) || !req.after.is_empty() {
            continue;
        }
        let (mine, n) = tenant_digest(ks, tenant)?;
        if (mine.as_slice(), n) == (hash.as_slice(), *count) || n == 0 {
            continue;
        }
        // Newest first: the cap keeps the records a budget check needs
        // most (not marked truncated: asking again would get the same).
        for d in tenant_deltas(ks, tenant)?.into_iter().rev().take(MAX_ENTRIES_PER_NAMESPACE) {
            if bytes >= RESPONSE_BUDGET {
                break;
            }
            let e = d.encode();
            bytes += e.len();
            deltas.push(e);
        }
    }
    Ok(DigestResponse { version: 1, deltas, truncated, last_seq, resume, busy: false })
}

/// Whether a logged delta goes to a peer: global namespaces, and usage
/// records of the tenants both serve.
fn in_scope(d: &Delta, shared: &[String]) -> bool {
    match Namespace::of_key(&d.key) {
        Ok(Namespace::ApiUsage) => validate_usage(d, shared).is_ok(),
        Ok(ns) => ns.scope() == Scope::Global,
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests;
