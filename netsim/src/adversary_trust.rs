//! `netsim adversary --attacks trust`: attacks on what peers take on trust
//! (issue 14 §3), over the wire like the rest of the adversary.
//!
//! - **Catalogue poisoning**: every 3 s, [`SYBILS`] registrations signed by
//!   fresh keys advertise the honest worker's model with `context_tokens: 1`,
//!   and as many map its aliases (`gnus-auto`) to [`POISON_MODEL`]. The
//!   gateway's `/v1/models` must still report the real model and context,
//!   and requests must still be admitted.
//! - **A fake gateway's flood**: every 3 s, [`FLOOD`] jobs signed by the
//!   adversary as their gateway, for the honest worker's model. It grants
//!   every claim a lease and serves the payload, so the honest worker runs
//!   them: the worker must give it at most its `--gateway-share` of the
//!   slots (`gcs_worker_gateway_slots_peak`), and the honest gateway's
//!   streams must still complete as the reference.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gcs_gateway::payload::{Generation, JobRequest as Payload, Message as Turn, Prompt, Role};
use gcs_node::jobs::wire::{JobRequest, JobResponse, LeasedPayload};
use gcs_node::jobs::JobSpec;
use gcs_node::{now_ms, Network};
use gcs_protocol::{
    encode, ids, open, sign, ApiRequestJob, ApiType, Heartbeat, JobLimits, LeaseGrant, Limits,
    Message, MessageType, NodeKey, NodeRegistration, Routing, PROTOCOL_VERSION,
};

/// The model id the hijacking registrations map the honest aliases to.
pub const POISON_MODEL: &str = "netsim-poison-model";
/// Sybil registrations of each kind, per round.
pub const SYBILS: usize = 3;
/// Fake-gateway jobs announced per round.
pub const FLOOD: usize = 8;

/// Attack kinds a `--attacks trust` run must have carried out.
pub const REQUIRED: [&str; 5] = [
    "catalog_poisoned_context",
    "catalog_hijacked_alias",
    "fake_gateway_job",
    "fake_gateway_lease",
    "fake_gateway_payload",
];

type Bump = Arc<dyn Fn(&str) + Send + Sync>;

/// The trust attacker's state.
pub struct Rogue {
    key: NodeKey,
    net: Network,
    limits: Limits,
    bump: Bump,
    sybils: Vec<NodeKey>,
    /// Fake jobs announced, with their payloads.
    jobs: Mutex<HashMap<String, Vec<u8>>>,
}

impl std::fmt::Debug for Rogue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rogue").field("gateway", &self.key.node_id()).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Rogue {
    /// An attacker signing as `key` (its fake gateway's id).
    pub fn new(key: NodeKey, net: Network, bump: Bump) -> anyhow::Result<Self> {
        let sybils = (0..2 * SYBILS).map(|_| NodeKey::generate()).collect::<Result<_, _>>()?;
        Ok(Self { key, net, limits: Limits::default(), bump, sybils, jobs: Mutex::default() })
    }

    /// One round: the poisoned registrations, then a flood of jobs.
    pub async fn round(&self, template: &NodeRegistration) {
        self.poison(template).await;
        self.flood(template).await;
    }

    async fn poison(&self, template: &NodeRegistration) {
        let Some(real) = template.models.first() else { return };
        let now = now_ms();
        for (i, k) in self.sybils.iter().enumerate() {
            let mut r = template.clone();
            let Ok(id) = ids::new_id(ids::REGISTRATION, now) else { return };
            r.registration_id = id;
            r.node_id = k.node_id();
            r.public_key = k.public_key();
            let mut m = real.clone();
            let kind = if i < SYBILS {
                m.context_tokens = 1;
                "catalog_poisoned_context"
            } else {
                m.model_id = POISON_MODEL.into();
                m.context_tokens = 1;
                "catalog_hijacked_alias"
            };
            r.models = vec![m];
            r.queue.current_api_jobs = 0;
            r.heartbeat =
                Heartbeat { created_at_ms: now, expires_at_ms: now + 30_000, ttl_ms: 30_000 };
            r.addresses.clear();
            r.memberships.clear();
            r.signature = None;
            if sign(&mut r, k).is_err() {
                continue;
            }
            if let Ok(b) = encode(&r) {
                let _ = self.net.publish(gcs_node::topics::CAPABILITIES_ALL, b).await;
                (self.bump)(kind);
            }
        }
    }

    fn payload() -> Vec<u8> {
        let g = Generation {
            prompt: Prompt::Chat(vec![Turn { role: Role::User, content: "flood".into() }]),
            max_tokens: 24,
            sampling: Default::default(),
            stop: vec![],
            logprobs: None,
            constraint: None,
        };
        Payload::Generation(g).encode().unwrap_or_default()
    }

    async fn flood(&self, template: &NodeRegistration) {
        let Some(real) = template.models.first() else { return };
        let now = now_ms();
        let body = Self::payload();
        for _ in 0..FLOOD {
            let spec = JobSpec {
                api_type: ApiType::ChatCompletion,
                model: real.model_id.clone(),
                stream: true,
                body: body.clone(),
                tenant_id: "netsim-fake".into(),
                project_id: "p".into(),
                api_key_id: "k".into(),
                idempotency_key: "i".into(),
                limits: JobLimits::default(),
                max_output_tokens: 24,
                routing: Routing::public(),
            };
            let Ok(job) = gcs_node::jobs::announce::build_job(&spec, &self.key, &body, now) else {
                continue;
            };
            lock(&self.jobs).insert(job.job_id.clone(), body.clone());
            if let Ok(b) = encode(&job) {
                let _ = self.net.publish(gcs_node::topics::API_JOBS_ALL, b).await;
                (self.bump)("fake_gateway_job");
            }
        }
        let mut jobs = lock(&self.jobs);
        if jobs.len() > 4 * FLOOD * 20 {
            jobs.clear(); // old ones expired long ago for the worker too
        }
    }

    /// The fake gateway's answer to a direct request about one of its
    /// jobs; `None` for anything else.
    pub fn answer(&self, req: &JobRequest) -> Option<JobResponse> {
        match req {
            JobRequest::FetchPayload { job_id, .. } => {
                let body = lock(&self.jobs).get(job_id).cloned()?;
                (self.bump)("fake_gateway_payload");
                let salt = gcs_protocol::Hash32::of(job_id.as_bytes()).0;
                Some(JobResponse::Payload(Box::new(LeasedPayload::new(
                    body,
                    "netsim-fake".into(),
                    salt,
                ))))
            }
            JobRequest::Envelope(b) => match open(b, now_ms(), &self.limits).ok()? {
                Message::JobClaim(c) if lock(&self.jobs).contains_key(&c.job_id) => {
                    let now = now_ms();
                    let mut l = LeaseGrant {
                        message_type: MessageType::LeaseGrant,
                        version: PROTOCOL_VERSION,
                        job_id: c.job_id.clone(),
                        lease_id: ids::new_id(ids::LEASE, now).ok()?,
                        claim_id: c.claim_id.clone(),
                        node_id: c.node_id.clone(),
                        gateway_node_id: self.key.node_id(),
                        attempt: 0,
                        renew_interval_ms: 2_000,
                        created_at_ms: now,
                        expires_at_ms: now + 10_000,
                        signature: None,
                    };
                    sign(&mut l, &self.key).ok()?;
                    (self.bump)("fake_gateway_lease");
                    Some(JobResponse::Envelope(encode(&l).ok()?))
                }
                _ => None,
            },
        }
    }

    /// Whether `job` is one of its own (it hears no gossip of its own, but
    /// a relay may echo one).
    pub fn is_own(&self, job: &ApiRequestJob) -> bool {
        job.gateway_node_id == self.key.node_id()
    }
}
