//! Authentication and the small endpoints: models, health, metrics, usage.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use gcs_protocol::{ApiType, ModelInfo, NodeStatus};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::keys::KeyRecord;
use crate::{json_body, now_ms, AppState};

/// The key presented in `Authorization: Bearer ...`, checked against the store.
pub(crate) fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<KeyRecord, ApiError> {
    let secret = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        })
        .ok_or_else(ApiError::unauthorized)?;
    match state.keys.authenticate(secret, now_ms()) {
        Ok(Some(k)) => Ok(k),
        Ok(None) => Err(ApiError::unauthorized()),
        Err(e) => {
            tracing::error!(error = %e, "key store unreadable");
            Err(ApiError::internal("the key store is unavailable"))
        }
    }
}

pub(crate) use crate::catalog::{Catalog, Served};

/// How long a computed model catalogue is reused: every request resolves
/// its model against it, and building it walks every fresh registration.
const CATALOG_TTL: std::time::Duration = std::time::Duration::from_millis(250);

/// Every model id and alias that fresh, available worker registrations
/// agree on now under the gateway's model policy (`catalog::build`; at most
/// `CATALOG_TTL` old; an empty one is never reused), and the seen-names
/// memory updated.
pub(crate) fn catalog(state: &AppState) -> Arc<Catalog> {
    let mut cache = state.catalog.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((at, cat)) = cache.as_ref() {
        if at.elapsed() < CATALOG_TTL && !cat.is_empty() {
            return cat.clone();
        }
    }
    let regs = state.backend.registrations();
    let out = crate::catalog::build(&regs, &state.config.models);
    let mut seen = state.seen_models.lock().unwrap_or_else(|p| p.into_inner());
    seen.note(out.keys(), now_ms());
    let out = Arc::new(out);
    *cache = Some((std::time::Instant::now(), out.clone()));
    out
}

fn model_object(state: &AppState, name: &str, s: &Served) -> Value {
    let tasks: Vec<&str> = s.info.tasks.iter().map(|t| t.as_str()).collect();
    json!({"id": name, "object": "model", "created": state.started_s, "owned_by": "gnus.ai",
           "gnus": {"model_id": s.info.model_id, "workers": s.workers, "tasks": tasks,
                    "context_tokens": s.info.context_tokens,
                    "quantization": s.info.quantization,
                    "decode_tokens_per_s": s.decode_tokens_per_s}})
}

/// `GET /v1/models`.
pub(crate) async fn list_models(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Response {
    let key = match authenticate(&state, &headers) {
        Ok(k) => k,
        Err(e) => return finish(&state, "models", e.into_response()),
    };
    let data: Vec<Value> = catalog(&state)
        .iter()
        .filter(|(n, s)| key.allows_model(&[n.as_str(), s.info.model_id.as_str()]))
        .map(|(n, s)| model_object(&state, n, s))
        .collect();
    finish(&state, "models", json_body(&json!({"object": "list", "data": data})))
}

/// `GET /v1/models/{model}`.
pub(crate) async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = authenticate(&state, &headers).and_then(|key| {
        let cat = catalog(&state);
        match cat.get(&model) {
            Some(s) if key.allows_model(&[model.as_str(), s.info.model_id.as_str()]) => {
                Ok(json_body(&model_object(&state, &model, s)))
            }
            _ => Err(ApiError::model_not_found(&model)),
        }
    });
    finish(&state, "model", r.unwrap_or_else(IntoResponse::into_response))
}

/// `GET /health`: 200 only while a capable worker is registered.
pub(crate) async fn health(State(state): State<Arc<AppState>>) -> Response {
    let cat = catalog(&state);
    let workers = state
        .backend
        .registrations()
        .iter()
        .filter(|r| !r.models.is_empty() && r.status != NodeStatus::Offline)
        .count();
    let models: Vec<&String> = cat.keys().collect();
    let in_flight = state.in_flight.load(std::sync::atomic::Ordering::Relaxed);
    if workers == 0 {
        let body = json!({"status": "unavailable", "reason": "no capable worker is registered",
                          "workers": 0, "in_flight": in_flight});
        return (StatusCode::SERVICE_UNAVAILABLE, json_body(&body)).into_response();
    }
    json_body(&json!({"status": "ok", "workers": workers, "models": models,
                      "in_flight": in_flight}))
}

/// `GET /metrics`.
pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.render() + &state.backend.node_metrics(),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
pub(crate) struct UsageQuery {
    /// Unix seconds, inclusive.
    start_time: Option<u64>,
    /// Unix seconds, exclusive.
    end_time: Option<u64>,
    /// Most records returned (newest first), default 100, at most 1000.
    limit: Option<usize>,
    /// Only the records of this batch's jobs.
    batch_id: Option<String>,
}

/// `GET /v1/usage`: the presenting key's own usage records.
pub(crate) async fn usage(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    query: Result<Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let r = (|| {
        let key = authenticate(&state, &headers)?;
        let Query(q) = query.map_err(|e| ApiError::invalid("query", e.body_text()))?;
        let since = q.start_time.unwrap_or(0).saturating_mul(1000);
        let until = q.end_time.map_or(u64::MAX, |t| t.saturating_mul(1000));
        let limit = q.limit.unwrap_or(100).clamp(1, 1000);
        let mut recs = state
            .backend
            .usage(&key.id, since, until)
            .map_err(|e| e.to_api())?;
        if let Some(b) = &q.batch_id {
            recs.retain(|u| u.batch_id.as_ref() == Some(b));
        }
        recs.sort_by_key(|r| std::cmp::Reverse(r.created_at_ms));
        let has_more = recs.len() > limit;
        recs.truncate(limit);
        let data: Vec<Value> = recs
            .iter()
            .map(|u| {
                json!({"object": "usage.record", "job_id": u.job_id, "created": u.created_at_ms / 1000,
                       "tenant_id": u.tenant_id, "project_id": u.project_id,
                       "api_key_id": u.api_key_id, "model": u.model, "api_type": u.api_type.as_str(),
                       "node_id": u.node_id.as_ref().map(|n| n.to_string()),
                       "recorded_by": u.recorded_by.to_string(),
                       "network": u.network.as_str(), "input_tokens": u.input_tokens,
                       "cached_tokens": u.cached_tokens,
                       "output_tokens_generated": u.output_tokens_generated,
                       "output_tokens_sent_to_client": u.output_tokens_sent_to_client,
                       "embedding_tokens": u.embedding_tokens, "compute_ms": u.compute_ms,
                       "first_token_ms": u.first_token_ms, "wall_ms": u.wall_ms,
                       "requeue_count": u.requeue_count,
                       "cancellation_reason": u.cancellation_reason.map(|c| c.as_str()),
                       "failed_after_partial_output": u.failed_after_partial_output,
                       "batch_id": u.batch_id, "child_jobs": u.child_jobs,
                       "parent_job_id": u.parent_job_id,
                       "price_percent": u.price_percent.unwrap_or(100),
                       "charged_tokens": u.charged_tokens()})
            })
            .collect();
        Ok::<_, ApiError>(json_body(&json!({"object": "list", "data": data, "has_more": has_more})))
    })();
    finish(&state, "usage", r.unwrap_or_else(IntoResponse::into_response))
}

/// Unknown paths.
pub(crate) async fn fallback(State(state): State<Arc<AppState>>, uri: Uri) -> Response {
    finish(&state, "unknown", ApiError::not_found(uri.path()).into_response())
}

/// Known paths, wrong method.
pub(crate) async fn method_not_allowed(State(state): State<Arc<AppState>>) -> Response {
    finish(&state, "unknown", ApiError::method_not_allowed().into_response())
}

/// Counts the answer in the metrics.
pub(crate) fn finish(state: &AppState, endpoint: &str, r: Response) -> Response {
    state.metrics.request(endpoint, r.status().as_u16());
    r
}

/// Whether a model's tasks include the endpoint's API type.
pub(crate) fn serves(info: &ModelInfo, api: ApiType) -> bool {
    info.tasks.contains(&api)
}
