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
/// delta, which the caller gossips to the tenant's other gateways.
pub fn record_usage(
    ks: &Keyspace,
    u: &gcs_protocol::UsageRecord,
    now_ms: u64,
) -> Result<Delta, crate::error::NodeError> {
    let delta = ks.put(&keys::usage(&u.job_id), gcs_protocol::encode(u)?, now_ms)?;
    index_usage(ks, &u.tenant_id, &u.job_id, now_ms)?;
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
/// they hold the same records with the same CRDT state. O(records of the
/// tenant) per call; see specs/network.md for when that needs a
/// maintained digest instead.
pub fn tenant_digest(ks: &Keyspace, tenant: &str) -> Result<(Vec<u8>, u64), KeyspaceError> {
    let mut h = blake3::Hasher::new();
    let mut n = 0u64;
    for d in tenant_deltas(ks, tenant)? {
        h.update(d.key.as_bytes()).update(&[0]).update(blake3::hash(&d.encode()).as_bytes());
        n += 1;
    }
    Ok((h.finalize().as_bytes().to_vec(), n))
}

/// Why a peer's delta was not merged.
#[derive(Debug, thiserror::Error)]
pub enum RefusedDelta {
    /// Undecodable, an unknown namespace, or the store failed.
    #[error(transparent)]
    Keyspace(#[from] KeyspaceError),
    /// The value is not a valid signed envelope.
    #[error(transparent)]
    Envelope(#[from] gcs_protocol::ProtocolError),
    /// A namespace that never leaves its scope.
    #[error("{0} is not replicated network-wide")]
    NotGlobal(&'static str),
    /// A usage tombstone.
    #[error("a usage record is never deleted")]
    UsageDeleted,
    /// A usage key holding another message.
    #[error("not a usage record")]
    NotUsage,
    /// A valid envelope filed under another record's key.
    #[error("{message_type} for {id} filed under {key}")]
    Misfiled {
        /// The envelope's type.
        message_type: gcs_protocol::MessageType,
        /// The id it names.
        id: String,
        /// The key it came under.
        key: String,
    },
    /// Usage of a tenant this gateway does not serve.
    #[error("this node does not serve tenant {0:?}")]
    TenantNotServed(String),
}

fn misfiled(m: &gcs_protocol::Message, key: &str) -> RefusedDelta {
    use gcs_protocol::Message as M;
    let id = match m {
        M::NodeRegistration(r) => r.node_id.to_string(),
        M::ApiRequestJob(j) => j.job_id.clone(),
        M::JobClaim(c) => c.job_id.clone(),
        M::LeaseGrant(l) => l.job_id.clone(),
        M::Cancellation(c) => c.job_id.clone(),
        M::Requeue(r) => r.job_id.clone(),
        M::UsageRecord(u) => u.job_id.clone(),
        _ => String::new(),
    };
    RefusedDelta::Misfiled { message_type: m.message_type(), id, key: key.chars().take(120).collect() }
}

/// Checks a usage delta from a peer: a signed usage record, stored under
/// its own job id, of a tenant this node's gateway serves.
fn validate_usage(delta: &Delta, served: &[String]) -> Result<(String, String), RefusedDelta> {
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
    Ok((u.tenant_id, u.job_id))
}

/// Validates and merges one encoded delta of any scope this node takes
/// from peers: global namespaces, and usage records of the tenants in
/// `served`.
pub fn merge_scoped(
    ks: &Keyspace,
    bytes: &[u8],
    served: &[String],
    now_ms: u64,
) -> Result<MergeOutcome, RefusedDelta> {
    let d = Delta::decode(bytes)?;
    if Namespace::of_key(&d.key)? != Namespace::ApiUsage {
        return merge_global(ks, d, now_ms);
    }
    let (tenant, job) = validate_usage(&d, served)?;
    let out = ks.merge(d, now_ms)?;
    index_usage(ks, &tenant, &job, now_ms)?;
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
        // Up to the per-namespace cap and the byte budget; the rest on the
        // next page, after the last key sent ("" = from the start).
        let mut last_key = after.map(str::to_string);
        let pending =
            ks.snapshot(ns)?.into_iter().filter(|d| after.is_none_or(|a| d.key.as_str() > a));
        for (sent, d) in pending.enumerate() {
            if sent == MAX_ENTRIES_PER_NAMESPACE || bytes >= RESPONSE_BUDGET {
                truncated.push(ns.cf().to_string());
                resume.push((ns.cf().to_string(), last_key.unwrap_or_default()));
                break;
            }
            let e = d.encode();
            bytes += e.len();
            last_key = Some(d.key);
            deltas.push(e);
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
    Ok(DigestResponse { version: 1, deltas, truncated, last_seq, resume })
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

/// Checks a delta from a peer before merging: only globally replicated
/// namespaces, and values that are protocol envelopes must decode and carry
/// a valid signature (a peer may relay records, never forge them).
pub fn validate(delta: &Delta) -> Result<(), RefusedDelta> {
    let ns = Namespace::of_key(&delta.key)?;
    if ns.scope() != Scope::Global {
        return Err(RefusedDelta::NotGlobal(ns.cf()));
    }
    let signed = matches!(
        ns,
        Namespace::ApiJobs
            | Namespace::ApiClaims
            | Namespace::ApiLeases
            | Namespace::ApiCancel
            | Namespace::ApiRequeue
            | Namespace::NodeRegistrations
            | Namespace::ProcessingLocks
            | Namespace::ProcessingResults
    );
    if !signed {
        return Ok(());
    }
    let limits = gcs_protocol::Limits { max_message_bytes: 1024 * 1024, ..Default::default() };
    // The id the key is filed under (`<prefix><id>[/...]`).
    let key_id = delta.key[ns.prefix().len()..].split('/').next().unwrap_or_default();
    let check = |bytes: &[u8]| -> Result<(), RefusedDelta> {
        let m = gcs_protocol::decode(bytes, &limits)?;
        m.verify()?;
        // A valid envelope filed under another job's or node's key would
        // overwrite that record: the key must name the envelope's own id.
        use gcs_protocol::Message as M;
        let own = match &m {
            M::NodeRegistration(r) => Some(r.node_id.as_str()),
            M::ApiRequestJob(j) => Some(j.job_id.as_str()),
            M::JobClaim(c) => Some(c.job_id.as_str()),
            M::LeaseGrant(l) => Some(l.job_id.as_str()),
            M::Cancellation(c) => Some(c.job_id.as_str()),
            M::Requeue(r) => Some(r.job_id.as_str()),
            _ => None,
        };
        match own {
            Some(id) if id != key_id => Err(misfiled(&m, &delta.key)),
            _ => Ok(()),
        }
    };
    match &delta.value {
        gcs_keyspace::CrdtValue::Register(r) => match r.value() {
            Some(b) => check(b),
            None => Ok(()),
        },
        gcs_keyspace::CrdtValue::Set(s) => s.elements().try_for_each(check),
    }
}

/// Validates and merges one encoded delta of a global namespace.
pub fn merge_validated(
    ks: &Keyspace,
    bytes: &[u8],
    now_ms: u64,
) -> Result<MergeOutcome, RefusedDelta> {
    merge_global(ks, Delta::decode(bytes)?, now_ms)
}

fn merge_global(ks: &Keyspace, d: Delta, now_ms: u64) -> Result<MergeOutcome, RefusedDelta> {
    validate(&d)?;
    if is_older_registration(ks, &d)? {
        return Ok(MergeOutcome::Unchanged);
    }
    Ok(ks.merge(d, now_ms)?)
}

/// A registration register is last-writer-wins by the *writer's* clock, so
/// a peer that re-writes an old (validly signed) registration would roll
/// the node's record back. The record's own heartbeat time decides instead.
fn is_older_registration(ks: &Keyspace, d: &Delta) -> Result<bool, KeyspaceError> {
    if Namespace::of_key(&d.key).ok() != Some(Namespace::NodeRegistrations) {
        return Ok(false);
    }
    let created = |b: &[u8]| {
        gcs_protocol::codec::from_cbor_bytes::<gcs_protocol::NodeRegistration>(b)
            .map(|r| r.heartbeat.created_at_ms)
            .ok()
    };
    let Some(incoming) = d.value.as_register().and_then(|r| r.value()).and_then(created) else {
        return Ok(false);
    };
    let stored = ks.get_bytes(&d.key)?;
    Ok(stored.as_deref().and_then(created).is_some_and(|have| have >= incoming))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gcs_protocol::samples::{self, Params};

    #[test]
    fn forged_or_out_of_scope_deltas_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ks = Keyspace::open(dir.path(), "a", Default::default()).unwrap();
        let (w, _) = samples::keys();
        let mut reg = samples::registration(&w, &Params::default());
        gcs_protocol::sign(&mut reg, &w).unwrap();
        let good = ks
            .put(
                &format!("/gcs/nodes/registrations/{}", reg.node_id),
                gcs_protocol::encode(&reg).unwrap(),
                1,
            )
            .unwrap();
        validate(&good).unwrap();
        reg.queue.current_api_jobs += 1; // tampered after signing
        let bad =
            ks.put("/gcs/nodes/registrations/x", gcs_protocol::encode(&reg).unwrap(), 2).unwrap();
        assert!(validate(&bad).is_err());
        let private = ks.put("/gcs/api/payloads/j", b"secret prompt".to_vec(), 3).unwrap();
        assert!(validate(&private).is_err(), "payloads never replicate network-wide");
        let garbage = ks.put("/gcs/api/leases/j", b"junk".to_vec(), 4).unwrap();
        assert!(validate(&garbage).is_err());
        assert!(merge_validated(&ks, &[1, 2, 3], 5).is_err());
    }

    #[test]
    fn answer_sends_only_differing_namespaces_and_converges() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
        let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
        for i in 0..50u8 {
            a.put(&format!("/gcs/api/states/j{i}"), vec![i], 1000).unwrap();
        }
        a.put("/gcs/local/secret", b"never sent".to_vec(), 1000).unwrap();
        let resp = answer(&a, &digest_request(&b, &[]).unwrap(), &[]).unwrap();
        assert_eq!(resp.deltas.len(), 50);
        for d in &resp.deltas {
            merge_validated(&b, d, 2000).unwrap();
        }
        assert_eq!(
            a.digest(Namespace::ApiJobStates).unwrap(),
            b.digest(Namespace::ApiJobStates).unwrap()
        );
        assert!(
            answer(&a, &digest_request(&b, &[]).unwrap(), &[]).unwrap().deltas.is_empty(),
            "in sync: nothing to send"
        );
        assert_eq!(b.get("/gcs/local/secret").unwrap(), None);
    }

    #[test]
    fn usage_records_go_only_to_the_tenants_gateways_and_converge() {
        let (w, g) = samples::keys();
        let (da, db, dc) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
        let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
        let c = Keyspace::open(dc.path(), "c", Default::default()).unwrap();
        let acme = vec!["tenant_123".to_string()];
        let other = vec!["other".to_string()];
        let mut sent = vec![];
        for i in 0..5 {
            let mut u = samples::usage(&w, &g, &Params::default());
            u.job_id = format!("gcsapi_{i}");
            u.signature = None;
            gcs_protocol::sign(&mut u, &g).unwrap();
            sent.push(record_usage(&a, &u, 1000 + i).unwrap().encode());
        }
        // Gossip: b serves the tenant and takes every record; c does not.
        for d in &sent {
            merge_scoped(&b, d, &acme, 2000).unwrap();
            assert!(merge_scoped(&c, d, &other, 2000).is_err());
            assert!(merge_validated(&c, d, 2000).is_err(), "usage is not global");
        }
        assert_eq!(
            tenant_digest(&a, "tenant_123").unwrap(),
            tenant_digest(&b, "tenant_123").unwrap()
        );
        assert_eq!(tenant_digest(&c, "tenant_123").unwrap().1, 0);
        // Anti-entropy: a late gateway of the tenant gets them; one that
        // only claims another tenant gets nothing.
        let resp = answer(&a, &digest_request(&c, &acme).unwrap(), &acme).unwrap();
        assert_eq!(resp.deltas.len(), 5);
        assert!(answer(&a, &digest_request(&c, &other).unwrap(), &acme).unwrap().deltas.is_empty());
        assert!(
            answer(&c, &digest_request(&a, &acme).unwrap(), &other).unwrap().deltas.is_empty(),
            "c does not serve the tenant: it answers nothing of it"
        );
        for d in &resp.deltas {
            merge_scoped(&c, d, &acme, 3000).unwrap();
        }
        assert_eq!(
            tenant_digest(&a, "tenant_123").unwrap(),
            tenant_digest(&c, "tenant_123").unwrap()
        );
        assert!(answer(&a, &digest_request(&c, &acme).unwrap(), &acme).unwrap().deltas.is_empty());
        // Forgeries: tampered after signing, or filed under another job.
        let mut u = samples::usage(&w, &g, &Params::default());
        gcs_protocol::sign(&mut u, &g).unwrap();
        u.output_tokens_sent_to_client += 1;
        let tampered =
            c.put(&keys::usage(&u.job_id), gcs_protocol::encode(&u).unwrap(), 4000).unwrap();
        assert!(merge_scoped(&b, &tampered.encode(), &acme, 4000).is_err());
        let mut u = samples::usage(&w, &g, &Params::default());
        gcs_protocol::sign(&mut u, &g).unwrap();
        let misfiled =
            c.put(&keys::usage("gcsapi_x"), gcs_protocol::encode(&u).unwrap(), 4001).unwrap();
        assert!(merge_scoped(&b, &misfiled.encode(), &acme, 4001).is_err());
    }

    fn merge_all(ks: &Keyspace, resp: &DigestResponse) {
        for d in &resp.deltas {
            merge_scoped(ks, d, &[], 9000).unwrap();
        }
    }

    #[test]
    fn after_first_contact_only_the_log_since_the_cursor_is_sent() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
        let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
        for i in 0..40u8 {
            a.put(&format!("/gcs/api/states/j{i}"), vec![i], 1000).unwrap();
        }
        let first = answer(&a, &digest_request(&b, &[]).unwrap(), &[]).unwrap();
        assert_eq!(first.deltas.len(), 40, "first contact: the differing namespace");
        merge_all(&b, &first);
        let cursor = first.last_seq.unwrap();
        for i in 0..3u8 {
            a.put(&format!("/gcs/nodes/heartbeat/n{i}"), vec![i], 2000).unwrap();
        }
        a.put("/gcs/api/payloads/j0", b"private prompt".to_vec(), 2000).unwrap();
        a.put("/gcs/api/states/j0", vec![9], 2000).unwrap();
        let mut req = digest_request(&b, &[]).unwrap();
        req.since = Some(cursor);
        let next = answer(&a, &req, &[]).unwrap();
        assert_eq!(next.deltas.len(), 4, "three heartbeats and one state, no payload");
        assert_eq!(next.last_seq, Some(a.last_seq()));
        merge_all(&b, &next);
        for ns in global_namespaces() {
            assert_eq!(a.digest(ns).unwrap(), b.digest(ns).unwrap(), "{ns:?}");
        }
        // Nothing new: an empty answer, the cursor stays.
        req.since = next.last_seq;
        let idle = answer(&a, &req, &[]).unwrap();
        assert!(idle.deltas.is_empty() && idle.last_seq == next.last_seq);
        // A cursor ahead of the log (the peer lost its store): digests decide.
        req.since = Some(a.last_seq() + 100);
        let b2 = tempfile::tempdir().unwrap();
        let fresh = Keyspace::open(b2.path(), "c", Default::default()).unwrap();
        req.digests = digest_request(&fresh, &[]).unwrap().digests;
        assert_eq!(answer(&a, &req, &[]).unwrap().deltas.len(), 43);
    }

    #[test]
    fn a_namespace_over_the_cap_arrives_in_pages() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
        let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
        let n = MAX_ENTRIES_PER_NAMESPACE + 25;
        for i in 0..n {
            a.put(&format!("/gcs/api/states/j{i:06}"), vec![1], 1000).unwrap();
        }
        let first = answer(&a, &digest_request(&b, &[]).unwrap(), &[]).unwrap();
        assert_eq!(first.deltas.len(), MAX_ENTRIES_PER_NAMESPACE);
        assert_eq!(first.resume.len(), 1);
        assert!(first.last_seq.is_some());
        merge_all(&b, &first);
        let mut req = digest_request(&b, &[]).unwrap();
        req.after = first.resume.clone();
        let second = answer(&a, &req, &[]).unwrap();
        assert_eq!(second.deltas.len(), 25, "the rest, not the first page again");
        assert!(second.resume.is_empty() && second.last_seq.is_none());
        merge_all(&b, &second);
        assert_eq!(
            a.digest(Namespace::ApiJobStates).unwrap(),
            b.digest(Namespace::ApiJobStates).unwrap()
        );
    }

    #[test]
    fn an_old_or_misfiled_registration_does_not_replace_the_record() {
        let (w, g) = samples::keys();
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
        let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
        let reg_at = |t: u64| {
            let mut r = samples::registration(&w, &Params::default());
            r.heartbeat.created_at_ms = t;
            r.heartbeat.expires_at_ms = t + 30_000;
            gcs_protocol::sign(&mut r, &w).unwrap();
            r
        };
        let (old, new) = (reg_at(1_000), reg_at(2_000));
        let key = format!("/gcs/nodes/registrations/{}", new.node_id);
        b.put(&key, gcs_protocol::encode(&new).unwrap(), 3_000).unwrap();
        // A peer writes the old one later (a newer writer clock).
        let replay = a.put(&key, gcs_protocol::encode(&old).unwrap(), 9_000).unwrap();
        assert_eq!(merge_validated(&b, &replay.encode(), 9_000).unwrap(), MergeOutcome::Unchanged);
        let kept: gcs_protocol::NodeRegistration =
            gcs_protocol::codec::from_cbor_bytes(&b.get_bytes(&key).unwrap().unwrap()).unwrap();
        assert_eq!(kept.heartbeat.created_at_ms, 2_000);
        // A newer one does replace it.
        let newer = a.put(&key, gcs_protocol::encode(&reg_at(4_000)).unwrap(), 9_001).unwrap();
        assert!(matches!(
            merge_validated(&b, &newer.encode(), 9_001).unwrap(),
            MergeOutcome::Changed(_)
        ));
        // A valid registration filed under another node's key is refused,
        // and so is a lease under another job's key.
        let (_, other) = samples::keys();
        let misfiled = a
            .put(
                &format!("/gcs/nodes/registrations/{}", other.node_id()),
                gcs_protocol::encode(&new).unwrap(),
                9_002,
            )
            .unwrap();
        assert!(merge_validated(&b, &misfiled.encode(), 9_002).is_err());
        let mut lease = samples::lease(&w, &g, &Params::default());
        gcs_protocol::sign(&mut lease, &g).unwrap();
        let wrong_job = a
            .put("/gcs/api/leases/gcsapi_other", gcs_protocol::encode(&lease).unwrap(), 9_003)
            .unwrap();
        assert!(merge_validated(&b, &wrong_job.encode(), 9_003).is_err());
        let right_job = a
            .put(
                &format!("/gcs/api/leases/{}", lease.job_id),
                gcs_protocol::encode(&lease).unwrap(),
                9_004,
            )
            .unwrap();
        merge_validated(&b, &right_job.encode(), 9_004).unwrap();
    }

    #[test]
    fn answers_stay_under_the_byte_budget_and_page_to_the_end() {
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a = Keyspace::open(da.path(), "a", Default::default()).unwrap();
        let b = Keyspace::open(db.path(), "b", Default::default()).unwrap();
        for i in 0..12u8 {
            a.put(&format!("/gcs/api/states/j{i:02}"), vec![i; 1 << 20], 1000).unwrap();
            a.put(&format!("/gcs/nodes/heartbeat/n{i:02}"), vec![i; 16], 1000).unwrap();
        }
        let mut req = digest_request(&b, &[]).unwrap();
        let (mut pages, mut got) = (0, 0);
        loop {
            let resp = answer(&a, &req, &[]).unwrap();
            let size: usize = resp.deltas.iter().map(Vec::len).sum();
            assert!(size <= RESPONSE_BUDGET + (1 << 20) + 4096, "page of {size} bytes");
            got += resp.deltas.len();
            merge_all(&b, &resp);
            pages += 1;
            if resp.resume.is_empty() {
                break;
            }
            req = digest_request(&b, &[]).unwrap();
            req.after = resp.resume;
            assert!(pages < 10, "no progress");
        }
        assert!(pages >= 3, "12 MiB in pages of 4 MiB: {pages}");
        assert!(got >= 24);
        for ns in [Namespace::ApiJobStates, Namespace::NodeHeartbeat] {
            assert_eq!(a.digest(ns).unwrap(), b.digest(ns).unwrap(), "{ns:?}");
        }
    }
}
