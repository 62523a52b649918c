//! Running one batch on this gateway (specs/batch.md, "Execution"):
//! validate the input, then send each request through the gateway's own
//! endpoint handler as the creating key, so a batch request is admitted,
//! validated, metered and answered exactly as the same request sent alone.
//!
//! Below interactive traffic: at most `per_batch` requests of a batch and
//! `global` of all batches in flight (never more than half of the gateway's
//! `max_in_flight`), and none starts while half of those places are taken; batch requests do not
//! count against the key's per-minute limits (they do against its budget).
//! Each request carries the idempotency key `<batch id>-<index>-<attempt>`,
//! so after a restart a request whose result was not yet recorded is
//! answered by the network from its stored result, not run twice.

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use futures::{FutureExt, StreamExt};
use gcs_protocol::ApiType;
use serde_json::Value;

use super::store::{entry, expired, Entry};
use super::validate::{self, Line, LineError};
use super::{cancelled, live_key, Active, Status};
use crate::admit::BatchCaller;
use crate::error::ApiError;
use crate::files::{blocking, Purpose};
use crate::{now_ms, AppState};

/// Largest response body kept for one output line.
const MAX_RESPONSE_BYTES: usize = 8 << 20;
/// How often the record's `request_counts` are written while it runs.
const SAVE_EVERY: Duration = Duration::from_millis(500);

/// Runs (or resumes) the batch until it ends; a storage failure stops it
/// (it resumes at the next start).
pub(crate) async fn run(state: Arc<AppState>, a: Arc<Active>) {
    let id = a.snapshot().id;
    if let Err(e) = drive(&state, &a).await {
        tracing::error!(batch_id = %id, error = %e, "batch stopped; it resumes at the next start");
    }
    state.batches.ended(&id);
}

async fn save(state: &AppState, a: &Active) -> Result<(), ApiError> {
    a.persist(&state.batches.store).await
}

async fn fail(state: &AppState, a: &Active, errors: Vec<LineError>) -> Result<(), ApiError> {
    let rec = a.update(|r| {
        r.status = Status::Failed;
        r.failed_at = Some(now_ms() / 1000);
        r.errors = errors;
    });
    tracing::info!(batch_id = %rec.id, errors = rec.errors.len(), "batch failed validation");
    save(state, a).await
}

/// Whether `model` may be served: the catalogue has it, it was served
/// recently, or no worker is known at all (then nobody can tell yet).
fn known(state: &AppState, model: &str) -> bool {
    let cat = crate::handlers::catalog(state);
    cat.is_empty()
        || cat.get(model).is_some()
        || state.seen_models.lock().unwrap_or_else(|p| p.into_inner()).contains(model)
}

async fn drive(state: &Arc<AppState>, a: &Arc<Active>) -> Result<(), ApiError> {
    let rec = a.snapshot();
    if matches!(rec.status, Status::Validating | Status::InProgress) {
        let lines = if rec.adopted_from.is_some() {
            // Taken over from another gateway (the input file is the
            // creator's): the lines come from the tasks in the network.
            match super::adopt::lines(state, &rec).await? {
                Some(l) => l,
                None => {
                    let e = LineError::whole(
                        "batch_records_lost",
                        "this gateway no longer holds the batch's requests",
                    );
                    return fail(state, a, vec![e]).await;
                }
            }
        } else {
            let (files, t, f) =
                (state.files.clone(), rec.tenant_id.clone(), rec.input_file_id.clone());
            let Some(input) = blocking(move || files.content(&t, &f)).await? else {
                let e = LineError::whole("input_file_not_found", "the input file was deleted");
                return fail(state, a, vec![e]).await;
            };
            match validate::lines(&input, &rec.endpoint) {
                Ok(l) => l,
                Err(errors) => return fail(state, a, errors).await,
            }
        };
        if rec.status == Status::Validating {
            let errors = validate::models(&lines, |m| known(state, m));
            if !errors.is_empty() {
                return fail(state, a, errors).await;
            }
            a.update(|r| {
                r.total = lines.len() as u64;
                if r.status == Status::Validating {
                    r.status = Status::InProgress;
                    r.in_progress_at = Some(now_ms() / 1000);
                }
            });
            save(state, a).await?;
        }
        if a.snapshot().status == Status::InProgress {
            execute(state, a, &lines).await?;
        }
    }
    // Cancelled (now, or before a restart): its tasks end in the network too.
    if a.snapshot().status == Status::Cancelling {
        super::queue::cancel_tasks(state, &a.snapshot()).await;
    }
    finalize(state, a).await
}

async fn execute(state: &Arc<AppState>, a: &Arc<Active>, lines: &[Line]) -> Result<(), ApiError> {
    let rec = a.snapshot();
    let (store, r2) = (state.batches.store.clone(), rec.clone());
    let done = blocking(move || store.results(&r2)).await?;
    a.update(|r| {
        (r.completed, r.failed, r.input_tokens, r.output_tokens) = (0, 0, 0, 0);
        done.iter().for_each(|e| r.count(e));
    });
    let mut done: HashSet<u64> = done.iter().map(|e| e.i).collect();
    let Some(api) = validate::endpoint_api(&rec.endpoint) else {
        return Err(ApiError::internal("a batch record names an unknown endpoint"));
    };
    // On the swarm's processing queue when every request can run there.
    if super::queue::run(state, a, api, lines, &mut done).await? {
        return save(state, a).await;
    }
    state.metrics.batch_runs_gateway.fetch_add(1, Ordering::Relaxed);
    // Owned indices: a stream of borrowed lines is not provably Send.
    let pending: Vec<usize> = (0..lines.len()).filter(|i| !done.contains(&(*i as u64))).collect();
    let per_batch = state.batches.limits.per_batch.max(1);
    let mut results = std::pin::pin!(futures::stream::iter(pending)
        .map(|i| request(state, a, api, i as u64, &lines[i]))
        .buffer_unordered(per_batch));
    let mut saved = Instant::now();
    while let Some(entry) = results.next().await {
        let Some(entry) = entry else { continue };
        state
            .batches
            .store
            .append(&rec, std::slice::from_ref(&entry))
            .map_err(crate::files::api_error)?;
        a.update(|r| r.count(&entry));
        if saved.elapsed() >= SAVE_EVERY {
            save(state, a).await?;
            saved = Instant::now();
        }
    }
    save(state, a).await
}

/// One request of the batch: `None` if the batch was cancelled first.
async fn request(
    state: &Arc<AppState>,
    a: &Arc<Active>,
    api: ApiType,
    i: u64,
    line: &Line,
) -> Option<Entry> {
    if a.cancel.load(Ordering::Relaxed) {
        return None;
    }
    let rec = a.snapshot();
    if now_ms() / 1000 >= rec.expires_at {
        return Some(expired(i, line));
    }
    tokio::select! {
        _ = cancelled(a) => None,
        e = attempts(state, &rec.id, &rec.api_key_id, api, i, line) => Some(e),
    }
}

async fn attempts(
    state: &Arc<AppState>,
    batch_id: &str,
    key_id: &str,
    api: ApiType,
    i: u64,
    line: &Line,
) -> Entry {
    let Ok(_slot) = state.batches.slots.clone().acquire_owned().await else {
        return entry(i, line, 500, None, ApiError::internal("batch slots closed").body());
    };
    let retries = state.batches.limits.retries;
    let mut attempt = 0;
    loop {
        // Interactive requests keep at least half of this gateway's places.
        let headroom = (state.config.max_in_flight / 2).max(1);
        while state.in_flight.load(Ordering::Relaxed) >= headroom {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let Some(key) = live_key(state, key_id) else {
            return entry(i, line, 401, None, ApiError::unauthorized().body());
        };
        let req = Request::builder()
            .method("POST")
            .uri(endpoint_path(api))
            .header(axum::http::header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", format!("{batch_id}-{i}-{attempt}"))
            .extension(BatchCaller { key, batch_id: batch_id.to_string() })
            .body(Body::from(line.body.clone()));
        let resp = match req {
            Ok(req) => dispatch(state.clone(), api, req).await,
            Err(e) => ApiError::internal(e.to_string()).into_response(),
        };
        let status = resp.status().as_u16();
        let (request_id, retry_after) = {
            let h = resp.headers();
            let header = |k: &str| h.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
            let retry = header("retry-after").and_then(|v| v.parse::<u64>().ok()).unwrap_or(1);
            (header("x-request-id"), retry)
        };
        let bytes = axum::body::to_bytes(resp.into_body(), MAX_RESPONSE_BYTES).await;
        // An exhausted budget does not refill: its 429 is the answer.
        let spent = status == 429
            && bytes.as_ref().is_ok_and(|b| {
                serde_json::from_slice::<Value>(b)
                    .is_ok_and(|v| v["error"]["code"] == "insufficient_quota")
            });
        // Capacity (429, 503) and the gateway's own failures (500: also
        // what a request hears when the node is stopping, which must not
        // become its final answer) are asked again.
        if matches!(status, 429 | 500 | 503) && !spent && attempt < retries {
            attempt += 1;
            tokio::time::sleep(Duration::from_secs(retry_after.clamp(1, 30))).await;
            continue;
        }
        let body = match bytes {
            Ok(b) => serde_json::from_slice(&b)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&b).into_owned())),
            Err(_) => ApiError::internal("the response was too large to keep").body(),
        };
        return entry(i, line, status, request_id, body);
    }
}

fn endpoint_path(api: ApiType) -> &'static str {
    match api {
        ApiType::Embedding => "/v1/embeddings",
        ApiType::Completion => "/v1/completions",
        _ => "/v1/chat/completions",
    }
}

/// The endpoint's own handler; a panic is a 500 line, not a dead batch.
async fn dispatch(state: Arc<AppState>, api: ApiType, req: Request) -> Response {
    let fut = async move {
        match api {
            ApiType::Embedding => crate::completion::embeddings(State(state), req).await,
            ApiType::Completion => crate::completion::completions(State(state), req).await,
            _ => crate::completion::chat(State(state), req).await,
        }
    };
    match AssertUnwindSafe(fut).catch_unwind().await {
        Ok(r) => r,
        Err(_) => ApiError::internal("a batch request panicked").into_response(),
    }
}

fn jsonl(entries: &[&Entry]) -> Vec<u8> {
    let mut out = vec![];
    for e in entries {
        let _ = serde_json::to_writer(&mut out, &e.out);
        out.push(b'\n');
    }
    out
}

/// Writes the output and error files and ends the batch.
async fn finalize(state: &Arc<AppState>, a: &Arc<Active>) -> Result<(), ApiError> {
    let rec = a.update(|r| {
        if r.status == Status::InProgress {
            r.status = Status::Finalizing;
            r.finalizing_at = Some(now_ms() / 1000);
        }
    });
    save(state, a).await?;
    let (store, r2) = (state.batches.store.clone(), rec.clone());
    let entries = blocking(move || store.results(&r2)).await?;
    let (ok, bad): (Vec<&Entry>, Vec<&Entry>) = entries.iter().partition(|e| e.ok);
    let expired = bad.iter().any(|e| e.out["error"]["code"] == "batch_expired");
    let write = |name: String, bytes: Vec<u8>| {
        let (files, tenant) = (state.files.clone(), rec.tenant_id.clone());
        blocking(move || {
            files.create(&tenant, &name, Purpose::BatchOutput, &bytes, false, now_ms() / 1000)
        })
    };
    let mut output = None;
    if !ok.is_empty() {
        output = Some(write(format!("{}_output.jsonl", rec.id), jsonl(&ok)).await?.id);
    }
    let mut errors = None;
    if !bad.is_empty() {
        errors = Some(write(format!("{}_error.jsonl", rec.id), jsonl(&bad)).await?.id);
    }
    let (n_ok, n_bad) = (ok.len() as u64, bad.len() as u64);
    let rec = a.update(|r| {
        let now = Some(now_ms() / 1000);
        r.output_file_id = output;
        r.error_file_id = errors;
        (r.completed, r.failed, r.input_tokens, r.output_tokens) = (0, 0, 0, 0);
        entries.iter().for_each(|e| r.count(e));
        debug_assert_eq!((r.completed, r.failed), (n_ok, n_bad));
        if r.status == Status::Cancelling {
            r.status = Status::Cancelled;
            r.cancelled_at = now;
        } else if expired {
            r.status = Status::Expired;
            r.expired_at = now;
        } else {
            r.status = Status::Completed;
            r.completed_at = now;
        }
    });
    save(state, a).await?;
    tracing::info!(batch_id = %rec.id, status = rec.status.as_str(), completed = n_ok,
                   failed = n_bad, "batch ended");
    Ok(())
}
