//! Record authority (the record-authority table of specs/network.md): who
//! may write each globally replicated namespace from a peer, checked on
//! every delta from gossip or anti-entropy before it is merged.

use gcs_keyspace::{keys, Delta, Keyspace, MergeOutcome, Namespace, Scope};
use gcs_protocol::{ApiRequestJob, MessageType};

use super::misfiled;
use crate::error::RefusedDelta;

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
    /// The processing queue (`processing::records`): a task from a gateway
    /// its tenant admitted, a lock by the worker it names under the queue
    /// rules, a result by the lock's holder.
    Processing,
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
        Namespace::ProcessingTasks
        | Namespace::ProcessingLocks
        | Namespace::ProcessingResults
        | Namespace::ProcessingReleases
        | Namespace::ProcessingCancels => Authority::Processing,
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
        // Checked with the node's tenant trust in `merge_scoped`.
        Authority::Processing => {
            return crate::processing::records::validate(delta).map(|_| None)
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
pub(super) fn record_id(m: &gcs_protocol::Message) -> Option<&str> {
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
pub(super) fn merge_validated(
    ks: &Keyspace,
    bytes: &[u8],
    now_ms: u64,
) -> Result<MergeOutcome, RefusedDelta> {
    merge_global(ks, Delta::decode(bytes)?, now_ms)
}

pub(super) fn merge_global(ks: &Keyspace, d: Delta, now_ms: u64) -> Result<MergeOutcome, RefusedDelta> {
    let incoming = validate(&d)?;
    if let Some(m) = &incoming {
        if !check_against_stored(ks, &d, m)? {
            return Ok(MergeOutcome::Unchanged);
        }
    }
    Ok(ks.merge(d, now_ms)?)
}
