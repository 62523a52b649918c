//! `encrypted_payload` jobs (26.20.3) on both sides of the job channel.
//!
//! The gateway never stores such a body in clear: from submit until a lease
//! exists it keeps it sealed to its own key ([`SealPurpose::AtRest`], under
//! `keys::payload` and in memory); a fetch by the lease holder opens that
//! box in memory and seals a fresh one to the holder under that lease
//! ([`reseal_for`]). The worker opens it in memory ([`open_leased`]) and
//! hands it to the engine; it stores nothing of it.
//!
//! The signed job announces `content_hash = blake3(nonce || body)` with a
//! fresh 32-byte nonce that travels only inside the box ([`committed`]), so
//! the public hash cannot confirm a guessed prompt; the worker checks the
//! opened bytes against it, which binds the box to the signed job.
//!
//! [`SealPurpose::AtRest`]: gcs_protocol::seal::SealPurpose::AtRest

use gcs_protocol::seal::{open_sealed, seal_to, SealBinding, SealError};
use gcs_protocol::{ApiRequestJob, Hash32, NodeId, NodeKey};

use super::wire::LeasedPayload;
use crate::error::NodeError;

/// Bytes of the commitment nonce in front of a sealed job's body.
pub const COMMIT_NONCE: usize = 32;

/// Whether a job's body travels sealed (its signed payload reference says so).
pub fn is_sealed(job: &ApiRequestJob) -> bool {
    job.request.payload_ref.encrypted
}

/// What the idempotency record keeps of a request's body: its blake3, or
/// for a sealed job a hash keyed by a secret of this gateway, so not even
/// a hash of the clear prompt lies at rest where a guess could be checked.
pub fn idempotency_digest(key: &NodeKey, spec: &super::JobSpec) -> Hash32 {
    if spec.routing.privacy_mode != gcs_protocol::PrivacyLevel::EncryptedPayload {
        return Hash32::of(&spec.body);
    }
    let k = blake3::derive_key("gcs gateway secret v1: sealed idempotency digest", &key.seed());
    Hash32(*blake3::keyed_hash(&k, &spec.body).as_bytes())
}

/// What a sealed job's boxes hold and its announced hash covers: a fresh
/// nonce, then the body.
pub fn committed(body: &[u8]) -> Result<Vec<u8>, NodeError> {
    let nonce: [u8; COMMIT_NONCE] = gcs_protocol::seal::random32()?;
    let mut out = Vec::with_capacity(COMMIT_NONCE + body.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(body);
    Ok(out)
}

/// The box a gateway keeps of `committed` until a lease exists.
pub fn seal_at_rest(key: &NodeKey, job_id: &str, committed: &[u8]) -> Result<Vec<u8>, SealError> {
    let me = key.node_id();
    seal_to(committed, &SealBinding::at_rest(job_id, &me))
}

/// The gateway's answer to the lease holder's fetch: its at-rest box opened
/// in memory and sealed to `holder` under `lease_id`.
pub fn reseal_for(
    key: &NodeKey,
    job_id: &str,
    lease_id: &str,
    holder: &NodeId,
    at_rest: &[u8],
) -> Result<Vec<u8>, SealError> {
    let me = key.node_id();
    let clear = open_sealed(at_rest, key, &SealBinding::at_rest(job_id, &me))?;
    seal_to(&clear, &SealBinding::lease(job_id, lease_id, &me, holder))
}

/// Why a lease holder cannot run a sealed payload.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PayloadError {
    /// The box does not open for this node, job, lease and gateway.
    #[error(transparent)]
    Seal(#[from] SealError),
    /// It opened, but is not what the signed job committed to.
    #[error("the opened payload does not match the job's content hash")]
    HashMismatch,
}

impl PayloadError {
    /// The stable error code of the failed result the worker sends.
    pub const CODE: &'static str = "gnus_payload_unreadable";
}

/// On the lease holder: the clear body of a sealed payload answer, checked
/// against the signed job. In memory only; the caller stores none of it.
pub fn open_leased(
    p: LeasedPayload,
    job: &ApiRequestJob,
    lease_id: &str,
    key: &NodeKey,
) -> Result<LeasedPayload, PayloadError> {
    let me = key.node_id();
    let binding = SealBinding::lease(&job.job_id, lease_id, &job.gateway_node_id, &me);
    let clear = open_sealed(&p.body, key, &binding)?;
    if clear.len() < COMMIT_NONCE || Hash32::of(&clear) != job.request.payload_ref.content_hash {
        return Err(PayloadError::HashMismatch);
    }
    Ok(LeasedPayload { body: clear[COMMIT_NONCE..].to_vec(), ..p })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn job(gw: &NodeKey, committed: &[u8]) -> ApiRequestJob {
        let mut j = gcs_protocol::samples::api_job(gw, &gcs_protocol::samples::Params::default());
        j.request.payload_ref.encrypted = true;
        j.request.payload_ref.content_hash = Hash32::of(committed);
        j
    }

    #[test]
    fn at_rest_then_leased_then_opened_by_the_holder_only() {
        let (gw, worker, other) =
            (NodeKey::from_seed([4; 32]), NodeKey::from_seed([5; 32]), NodeKey::from_seed([6; 32]));
        let body = b"a very private prompt".to_vec();
        let c = committed(&body).unwrap();
        let j = job(&gw, &c);
        let at_rest = seal_at_rest(&gw, &j.job_id, &c).unwrap();
        assert!(!at_rest.windows(7).any(|w| w == b"private"));
        let sealed = reseal_for(&gw, &j.job_id, "lease_a", &worker.node_id(), &at_rest).unwrap();
        let p = LeasedPayload::new(sealed.clone(), "t".into(), [0; 32]);
        assert_eq!(open_leased(p.clone(), &j, "lease_a", &worker).unwrap().body, body);
        // Another lease, another node, a tampered byte: typed refusals.
        assert_eq!(
            open_leased(p.clone(), &j, "lease_b", &worker),
            Err(PayloadError::Seal(SealError::Tampered))
        );
        assert_eq!(
            open_leased(p.clone(), &j, "lease_a", &other),
            Err(PayloadError::Seal(SealError::Tampered))
        );
        let mut t = sealed;
        t[40] ^= 1;
        let tp = LeasedPayload::new(t, "t".into(), [0; 32]);
        assert_eq!(
            open_leased(tp, &j, "lease_a", &worker),
            Err(PayloadError::Seal(SealError::Tampered))
        );
        // Only the gateway opens its at-rest box.
        assert!(reseal_for(&worker, &j.job_id, "lease_a", &worker.node_id(), &at_rest).is_err());
    }

    #[test]
    fn a_box_of_other_bytes_than_the_job_committed_to_is_refused() {
        let (gw, worker) = (NodeKey::from_seed([4; 32]), NodeKey::from_seed([5; 32]));
        let j = job(&gw, &committed(b"the real body").unwrap());
        // The gateway seals something else (a lie, or a bug): it opens, but
        // the hash in the signed job does not match.
        let other = committed(b"another body").unwrap();
        let at_rest = seal_at_rest(&gw, &j.job_id, &other).unwrap();
        let sealed = reseal_for(&gw, &j.job_id, "l", &worker.node_id(), &at_rest).unwrap();
        let p = LeasedPayload::new(sealed, "t".into(), [0; 32]);
        assert_eq!(open_leased(p, &j, "l", &worker), Err(PayloadError::HashMismatch));
    }

    #[test]
    fn a_sealed_jobs_idempotency_digest_is_no_hash_of_its_body() {
        let key = NodeKey::from_seed([4; 32]);
        let mut spec = super::super::JobSpec {
            api_type: gcs_protocol::ApiType::ChatCompletion,
            model: "m".into(),
            stream: false,
            body: b"prompt".to_vec(),
            tenant_id: "t".into(),
            project_id: "p".into(),
            api_key_id: "k".into(),
            idempotency_key: "i".into(),
            limits: gcs_protocol::JobLimits::default(),
            max_output_tokens: 1,
            routing: gcs_protocol::Routing::public(),
            batch_id: None,
            parent: None,
            price_percent: None,
        };
        assert_eq!(idempotency_digest(&key, &spec), Hash32::of(b"prompt"));
        spec.routing.privacy_mode = gcs_protocol::PrivacyLevel::EncryptedPayload;
        let d = idempotency_digest(&key, &spec);
        assert_ne!(d, Hash32::of(b"prompt"));
        assert_eq!(d, idempotency_digest(&key, &spec), "stable: repeats are recognised");
        assert_ne!(d, idempotency_digest(&NodeKey::from_seed([5; 32]), &spec));
    }

    #[test]
    fn two_commitments_of_one_body_differ() {
        assert_ne!(Hash32::of(&committed(b"x").unwrap()), Hash32::of(&committed(b"x").unwrap()));
    }
}
