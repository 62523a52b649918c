//! Gateway side of jobs: submit, answer claims and renewals, fence the
//! stream into the client's bounded channel, serve the payload to the lease
//! holder only, record usage.

use std::collections::HashMap;
use std::sync::Mutex;

use gcs_keyspace::{keys, Keyspace};
use gcs_protocol::{
    now_ms, open, sign, ApiRequestJob, CancellationReason, Hash32, Limits, Message, MessageType,
    NodeKey, PROTOCOL_VERSION,
};
use libp2p::PeerId;
use tokio::sync::mpsc;

use super::announce::{build_job, cache_salt, GatewayRecord};
use super::wire::{JobRequest, JobResponse, LeasedPayload};
use super::{peer_of, JobEvent, JobSpec};
use crate::error::NodeError;
use crate::lifecycle::tracker::{Effect, Input, JobTracker, TrackerConfig};
use crate::network::Network;
use crate::registry::Registry;
use crate::topics;

/// Chunks buffered per client before it counts as too slow (26.16.7).
pub const CLIENT_BUFFER: usize = 256;

struct Active {
    tracker: JobTracker,
    events: mpsc::Sender<JobEvent>,
    /// The body, the real tenant and its cache salt: the lease holder's only.
    payload: LeasedPayload,
    lease_id: Option<String>,
    /// Repeats of the same idempotent request: they hear only the end.
    watchers: Vec<mpsc::Sender<JobEvent>>,
}

/// How long an idempotency key maps to its job.
pub const IDEMPOTENCY_RETENTION_MS: u64 = 24 * 3_600_000;

#[derive(serde::Serialize, serde::Deserialize)]
struct IdempotencyEntry {
    job_id: String,
    body_hash: Hash32,
    created_at_ms: u64,
}

/// Where a tenant's idempotency key is recorded (local namespace: never
/// replicated; hashed, since keys are client text).
fn idempotency_key(tenant: &str, key: &str) -> String {
    let mut h = blake3::Hasher::new();
    h.update(tenant.as_bytes()).update(&[0]).update(key.as_bytes());
    keys::idempotency(&h.finalize().to_hex())
}

/// The metered result of a job that already ended at the gateway (the
/// client cancelled; the worker stopped a few tokens later): if it comes
/// from the recorded lease holder under that lease, the job's usage record
/// is re-signed with what the worker really generated and consumed. The
/// record stays the job's only one.
async fn late_metering(
    r: &gcs_protocol::FinalResult,
    ctx: &Ctx<'_>,
    penalties: &mut crate::lifecycle::penalty::PenaltyBox,
) -> Result<bool, NodeError> {
    let Some(m) = &r.metering else { return Ok(false) };
    let job = &r.job_id;
    let Some(lease) = ctx.keyspace.get_cbor::<gcs_protocol::LeaseGrant>(&keys::lease(job))? else {
        return Ok(false);
    };
    if r.node_id != lease.node_id || r.lease_id.as_deref() != Some(lease.lease_id.as_str()) {
        return Ok(false);
    }
    let Some(mut u) = ctx.keyspace.get_cbor::<gcs_protocol::UsageRecord>(&keys::usage(job))? else {
        return Ok(false);
    };
    // Bounded by what this gateway knows of the job (a worker may lie).
    let record = match ctx.keyspace.find_cbor::<ApiRequestJob>(&keys::job(job))? {
        Some(j) => Some(j),
        None => ctx.keyspace.find_cbor(&keys::confined_job(job))?,
    };
    let Some(record) = record else { return Ok(false) };
    let reported = m;
    let m =
        &crate::lifecycle::tracker::bounded_metering(&record, m, u.output_tokens_sent_to_client);
    if !crate::lifecycle::tracker::within_bounds(reported, m) {
        let until = penalties.strike(&r.node_id, now_ms());
        tracing::info!(node = %r.node_id, until, "late metering outside its bounds");
    }
    let generated = u.output_tokens_generated.max(m.output_tokens);
    if generated == u.output_tokens_generated && u.input_tokens > 0 {
        return Ok(true);
    }
    u.output_tokens_generated = generated;
    u.input_tokens = u.input_tokens.max(m.input_tokens);
    u.cached_tokens = u.cached_tokens.max(m.cached_tokens.min(u.input_tokens));
    u.compute_ms = u.compute_ms.max(m.compute_ms);
    u.signature = None;
    sign(&mut u, ctx.key)?;
    // The job was already answered; a failure here leaves the first record
    // (logged by store_usage).
    let _ = store_usage(&u, ctx).await;
    tracing::debug!(job_id = %job, generated, "usage updated with the worker's late metering");
    Ok(true)
}

/// Stores a usage record (synced to disk) and gossips it to the tenant's
/// other gateways (tenant-gateway scope): a tenant's budget and `/v1/usage`
/// then hold on every gateway that serves it. An error means the record is
/// not known to be stored: the caller must not answer the job as served.
pub(super) async fn store_usage(u: &gcs_protocol::UsageRecord, ctx: &Ctx<'_>) -> Result<(), NodeError> {
    let delta = crate::replication::record_usage(ctx.keyspace, u, now_ms()).inspect_err(|e| {
        tracing::error!(job_id = %u.job_id, error = %e, "usage record not stored");
    })?;
    if topics::valid_tenant(&u.tenant_id) {
        let topic = topics::tenant_usage(&u.tenant_id);
        if let Err(e) = ctx.network.publish(&topic, delta.encode()).await {
            // No other gateway of this tenant is connected: anti-entropy
            // brings them the record when one is.
            tracing::debug!(job_id = %u.job_id, error = %e, "usage record not gossiped");
        }
    }
    Ok(())
}

/// What the client gets instead of an answer whose usage record could not
/// be stored (serving unbilled is not an option; the storage error itself
/// stays in the log).
pub fn storage_unavailable() -> gcs_protocol::ErrorInfo {
    gcs_protocol::ErrorInfo {
        kind: "service_unavailable".into(),
        code: gcs_gateway::backend::STORAGE_UNAVAILABLE.into(),
        message: "the gateway could not record this request's usage; retry later".into(),
    }
}

/// Tokens of the fenced stream recorded for a job (what its client got).
fn recorded_tokens(keyspace: &Keyspace, job_id: &str) -> Result<u64, NodeError> {
    Ok(keyspace
        .scan_cbor::<gcs_protocol::StreamChunk>(&keys::stream(job_id))?
        .into_iter()
        .map(|(_, c)| u64::from(c.usage_delta.output_tokens))
        .sum())
}

/// The seed a job's payload samples with (the client's, or the one the
/// gateway assigned at admission); `None` for greedy and embedding jobs,
/// and for a body that does not decode (the worker refuses it anyway).
fn payload_seed(body: &[u8]) -> Option<u64> {
    match gcs_gateway::payload::JobRequest::decode(body).ok()? {
        gcs_gateway::payload::JobRequest::Generation(g) => g.sampling.seed,
        gcs_gateway::payload::JobRequest::Embedding(_) => None,
    }
}

/// What the gateway needs from the node.
pub(crate) struct Ctx<'a> {
    pub key: &'a NodeKey,
    pub network: &'a Network,
    pub keyspace: &'a Keyspace,
    pub registry: &'a Mutex<Registry>,
    pub limits: &'a Limits,
    pub tracker: TrackerConfig,
    /// This node's own worker (`--role all`), which hears no gossip from itself.
    pub local_worker: Option<&'a crate::jobs::worker::WorkerState>,
    /// This node's swarm (the default swarm of `local_only` jobs).
    pub swarm_id: &'a str,
    /// The tenant and swarm keys this gateway holds.
    pub trust: &'a crate::tenants::TenantTrust,
}

/// The key whose certificates a claimant of this job must present: the
/// tenant's for private and hybrid jobs, the swarm's for local-only ones,
/// this gateway's own for gateway-local ones (None: no node can win a
/// private or local job here).
fn membership_issuer(
    r: &gcs_protocol::Routing,
    tenant: &str,
    trust: &crate::tenants::TenantTrust,
    me: &gcs_protocol::NodeId,
) -> Option<gcs_protocol::NodeId> {
    use gcs_protocol::RoutingMode as R;
    trust.with(|t| match r.network {
        R::Private | R::Hybrid => t.tenants.get(tenant).cloned(),
        R::LocalOnly => t.swarms.get(&r.swarm_id).cloned(),
        R::GatewayLocal => Some(me.clone()),
        R::Public => None,
    })
}

/// The claimant's registration with the certificates that still stand for
/// the job's issuer: revoked and superseded ones dropped, a renewal stored
/// here added (`lifecycle::membership::current`).
fn current_memberships(
    mut reg: gcs_protocol::NodeRegistration,
    job: Option<&ApiRequestJob>,
    ks: &Keyspace,
) -> gcs_protocol::NodeRegistration {
    let Some(issuer) = job.and_then(|j| j.routing.membership_issuer.as_ref()) else { return reg };
    let limits = Limits::default();
    use gcs_protocol::MembershipScope as S;
    let stored: Vec<Message> = [S::TenantMember, S::SwarmMember, S::GatewayWorker]
        .iter()
        .filter_map(|s| {
            ks.get_bytes(&keys::membership(issuer.as_str(), s.as_str(), reg.node_id.as_str())).ok().flatten()
        })
        .filter_map(|b| gcs_protocol::decode(&b, &limits).ok())
        .collect();
    reg.memberships = crate::lifecycle::membership::current(&reg.node_id, &reg.memberships, &stored);
    reg
}

/// Where the gateway records a job. A public job is a global record. A
/// private, hybrid, local-only or gateway-local job is announced only on
/// its tenant's, swarm's or gateway's topic, so its record stays on this
/// node: in the global namespace, anti-entropy would hand it to every peer.
fn job_record_key(job: &ApiRequestJob) -> String {
    use gcs_protocol::RoutingMode as R;
    match job.routing.network {
        R::Public => keys::job(&job.job_id),
        R::Private | R::Hybrid | R::LocalOnly | R::GatewayLocal => {
            keys::confined_job(&job.job_id)
        }
    }
}

/// The gossip topics a job is announced on (26.9.2): private jobs only on
/// the tenant's private topic, hybrid jobs there first and on the public
/// topic once the private-first window has passed (re-announcements),
/// local-only jobs on their swarm's topic, gateway-local jobs on the topic of
/// their gateway (joined by the workers it attached).
pub(crate) fn job_topics(job: &ApiRequestJob) -> Vec<String> {
    use gcs_protocol::RoutingMode as R;
    let private = || topics::api_jobs_private(&job.tenant.tenant_id);
    match job.routing.network {
        R::Private => vec![private()],
        R::Hybrid if job.announcement == 0 => vec![private()],
        R::Hybrid => vec![private(), topics::API_JOBS_ALL.to_string()],
        R::LocalOnly => vec![topics::api_jobs_local(&job.routing.swarm_id)],
        R::GatewayLocal => vec![topics::api_jobs_gateway(job.gateway_node_id.as_str())],
        R::Public => vec![topics::API_JOBS_ALL.to_string()],
    }
}

/// Jobs this gateway is tracking.
pub(crate) struct GatewayState {
    active: HashMap<String, Active>,
    /// Workers that recently lost a job sit out of new ones.
    penalties: crate::lifecycle::penalty::PenaltyBox,
}

impl GatewayState {
    /// No jobs yet; workers that lose one sit out `sit_out_ms` at first.
    pub fn new(sit_out_ms: u64) -> Self {
        Self { active: HashMap::new(), penalties: crate::lifecycle::penalty::PenaltyBox::new(sit_out_ms) }
    }

    /// After a restart: every job this gateway published that has no usage
    /// record was in flight when it stopped. Its client is gone with the old
    /// process, so the job is ended — the worker is told to stop, and a
    /// failed result and a usage record are written — and none is left
    /// hanging. Returns how many were recovered.
    pub async fn recover(&mut self, ctx: &Ctx<'_>) -> Result<usize, NodeError> {
        let me = ctx.key.node_id();
        let now = now_ms();
        let mut n = 0;
        // The open-jobs index (written at submit, cleared with the usage
        // record), not every job record this node holds.
        for job in crate::indexes::open_jobs(ctx.keyspace)? {
            let id = &job.job_id;
            if job.gateway_node_id != me || ctx.keyspace.get_bytes(&keys::usage(id))?.is_some() {
                crate::indexes::close_job(ctx.keyspace, id, now)?;
                continue;
            }
            let lease = ctx.keyspace.find_cbor(&keys::lease(id))?;
            let record = ctx.keyspace.get_bytes(&keys::payload(id))?;
            let (mut tracker, _) = JobTracker::new(job.clone(), ctx.tracker, now);
            if let Some(r) = record.as_deref().and_then(GatewayRecord::decode) {
                tracker.bill_to(r.billing);
                tracker.for_batch(r.batch_id);
                tracker.priced(r.price_percent);
            }
            tracker.restore_lease(lease);
            tracker.restore_delivered(recorded_tokens(ctx.keyspace, id)?);
            let effects =
                tracker.handle(Input::Cancel(CancellationReason::Admin), now, ctx.key, ctx.limits);
            let (tx, _rx) = mpsc::channel(1);
            self.active.insert(
                id.clone(),
                Active {
                    tracker,
                    events: tx,
                    payload: LeasedPayload::new(vec![], String::new(), [0; 32]),
                    lease_id: None,
                    watchers: vec![],
                },
            );
            self.apply(id, effects, ctx).await;
            let error = gcs_protocol::ErrorInfo {
                kind: "server_error".into(),
                code: "gnus_gateway_restarted".into(),
                message: "the gateway restarted while this request was in flight".into(),
            };
            let mut r = gcs_protocol::FinalResult {
                message_type: MessageType::FinalResult,
                version: PROTOCOL_VERSION,
                job_id: id.clone(),
                node_id: me.clone(),
                lease_id: None,
                status: gcs_protocol::ResultStatus::Cancelled,
                response: None,
                error: Some(error),
                metering: None,
                attestation: None,
                chunks_sent: 0,
                created_at_ms: now,
                signature: None,
            };
            sign(&mut r, ctx.key)?;
            ctx.keyspace.put(&keys::result(id), gcs_protocol::encode(&r)?, now)?;
            tracing::warn!(job_id = %id, "in-flight job ended after a gateway restart");
            n += 1;
        }
        Ok(n)
    }

    /// Publishes a job and returns its id and the client's event stream.
    pub async fn submit(
        &mut self,
        spec: JobSpec,
        ctx: &Ctx<'_>,
    ) -> Result<(String, mpsc::Receiver<JobEvent>), NodeError> {
        let now = now_ms();
        let idem = idempotency_key(&spec.tenant_id, &spec.idempotency_key);
        let body_hash = super::sealed::idempotency_digest(ctx.key, &spec);
        if let Some(repeat) = self.repeat(&idem, body_hash, now, ctx)? {
            return Ok(repeat);
        }
        let mut spec = spec;
        if spec.routing.network == gcs_protocol::RoutingMode::LocalOnly
            && (spec.routing.swarm_id.is_empty() || spec.routing.swarm_id == topics::PUBLIC_SWARM)
        {
            // "Local" means this gateway's own swarm.
            spec.routing.swarm_id = ctx.swarm_id.to_string();
        }
        self.leave_out_failing(&mut spec, ctx, now);
        spec.routing.membership_issuer =
            membership_issuer(&spec.routing, &spec.tenant_id, ctx.trust, &ctx.key.node_id());
        // A tenant that pins nodes: its private and hybrid jobs name them.
        if !ctx.trust.with(|t| crate::tenants::pins::restrict(&mut spec.routing, &spec.tenant_id, t)) {
            tracing::warn!(tenant = %spec.tenant_id, "the tenant pins nodes but none is admitted now: no private node can win this job");
            spec.routing.membership_issuer = None;
        }
        // A private job no pinned node can win now: refused at once (503),
        // not left to wait out its queue timeout.
        if ctx.trust.with(|t| crate::tenants::pins::pins(t, &spec.tenant_id)) {
            let reg = ctx.registry.lock().unwrap_or_else(|p| p.into_inner());
            let (r, tenant, model) = (&spec.routing, &spec.tenant_id, &spec.model);
            if let Some(why) = crate::tenants::pins::unservable(r, tenant, model, reg.fresh(now)) {
                return Err(NodeError::NoCapableNodes(why));
            }
        }
        if spec.routing.membership_issuer.is_none()
            && matches!(spec.routing.network, gcs_protocol::RoutingMode::Private | gcs_protocol::RoutingMode::LocalOnly)
        {
            tracing::warn!(tenant = %spec.tenant_id, swarm = %spec.routing.swarm_id, "no tenant or swarm key on this gateway (gcs-node tenants create): no node can win this job");
        }
        // An `encrypted_payload` job commits to a nonce and its body, and the
        // body is kept sealed to this gateway until a lease (jobs::sealed).
        let sealed = spec.routing.privacy_mode == gcs_protocol::PrivacyLevel::EncryptedPayload;
        let committed = if sealed { Some(super::sealed::committed(&spec.body)?) } else { None };
        let job = build_job(&spec, ctx.key, committed.as_deref().unwrap_or(&spec.body), now)?;
        let job_id = job.job_id.clone();
        let entry = IdempotencyEntry { job_id: job_id.clone(), body_hash, created_at_ms: now };
        ctx.keyspace.put(&idem, gcs_protocol::codec::to_canonical_bytes(&entry)?, now)?;
        let record_key = job_record_key(&job);
        ctx.keyspace.put(&record_key, gcs_protocol::encode(&job)?, now)?;
        crate::indexes::open_job(ctx.keyspace, &job_id, &record_key, now)?;
        let mut record = GatewayRecord::of(&spec);
        if let Some(c) = &committed {
            record.body = super::sealed::seal_at_rest(ctx.key, &job_id, c)?;
            record.sealed = true;
        }
        let billing = record.billing.clone();
        ctx.keyspace.put(
            &keys::payload(&job_id),
            gcs_protocol::codec::to_canonical_bytes(&record)?,
            now,
        )?;
        let (mut tracker, effects) = JobTracker::new(job, ctx.tracker, now);
        tracker.bill_to(billing);
        tracker.for_batch(record.batch_id.clone());
        tracker.priced(record.price_percent);
        tracker.set_seed(payload_seed(&spec.body));
        let salt = cache_salt(ctx.key, &spec.tenant_id);
        let body = if record.sealed { record.body } else { spec.body };
        let payload = LeasedPayload::new(body, spec.tenant_id, salt);
        let (tx, rx) = mpsc::channel(CLIENT_BUFFER);
        self.active.insert(
            job_id.clone(),
            Active { tracker, events: tx, payload, lease_id: None, watchers: vec![] },
        );
        self.apply(&job_id, effects, ctx).await;
        Ok((job_id, rx))
    }

    /// Excludes the workers that sit out from a new job — unless none of
    /// the fresh workers for its model would be left.
    fn leave_out_failing(&self, spec: &mut JobSpec, ctx: &Ctx<'_>, now: u64) {
        use gcs_protocol::RoutingMode as R;
        let out = self.penalties.out(now);
        // A private or local-only job has few possible nodes: the spare
        // check below does not know which, so it is not narrowed further.
        if out.is_empty() || matches!(spec.routing.network, R::Private | R::LocalOnly | R::GatewayLocal) {
            return;
        }
        let reg = ctx.registry.lock().unwrap_or_else(|p| p.into_inner());
        let spare = reg.fresh(now).any(|r| {
            !out.contains(&r.node_id)
                && !spec.routing.excluded_nodes.contains(&r.node_id)
                && r.model(&spec.model).is_some()
        });
        if spare {
            tracing::debug!(job_model = %spec.model, ?out, "failing workers left out");
            spec.routing.excluded_nodes.extend(out);
        }
    }

    /// The same idempotency key from the same tenant within its retention
    /// window gets the same job: its stored result if it finished, or its end
    /// when it does. A different body is a conflict. A key whose job failed
    /// without a result may be retried (None: make a new job).
    fn repeat(
        &mut self,
        idem: &str,
        body_hash: Hash32,
        now: u64,
        ctx: &Ctx<'_>,
    ) -> Result<Option<(String, mpsc::Receiver<JobEvent>)>, NodeError> {
        let Some(e) = ctx.keyspace.find_cbor::<IdempotencyEntry>(idem)? else {
            return Ok(None);
        };
        if now.saturating_sub(e.created_at_ms) > IDEMPOTENCY_RETENTION_MS {
            return Ok(None);
        }
        if e.body_hash != body_hash {
            return Err(NodeError::IdempotencyConflict { job_id: e.job_id });
        }
        let (tx, rx) = mpsc::channel(4);
        if let Some(a) = self.active.get_mut(&e.job_id) {
            a.watchers.push(tx);
            return Ok(Some((e.job_id, rx)));
        }
        let result =
            ctx.keyspace.find_cbor::<gcs_protocol::FinalResult>(&keys::result(&e.job_id))?;
        match result {
            Some(r) if r.status == gcs_protocol::ResultStatus::Completed => {
                let _ = tx.try_send(JobEvent::Completed(Box::new(r)));
                Ok(Some((e.job_id, rx)))
            }
            _ => Ok(None),
        }
    }

    /// Feeds an input to one job and applies the effects; returns the
    /// envelope to answer a claim or renewal with, if any.
    async fn feed(&mut self, job_id: &str, input: Input, ctx: &Ctx<'_>) -> Option<Vec<u8>> {
        let a = self.active.get_mut(job_id)?;
        let effects = a.tracker.handle(input, now_ms(), ctx.key, ctx.limits);
        self.apply(job_id, effects, ctx).await
    }

    /// A client cancel (disconnect, timeout, quota, admin).
    pub async fn cancel(&mut self, job_id: &str, reason: CancellationReason, ctx: &Ctx<'_>) {
        self.feed(job_id, Input::Cancel(reason), ctx).await;
    }

    /// A connection closed: every job whose lease holder it was loses its worker.
    pub async fn on_peer_disconnected(&mut self, peer: PeerId, ctx: &Ctx<'_>) {
        let hit: Vec<(String, gcs_protocol::NodeId)> = self
            .active
            .iter()
            .filter_map(|(id, a)| {
                let l = a.tracker.lease()?;
                (peer_of(&l.node_id) == Some(peer)).then(|| (id.clone(), l.node_id.clone()))
            })
            .collect();
        for (id, node) in hit {
            self.feed(&id, Input::WorkerDisconnected(node), ctx).await;
        }
    }

    /// Time passes for every job.
    pub async fn tick(&mut self, ctx: &Ctx<'_>) {
        let ids: Vec<String> = self.active.keys().cloned().collect();
        for id in ids {
            self.feed(&id, Input::Tick, ctx).await;
        }
    }

    /// Handles a direct request; returns the response.
    pub async fn on_request(
        &mut self,
        peer: PeerId,
        req: JobRequest,
        ctx: &Ctx<'_>,
    ) -> JobResponse {
        match req {
            JobRequest::FetchPayload { job_id, lease_id } => {
                let Some(a) = self.active.get(&job_id) else {
                    return JobResponse::Refused("unknown job".into());
                };
                match a.tracker.lease() {
                    Some(l) if l.lease_id == lease_id && peer_of(&l.node_id) == Some(peer) => {
                        // A continuation's holder also gets where the
                        // stream stands (its lease only; never gossiped).
                        let continuation = a.tracker.continuation().cloned();
                        if !super::sealed::is_sealed(a.tracker.job()) {
                            return JobResponse::Payload(Box::new(LeasedPayload {
                                continuation,
                                ..a.payload.clone()
                            }));
                        }
                        // Opened in memory, sealed to this holder and lease.
                        let at_rest = &a.payload.body;
                        match super::sealed::reseal_for(ctx.key, &job_id, &lease_id, &l.node_id, at_rest) {
                            Ok(body) => JobResponse::Payload(Box::new(LeasedPayload {
                                body,
                                continuation,
                                ..a.payload.clone()
                            })),
                            Err(e) => {
                                tracing::error!(job_id, error = %e, "sealed payload not resealed");
                                JobResponse::Refused("the sealed payload is unavailable".into())
                            }
                        }
                    }
                    _ => JobResponse::Refused("only the lease holder may fetch the payload".into()),
                }
            }
            // A processing lock holder's chunk fetch or delivery, or a
            // tenant gateway's mirror pull (processing/serve.rs).
            JobRequest::FetchChunk(_)
            | JobRequest::DeliverOutput(_)
            | JobRequest::MirrorPull(_) => {
                crate::processing::serve::answer(ctx.keyspace, ctx.trust, peer, &req)
            }
            JobRequest::Envelope(bytes) => {
                let msg = match open(&bytes, now_ms(), ctx.limits) {
                    Ok(m) => m,
                    Err(e) => return JobResponse::Refused(e.to_string()),
                };
                if peer_of(msg.signer()) != Some(peer) {
                    return JobResponse::Refused("the sender must be the signer".into());
                }
                let (job_id, input) = match msg {
                    Message::JobClaim(c) => {
                        // Every signed claim for a live job is kept (winners
                        // and losers): the audit trail of first-valid-claim.
                        // Bounded: a peer minting claim ids adds nothing past
                        // the cap (peers refuse a larger set too).
                        if self.active.contains_key(&c.job_id) {
                            let key = keys::claims(&c.job_id);
                            let held = match ctx.keyspace.get(&key) {
                                Ok(v) => v.and_then(|v| v.as_set().map(|s| s.len())).unwrap_or(0),
                                Err(_) => usize::MAX,
                            };
                            if held < crate::replication::MAX_CLAIMS_PER_JOB {
                                if let Err(e) = ctx.keyspace.set_add(&key, &bytes, now_ms()) {
                                    tracing::warn!(job_id = %c.job_id, error = %e, "claim not recorded");
                                }
                            }
                        }
                        let reg = ctx
                            .registry
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get(&c.node_id)
                            .cloned();
                        let job = self.active.get(&c.job_id).map(|a| a.tracker.job());
                        let reg = reg.map(|r| current_memberships(r, job, ctx.keyspace));
                        (c.job_id.clone(), Input::Claim(Box::new(c), reg.map(Box::new)))
                    }
                    Message::LeaseRenewal(r) => (r.job_id.clone(), Input::Renewal(r)),
                    Message::StreamChunk(c) => (c.job_id.clone(), Input::Chunk(Box::new(c))),
                    Message::FinalResult(r) => (r.job_id.clone(), Input::Result(Box::new(r))),
                    other => {
                        return JobResponse::Refused(format!(
                            "{} is not a job-channel message",
                            other.message_type()
                        ))
                    }
                };
                if !self.active.contains_key(&job_id) {
                    if let Input::Result(r) = &input {
                        if late_metering(r, ctx, &mut self.penalties).await.unwrap_or(false) {
                            return JobResponse::Ack;
                        }
                    }
                    return JobResponse::Refused("unknown or finished job".into());
                }
                match self.feed(&job_id, input, ctx).await {
                    Some(envelope) => JobResponse::Envelope(envelope),
                    None => JobResponse::Ack,
                }
            }
        }
    }

    async fn apply(
        &mut self,
        job_id: &str,
        effects: Vec<Effect>,
        ctx: &Ctx<'_>,
    ) -> Option<Vec<u8>> {
        let mut reply = None;
        let mut client_gone = None;
        // The client hears of the end only after the usage record is stored.
        let mut terminal = None;
        // Set when the usage record failed to store: whether tokens were sent.
        let mut usage_lost = None;
        let now = now_ms();
        for e in effects {
            if let (Effect::Lease(l), Some(a)) = (&e, self.active.get_mut(job_id)) {
                if a.lease_id.as_deref() != Some(l.lease_id.as_str()) {
                    a.lease_id = Some(l.lease_id.clone());
                    let _ = a.events.try_send(JobEvent::Leased { node_id: l.node_id.clone() });
                }
            }
            let Some(a) = self.active.get(job_id) else { break };
            match e {
                Effect::Publish(job) => {
                    if let Some(w) = ctx.local_worker {
                        w.consider((*job).clone());
                    }
                    if let Ok(b) = gcs_protocol::encode(job.as_ref()) {
                        for topic in job_topics(&job) {
                            if let Err(err) = ctx.network.publish(&topic, b.clone()).await {
                                tracing::debug!(job_id, %topic, error = %err, "job not published on gossip (duplicate or no peers)");
                            }
                        }
                    }
                }
                Effect::Lease(l) => {
                    if let Ok(b) = gcs_protocol::encode(&l) {
                        let _ = ctx.keyspace.put(&keys::lease(job_id), b.clone(), now);
                        reply = Some(b);
                    }
                }
                Effect::RejectClaim(r) => {
                    if r.reason == gcs_protocol::ClaimRejectReason::PolicyDenied {
                        // Not a lost race: a node outside the job's routing
                        // or without its membership (bounded: claims per
                        // job are capped).
                        tracing::info!(job_id = %r.job_id, node = %r.node_id, "claim refused: policy_denied");
                    }
                    reply = gcs_protocol::encode(&r).ok()
                }
                Effect::Forward(chunks) => {
                    for c in chunks {
                        // The fenced stream is recorded (job-participant scope,
                        // compacted after an hour): a restarted gateway or an
                        // auditor can replay exactly what the client received.
                        let key = keys::stream_chunk(job_id, c.sequence);
                        if let Ok(b) = gcs_protocol::encode(&c) {
                            let _ = ctx.keyspace.put(&key, b, now);
                        }
                        match a.events.try_send(JobEvent::Chunk(Box::new(c))) {
                            Ok(()) => {}
                            Err(mpsc::error::TrySendError::Full(_)) => {
                                client_gone = Some(CancellationReason::ClientBackpressure)
                            }
                            Err(mpsc::error::TrySendError::Closed(_)) => {
                                client_gone = Some(CancellationReason::ClientDisconnected)
                            }
                        }
                    }
                }
                Effect::Requeue(r) => {
                    use gcs_protocol::RequeueReason as Q;
                    let lost = !matches!(
                        r.reason,
                        Q::NoValidClaim | Q::ChildJobsFailed | Q::PayloadUnreadable
                    );
                    if let Some(node) = r.excluded_nodes.last().filter(|_| lost) {
                        let until = self.penalties.strike(node, now);
                        tracing::info!(%node, sits_out_ms = until - now, "worker lost a job");
                    }
                    let key = keys::requeue(job_id, r.requeue_count);
                    let _ =
                        ctx.keyspace.put(&key, gcs_protocol::encode(&r).unwrap_or_default(), now);
                    tracing::info!(job_id, reason = %r.reason, attempt = r.requeue_count, "job requeued");
                }
                Effect::Continue { requeue: r, continuation } => {
                    // The lost holder sits out, as after any lost job.
                    if let Some(node) = r.excluded_nodes.last() {
                        let until = self.penalties.strike(node, now);
                        tracing::info!(%node, sits_out_ms = until - now, "worker lost a job");
                    }
                    let key = keys::requeue(job_id, r.requeue_count);
                    let _ =
                        ctx.keyspace.put(&key, gcs_protocol::encode(&r).unwrap_or_default(), now);
                    super::continuations::started();
                    tracing::info!(job_id, reason = %r.reason, continuation, "job continues on another worker");
                }
                Effect::Cancel(c) => {
                    let holder = a.tracker.lease().and_then(|l| peer_of(&l.node_id));
                    if let (Some(peer), Ok(bytes)) = (holder, gcs_protocol::encode(&c)) {
                        let net = ctx.network.clone();
                        tokio::spawn(async move {
                            let _ = net.request(peer, JobRequest::Envelope(bytes)).await;
                        });
                    }
                }
                Effect::Revoke { holder, cancellation } => {
                    // The lost holder, not the current one: it may be
                    // paused or cut off, so the request may fail (the
                    // tracker sends it once more on its next late chunk).
                    if let (Some(peer), Ok(bytes)) = (peer_of(&holder), gcs_protocol::encode(&cancellation)) {
                        let net = ctx.network.clone();
                        tokio::spawn(async move {
                            let _ = net.request(peer, JobRequest::Envelope(bytes)).await;
                        });
                    }
                }
                Effect::Seam(s) => {
                    super::continuations::seam(&s);
                    tracing::info!(job_id, detect_ms = s.detect_ms, claim_ms = s.claim_ms, resume_ms = s.resume_ms, "continuation seam");
                }
                Effect::Complete(r) => {
                    let _ = ctx.keyspace.put(
                        &keys::result(job_id),
                        gcs_protocol::encode(r.as_ref()).unwrap_or_default(),
                        now,
                    );
                    if a.tracker.continuations() > 0 {
                        super::continuations::ended(true);
                    }
                    terminal = Some(JobEvent::Completed(r));
                }
                Effect::Fail { error, after_partial_output } => {
                    if let (true, Some(l)) = (error.code == "gnus_worker_lost", a.tracker.lease()) {
                        let until = self.penalties.strike(&l.node_id, now);
                        tracing::info!(node = %l.node_id, sits_out_ms = until - now, "worker lost a job");
                    }
                    if a.tracker.continuations() > 0 {
                        super::continuations::ended(false);
                    }
                    terminal = Some(JobEvent::Failed { error, after_partial_output });
                }
                Effect::Strike(node) => {
                    let until = self.penalties.strike(&node, now);
                    tracing::info!(%node, sits_out_ms = until - now, "worker broke a checked rule");
                }
                Effect::Usage(u) => {
                    if store_usage(&u, ctx).await.is_err() {
                        usage_lost = Some(a.tracker.delivered_tokens() > 0);
                    }
                }
            }
        }
        // An answer whose usage is not stored is not given: a blocking
        // request gets a 503, a stream an error event after what it got.
        if let (Some(partial), Some(JobEvent::Completed(_))) = (usage_lost, &terminal) {
            terminal = Some(JobEvent::Failed {
                error: storage_unavailable(),
                after_partial_output: partial,
            });
        }
        if let (Some(ev), Some(a)) = (terminal, self.active.get(job_id)) {
            for w in &a.watchers {
                let _ = w.try_send(ev.clone());
            }
            let _ = a.events.try_send(ev);
        }
        if let Some(reason) = client_gone {
            if let Some(a) = self.active.get_mut(job_id) {
                let effects = a.tracker.handle(Input::Cancel(reason), now, ctx.key, ctx.limits);
                let _ = a.events.try_send(JobEvent::Cancelled);
                Box::pin(self.apply(job_id, effects, ctx)).await;
            }
        }
        if self.active.get(job_id).is_some_and(|a| a.tracker.state().is_terminal()) {
            self.active.remove(job_id);
        }
        reply
    }
}
