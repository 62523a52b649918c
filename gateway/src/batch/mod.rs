//! The Batch API (specs/batch.md): `POST /v1/batches`,
//! `GET /v1/batches/{id}`, `GET /v1/batches`, `POST /v1/batches/{id}/cancel`.
//! A batch's requests run on this gateway as ordinary requests of the key
//! that created it ([`run`]), below interactive traffic.

pub mod adopt;
pub mod queue;
pub mod run;
pub mod store;
pub mod validate;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{Notify, Semaphore};

pub use store::{BatchRecord, BatchStore, Status, BATCH_RECORD_VERSION};

use crate::error::ApiError;
use crate::files::{blocking, Purpose};
use crate::handlers::{authenticate, finish};
use crate::{json_body, now_ms, AppState};

/// The only completion window (OpenAI's).
pub const WINDOW: &str = "24h";
const WINDOW_S: u64 = 24 * 3600;
/// Most metadata pairs, and their key and value lengths (OpenAI's).
const MAX_METADATA: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

/// Bounds of batch work on this gateway.
#[derive(Clone, Debug)]
pub struct BatchLimits {
    /// Requests of one batch in flight at once.
    pub per_batch: usize,
    /// Requests of all batches in flight at once.
    pub global: usize,
    /// Batches of one tenant not yet ended.
    pub max_active_per_tenant: usize,
    /// Batch records one tenant keeps; the oldest ended ones go first.
    pub max_records_per_tenant: usize,
    /// Times a request refused for capacity (429, 503) is retried.
    pub retries: u32,
}

impl Default for BatchLimits {
    fn default() -> Self {
        Self {
            per_batch: 4,
            global: 8,
            max_active_per_tenant: 16,
            max_records_per_tenant: 500,
            retries: 4,
        }
    }
}

/// A batch being worked on.
#[derive(Debug)]
pub(crate) struct Active {
    pub rec: Mutex<BatchRecord>,
    pub cancel: AtomicBool,
    pub cancelled: Notify,
    /// Held while the record is written, so the last write is the newest
    /// state (the runner and a cancel both write).
    saving: tokio::sync::Mutex<()>,
}

impl Active {
    pub(crate) fn snapshot(&self) -> BatchRecord {
        self.rec.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Writes the newest state of the record.
    pub(crate) async fn persist(&self, store: &Arc<BatchStore>) -> Result<(), ApiError> {
        let _g = self.saving.lock().await;
        let (store, rec) = (store.clone(), self.snapshot());
        blocking(move || store.save(&rec)).await
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut BatchRecord)) -> BatchRecord {
        let mut r = self.rec.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut r);
        r.clone()
    }
}

/// Every batch of this gateway.
#[derive(Debug)]
pub struct Batches {
    pub(crate) store: Arc<BatchStore>,
    active: Mutex<HashMap<String, Arc<Active>>>,
    /// Requests of all batches in flight.
    pub(crate) slots: Arc<Semaphore>,
    /// Bounds.
    pub limits: BatchLimits,
    /// Held while a batch of another gateway is looked for, with the ids
    /// looked for in vain lately (`adopt`).
    adopting: tokio::sync::Mutex<HashMap<String, std::time::Instant>>,
}

impl Batches {
    /// Batches under `root`, on a gateway of `max_in_flight` places: batch
    /// requests never hold more than half of them.
    pub fn new(root: std::path::PathBuf, limits: BatchLimits, max_in_flight: usize) -> Self {
        let slots = limits.global.min(max_in_flight / 2).max(1);
        Self {
            store: Arc::new(BatchStore::new(root)),
            active: Mutex::default(),
            slots: Arc::new(Semaphore::new(slots)),
            limits,
            adopting: tokio::sync::Mutex::default(),
        }
    }

    fn active(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Active>>> {
        self.active.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn start(&self, rec: BatchRecord) -> Arc<Active> {
        let a = Arc::new(Active {
            rec: Mutex::new(rec.clone()),
            cancel: AtomicBool::new(rec.status == Status::Cancelling),
            cancelled: Notify::new(),
            saving: tokio::sync::Mutex::new(()),
        });
        self.active().insert(rec.id, a.clone());
        a
    }

    pub(crate) fn ended(&self, id: &str) {
        self.active().remove(id);
    }

    fn get_active(&self, tenant: &str, id: &str) -> Option<Arc<Active>> {
        let a = self.active().get(id).cloned()?;
        (a.snapshot().tenant_id == tenant).then_some(a)
    }

    fn active_of(&self, tenant: &str) -> usize {
        self.active().values().filter(|a| a.snapshot().tenant_id == tenant).count()
    }

    /// The record of `id` for `tenant`: the live one while it runs.
    fn record(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<Option<BatchRecord>, crate::files::FileError> {
        match self.get_active(tenant, id) {
            Some(a) => Ok(Some(a.snapshot())),
            None => self.store.load(tenant, id),
        }
    }
}

/// Resumes every unfinished batch (at start).
pub(crate) fn resume(state: &Arc<AppState>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        tracing::warn!("no async runtime: unfinished batches are not resumed");
        return;
    };
    match state.batches.store.unfinished() {
        Ok(recs) => {
            for rec in recs {
                tracing::info!(batch_id = %rec.id, status = rec.status.as_str(), "resuming a batch");
                let a = state.batches.start(rec);
                rt.spawn(run::run(state.clone(), a));
            }
        }
        Err(e) => tracing::error!(error = %e, "cannot read the batch records"),
    }
}

/// The batch `id` of `tenant` that another gateway of the tenant created,
/// taken over here (`adopt`) and running, if this node holds all of it.
async fn adopted(state: &Arc<AppState>, tenant: &str, id: &str) -> Result<Option<BatchRecord>, ApiError> {
    let Some((rec, new)) = adopt::adopt(state, tenant, id).await? else { return Ok(None) };
    if new {
        let a = state.batches.start(rec.clone());
        tokio::spawn(run::run(state.clone(), a));
    }
    Ok(Some(rec))
}

fn not_found(id: &str) -> ApiError {
    let mut e = ApiError::invalid("batch_id", format!("No such Batch object: {id}"));
    e.status = StatusCode::NOT_FOUND;
    e.code = "batch_not_found".into();
    e
}

fn not_cancellable(status: Status) -> ApiError {
    let mut e = ApiError::invalid(
        "batch_id",
        format!("Cannot cancel a batch with status '{}'.", status.as_str()),
    );
    e.status = StatusCode::CONFLICT;
    e.code = "batch_not_cancellable".into();
    e
}

fn metadata(v: Option<&Value>) -> Result<Option<serde_json::Map<String, Value>>, ApiError> {
    let m = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(ApiError::invalid("metadata", "'metadata' must be an object")),
    };
    let fits = |(k, v): (&String, &Value)| {
        k.len() <= MAX_METADATA_KEY && v.as_str().is_some_and(|s| s.len() <= MAX_METADATA_VALUE)
    };
    if m.len() > MAX_METADATA || !m.iter().all(fits) {
        return Err(ApiError::invalid(
            "metadata",
            format!(
                "'metadata' holds at most {MAX_METADATA} string values, keys of at most \
                 {MAX_METADATA_KEY} and values of at most {MAX_METADATA_VALUE} characters"
            ),
        ));
    }
    Ok(Some(m.clone()))
}

async fn create_inner(state: &Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let key = authenticate(state, req.headers())?;
    let (_, bytes) = crate::admit::read_body(state, req).await?;
    let v: Value =
        serde_json::from_slice(&bytes).map_err(|e| ApiError::malformed_json(&e.to_string()))?;
    let Value::Object(body) = v else {
        return Err(ApiError::invalid("body", "the request body must be a JSON object"));
    };
    let text = |k: &str| match body.get(k) {
        Some(Value::String(s)) => Ok(s.clone()),
        None | Some(Value::Null) => Err(ApiError::missing(k)),
        Some(_) => Err(ApiError::invalid(k, format!("'{k}' must be a string"))),
    };
    let (input_file_id, endpoint, window) =
        (text("input_file_id")?, text("endpoint")?, text("completion_window")?);
    if validate::endpoint_api(&endpoint).is_none() {
        return Err(ApiError::invalid(
            "endpoint",
            "'endpoint' must be /v1/chat/completions, /v1/completions or /v1/embeddings",
        ));
    }
    if window != WINDOW {
        return Err(ApiError::invalid("completion_window", "'completion_window' must be \"24h\""));
    }
    let metadata = metadata(body.get("metadata"))?;
    let (files, tenant, fid) = (state.files.clone(), key.tenant_id.clone(), input_file_id.clone());
    let input = blocking(move || files.get(&tenant, &fid)).await?;
    match input {
        Some(f) if f.purpose == Purpose::Batch => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "input_file_id",
                "the input file's purpose is not 'batch'",
            ))
        }
        None => {
            let mut e =
                ApiError::invalid("input_file_id", format!("No such File object: {input_file_id}"));
            e.status = StatusCode::NOT_FOUND;
            e.code = "file_not_found".into();
            return Err(e);
        }
    }
    let limits = &state.batches.limits;
    if state.batches.active_of(&key.tenant_id) >= limits.max_active_per_tenant {
        return Err(ApiError::rate_limited(
            "batch_limit_exceeded",
            format!(
                "this tenant has {} batches running; wait for one to end",
                limits.max_active_per_tenant
            ),
            60,
        ));
    }
    let now = now_ms() / 1000;
    let rec = BatchRecord {
        v: BATCH_RECORD_VERSION,
        id: crate::files::store::fresh_id("batch_"),
        tenant_id: key.tenant_id.clone(),
        project_id: key.project_id.clone(),
        api_key_id: key.id.clone(),
        endpoint,
        input_file_id,
        completion_window: window,
        metadata,
        status: Status::Validating,
        created_at: now,
        expires_at: now + WINDOW_S,
        in_progress_at: None,
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
        total: 0,
        completed: 0,
        failed: 0,
        input_tokens: 0,
        output_tokens: 0,
        output_file_id: None,
        error_file_id: None,
        errors: vec![],
        processing: None,
        adopted_from: None,
        price_percent: None,
    };
    let (store, saved, keep) =
        (state.batches.store.clone(), rec.clone(), limits.max_records_per_tenant);
    blocking(move || {
        prune(&store, &saved.tenant_id, keep.saturating_sub(1))?;
        store.save(&saved)
    })
    .await?;
    tracing::info!(batch_id = %rec.id, endpoint = %rec.endpoint, "batch created");
    let a = state.batches.start(rec.clone());
    tokio::spawn(run::run(state.clone(), a));
    Ok(json_body(&rec.to_json()))
}

/// Keeps at most `keep` records of `tenant`, removing the oldest ended ones.
fn prune(store: &BatchStore, tenant: &str, keep: usize) -> Result<(), crate::files::FileError> {
    let all = store.list(tenant)?;
    let excess = all.len().saturating_sub(keep);
    for r in all.iter().rev().filter(|r| r.status.terminal()).take(excess) {
        store.remove(r);
    }
    Ok(())
}

/// `POST /v1/batches`.
pub(crate) async fn create(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let r = create_inner(&state, req).await;
    finish(&state, "batches", r.unwrap_or_else(IntoResponse::into_response))
}

/// `GET /v1/batches/{id}`.
pub(crate) async fn retrieve(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let key = authenticate(&state, &headers)?;
        let mut b = state.batches.record(&key.tenant_id, &id).map_err(crate::files::api_error)?;
        if b.is_none() {
            // Another gateway of the tenant may have created it.
            b = adopted(&state, &key.tenant_id, &id).await?;
        }
        b.map(|b| json_body(&b.to_json())).ok_or_else(|| not_found(&id))
    }
    .await;
    finish(&state, "batches", r.unwrap_or_else(IntoResponse::into_response))
}

/// Query of `GET /v1/batches`.
#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
}

/// `GET /v1/batches`: newest first, `after` a batch id, `limit` 1 to 100.
pub(crate) async fn list(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let r = async {
        let key = authenticate(&state, &headers)?;
        let Query(q) = query.map_err(|e| ApiError::invalid("query", e.body_text()))?;
        let limit = q.limit.unwrap_or(20).clamp(1, 100);
        let (store, tenant) = (state.batches.store.clone(), key.tenant_id.clone());
        let mut all = blocking(move || store.list(&tenant)).await?;
        for r in all.iter_mut() {
            if let Some(a) = state.batches.get_active(&key.tenant_id, &r.id) {
                *r = a.snapshot();
            }
        }
        let page = crate::list_page(all, q.after.as_deref(), limit, |b| b.id.as_str(), BatchRecord::to_json);
        Ok::<_, ApiError>(page)
    }
    .await;
    finish(&state, "batches", r.unwrap_or_else(IntoResponse::into_response))
}

/// `POST /v1/batches/{id}/cancel`: `cancelling` at once; requests in
/// flight are cancelled and the batch ends `cancelled` with what finished.
pub(crate) async fn cancel(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let key = authenticate(&state, &headers)?;
        let mut b = state.batches.record(&key.tenant_id, &id).map_err(crate::files::api_error)?;
        if b.is_none() {
            b = adopted(&state, &key.tenant_id, &id).await?;
        }
        let b = b.ok_or_else(|| not_found(&id))?;
        if b.status.terminal() {
            return Err(not_cancellable(b.status));
        }
        let cancelling = |r: &mut BatchRecord| {
            if matches!(r.status, Status::Validating | Status::InProgress) {
                r.status = Status::Cancelling;
                r.cancelling_at = Some(now_ms() / 1000);
            }
        };
        // Not running (its runner stopped on a storage error): the record
        // says cancelling, and the next start finishes it.
        let rec = match state.batches.get_active(&key.tenant_id, &id) {
            Some(a) => {
                let rec = a.update(cancelling);
                a.cancel.store(true, Ordering::Relaxed);
                a.cancelled.notify_waiters();
                a.persist(&state.batches.store).await?;
                rec
            }
            None => {
                // Re-read: its runner may have ended it just now.
                let (store, t, i) =
                    (state.batches.store.clone(), key.tenant_id.clone(), id.clone());
                let mut rec = blocking(move || store.load(&t, &i)).await?.unwrap_or(b);
                if rec.status.terminal() {
                    return Err(not_cancellable(rec.status));
                }
                cancelling(&mut rec);
                let (store, saved) = (state.batches.store.clone(), rec.clone());
                blocking(move || store.save(&saved)).await?;
                rec
            }
        };
        tracing::info!(batch_id = %id, "batch cancel asked");
        Ok(json_body(&rec.to_json()))
    }
    .await;
    finish(&state, "batches", r.unwrap_or_else(IntoResponse::into_response))
}

/// Waits until `a` is cancelled.
pub(super) async fn cancelled(a: &Active) {
    loop {
        let n = a.cancelled.notified();
        if a.cancel.load(Ordering::Relaxed) {
            return;
        }
        n.await;
    }
}

/// The creating key, if it is still live.
pub(super) fn live_key(state: &AppState, key_id: &str) -> Option<crate::keys::KeyRecord> {
    match state.keys.list() {
        Ok(keys) => keys.into_iter().find(|k| k.id == key_id && k.is_live(now_ms())),
        Err(e) => {
            tracing::error!(error = %e, "key store unreadable");
            None
        }
    }
}
