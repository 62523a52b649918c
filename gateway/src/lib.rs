//! The GCS gateway: an OpenAI-compatible HTTP/SSE front door over any
//! [`Backend`] (the `gcs-node` runtime implements it over libp2p).
//!
//! - [`backend`]: the trait between HTTP and the network, and its events.
//! - [`request`]: request bodies parsed and validated into typed requests.
//! - [`payload`]: the typed request a job carries to its worker (versioned);
//!   [`validate`]: its one check against a model, at the edge and the worker.
//! - [`codec`]: every OpenAI response body, chunk and usage object.
//! - [`keys`], [`limits`]: API keys (hashed at rest), rate limits, budgets;
//!   [`durable`]: crash-safe small files and their writer lock.
//! - `admit`: authentication, admission and job submission.
//! - [`completion`], [`sse`]: blocking answers and streams (26.16).
//! - [`handlers`]: models, health, metrics, usage.
//! - [`files`], [`batch`]: the Files and Batch APIs (specs/batch.md).
//! - [`serve`]: plain HTTP or HTTPS (rustls).

mod admit;
pub mod backend;
pub mod batch;
pub mod catalog;
mod children;
pub mod codec;
pub mod completion;
pub mod durable;
pub mod error;
pub mod files;
mod guard;
pub mod handlers;
pub mod keys;
pub mod limits;
pub mod metrics;
pub mod payload;
pub mod request;
pub mod serve;
pub mod sse;
pub mod tools;
pub mod validate;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;

pub use backend::{Backend, BackendError, BoxFuture, JobEvent, JobSpec, ParentUsage};
pub use error::ApiError;
pub use keys::{KeyRecord, KeyStore, NewKey};
pub use serve::{serve, TlsFiles};

/// Gateway settings (26.16.7 defaults).
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Bytes a stream may have queued for a slow client before its job is
    /// cancelled with `client_backpressure`.
    pub stream_buffer_bytes: usize,
    /// Keepalive comment interval during gaps.
    pub keepalive: Duration,
    /// How long a stream's HTTP status is held for its first chunk, so that
    /// a job failing before it gets its own status as JSON (at most one
    /// keepalive interval).
    pub stream_hold: Duration,
    /// Default first-token timeout (from the lease; the network requeues).
    pub first_token_timeout_ms: u64,
    /// Default idle-stream timeout.
    pub idle_timeout_ms: u64,
    /// Default wall-clock timeout.
    pub wall_timeout_ms: u64,
    /// Jobs this gateway has in flight before it answers 429.
    pub max_in_flight: usize,
    /// Embedding inputs per job (arrays are split across workers).
    pub embed_batch: usize,
    /// Jobs one request may become (choices, embedding batches); a larger
    /// embeddings request gets larger batches, up to 64 inputs a job.
    pub max_jobs_per_request: usize,
    /// This gateway's swarm: `local_only` requests go to its nodes.
    pub swarm_id: String,
    /// This gateway's node id (`gnusnode_…`): a `gateway_local` request
    /// with no fresh registration of it or of a worker presenting its
    /// `gateway_worker` certificate is a 503 at once. Empty: not checked
    /// here (the claim check still decides).
    pub gateway_id: String,
    /// Connection limits of the HTTP edge, for [`serve::serve_with`].
    pub edge: serve::EdgeLimits,
    /// Which model metadata comes from peers ([`catalog::build`]).
    pub models: catalog::ModelPolicy,
    /// Bounds of the Files API (specs/batch.md).
    pub files: files::FileLimits,
    /// Bounds of batch work (specs/batch.md).
    pub batch: batch::BatchLimits,
    /// The price of batch work in percent of the API price, 1–100
    /// (specs/batch.md "Pricing"): a budget is charged that share of a
    /// batch job's real tokens.
    pub batch_price_percent: u8,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            stream_buffer_bytes: 262_144,
            keepalive: Duration::from_secs(15),
            stream_hold: Duration::from_secs(2),
            first_token_timeout_ms: 10_000,
            idle_timeout_ms: 30_000,
            wall_timeout_ms: 120_000,
            max_in_flight: 256,
            embed_batch: 4,
            max_jobs_per_request: 32,
            swarm_id: "public".into(),
            gateway_id: String::new(),
            edge: serve::EdgeLimits::default(),
            models: catalog::ModelPolicy::default(),
            files: files::FileLimits::default(),
            batch: batch::BatchLimits::default(),
            batch_price_percent: 50,
        }
    }
}

impl GatewayConfig {
    /// The batch price in percent, [`Self::batch_price_percent`] held to
    /// 1–100 (a config built in code may hold anything): the one value
    /// metering, reservations and job specs use.
    pub fn batch_price(&self) -> u8 {
        self.batch_price_percent.clamp(1, 100)
    }
}

/// Shared state of every handler.
#[derive(Debug)]
pub struct AppState {
    /// The network.
    pub backend: Arc<dyn Backend>,
    /// API keys.
    pub keys: Arc<KeyStore>,
    /// Per-key limits.
    pub limiter: limits::Limiter,
    /// Metrics.
    pub metrics: metrics::Metrics,
    /// Settings.
    pub config: GatewayConfig,
    /// Requests in flight now.
    pub in_flight: AtomicUsize,
    /// Model names the network served recently (bounded): a name seen
    /// once but served by nobody now is a 503, not a 404.
    pub seen_models: Mutex<catalog::SeenModels>,
    /// Start time (seconds), the `created` of listed models.
    pub started_s: u64,
    /// Failed authentications per client address.
    pub(crate) auth_failures: guard::AuthFailures,
    /// The model catalogue and when it was built.
    pub(crate) catalog: Mutex<Option<(std::time::Instant, Arc<handlers::Catalog>)>>,
    /// Uploaded and batch output files (beside the key file).
    pub files: Arc<files::FileStore>,
    /// Uploads being read now (each holds its body in memory).
    pub(crate) uploads: tokio::sync::Semaphore,
    /// Batches (beside the key file).
    pub batches: batch::Batches,
}

pub use gcs_protocol::now_ms;

/// A JSON body with the right content type.
/// One page of an OpenAI list object from records in list order: at most
/// `limit` of those after the id `after` (an unknown cursor is past the
/// end: an empty page, as OpenAI answers).
pub(crate) fn list_page<T>(
    mut all: Vec<T>,
    after: Option<&str>,
    limit: usize,
    id: impl Fn(&T) -> &str,
    to_json: impl Fn(&T) -> serde_json::Value,
) -> axum::response::Response {
    if let Some(after) = after {
        let at = all.iter().position(|x| id(x) == after).map_or(all.len(), |i| i + 1);
        all.drain(..at);
    }
    let has_more = all.len() > limit;
    all.truncate(limit);
    let data: Vec<serde_json::Value> = all.iter().map(&to_json).collect();
    json_body(&serde_json::json!({"object": "list", "data": data, "has_more": has_more,
        "first_id": all.first().map(&id), "last_id": all.last().map(&id)}))
}

pub(crate) fn json_body(v: &serde_json::Value) -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        serde_json::to_vec(v).unwrap_or_default(),
    )
        .into_response()
}

/// The HTTP application.
pub fn router(backend: Arc<dyn Backend>, keys: Arc<KeyStore>, config: GatewayConfig) -> Router {
    // Files and batches live in the data directory that holds the key file.
    let data_dir = keys.path().parent().map(std::path::Path::to_path_buf).unwrap_or_default();
    let files = Arc::new(files::FileStore::new(data_dir.join("files"), config.files.clone()));
    let state = Arc::new(AppState {
        uploads: tokio::sync::Semaphore::new(config.files.concurrent_uploads.max(1)),
        files,
        batches: batch::Batches::new(
            data_dir.join("batches"),
            config.batch.clone(),
            config.max_in_flight,
        ),
        auth_failures: guard::AuthFailures::new(config.edge.unauthenticated_per_ip_per_minute),
        backend,
        keys,
        limiter: limits::Limiter::default(),
        metrics: metrics::Metrics::default(),
        config,
        in_flight: AtomicUsize::new(0),
        seen_models: Mutex::new(catalog::SeenModels::default()),
        started_s: now_ms() / 1000,
        catalog: Mutex::new(None),
    });
    batch::resume(&state);
    let r = Router::new();
    // A handler that panics, for the panic guard's test only.
    #[cfg(test)]
    let r = r.route(
        "/v1/__panic",
        get(|| async {
            if std::hint::black_box(true) {
                panic!("a test panic");
            }
            "unreachable"
        }),
    );
    r.route("/v1/models", get(handlers::list_models))
        .route("/v1/models/{*model}", get(handlers::get_model))
        .route("/v1/chat/completions", post(completion::chat))
        .route("/v1/completions", post(completion::completions))
        .route("/v1/embeddings", post(completion::embeddings))
        .route("/v1/usage", get(handlers::usage))
        .route("/v1/files", post(files::upload).get(files::list))
        .route("/v1/files/{id}", get(files::retrieve).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/batches", post(batch::create).get(batch::list))
        .route("/v1/batches/{id}", get(batch::retrieve))
        .route("/v1/batches/{id}/cancel", post(batch::cancel))
        .route("/health", get(handlers::health))
        .route("/metrics", get(handlers::metrics))
        .fallback(handlers::fallback)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        // Bodies are read with our own limit so that 413 is an OpenAI envelope.
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard::guard))
        .layer(axum::middleware::from_fn(cors))
        .with_state(state)
}

/// Browser apps call the API cross-origin with a bearer key (no cookies),
/// so any origin may: the key, not the origin, is the credential.
async fn cors(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::{header, HeaderValue, Method};
    let mut r =
        if req.method() == Method::OPTIONS { cors_preflight() } else { next.run(req).await };
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("x-request-id, x-gcs-job-id, x-gcs-node-id, retry-after"),
    );
    r
}

/// `OPTIONS` on any path: the CORS preflight.
fn cors_preflight() -> axum::response::Response {
    use axum::http::{header, HeaderValue, StatusCode};
    use axum::response::IntoResponse;
    let mut r = StatusCode::NO_CONTENT.into_response();
    let h = r.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static(
            "authorization, content-type, idempotency-key, openai-organization, openai-project, \
             x-stainless-os, x-stainless-lang, x-stainless-package-version, x-stainless-runtime, \
             x-stainless-runtime-version, x-stainless-arch, x-stainless-retry-count, \
             x-stainless-timeout",
        ),
    );
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    r
}
