//! `POST /v1/chat/completions`, `/v1/completions` and `/v1/embeddings`:
//! authenticate, parse, resolve the model against what the network serves
//! now, check the key's scope and limits, submit the job, and answer with
//! one JSON body (here) or a stream ([`crate::sse`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use gcs_protocol::{
    ApiType, CancellationReason, FinalResult, FinishReason, JobLimits, Metering, Routing,
    RoutingMode,
};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::backend::{BackendError, JobEvent, JobSpec};
use crate::error::ApiError;
use crate::handlers::{authenticate, catalog, finish, serves};
use crate::keys::KeyRecord;
use crate::limits::Ticket;
use crate::request::{parse, Parsed};
use crate::{json_body, now_ms, AppState};

/// Slack on top of a job's own timeouts before the edge gives up on the
/// network: the network's tracker fires first and says why.
pub(crate) const EDGE_GRACE: Duration = Duration::from_secs(2);

/// One admitted request. Dropping it (the client went away, or the handler
/// finished) releases its slot, settles its token reservation, and cancels
/// its jobs unless they ended.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub state: Arc<AppState>,
    pub key: KeyRecord,
    pub parsed: Parsed,
    pub limits: JobLimits,
    pub started: Instant,
    pub created_s: u64,
    ticket: Option<Ticket>,
    estimate: u64,
    /// Tokens metered, once known.
    pub used_tokens: Option<u64>,
    /// Jobs not yet ended.
    pub open_jobs: Vec<String>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::Relaxed);
        if let Some(t) = self.ticket.take() {
            self.state.limiter.settle(t, self.used_tokens.unwrap_or(self.estimate));
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

async fn read_body(state: &AppState, req: Request) -> Result<(HeaderMap, Vec<u8>), ApiError> {
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
    let bytes = axum::body::to_bytes(body, max).await.map_err(|_| ApiError::too_large(max))?;
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

/// Authenticates, parses and admits a request.
async fn admit(
    state: &Arc<AppState>,
    api: ApiType,
    req: Request,
) -> Result<(InFlight, Option<String>), ApiError> {
    let key = authenticate(state, req.headers())?;
    let (headers, bytes) = read_body(state, req).await?;
    let idem = idempotency_key(&headers)?;
    let parsed = parse(api, &bytes)?;
    let cat = catalog(state);
    let served = match cat.get(&parsed.model) {
        Some(s) if serves(&s.info, api) => s.clone(),
        Some(_) => {
            let mut e = ApiError::invalid(
                "model",
                format!("the model '{}' does not serve {}", parsed.model, api.as_str()),
            );
            e.code = "model_not_supported".into();
            return Err(e);
        }
        None => {
            let seen =
                state.seen_models.lock().unwrap_or_else(|p| p.into_inner()).contains(&parsed.model);
            // A name the network served before, or no worker at all: the
            // network is short of capacity; otherwise nobody knows the name.
            if seen || cat.is_empty() {
                return Err(ApiError::no_capable_nodes(&parsed.model));
            }
            return Err(ApiError::model_not_found(&parsed.model));
        }
    };
    let context = u64::from(served.info.context_tokens);
    if context > 0 && parsed.max_tokens >= context {
        return Err(ApiError::invalid(
            if parsed.body.contains_key("max_completion_tokens") {
                "max_completion_tokens"
            } else {
                "max_tokens"
            },
            format!("the model '{}' has a context of {context} tokens", parsed.model),
        ));
    }
    if !key.allows_model(&[parsed.model.as_str(), served.info.model_id.as_str()]) {
        return Err(ApiError::forbidden(
            "model",
            format!("this API key may not use the model '{}'", parsed.model),
        ));
    }
    if !key.allows_routing(parsed.network) {
        return Err(ApiError::forbidden(
            "gnus.network",
            format!("this API key may not use '{}' routing", parsed.network),
        ));
    }
    if !routable(state, &parsed.model, &key.tenant_id, parsed.network) {
        // Only a node of that kind may win the job: without one it would
        // wait out its queue timeout, so say so now.
        let mut e = ApiError::no_capable_nodes(&parsed.model);
        e.message = match parsed.network {
            RoutingMode::Private => format!(
                "No private node of this tenant can serve '{}' right now ('private' routing).",
                parsed.model
            ),
            _ => format!(
                "No node of swarm '{}' can serve '{}' right now ('local_only' routing).",
                state.config.swarm_id, parsed.model
            ),
        };
        return Err(e);
    }
    let c = &state.config;
    if state.in_flight.fetch_add(1, Ordering::Relaxed) >= c.max_in_flight {
        state.in_flight.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::rate_limited(
            "gateway_overloaded",
            format!("this gateway has {} requests in flight; retry shortly", c.max_in_flight),
            1,
        ));
    }
    let t = parsed.timeouts;
    let limits = JobLimits {
        first_token_timeout_ms: t
            .first_token_ms
            .or(key.first_token_timeout_ms)
            .unwrap_or(c.first_token_timeout_ms),
        idle_stream_timeout_ms: t.idle_ms.or(key.idle_timeout_ms).unwrap_or(c.idle_timeout_ms),
        wall_timeout_ms: t.wall_ms.or(key.wall_timeout_ms).unwrap_or(c.wall_timeout_ms),
        ..JobLimits::default()
    };
    // Bytes / 4 is a generous token estimate for English text; it is
    // replaced by the metered count when the request ends.
    let estimate =
        ((parsed.prompt_chars as u64).div_ceil(4) + parsed.max_tokens) * u64::from(parsed.n);
    let mut flight = InFlight {
        state: state.clone(),
        key,
        parsed,
        limits,
        started: Instant::now(),
        created_s: now_ms() / 1000,
        ticket: None,
        estimate,
        used_tokens: None,
        open_jobs: vec![],
    };
    let ticket = state
        .limiter
        .admit(&flight.key, estimate, now_ms(), || spent_tokens(state, &flight.key.id))?;
    flight.ticket = Some(ticket);
    Ok((flight, idem))
}

/// Whether a fresh registration can win a job of this routing: private
/// jobs need one of the tenant's private nodes, local-only ones a node of
/// this gateway's swarm (hybrid jobs fall back to public nodes).
fn routable(state: &AppState, model: &str, tenant: &str, network: RoutingMode) -> bool {
    let fits = |r: &gcs_protocol::NodeRegistration| match network {
        RoutingMode::Private => {
            r.queue.accepts_private_jobs && r.tenant_id.as_deref() == Some(tenant)
        }
        RoutingMode::LocalOnly => {
            r.queue.accepts_local_only_jobs && r.swarm_id == state.config.swarm_id
        }
        _ => true,
    };
    !matches!(network, RoutingMode::Private | RoutingMode::LocalOnly)
        || state.backend.registrations().iter().any(|r| {
            r.status != gcs_protocol::NodeStatus::Offline && r.model(model).is_some() && fits(r)
        })
}

/// A key's metered lifetime use, from its usage records.
fn spent_tokens(state: &AppState, key_id: &str) -> u64 {
    match state.backend.usage(key_id, 0, u64::MAX) {
        Ok(recs) => recs.iter().map(|u| u.input_tokens + u.output_tokens_generated).sum(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read usage records for a budget");
            0
        }
    }
}

/// Submits one job for the admitted request.
pub(crate) async fn submit(
    f: &mut InFlight,
    body: Vec<u8>,
    idem: String,
) -> Result<(String, mpsc::Receiver<JobEvent>), ApiError> {
    let p = &f.parsed;
    let spec = JobSpec {
        api_type: p.api_type,
        model: p.model.clone(),
        stream: p.stream,
        body,
        tenant_id: f.key.tenant_id.clone(),
        project_id: f.key.project_id.clone(),
        api_key_id: f.key.id.clone(),
        idempotency_key: idem,
        limits: f.limits.clone(),
        max_output_tokens: p.max_tokens.min(u64::from(u32::MAX)) as u32,
        routing: Routing {
            network: p.network,
            privacy_mode: p.privacy,
            swarm_id: f.state.config.swarm_id.clone(),
            ..Routing::public()
        },
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
        Err(BackendError::IdempotencyConflict { job_id }) => {
            Err(ApiError::idempotency_conflict(&job_id))
        }
        Err(BackendError::Unavailable(m)) => Err(ApiError::unavailable(m)),
        Err(BackendError::Internal(m)) => Err(ApiError::internal(m)),
    }
}

fn fresh_idempotency_key() -> String {
    let mut raw = [0u8; 16];
    let _ = getrandom::getrandom(&mut raw);
    format!("auto_{}", hex::encode(raw))
}

/// The usage object of a finished request.
pub(crate) fn usage_json(m: Option<&Metering>, completion_fallback: u64) -> Value {
    let m = m.cloned().unwrap_or_default();
    let out = if m.output_tokens == 0 { completion_fallback } else { m.output_tokens };
    json!({"prompt_tokens": m.input_tokens, "completion_tokens": out,
           "total_tokens": m.input_tokens + out,
           "prompt_tokens_details": {"cached_tokens": m.cached_tokens},
           "completion_tokens_details": {"reasoning_tokens": 0}})
}

/// `chatcmpl-...` / `cmpl-...` from the job id.
pub(crate) fn response_id(api: ApiType, job_id: &str) -> String {
    let prefix = if api == ApiType::ChatCompletion { "chatcmpl-" } else { "cmpl-" };
    format!("{prefix}{}", job_id.trim_start_matches(gcs_protocol::ids::JOB))
}

/// The finish reason a worker's result states, or `stop`.
pub(crate) fn result_finish(r: &FinalResult) -> String {
    r.response
        .as_ref()
        .and_then(|b| b.body.pointer("/choices/0/finish_reason"))
        .and_then(Value::as_str)
        .unwrap_or("stop")
        .to_string()
}

struct Collected {
    text: String,
    /// Per-token log-probabilities, in order (when asked for).
    logprobs: Vec<gcs_protocol::TokenLogprob>,
    tokens: u64,
    finish: Option<FinishReason>,
    result: Box<FinalResult>,
}

/// Waits for one job's end, gathering its fenced chunks. On the edge's own
/// timeout the job is cancelled here.
async fn collect(
    state: &AppState,
    started: Instant,
    limits: &JobLimits,
    job_id: &str,
    mut rx: mpsc::Receiver<JobEvent>,
) -> Result<Collected, ApiError> {
    let wall = started + Duration::from_millis(limits.wall_timeout_ms) + EDGE_GRACE;
    let idle = Duration::from_millis(limits.idle_stream_timeout_ms) + EDGE_GRACE;
    let (mut text, mut tokens, mut finish, mut leases) = (String::new(), 0u64, None, 0);
    let mut logprobs = vec![];
    loop {
        let deadline =
            if tokens > 0 { wall.min(tokio::time::Instant::now().into_std() + idle) } else { wall };
        let ev = match tokio::time::timeout_at(deadline.into(), rx.recv()).await {
            Ok(Some(ev)) => ev,
            Ok(None) => return Err(ApiError::internal("the network dropped the request")),
            Err(_) => {
                state.metrics.cancellation(CancellationReason::Timeout.as_str());
                state.backend.cancel(job_id.to_string(), CancellationReason::Timeout).await;
                let code = if tokens > 0 { "gnus_idle_timeout" } else { "gnus_wall_timeout" };
                return Err(ApiError::timeout(code, "the request timed out in the network"));
            }
        };
        match ev {
            JobEvent::Leased { .. } => {
                leases += 1;
                if leases == 1 {
                    state.metrics.claim.observe(started.elapsed().as_secs_f64());
                } else {
                    state.metrics.requeues.fetch_add(1, Ordering::Relaxed);
                }
            }
            JobEvent::Chunk(c) => {
                if let Some(t) = &c.delta.content {
                    text.push_str(t);
                }
                logprobs.extend(c.delta.logprobs.iter().cloned());
                tokens += u64::from(c.usage_delta.output_tokens);
                finish = finish.or(c.finish_reason);
            }
            JobEvent::Completed(r) => {
                if tokens == 0 && text.is_empty() {
                    // A repeat of an idempotent request hears only the stored
                    // result: its text is in the worker's answer.
                    let body = r.response.as_ref().map(|b| &b.body);
                    let stored = body
                        .and_then(|b| {
                            b.pointer("/choices/0/message/content")
                                .or_else(|| b.pointer("/choices/0/text"))
                        })
                        .and_then(Value::as_str);
                    text = stored.unwrap_or_default().to_string();
                }
                return Ok(Collected { text, logprobs, tokens, finish, result: r });
            }
            JobEvent::Failed { error, .. } => return Err(ApiError::from_info(&error)),
            JobEvent::Cancelled => {
                return Err(ApiError::unavailable("the request was cancelled in the network"))
            }
        }
    }
}

/// The body of choice `i` of `n`: its own seed when one was given, so the
/// choices differ under sampling the way OpenAI's do.
fn choice_body(body: &serde_json::Map<String, Value>, i: u32) -> Result<Vec<u8>, ApiError> {
    let mut b = body.clone();
    b.remove("n");
    if i > 0 {
        if let Some(seed) = b.get("seed").and_then(Value::as_i64) {
            b.insert("seed".into(), json!(seed.wrapping_add(i64::from(i))));
        }
    }
    serde_json::to_vec(&b).map_err(|e| ApiError::internal(e.to_string()))
}

fn with_job_headers(mut r: Response, job_id: &str, worker: &str) -> Response {
    for (k, v) in [("x-request-id", job_id), ("x-gcs-job-id", job_id), ("x-gcs-node-id", worker)] {
        if let Ok(v) = HeaderValue::from_str(v) {
            r.headers_mut().insert(k, v);
        }
    }
    r
}

async fn generate(state: Arc<AppState>, api: ApiType, req: Request) -> Result<Response, ApiError> {
    let (mut f, idem) = admit(&state, api, req).await?;
    let idem = idem.unwrap_or_else(fresh_idempotency_key);
    let n = f.parsed.n;
    let mut jobs = Vec::with_capacity(n as usize);
    for i in 0..n {
        let body = choice_body(&f.parsed.body, i)?;
        let key = if n == 1 { idem.clone() } else { format!("{idem}#{i}") };
        jobs.push(submit(&mut f, body, key).await?);
    }
    if f.parsed.stream {
        return Ok(crate::sse::respond(f, jobs));
    }
    let first_job = jobs[0].0.clone();
    let waits = jobs.into_iter().map(|(job_id, rx)| {
        let (state, limits, started) = (&state, &f.limits, f.started);
        async move {
            let r = collect(state, started, limits, &job_id, rx).await;
            (job_id, r)
        }
    });
    let mut done = vec![];
    for (job_id, r) in futures::future::join_all(waits).await {
        f.ended(&job_id);
        done.push(r);
    }
    let done = done.into_iter().collect::<Result<Vec<_>, _>>()?;
    let metering: Vec<Option<&Metering>> =
        done.iter().map(|c| c.result.metering.as_ref()).collect();
    // One prompt, n completions (OpenAI's accounting for n > 1).
    let prompt = metering.first().copied().flatten().cloned().unwrap_or_default();
    let completion: u64 = done
        .iter()
        .zip(&metering)
        .map(|(c, m)| m.map_or(c.tokens, |m| m.output_tokens.max(c.tokens)))
        .sum();
    let total = Metering { output_tokens: completion, ..prompt.clone() };
    f.used_tokens = Some(prompt.input_tokens + completion);
    state.metrics.tokens_generated.fetch_add(completion, Ordering::Relaxed);
    state
        .metrics
        .tokens_delivered
        .fetch_add(done.iter().map(|c| c.tokens).sum(), Ordering::Relaxed);
    let usage = usage_json(Some(&total), completion);
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let finish = c.finish.map_or_else(|| result_finish(&c.result), |x| x.as_str().into());
            if api == ApiType::ChatCompletion {
                let lp = if f.parsed.logprobs { logprobs_json(&c.logprobs) } else { Value::Null };
                json!({"index": i, "message": {"role": "assistant", "content": c.text,
                                               "refusal": null},
                       "logprobs": lp, "finish_reason": finish})
            } else {
                json!({"index": i, "text": c.text, "logprobs": null, "finish_reason": finish})
            }
        })
        .collect();
    let object = if api == ApiType::ChatCompletion { "chat.completion" } else { "text_completion" };
    let body = json!({"id": response_id(api, &first_job), "object": object,
                      "created": f.created_s, "model": f.parsed.model,
                      "system_fingerprint": null, "choices": choices, "usage": usage});
    let workers: Vec<String> = done.iter().map(|c| c.result.node_id.to_string()).collect();
    Ok(with_job_headers(json_body(&body), &first_job, &workers.join(",")))
}

/// OpenAI's chat `logprobs` object for these tokens.
pub(crate) fn logprobs_json(lp: &[gcs_protocol::TokenLogprob]) -> Value {
    let content: Vec<Value> = lp
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|a| json!({"token": a.token, "logprob": a.logprob, "bytes": a.bytes}))
                .collect();
            json!({"token": t.token, "logprob": t.logprob, "bytes": t.bytes, "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat(State(state): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let r = generate(state.clone(), ApiType::ChatCompletion, req).await;
    answer(&state, "chat", r)
}

/// `POST /v1/completions`.
pub(crate) async fn completions(
    State(state): State<Arc<AppState>>,
    req: Request<Body>,
) -> Response {
    let r = generate(state.clone(), ApiType::Completion, req).await;
    answer(&state, "completions", r)
}

fn answer(state: &AppState, endpoint: &str, r: Result<Response, ApiError>) -> Response {
    let r = r.unwrap_or_else(|e| {
        state.metrics.error(&e.code);
        if e.status.is_server_error() {
            tracing::warn!(endpoint, error = %e, "request failed");
        }
        e.into_response()
    });
    finish(state, endpoint, r)
}

/// `POST /v1/embeddings`: arrays are split into jobs of `embed_batch`
/// inputs, run in parallel (on as many workers as claim them), and
/// reassembled in order.
pub(crate) async fn embeddings(State(state): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let r = embed(state.clone(), req).await;
    answer(&state, "embeddings", r)
}

async fn embed(state: Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let (mut f, idem) = admit(&state, ApiType::Embedding, req).await?;
    let idem = idem.unwrap_or_else(fresh_idempotency_key);
    let batch = state.config.embed_batch.max(1);
    let inputs = f.parsed.inputs.clone();
    let mut jobs = vec![];
    for (i, part) in inputs.chunks(batch).enumerate() {
        let body = json!({"model": f.parsed.model, "input": part});
        let body = serde_json::to_vec(&body).map_err(|e| ApiError::internal(e.to_string()))?;
        jobs.push(submit(&mut f, body, format!("{idem}#{i}")).await?);
    }
    let first_job = jobs.first().map(|j| j.0.clone()).unwrap_or_default();
    let mut waits = vec![];
    for (job_id, mut rx) in jobs {
        let wall = f.started + Duration::from_millis(f.limits.wall_timeout_ms) + EDGE_GRACE;
        waits.push(async move {
            loop {
                match tokio::time::timeout_at(wall.into(), rx.recv()).await {
                    Ok(Some(JobEvent::Completed(r))) => return (job_id, Ok(r)),
                    Ok(Some(JobEvent::Failed { error, .. })) => {
                        return (job_id, Err(Some(ApiError::from_info(&error))))
                    }
                    Ok(Some(JobEvent::Cancelled)) | Ok(None) => return (job_id, Err(None)),
                    Ok(Some(_)) => continue,
                    Err(_) => {
                        let e = ApiError::timeout("gnus_wall_timeout", "the request timed out");
                        return (job_id, Err(Some(e)));
                    }
                }
            }
        });
    }
    let results = futures::future::join_all(waits).await;
    let mut data = Vec::with_capacity(inputs.len());
    let (mut tokens, mut workers) = (0u64, vec![]);
    let mut failure = None;
    for (job_id, r) in results {
        f.ended(&job_id);
        match r {
            Ok(r) => {
                tokens += r.metering.as_ref().map_or(0, |m| m.input_tokens);
                workers.push(r.node_id.to_string());
                let vecs = r
                    .response
                    .as_ref()
                    .and_then(|b| b.body.get("data"))
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                for v in vecs {
                    data.push(v.get("embedding").cloned().unwrap_or(Value::Null));
                }
            }
            Err(e) => {
                failure.get_or_insert(e.unwrap_or_else(|| {
                    ApiError::unavailable("the request was cancelled in the network")
                }));
            }
        }
    }
    if let Some(e) = failure {
        // Any other part still running is cancelled when `f` drops.
        return Err(e);
    }
    if data.len() != inputs.len() || data.iter().any(|v| !v.is_array()) {
        return Err(ApiError::internal("a worker returned a malformed embedding answer"));
    }
    f.used_tokens = Some(tokens);
    let data: Vec<Value> = data
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let emb = if f.parsed.base64 {
                let bytes: Vec<u8> = v
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|x| (x.as_f64().unwrap_or(0.0) as f32).to_le_bytes())
                    .collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                v
            };
            json!({"object": "embedding", "index": i, "embedding": emb})
        })
        .collect();
    let body = json!({"object": "list", "data": data, "model": f.parsed.model,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    let r = json_body(&body);
    Ok(with_job_headers(r, &first_job, &workers.join(",")))
}
