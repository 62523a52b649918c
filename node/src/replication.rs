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
use gcs_protocol::{ApiRequestJob, MessageType};
use serde::{Deserialize, Serialize};

pub mod tenant_digest;

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
    if Namespace::of_key(&d.key)? != Namespace::ApiUsage {
        return merge_global(ks, d, now_ms);
    }
    let (u, tenant, job) = validate_usage(&d, served)?;
    crate::tenants::records::authorise_usage(ks, &u, trust, now_ms)?;
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

/// Who may write a globally replicated namespace, as a peer sees it (the
/// record-authority table of specs/network.md). Enforced here and nowhere
/// else: every delta from gossip or anti-entropy passes [`validate`] and
/// [`check_against_stored`] before it is merged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authority {
    /// Nobody reads it from peers, so nobody may write it from a peer.
    NotFromPeers,
    /// A register holding one signed `ty`, filed under the id it names.
    /// `by_job_gateway`: its signer must be the gateway of the job record
    /// this node holds. Once stored, only the same signer may replace it,
    /// and only with an envelope that is newer by its own fields.
    Register {
        /// The message type of its values.
        ty: MessageType,
        /// Signed by the job's gateway.
        by_job_gateway: bool,
    },
    /// A tenant's or swarm's statement about one node (a membership
    /// certificate or its revocation), signed by the issuer its key names
    /// (`tenants::records`); replaced only by a newer statement.
    Membership,
    /// A set of signed `ty` elements, at most `cap` per key.
    Set {
        /// The message type of its elements.
        ty: MessageType,
        /// Elements per key.
        cap: usize,
    },
}

/// Signed claims kept per job (winners and losers, the audit trail).
pub const MAX_CLAIMS_PER_JOB: usize = 32;

/// The authority over `ns`.
pub fn authority(ns: Namespace) -> Authority {
    use Authority::{NotFromPeers, Register, Set};
    let by_gateway = |ty| Register { ty, by_job_gateway: true };
    match ns {
        Namespace::ApiJobs => Register { ty: MessageType::ApiRequestJob, by_job_gateway: false },
        Namespace::ApiLeases => by_gateway(MessageType::LeaseGrant),
        Namespace::ApiCancel => by_gateway(MessageType::Cancellation),
        Namespace::ApiRequeue => by_gateway(MessageType::Requeue),
        Namespace::ApiClaims => Set { ty: MessageType::JobClaim, cap: MAX_CLAIMS_PER_JOB },
        Namespace::NodeRegistrations => {
            Register { ty: MessageType::NodeRegistration, by_job_gateway: false }
        }
        Namespace::TenantMemberships => Authority::Membership,
        // Written by no node today (states, capabilities, heartbeats, the
        // processing queue), or never global (payloads, results, streams,
        // usage, local).
        _ => NotFromPeers,
    }
}

/// Checks a delta from a peer on its own: a globally replicated namespace
/// that peers may write, no tombstone, and values that are valid signed
/// envelopes of the namespace's type filed under their own id (a peer may
/// relay records, never forge them).
/// Returns a register's envelope, decoded once for [`check_against_stored`].
pub fn validate(delta: &Delta) -> Result<Option<gcs_protocol::Message>, RefusedDelta> {
    let ns = Namespace::of_key(&delta.key)?;
    if ns.scope() != Scope::Global {
        return Err(RefusedDelta::NotGlobal(ns.cf()));
    }
    let ty = match authority(ns) {
        Authority::NotFromPeers => return Err(RefusedDelta::NotFromPeers(ns.cf())),
        Authority::Membership => {
            return crate::tenants::records::validate_statement(delta, &record_limits()).map(Some)
        }
        Authority::Register { ty, .. } | Authority::Set { ty, .. } => ty,
    };
    let limits = record_limits();
    // The id the key is filed under (`<prefix><id>[/...]`).
    let key_id = delta.key[ns.prefix().len()..].split('/').next().unwrap_or_default();
    let check = |bytes: &[u8]| -> Result<gcs_protocol::Message, RefusedDelta> {
        let m = gcs_protocol::decode(bytes, &limits)?;
        m.verify()?;
        if m.message_type() != ty {
            return Err(RefusedDelta::WrongType { expected: ty, found: m.message_type() });
        }
        // A valid envelope filed under another job's or node's key would
        // overwrite that record: the key must name the envelope's own id.
        match record_id(&m) {
            Some(id) if id != key_id => Err(misfiled(&m, &delta.key)),
            _ => Ok(m),
        }
    };
    match &delta.value {
        gcs_keyspace::CrdtValue::Register(r) => match r.value() {
            Some(b) => check(b).map(Some),
            None => Err(RefusedDelta::Tombstone),
        },
        gcs_keyspace::CrdtValue::Set(s) => match authority(ns) {
            Authority::Set { cap, .. } if s.len() > cap => Err(RefusedDelta::TooMany(cap)),
            _ => s.elements().try_for_each(|e| check(e).map(drop)).map(|()| None),
        },
    }
}

/// The bounds of an envelope a peer's record may hold.
fn record_limits() -> gcs_protocol::Limits {
    gcs_protocol::Limits { max_message_bytes: 1024 * 1024, ..Default::default() }
}

/// The id a record is filed under: its job's, or its node's.
fn record_id(m: &gcs_protocol::Message) -> Option<&str> {
    use gcs_protocol::Message as M;
    Some(match m {
        M::NodeRegistration(r) => r.node_id.as_str(),
        M::ApiRequestJob(j) => j.job_id.as_str(),
        M::JobClaim(c) => c.job_id.as_str(),
        M::LeaseGrant(l) => l.job_id.as_str(),
        M::Cancellation(c) => c.job_id.as_str(),
        M::Requeue(r) => r.job_id.as_str(),
        M::UsageRecord(u) => u.job_id.as_str(),
        _ => return None,
    })
}

/// How a register's envelopes are ordered, by their own signed fields: a
/// peer cannot roll a record back (or pin it) by lying about its clock.
fn envelope_order(m: &gcs_protocol::Message) -> (u64, u64) {
    use gcs_protocol::Message as M;
    match m {
        M::NodeRegistration(r) => (r.heartbeat.created_at_ms, 0),
        M::ApiRequestJob(j) => (u64::from(j.announcement), j.created_at_ms),
        M::LeaseGrant(l) => (u64::from(l.attempt), l.created_at_ms),
        M::Requeue(r) => (u64::from(r.requeue_count), r.created_at_ms),
        M::Cancellation(c) => (c.created_at_ms, 0),
        M::MembershipCertificate(c) => (c.issued_at_ms, 0),
        // After a certificate of the same millisecond.
        M::MembershipRevocation(r) => (r.created_at_ms, 1),
        _ => (0, 0),
    }
}

/// Checks a register delta (its envelope `incoming`, from [`validate`])
/// against what this node holds: the signer of a job's lease, cancellation
/// or requeue is that job's gateway; a stored record is replaced only by
/// its own signer and only with a newer envelope; the same envelope again
/// changes nothing (no clock pumping). `Ok(false)`: nothing to merge.
fn check_against_stored(
    ks: &Keyspace,
    d: &Delta,
    incoming: &gcs_protocol::Message,
) -> Result<bool, RefusedDelta> {
    let ns = Namespace::of_key(&d.key)?;
    let by_job_gateway = match authority(ns) {
        Authority::Register { by_job_gateway, .. } => by_job_gateway,
        Authority::Membership => false,
        _ => return Ok(true),
    };
    let Some(bytes) = d.value.as_register().and_then(|r| r.value()) else {
        return Err(RefusedDelta::Tombstone);
    };
    if by_job_gateway {
        let job = record_id(incoming).unwrap_or_default();
        if let Some(j) = ks.find_cbor::<ApiRequestJob>(&keys::job(job))? {
            if incoming.signer() != &j.gateway_node_id {
                return Err(RefusedDelta::NotTheAuthor(ns.cf()));
            }
        }
    }
    let Some(stored) = ks.get_bytes(&d.key)? else { return Ok(true) };
    if stored == bytes {
        return Ok(false);
    }
    let Ok(stored) = gcs_protocol::decode(&stored, &record_limits()) else { return Ok(true) };
    if stored.signer() != incoming.signer() {
        return Err(RefusedDelta::NotTheAuthor(ns.cf()));
    }
    Ok(envelope_order(incoming) > envelope_order(&stored))
}

/// Validates and merges one encoded delta of a global namespace (the
/// network merges through `network::intake`, which adds quotas and clock
/// bounds in front of [`merge_scoped`]).
#[cfg(test)]
pub fn merge_validated(
    ks: &Keyspace,
    bytes: &[u8],
    now_ms: u64,
) -> Result<MergeOutcome, RefusedDelta> {
    merge_global(ks, Delta::decode(bytes)?, now_ms)
}

fn merge_global(ks: &Keyspace, d: Delta, now_ms: u64) -> Result<MergeOutcome, RefusedDelta> {
    let incoming = validate(&d)?;
    if let Some(m) = &incoming {
        if !check_against_stored(ks, &d, m)? {
            return Ok(MergeOutcome::Unchanged);
        }
    }
    Ok(ks.merge(d, now_ms)?)
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
            raw_merge(&b, d, 2000);
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
        // g is a gateway the tenant admitted (its certificate is stored at
        // every gateway of the tenant).
        let trust = crate::tenants::records::admit_sample_gateway(&[&a, &b, &c], &g);
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
            merge_scoped(&b, Delta::decode(d).unwrap(), &acme, &trust, 2000).unwrap();
            assert!(merge_scoped(&c, Delta::decode(d).unwrap(), &other, &trust, 2000).is_err());
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
            merge_scoped(&c, Delta::decode(d).unwrap(), &acme, &trust, 3000).unwrap();
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
        assert!(merge_scoped(&b, tampered, &acme, &trust, 4000).is_err());
        let mut u = samples::usage(&w, &g, &Params::default());
        gcs_protocol::sign(&mut u, &g).unwrap();
        let misfiled =
            c.put(&keys::usage("gcsapi_x"), gcs_protocol::encode(&u).unwrap(), 4001).unwrap();
        assert!(merge_scoped(&b, misfiled, &acme, &trust, 4001).is_err());
    }

    /// The paging tests fill namespaces peers may not write (unsigned
    /// filler): they test the answers' mechanics, so they merge below the
    /// authority rules, which have tests of their own.
    fn raw_merge(ks: &Keyspace, d: &[u8], now: u64) {
        ks.merge_bytes(d, now).unwrap();
    }

    fn merge_all(ks: &Keyspace, resp: &DigestResponse) {
        for d in &resp.deltas {
            raw_merge(ks, d, 9000);
        }
    }

    /// A job of `gw`, stored where this node keeps job records.
    fn stored_job(ks: &Keyspace, gw: &gcs_protocol::NodeKey) -> ApiRequestJob {
        let mut job = samples::api_job(gw, &Params::default());
        gcs_protocol::sign(&mut job, gw).unwrap();
        ks.put(&keys::job(&job.job_id), gcs_protocol::encode(&job).unwrap(), 1).unwrap();
        job
    }

    fn lease(gw: &gcs_protocol::NodeKey, job: &ApiRequestJob, attempt: u32) -> Delta {
        let (worker, _) = samples::keys();
        let mut l = samples::lease(&worker, gw, &Params::default());
        l.job_id = job.job_id.clone();
        l.gateway_node_id = gw.node_id();
        l.attempt = attempt;
        gcs_protocol::sign(&mut l, gw).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let peer = Keyspace::open(dir.path(), "peer", Default::default()).unwrap();
        peer.put(
            &keys::lease(&job.job_id),
            gcs_protocol::encode(&l).unwrap(),
            50 + u64::from(attempt),
        )
        .unwrap()
    }

    #[test]
    fn only_a_jobs_gateway_writes_its_lease_and_only_forward() {
        let dir = tempfile::tempdir().unwrap();
        let ks = Keyspace::open(dir.path(), "me", Default::default()).unwrap();
        let (_, gw) = samples::keys();
        let job = stored_job(&ks, &gw);
        let thief = gcs_protocol::NodeKey::from_seed([66; 32]);
        let forged = lease(&thief, &job, 5);
        assert!(matches!(merge_global(&ks, forged, 100), Err(RefusedDelta::NotTheAuthor(_))));
        let first = lease(&gw, &job, 1);
        assert!(matches!(merge_global(&ks, first.clone(), 100), Ok(MergeOutcome::Changed(_))));
        assert_eq!(merge_global(&ks, first, 200).unwrap(), MergeOutcome::Unchanged, "a replay");
        let older = lease(&gw, &job, 0);
        assert_eq!(merge_global(&ks, older, 300).unwrap(), MergeOutcome::Unchanged, "rolled back");
        let newer = lease(&gw, &job, 2);
        assert!(matches!(merge_global(&ks, newer, 400), Ok(MergeOutcome::Changed(_))));
        let l: gcs_protocol::LeaseGrant = ks.get_cbor(&keys::lease(&job.job_id)).unwrap().unwrap();
        assert_eq!((l.attempt, l.gateway_node_id), (2, gw.node_id()));
    }

    #[test]
    fn a_job_record_keeps_its_gateway() {
        let dir = tempfile::tempdir().unwrap();
        let ks = Keyspace::open(dir.path(), "me", Default::default()).unwrap();
        let (_, gw) = samples::keys();
        let job = stored_job(&ks, &gw);
        let thief = gcs_protocol::NodeKey::from_seed([66; 32]);
        let mut hijack = job.clone();
        hijack.gateway_node_id = thief.node_id();
        hijack.announcement = 9;
        hijack.signature = None;
        gcs_protocol::sign(&mut hijack, &thief).unwrap();
        let peer_dir = tempfile::tempdir().unwrap();
        let peer = Keyspace::open(peer_dir.path(), "peer", Default::default()).unwrap();
        let key = keys::job(&job.job_id);
        let hijack = peer.put(&key, gcs_protocol::encode(&hijack).unwrap(), 10).unwrap();
        assert!(matches!(merge_global(&ks, hijack, 20), Err(RefusedDelta::NotTheAuthor(_))));
    }

    #[test]
    fn peers_never_delete_and_never_write_what_nobody_reads_from_them() {
        let dir = tempfile::tempdir().unwrap();
        let peer = Keyspace::open(dir.path(), "peer", Default::default()).unwrap();
        let filler = peer.put("/gcs/api/states/j", vec![1; 1000], 1).unwrap();
        assert!(matches!(validate(&filler), Err(RefusedDelta::NotFromPeers(_))));
        let hb = peer.put("/gcs/nodes/heartbeat/n", vec![1], 1).unwrap();
        assert!(matches!(validate(&hb), Err(RefusedDelta::NotFromPeers(_))));
        let (w, gw) = samples::keys();
        let mut reg = samples::registration(&w, &Params::default());
        gcs_protocol::sign(&mut reg, &w).unwrap();
        let key = keys::registration(reg.node_id.as_str());
        peer.put(&key, gcs_protocol::encode(&reg).unwrap(), 2).unwrap();
        let tombstone = peer.delete(&key, 3).unwrap();
        assert!(matches!(validate(&tombstone), Err(RefusedDelta::Tombstone)));
        // A lease where a registration belongs.
        let mut l = samples::lease(&w, &gw, &Params::default());
        gcs_protocol::sign(&mut l, &gw).unwrap();
        let wrong = peer.put(&key, gcs_protocol::encode(&l).unwrap(), 4).unwrap();
        assert!(matches!(validate(&wrong), Err(RefusedDelta::WrongType { .. })));
    }

    #[test]
    fn a_claims_set_over_its_cap_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let peer = Keyspace::open(dir.path(), "peer", Default::default()).unwrap();
        let (w, _) = samples::keys();
        let mut last = None;
        for i in 0..=MAX_CLAIMS_PER_JOB {
            let mut c = samples::claim(&w, &Params::default());
            c.claim_id = format!("clm_{i}");
            gcs_protocol::sign(&mut c, &w).unwrap();
            let key = keys::claims(&c.job_id);
            let d = peer.set_add(&key, &gcs_protocol::encode(&c).unwrap(), 10 + i as u64).unwrap();
            if i + 1 == MAX_CLAIMS_PER_JOB {
                validate(&d).unwrap();
            }
            last = Some(d);
        }
        assert!(matches!(validate(&last.unwrap()), Err(RefusedDelta::TooMany(_))));
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
