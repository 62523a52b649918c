//! Admission: authenticate, parse, resolve the model against what the
//! network serves now, check the key's scope and limits, and submit jobs.
//! An admitted request is an [`InFlight`], whose drop settles it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::HeaderMap;
use gcs_protocol::{ApiType, CancellationReason, JobLimits, Routing, RoutingMode};
use tokio::sync::mpsc;

use crate::backend::{JobEvent, JobSpec};
use crate::error::ApiError;
use crate::handlers::{authenticate, catalog, serves};
use crate::keys::KeyRecord;
use crate::limits::Ticket;
use crate::payload::JobRequest;
use crate::request::{parse, Common, Parsed};
use crate::{now_ms, AppState};

/// Slack on top of a job's own timeouts before the edge gives up on the
/// network: the network's tracker fires first and says why.
pub(crate) const EDGE_GRACE: Duration = Duration::from_secs(2);

/// Most embedding inputs one job carries when a large request is split into
/// at most `max_jobs_per_request` jobs.
pub(crate) const MAX_INPUTS_PER_JOB: usize = 64;

/// Places among the gateway's `max_in_flight` jobs: one taken before the
/// body is read (so unadmitted clients cannot hold many bodies in memory),
/// grown to the request's job count once it is parsed, all held until the
/// request ends.
#[derive(Debug)]
pub(crate) struct Slot {
    state: Arc<AppState>,
    held: usize,
}

impl Slot {
    fn take(state: &Arc<AppState>) -> Result<Self, ApiError> {
        let mut s = Slot { state: state.clone(), held: 0 };
        s.grow(1)?;
        Ok(s)
    }

    /// Holds `n` places in all.
    fn grow(&mut self, n: usize) -> Result<(), ApiError> {
        let more = n.saturating_sub(self.held);
        let max = self.state.config.max_in_flight;
        if self.state.in_flight.fetch_add(more, Ordering::Relaxed) + more > max {
            self.state.in_flight.fetch_sub(more, Ordering::Relaxed);
            return Err(ApiError::rate_limited(
                "gateway_overloaded",
                format!("this gateway has {max} jobs in flight; retry shortly"),
                1,
            ));
        }
        self.held += more;
        Ok(())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(self.held, Ordering::Relaxed);
    }
}

/// Inputs per job for an embeddings request of `inputs` inputs: the
/// configured batch, larger when that would make more than
/// `max_jobs_per_request` jobs, and a 400 when even
/// [`MAX_INPUTS_PER_JOB`] would.
pub(crate) fn embed_batch(config: &crate::GatewayConfig, inputs: usize) -> Result<usize, ApiError> {
    let max_jobs = config.max_jobs_per_request.max(1);
    let per_job = config.embed_batch.max(1).max(inputs.div_ceil(max_jobs));
    if per_job > MAX_INPUTS_PER_JOB.max(config.embed_batch) {
        let most = max_jobs * MAX_INPUTS_PER_JOB.max(config.embed_batch);
        return Err(ApiError::invalid(
            "input",
            format!("this gateway takes at most {most} inputs per request"),
        ));
    }
    Ok(per_job)
}

/// The jobs a parsed request becomes on the network.
fn job_count(config: &crate::GatewayConfig, parsed: &Parsed) -> Result<usize, ApiError> {
    match parsed {
        Parsed::Generation(g) => {
            let max = config.max_jobs_per_request.max(1);
            if g.n as usize > max {
                return Err(ApiError::invalid(
                    "n",
                    format!("this gateway takes at most n = {max}"),
                ));
            }
            Ok(g.n as usize)
        }
        Parsed::Embedding(e) => {
            let n = e.job.inputs.len();
            Ok(n.div_ceil(embed_batch(config, n)?))
        }
    }
}

/// One admitted request. Dropping it (the client went away, or the handler
/// finished) releases its slot, settles its token reservation, and cancels
/// its jobs unless they ended.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub state: Arc<AppState>,
    pub key: KeyRecord,
    /// Model, routing, limits of the request.
    pub common: Common,
    pub limits: JobLimits,
    pub started: Instant,
    pub created_s: u64,
    ticket: Option<Ticket>,
    estimate: u64,
    /// Tokens metered, once known.
    pub used_tokens: Option<u64>,
    /// Jobs not yet ended.
    pub open_jobs: Vec<String>,
    /// The batch this request runs for (its jobs' usage records name it).
    pub batch_id: Option<String>,
    _slot: Slot,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            let used = self.used_tokens.unwrap_or(self.estimate);
            // As its usage records charge it: batch work at the batch price.
            let pct = u64::from(self.state.config.batch_price());
            let charged =
                if self.batch_id.is_some() { used.saturating_mul(pct).div_ceil(100) } else { used };
            self.state.limiter.settle(t, charged);
        }
        if self.open_jobs.is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        for job in std::mem::take(&mut self.open_jobs) {
            tracing::info!(job_id = %job, "client went away: cancelling its job");
            self.state.metrics.cancellation(CancellationReason::ClientDisconnected.as_str());
            let b = self.state.backend.clone();
            rt.spawn(async move { b.cancel(job, CancellationReason::ClientDisconnected).await });
        }
    }
}

impl InFlight {
    /// The job ended (any outcome): no cancel on drop.
    pub fn ended(&mut self, job_id: &str) {
        self.open_jobs.retain(|j| j != job_id);
    }

    /// Cancels a job now for `reason`.
    pub async fn cancel(&mut self, job_id: &str, reason: CancellationReason) {
        self.ended(job_id);
        self.state.metrics.cancellation(reason.as_str());
        self.state.backend.cancel(job_id.to_string(), reason).await;
    }
}

pub(crate) async fn read_body(
    state: &AppState,
    req: Request,
) -> Result<(HeaderMap, Vec<u8>), ApiError> {
    let max = state.config.max_body_bytes;
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > max) {
        return Err(ApiError::too_large(max));
    }
    if let Some(ct) = parts.headers.get(axum::http::header::CONTENT_TYPE) {
        // No Content-Type is read as JSON (as OpenAI does); a declared
        // form, text or binary body is refused rather than guessed at.
        let ct = String::from_utf8_lossy(ct.as_bytes()).to_ascii_lowercase();
        let essence = ct.split(';').next().unwrap_or_default().trim();
        if essence != "application/json" && !essence.ends_with("+json") {
            return Err(ApiError::unsupported_media_type(essence));
        }
    }
    // The whole body within one bound: a client trickling it byte by byte
    // would otherwise hold its in-flight slot for as long as it likes.
    let limit = state.config.edge.body_read_timeout;
    let bytes = match tokio::time::timeout(limit, axum::body::to_bytes(body, max)).await {
        Ok(r) => r.map_err(|_| ApiError::too_large(max))?,
        Err(_) => {
            state.metrics.body_timeouts.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::request_timeout(limit.as_secs().max(1)));
        }
    };
    Ok((parts.headers, bytes.to_vec()))
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get("idempotency-key") else { return Ok(None) };
    match v.to_str() {
        Ok(s) if !s.is_empty() && s.len() <= 255 && s.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Some(s.to_string()))
        }
        _ => Err(ApiError::invalid(
            "Idempotency-Key",
            "the Idempotency-Key header must be 1 to 255 visible ASCII characters",
        )),
    }
}

/// The key a batch request runs as, in the request's extensions (set only
/// by `batch::run`; no client can put it there).
#[derive(Clone, Debug)]
pub(crate) struct BatchCaller {
    /// The batch's creating key (re-read and checked live before each request).
    pub key: KeyRecord,
    /// The batch's id, carried to its jobs' usage records.
    pub batch_id: String,
}

/// Authenticates, parses and admits a request; returns it, the parsed
/// request and the client's idempotency key.
pub(crate) async fn admit(
    state: &Arc<AppState>,
    api: ApiType,
    req: Request,
) -> Result<(InFlight, Parsed, Option<String>), ApiError> {
    // A batch's request runs as the key that created the batch (see
    // `batch::run`); only the gateway itself can set that extension.
    let caller = req.extensions().get::<BatchCaller>().cloned();
    let is_batch = caller.is_some();
    let batch_id = caller.as_ref().map(|c| c.batch_id.clone());
    let key = match caller.map(|c| c.key) {
        Some(k) => k,
        None => authenticate(state, req.headers())?,
    };
    let slot = Slot::take(state)?;
    let (headers, bytes) = read_body(state, req).await?;
    let idem = idempotency_key(&headers)?;
    let parsed = parse(api, &bytes)?;
    let (max_tokens, n) = (parsed.max_tokens(), parsed.n());
    let jobs = job_count(&state.config, &parsed)?;
    let common = parsed.common().clone();
    let cat = catalog(state);
    let served = match cat.get(&common.model) {
        Some(s) if serves(&s.info, api) => s.clone(),
        Some(_) => {
            let mut e = ApiError::invalid(
                "model",
                format!("the model '{}' does not serve {}", common.model, api.as_str()),
            );
            e.code = "model_not_supported".into();
            return Err(e);
        }
        None => {
            let seen =
                state.seen_models.lock().unwrap_or_else(|p| p.into_inner()).contains(&common.model);
            // A name the network served before, or no worker at all: the
            // network is short of capacity; otherwise nobody knows the name.
            if seen || cat.is_empty() {
                return Err(ApiError::no_capable_nodes(&common.model));
            }
            return Err(ApiError::model_not_found(&common.model));
        }
    };
    let context = u64::from(served.info.context_tokens);
    if context > 0 && max_tokens >= context {
        let field = match &parsed {
            Parsed::Generation(g) => g.budget_field,
            Parsed::Embedding(_) => "max_tokens",
        };
        return Err(ApiError::invalid(
            field,
            format!("the model '{}' has a context of {context} tokens", common.model),
        ));
    }
    if let Parsed::Generation(g) = &parsed {
        // The engine's own rules, with the catalogue's limits for this
        // model (the worker applies the same function with its engine's).
        let model = crate::validate::ModelLimits {
            context_tokens: Some(served.info.context_tokens).filter(|&c| c > 0),
            vocab_size: Some(served.info.vocab_size).filter(|&v| v > 0),
        };
        crate::validate::generation(&g.job, model, crate::validate::PromptTokens::FromBytes)
            .map_err(|e| ApiError::invalid(e.param, e.message))?;
    }
    if !key.allows_model(&[common.model.as_str(), served.info.model_id.as_str()]) {
        return Err(ApiError::forbidden(
            "model",
            format!("this API key may not use the model '{}'", common.model),
        ));
    }
    if !key.allows_routing(common.network) {
        return Err(ApiError::forbidden(
            "gnus.network",
            format!("this API key may not use '{}' routing", common.network),
        ));
    }
    if !routable(state, &common.model, &key.tenant_id, common.network) {
        // Only a node of that kind may win the job: without one it would
        // wait out its queue timeout, so say so now.
        let mut e = ApiError::no_capable_nodes(&common.model);
        e.message = match common.network {
            RoutingMode::Private => format!(
                "No private node of this tenant can serve '{}' right now ('private' routing).",
                common.model
            ),
            RoutingMode::GatewayLocal => format!(
                "No worker attached to this gateway can serve '{}' right now ('gateway_local' routing).",
                common.model
            ),
            _ => format!(
                "No node of swarm '{}' can serve '{}' right now ('local_only' routing).",
                state.config.swarm_id, common.model
            ),
        };
        return Err(e);
    }
    if let Some(rpm) = key.rpm.filter(|r| !is_batch && (*r as usize) < jobs) {
        // It would never fit the key's window: say so instead of a 429
        // that a retry cannot cure.
        let param = if api == ApiType::Embedding { "input" } else { "n" };
        return Err(ApiError::invalid(
            param,
            format!("this request is {jobs} jobs; this key allows {rpm} per minute"),
        ));
    }
    let mut slot = slot;
    slot.grow(jobs)?;
    let c = &state.config;
    let t = common.timeouts;
    let limits = JobLimits {
        first_token_timeout_ms: t
            .first_token_ms
            .or(key.first_token_timeout_ms)
            .unwrap_or(c.first_token_timeout_ms),
        idle_stream_timeout_ms: t.idle_ms.or(key.idle_timeout_ms).unwrap_or(c.idle_timeout_ms),
        wall_timeout_ms: t.wall_ms.or(key.wall_timeout_ms).unwrap_or_else(|| {
            default_wall_ms(c.wall_timeout_ms, max_tokens, served.decode_tokens_per_s)
        }),
        max_continuations: common.continuation.max_continuations(),
        ..JobLimits::default()
    };
    // Bytes / 4 is a generous token estimate for English text; it is
    // replaced by the metered count when the request ends.
    let estimate = (common.prompt_chars as u64)
        .div_ceil(4)
        .saturating_add(max_tokens)
        .saturating_mul(u64::from(n));
    let mut flight = InFlight {
        state: state.clone(),
        key,
        common,
        limits,
        started: Instant::now(),
        created_s: now_ms() / 1000,
        ticket: None,
        estimate,
        used_tokens: None,
        open_jobs: vec![],
        batch_id,
        _slot: slot,
    };
    let spent = || spent_tokens(state, &flight.key.id);
    let ticket = if is_batch {
        // Batch work fills idle capacity: it never uses up the key's
        // per-minute limits that interactive requests need, and it reserves
        // the share of its estimate it will be charged (the batch price).
        let pct = u64::from(state.config.batch_price());
        state.limiter.admit_budget(&flight.key, estimate.saturating_mul(pct).div_ceil(100), spent)?
    } else {
        state.limiter.admit(&flight.key, estimate, jobs as u32, now_ms(), spent)?
    };
    flight.ticket = Some(ticket);
    Ok((flight, parsed, idem))
}

/// Whether a fresh registration can win a job of this routing: private
/// jobs need one of the tenant's private nodes, local-only ones a node of
/// this gateway's swarm (hybrid jobs fall back to public nodes). A node
/// counts only when it presents a membership certificate for the tenant or
/// swarm: what it says of itself wins no claim (the node's claim check
/// verifies the certificate's issuer and signature; this is the fast 503).
fn routable(state: &AppState, model: &str, tenant: &str, network: RoutingMode) -> bool {
    use gcs_protocol::MembershipScope as S;
    let presents = |r: &gcs_protocol::NodeRegistration, scope: S, group: &str| {
        r.memberships.iter().any(|c| c.scope == scope && c.group_id == group)
    };
    let fits = |r: &gcs_protocol::NodeRegistration| match network {
        RoutingMode::Private => {
            r.queue.accepts_private_jobs && presents(r, S::TenantMember, tenant)
        }
        RoutingMode::LocalOnly => {
            r.queue.accepts_local_only_jobs
                && presents(r, S::SwarmMember, &state.config.swarm_id)
        }
        // The gateway's own worker, or one it attached.
        RoutingMode::GatewayLocal => {
            let me = state.config.gateway_id.as_str();
            r.node_id.as_str() == me || presents(r, S::GatewayWorker, me)
        }
        _ => true,
    };
    let gated = match network {
        RoutingMode::Private | RoutingMode::LocalOnly => true,
        RoutingMode::GatewayLocal => !state.config.gateway_id.is_empty(),
        _ => false,
    };
    !gated
        || state.backend.registrations().iter().any(|r| {
            r.status != gcs_protocol::NodeStatus::Offline && r.model(model).is_some() && fits(r)
        })
}

/// The most a model's speed stretches the default wall timeout to.
const MAX_DEFAULT_WALL_MS: u64 = 30 * 60 * 1000;
/// How many times its decode time at the model's median advertised speed
/// a request's default wall timeout allows: batching, a prompt to prefill
/// and a busier worker all slow one stream.
const WALL_HEADROOM: f64 = 4.0;

/// The default wall timeout of a request for `max_tokens` of a model whose
/// workers advertise a median decode speed of `tokens_per_s` (0: none
/// advertised): the configured one, or long enough for `max_tokens` at
/// that speed with [`WALL_HEADROOM`], up to [`MAX_DEFAULT_WALL_MS`], so a
/// slow model's long answer is not cut while it still streams (the idle
/// timeout still ends a stalled one). Liars need a majority of the
/// model's workers to move the median, and moving it only lengthens the
/// default within the cap or leaves the configured one; a request or key
/// that sets its own wall timeout keeps it.
fn default_wall_ms(configured_ms: u64, max_tokens: u64, tokens_per_s: f64) -> u64 {
    if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) {
        return configured_ms;
    }
    let needed = max_tokens as f64 / tokens_per_s * WALL_HEADROOM * 1000.0;
    // `as` saturates; the cap bounds what a low advertised speed can ask.
    configured_ms.max((needed.ceil() as u64).min(MAX_DEFAULT_WALL_MS))
}

/// A key's metered lifetime use, from its usage records.
fn spent_tokens(state: &AppState, key_id: &str) -> u64 {
    match state.backend.usage(key_id, 0, u64::MAX) {
        // Saturating: a record's counts come from the network.
        // A parent's roll-up charges nothing (its children's records do);
        // batch work is charged at the price its record names.
        Ok(recs) => recs.iter().fold(0u64, |a, u| a.saturating_add(u.charged_tokens())),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read usage records for a budget");
            0
        }
    }
}

/// Submits one job of the admitted request: `job` is its signed payload.
pub(crate) async fn submit(
    f: &mut InFlight,
    job: &JobRequest,
    stream: bool,
    idem: String,
) -> Result<(String, mpsc::Receiver<JobEvent>), ApiError> {
    let limits = f.limits.clone();
    submit_as(f, job, stream, idem, None, limits).await
}

/// [`submit`] of a child job of the request (`parent`), under `limits`
/// (the caller's: a child's wall timeout ends at the parent's deadline).
pub(crate) async fn submit_as(
    f: &mut InFlight,
    job: &JobRequest,
    stream: bool,
    idem: String,
    parent: Option<gcs_protocol::ChildJobReference>,
    limits: JobLimits,
) -> Result<(String, mpsc::Receiver<JobEvent>), ApiError> {
    let body = job.encode().map_err(|e| ApiError::internal(e.to_string()))?;
    let max_output_tokens = match job {
        JobRequest::Generation(g) => g.max_tokens,
        JobRequest::Embedding(_) => 0,
    };
    let c = &f.common;
    let spec = JobSpec {
        api_type: c.api_type,
        model: c.model.clone(),
        stream,
        body,
        tenant_id: f.key.tenant_id.clone(),
        project_id: f.key.project_id.clone(),
        api_key_id: f.key.id.clone(),
        idempotency_key: idem,
        limits,
        max_output_tokens,
        routing: Routing {
            network: c.network,
            privacy_mode: c.privacy,
            swarm_id: f.state.config.swarm_id.clone(),
            ..Routing::public()
        },
        batch_id: f.batch_id.clone(),
        parent,
        // Batch work is charged at the gateway's batch price.
        price_percent: f.batch_id.as_ref().map(|_| f.state.config.batch_price()),
    };
    let r = f.state.backend.submit(spec).await;
    if r.is_err() && f.open_jobs.is_empty() {
        // Nothing ran: the request's token reservation is released whole.
        f.used_tokens = Some(0);
    }
    match r {
        Ok((id, rx)) => {
            f.open_jobs.push(id.clone());
            Ok((id, rx))
        }
        Err(e) => Err(e.to_api()),
    }
}

/// A key for a request that names none: a repeat is then a new job.
pub(crate) fn fresh_idempotency_key() -> String {
    let mut raw = [0u8; 16];
    let _ = getrandom::getrandom(&mut raw);
    format!("auto_{}", hex::encode(raw))
}
