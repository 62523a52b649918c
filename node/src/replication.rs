//! Keyspace replication (specs/network.md): deltas of globally replicated
//! namespaces are gossiped on `gcs.keyspace.deltas`; a late joiner or a node
//! back from a partition catches up by anti-entropy — it sends its
//! per-namespace digests to a peer over a direct stream, and the peer answers
//! with the entries of every namespace whose digest differs. Merge is
//! idempotent and order-free, so over-sending is harmless.

use gcs_keyspace::{Delta, Digest, Keyspace, KeyspaceError, MergeOutcome, Namespace, Scope};
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
}

/// Namespaces every node replicates.
pub fn global_namespaces() -> impl Iterator<Item = Namespace> {
    Namespace::ALL.iter().copied().filter(|n| n.scope() == Scope::Global)
}

/// The request describing `ks`.
pub fn digest_request(ks: &Keyspace) -> Result<DigestRequest, KeyspaceError> {
    let mut digests = vec![];
    for ns in global_namespaces() {
        let d = ks.digest(ns)?;
        digests.push((ns.cf().to_string(), d.hash.to_vec(), d.count));
    }
    Ok(DigestRequest { version: 1, digests })
}

/// The answer of `ks` to a peer's digests.
pub fn answer(ks: &Keyspace, req: &DigestRequest) -> Result<DigestResponse, KeyspaceError> {
    let mut deltas = vec![];
    let mut truncated = vec![];
    for ns in global_namespaces() {
        let mine = ks.digest(ns)?;
        let theirs =
            req.digests.iter().find(|(cf, _, _)| cf == ns.cf()).map(|(_, h, c)| (h.as_slice(), *c));
        if theirs == Some((mine.hash.as_slice(), mine.count)) || mine == Digest::default() {
            continue;
        }
        let snap = ks.snapshot(ns)?;
        if snap.len() > MAX_ENTRIES_PER_NAMESPACE {
            truncated.push(ns.cf().to_string());
        }
        deltas.extend(snap.into_iter().take(MAX_ENTRIES_PER_NAMESPACE).map(|d| d.encode()));
    }
    Ok(DigestResponse { version: 1, deltas, truncated })
}

/// Checks a delta from a peer before merging: only globally replicated
/// namespaces, and values that are protocol envelopes must decode and carry
/// a valid signature (a peer may relay records, never forge them).
pub fn validate(delta: &Delta) -> Result<(), String> {
    let ns = Namespace::of_key(&delta.key).map_err(|e| e.to_string())?;
    if ns.scope() != Scope::Global {
        return Err(format!("{} is not replicated network-wide", ns.cf()));
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
    let check = |bytes: &[u8]| -> Result<(), String> {
        let m = gcs_protocol::decode(bytes, &limits).map_err(|e| e.to_string())?;
        m.verify().map_err(|e| e.to_string())
    };
    match &delta.value {
        gcs_keyspace::CrdtValue::Register(r) => match r.value() {
            Some(b) => check(b),
            None => Ok(()),
        },
        gcs_keyspace::CrdtValue::Set(s) => s.elements().try_for_each(check),
    }
}

/// Validates and merges one encoded delta.
pub fn merge_validated(ks: &Keyspace, bytes: &[u8], now_ms: u64) -> Result<MergeOutcome, String> {
    let d = Delta::decode(bytes).map_err(|e| e.to_string())?;
    validate(&d)?;
    ks.merge(d, now_ms).map_err(|e| e.to_string())
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
        let resp = answer(&a, &digest_request(&b).unwrap()).unwrap();
        assert_eq!(resp.deltas.len(), 50);
        for d in &resp.deltas {
            merge_validated(&b, d, 2000).unwrap();
        }
        assert_eq!(
            a.digest(Namespace::ApiJobStates).unwrap(),
            b.digest(Namespace::ApiJobStates).unwrap()
        );
        assert!(
            answer(&a, &digest_request(&b).unwrap()).unwrap().deltas.is_empty(),
            "in sync: nothing to send"
        );
        assert_eq!(b.get("/gcs/local/secret").unwrap(), None);
    }
}
