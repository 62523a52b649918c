//! A batch on the swarm's processing queue (specs/batch.md, "Processing on
//! the network"): each request is rendered into the job payload the same
//! request sent alone would carry, the batch's requests of one model
//! become one processing task ([`Backend::enqueue`]) that workers lock,
//! run and answer subtask by subtask, and the runner collects the answers
//! into the batch's results ([`Backend::collect`], which stores each
//! answer's usage record with the batch's id and price first).
//!
//! Only when every request can run there unchanged: one choice, no
//! streaming, public routing at the standard privacy level, no base64
//! embeddings, a key without a token budget (budgets are enforced per
//! request by the handlers) that may use the model, and a worker
//! advertising processing slots for every model. Otherwise the batch runs
//! through the gateway's handlers (`run.rs`), as before.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use gcs_protocol::{ApiType, PrivacyLevel, RoutingMode};
use serde_json::json;

use super::store::{BatchRecord, Entry, TaskRef};
use super::validate::Line;
use super::Active;
use crate::backend::{ProcessingBatch, ProcessingLine, ProcessingMeter};
use crate::error::ApiError;
use crate::payload::JobRequest;
use crate::request::Parsed;
use crate::{now_ms, AppState};

/// How often the runner collects a task's answers.
const COLLECT_EVERY: Duration = Duration::from_millis(500);


/// The requests of a batch rendered per model, or why the batch runs
/// through the handlers instead.
fn render(
    state: &AppState,
    rec: &BatchRecord,
    api: ApiType,
    lines: &[Line],
    pending: &[usize],
) -> Result<BTreeMap<String, Vec<ProcessingLine>>, &'static str> {
    let key = super::live_key(state, &rec.api_key_id).ok_or("the creating key is not live")?;
    if key.budget_tokens.is_some() {
        return Err("the key has a token budget");
    }
    if !(key.routing.is_empty() || key.routing.contains(&RoutingMode::Public)) {
        return Err("the key may not route publicly");
    }
    let mut by_model: BTreeMap<String, Vec<ProcessingLine>> = BTreeMap::new();
    for &i in pending {
        let line = &lines[i];
        if !(key.models.is_empty() || key.models.contains(&line.model)) {
            return Err("the key may not use a model");
        }
        let parsed = crate::request::parse(api, &line.body).map_err(|_| "a request is refused")?;
        let c = parsed.common();
        if c.network != RoutingMode::Public || c.privacy != PrivacyLevel::Standard {
            return Err("a request asks for other routing or privacy");
        }
        let job = match parsed {
            Parsed::Generation(mut g) => {
                if g.n != 1 || g.stream {
                    return Err("a request asks for several choices");
                }
                // As the handler would, under the request's idempotency key.
                g.assign_seed(&format!("{}-{i}-0", rec.id));
                JobRequest::Generation(g.job)
            }
            Parsed::Embedding(e) if !e.base64 => JobRequest::Embedding(e.job),
            Parsed::Embedding(_) => return Err("a request asks for base64 embeddings"),
        };
        let bytes = job.encode().map_err(|_| "a payload does not encode")?;
        let l = ProcessingLine { index: i as u64, custom_id: line.custom_id.clone(), body: bytes };
        by_model.entry(line.model.clone()).or_default().push(l);
    }
    if let Some(m) = by_model.keys().find(|m| !state.backend.processing_capacity(m)) {
        tracing::debug!(batch_id = %rec.id, model = %m, "no worker advertises processing slots");
        return Err("no worker advertises processing slots for a model");
    }
    Ok(by_model)
}

/// The batch price: the creator's for a batch taken over, else this
/// gateway's.
fn price(state: &AppState, rec: &BatchRecord) -> u8 {
    rec.price_percent.unwrap_or(state.config.batch_price_percent).clamp(1, 100)
}

fn meter(state: &AppState, rec: &BatchRecord, api: ApiType, model: &str) -> ProcessingMeter {
    ProcessingMeter {
        batch_id: rec.id.clone(),
        tenant_id: rec.tenant_id.clone(),
        project_id: rec.project_id.clone(),
        api_key_id: rec.api_key_id.clone(),
        api_type: api,
        model: model.into(),
        price_percent: Some(price(state, rec)),
    }
}

/// Runs the batch's pending requests on the processing queue; `false`
/// when it cannot (the caller then runs them through the handlers). A
/// batch enqueued before a restart resumes collecting its tasks.
pub(crate) async fn run(
    state: &Arc<AppState>,
    a: &Arc<Active>,
    api: ApiType,
    lines: &[Line],
    done: &mut HashSet<u64>,
) -> Result<bool, ApiError> {
    let rec = a.snapshot();
    let tasks = match rec.processing.clone() {
        Some(t) => t,
        None => {
            let pending: Vec<usize> =
                (0..lines.len()).filter(|i| !done.contains(&(*i as u64))).collect();
            if pending.is_empty() {
                return Ok(true);
            }
            let by_model = match render(state, &rec, api, lines, &pending) {
                Ok(m) => m,
                Err(why) => {
                    tracing::info!(batch_id = %rec.id, why, "batch runs through the gateway's handlers");
                    return Ok(false);
                }
            };
            let mut tasks = vec![];
            let manifest = super::adopt::manifest(&rec, by_model.len(), price(state, &rec));
            for (model, lines) in by_model {
                let m = meter(state, &rec, api, &model);
                let batch = ProcessingBatch { meter: m, lines, manifest: manifest.clone() };
                // A task already enqueued stays: its answers are collected
                // with the others; the rest of the batch runs here.
                match state.backend.enqueue(batch).await {
                    Ok(task_id) => tasks.push(TaskRef { model, task_id }),
                    Err(e) if tasks.is_empty() => {
                        tracing::warn!(batch_id = %rec.id, error = %e, "batch not enqueued; it runs through the handlers");
                        return Ok(false);
                    }
                    Err(e) => return Err(e.to_api()),
                }
            }
            a.update(|r| r.processing = Some(tasks.clone()));
            a.persist(&state.batches.store).await?;
            tasks
        }
    };
    state.metrics.batch_runs_processing.fetch_add(1, Ordering::Relaxed);
    collect(state, a, api, lines, done, &tasks).await?;
    Ok(true)
}

/// Cancels the batch's processing tasks in the network (workers take no
/// more of their subtasks and stop the running ones between requests). A
/// task not cancelled is logged: the batch still ends, and the task's
/// chunks are served to no one past its subtasks' live locks.
pub(crate) async fn cancel_tasks(state: &AppState, rec: &BatchRecord) {
    for t in rec.processing.iter().flatten() {
        if let Err(e) = state.backend.cancel_task(t.task_id.clone()).await {
            tracing::warn!(batch_id = %rec.id, task_id = %t.task_id, error = %e, "task not cancelled");
        }
    }
}

fn bad_entry(i: u64, line: &Line, reason: &str) -> Entry {
    let body = json!({"error": {"message": format!("the request failed on every worker that took it: {reason}"),
                                "type": "server_error", "param": null, "code": "processing_failed"}});
    super::store::entry(i, line, 500, None, body)
}

async fn collect(
    state: &Arc<AppState>,
    a: &Arc<Active>,
    api: ApiType,
    lines: &[Line],
    done: &mut HashSet<u64>,
    tasks: &[TaskRef],
) -> Result<(), ApiError> {
    let rec = a.snapshot();
    // What the backend need not read again; shared with each call, and
    // grown in place once the call has dropped its copy.
    let mut skip = Arc::new(done.clone());
    loop {
        let mut fresh: Vec<Entry> = vec![];
        let mut cancelled = 0;
        for t in tasks {
            let m = meter(state, &rec, api, &t.model);
            let p = match state.backend.collect(t.task_id.clone(), m, skip.clone()).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(batch_id = %rec.id, task_id = %t.task_id, error = %e, "task not collected");
                    continue;
                }
            };
            cancelled += usize::from(p.cancelled);
            for l in p.answered {
                let Some(line) = lines.get(l.index as usize) else { continue };
                if done.insert(l.index) {
                    fresh.push(super::store::entry(l.index, line, l.status, Some(l.request_id), l.body));
                }
            }
            for (i, reason) in p.bad {
                let Some(line) = lines.get(i as usize) else { continue };
                if done.insert(i) {
                    fresh.push(bad_entry(i, line, &reason));
                }
            }
        }
        if !fresh.is_empty() {
            Arc::make_mut(&mut skip).extend(fresh.iter().map(|e| e.i));
            state.batches.store.append(&rec, &fresh).map_err(crate::files::api_error)?;
            a.update(|r| fresh.iter().for_each(|e| r.count(e)));
            a.persist(&state.batches.store).await?;
        }
        if done.len() >= lines.len() || a.cancel.load(Ordering::Relaxed) {
            return Ok(());
        }
        // Cancelled in the network by another gateway of the tenant (one
        // that took the batch over, or its creator): the batch ends
        // cancelled here too, with what was answered.
        if !tasks.is_empty() && cancelled == tasks.len() {
            tracing::info!(batch_id = %rec.id, "batch's tasks cancelled by another gateway");
            a.update(|r| {
                if r.status == super::Status::InProgress {
                    r.status = super::Status::Cancelling;
                    r.cancelling_at = Some(now_ms() / 1000);
                }
            });
            a.cancel.store(true, Ordering::Relaxed);
            return Ok(());
        }
        if now_ms() / 1000 >= rec.expires_at {
            let expired: Vec<Entry> = (0..lines.len() as u64)
                .filter(|i| !done.contains(i))
                .map(|i| super::store::expired(i, &lines[i as usize]))
                .collect();
            state.batches.store.append(&rec, &expired).map_err(crate::files::api_error)?;
            a.update(|r| expired.iter().for_each(|e| r.count(e)));
            done.extend(expired.iter().map(|e| e.i));
            return Ok(());
        }
        tokio::select! {
            _ = tokio::time::sleep(COLLECT_EVERY) => {}
            _ = super::cancelled(a) => {}
        }
    }
}
