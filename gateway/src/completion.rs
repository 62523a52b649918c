//! `POST /v1/chat/completions`, `/v1/completions` and `/v1/embeddings`:
//! admit ([`crate::admit`]), submit one job per choice or embedding batch,
//! and answer with one JSON body (here) or a stream ([`crate::sse`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use gcs_protocol::{ApiType, CancellationReason, FinalResult, FinishReason, JobLimits, Metering};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::admit::{admit, fresh_idempotency_key, submit, InFlight, EDGE_GRACE};
use crate::backend::JobEvent;
use crate::codec;
use crate::error::ApiError;
use crate::handlers::finish;
use crate::payload::{Embedding, JobRequest};
use crate::request::{EmbeddingRequest, GenerationRequest, Parsed};
use crate::{json_body, AppState};

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
                    text = codec::result_text(&r).unwrap_or_default().to_string();
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

fn with_job_headers(mut r: Response, job_id: &str, worker: &str) -> Response {
    for (k, v) in [("x-request-id", job_id), ("x-gcs-job-id", job_id), ("x-gcs-node-id", worker)] {
        if let Ok(v) = HeaderValue::from_str(v) {
            r.headers_mut().insert(k, v);
        }
    }
    r
}

/// Admits a request and answers it by kind.
async fn serve_api(state: Arc<AppState>, api: ApiType, req: Request) -> Result<Response, ApiError> {
    let (f, parsed, idem) = admit(&state, api, req).await?;
    let idem = idem.unwrap_or_else(fresh_idempotency_key);
    match parsed {
        Parsed::Generation(g) => generate(state, f, g, idem).await,
        Parsed::Embedding(e) => embed(state, f, e, idem).await,
    }
}

async fn generate(
    state: Arc<AppState>,
    mut f: InFlight,
    mut g: GenerationRequest,
    idem: String,
) -> Result<Response, ApiError> {
    g.assign_seed(&idem);
    let (api, n) = (f.common.api_type, g.n);
    let mut jobs = Vec::with_capacity(n as usize);
    for i in 0..n {
        let key = if n == 1 { idem.clone() } else { format!("{idem}#{i}") };
        jobs.push(submit(&mut f, &g.choice(i), g.stream, key).await?);
    }
    if g.stream {
        return crate::sse::respond(f, &g, jobs).await;
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
    let usage = codec::metered_usage(Some(&total), completion);
    let id = codec::response_id(api, &first_job);
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let finish =
                c.finish.map_or_else(|| codec::result_finish(&c.result), |x| x.as_str().into());
            let lp = if g.job.logprobs.is_some() {
                codec::logprobs_of(api, &c.logprobs, &mut 0)
            } else {
                Value::Null
            };
            match &g.job.tools {
                // The signed text is read for calls here, as the stream reads it.
                Some(t) => codec::tools_choice(i, &c.text, lp, &finish, t.max_calls.into(), &id),
                None => codec::choice(api, i, &c.text, lp, &finish),
            }
        })
        .collect();
    let body = codec::completion(api, &id, f.created_s, &f.common.model, choices, usage);
    let workers: Vec<String> = done.iter().map(|c| c.result.node_id.to_string()).collect();
    Ok(with_job_headers(json_body(&body), &first_job, &workers.join(",")))
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat(State(state): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let r = serve_api(state.clone(), ApiType::ChatCompletion, req).await;
    answer(&state, "chat", r)
}

/// `POST /v1/completions`.
pub(crate) async fn completions(
    State(state): State<Arc<AppState>>,
    req: Request<Body>,
) -> Response {
    let r = serve_api(state.clone(), ApiType::Completion, req).await;
    answer(&state, "completions", r)
}

fn answer(state: &AppState, endpoint: &str, r: Result<Response, ApiError>) -> Response {
    let r = r.unwrap_or_else(|e| {
        state.metrics.error(&e.code);
        if e.status.is_server_error() {
            tracing::warn!(endpoint, error = %e, "request failed");
        }
        let unread = matches!(e.status.as_u16(), 408 | 413);
        let mut r = e.into_response();
        if unread {
            // The body was not read to its end: this connection cannot
            // carry another request.
            r.headers_mut()
                .insert(axum::http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    });
    finish(state, endpoint, r)
}

/// `POST /v1/embeddings`: arrays larger than `embed_batch` inputs become
/// child jobs of one parent (26.14, [`crate::children`]), run in parallel
/// on as many workers as claim them, and reassembled in order.
pub(crate) async fn embeddings(State(state): State<Arc<AppState>>, req: Request<Body>) -> Response {
    let r = serve_api(state.clone(), ApiType::Embedding, req).await;
    answer(&state, "embeddings", r)
}

async fn embed(
    state: Arc<AppState>,
    mut f: InFlight,
    e: EmbeddingRequest,
    idem: String,
) -> Result<Response, ApiError> {
    let batch = crate::admit::embed_batch(&state.config, e.job.inputs.len())?;
    let inputs = e.job.inputs;
    let parts: Vec<JobRequest> = inputs
        .chunks(batch)
        .map(|part| JobRequest::Embedding(Embedding { inputs: part.to_vec() }))
        .collect();
    // One job when the request fits one; otherwise child jobs of one
    // parent (crate::children), spread over the workers that claim them.
    let (first_job, results) = if parts.len() == 1 {
        let (job_id, rx) = submit(&mut f, &parts[0], false, idem).await?;
        let wall = f.started + Duration::from_millis(f.limits.wall_timeout_ms) + EDGE_GRACE;
        let r = crate::children::wait(rx, wall).await;
        f.ended(&job_id);
        (job_id.clone(), vec![(job_id, r?)])
    } else {
        let done = crate::children::run(&mut f, "embeddings", parts, &idem).await?;
        (done.parent_id, done.results)
    };
    let mut data = Vec::with_capacity(inputs.len());
    let (mut tokens, mut workers) = (0u64, vec![]);
    for (_, r) in results {
        tokens += r.metering.as_ref().map_or(0, |m| m.input_tokens);
        workers.push(r.node_id.to_string());
        data.extend(codec::result_embeddings(&r));
    }
    if data.len() != inputs.len() || data.iter().any(|v| !v.is_array()) {
        return Err(ApiError::internal("a worker returned a malformed embedding answer"));
    }
    f.used_tokens = Some(tokens);
    let data: Vec<Value> = data
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let emb = if e.base64 {
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
            codec::embedding(i, emb)
        })
        .collect();
    let body = codec::embedding_list(&f.common.model, data, tokens);
    let r = json_body(&body);
    Ok(with_job_headers(r, &first_job, &workers.join(",")))
}
