//! The Files API (specs/batch.md): `POST /v1/files` (multipart, purpose
//! `batch`), `GET /v1/files`, `GET /v1/files/{id}`,
//! `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`, per tenant: a key
//! of another tenant gets the 404 of a file that does not exist.

pub mod multipart;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

pub use store::{FileError, FileLimits, FileRecord, FileStore, Purpose};

use crate::error::ApiError;
use crate::handlers::{authenticate, finish};
use crate::{json_body, now_ms, AppState};

/// How long an upload's body may take to arrive (larger than the edge's
/// JSON bound: a file is up to `max_file_bytes`).
const UPLOAD_READ_TIMEOUT: Duration = Duration::from_secs(120);
/// The form around the file: its part headers and the purpose field.
const FORM_OVERHEAD: usize = 64 * 1024;
/// Longest stored file name.
const MAX_FILENAME: usize = 255;

/// A file-store failure as the client sees it.
pub(crate) fn api_error(e: FileError) -> ApiError {
    match e {
        FileError::Io(_) => crate::BackendError::Storage(e.to_string()).to_api(),
        FileError::Quota { .. } => {
            let mut a = ApiError::invalid("file", format!("{e}; delete files to make room"));
            a.code = "storage_limit_exceeded".into();
            a
        }
    }
}

/// The store call off the async runtime (files are up to tens of MiB and
/// every write is synced).
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FileError> + Send + 'static,
) -> Result<T, ApiError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(api_error),
        Err(_) => Err(ApiError::internal("the file store task failed")),
    }
}

fn not_found(id: &str) -> ApiError {
    let mut e = ApiError::invalid("file_id", format!("No such File object: {id}"));
    e.status = axum::http::StatusCode::NOT_FOUND;
    e.code = "file_not_found".into();
    e
}

fn file_name(raw: Option<&str>) -> String {
    let base = raw.unwrap_or_default().rsplit(['/', '\\']).next().unwrap_or_default();
    let clean: String = base.chars().filter(|c| !c.is_control()).take(MAX_FILENAME).collect();
    if clean.is_empty() {
        "upload.jsonl".into()
    } else {
        clean
    }
}

async fn read_form(state: &AppState, req: Request) -> Result<(Vec<u8>, String), ApiError> {
    let max = state.config.files.max_file_bytes.saturating_add(FORM_OVERHEAD);
    let headers = req.headers();
    let ct = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let Some(boundary) = multipart::boundary(ct) else {
        return Err(ApiError::unsupported_media_type(ct.split(';').next().unwrap_or_default()));
    };
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let too_large = || ApiError::too_large(state.config.files.max_file_bytes);
    if declared.is_some_and(|n| n > max) {
        return Err(too_large());
    }
    let body = req.into_body();
    match tokio::time::timeout(UPLOAD_READ_TIMEOUT, axum::body::to_bytes(body, max)).await {
        Ok(Ok(b)) => Ok((b.to_vec(), boundary)),
        Ok(Err(_)) => Err(too_large()),
        Err(_) => Err(ApiError::request_timeout(UPLOAD_READ_TIMEOUT.as_secs())),
    }
}

async fn upload_inner(state: &Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let key = authenticate(state, req.headers())?;
    let Ok(_permit) = state.uploads.try_acquire() else {
        return Err(ApiError::rate_limited(
            "gateway_overloaded",
            "this gateway is reading as many uploads as it takes at once; retry shortly",
            2,
        ));
    };
    let (body, boundary) = read_form(state, req).await?;
    let parts = multipart::parse(&body, &boundary).map_err(|e| ApiError::invalid("file", e))?;
    let purpose =
        parts.iter().find(|p| p.name == "purpose").ok_or_else(|| ApiError::missing("purpose"))?;
    if purpose.data != b"batch" {
        return Err(ApiError::unsupported(
            "purpose",
            format!(
                "this gateway stores files of purpose 'batch' only, not '{}'",
                String::from_utf8_lossy(purpose.data)
            ),
        ));
    }
    let file = parts.iter().find(|p| p.name == "file").ok_or_else(|| ApiError::missing("file"))?;
    let lim = &state.config.files;
    if file.data.len() > lim.max_file_bytes {
        return Err(ApiError::too_large(lim.max_file_bytes));
    }
    if std::str::from_utf8(file.data).is_err() {
        return Err(ApiError::invalid("file", "a batch file must be UTF-8 JSONL"));
    }
    let lines = file.data.split(|&b| b == b'\n').filter(|l| !l.trim_ascii().is_empty()).count();
    if lines > lim.max_lines {
        return Err(ApiError::invalid(
            "file",
            format!("a batch file holds at most {} requests; this one has {lines}", lim.max_lines),
        ));
    }
    let name = file_name(file.filename.as_deref());
    let data = file.data.to_vec();
    drop(parts);
    drop(body);
    let files = state.files.clone();
    let tenant = key.tenant_id.clone();
    let rec = blocking(move || {
        files.create(&tenant, &name, Purpose::Batch, &data, true, now_ms() / 1000)
    })
    .await?;
    tracing::info!(file_id = %rec.id, bytes = rec.bytes, lines, "file uploaded");
    Ok(json_body(&rec.to_json()))
}

/// `POST /v1/files`.
pub(crate) async fn upload(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let r = upload_inner(&state, req).await;
    let r = r.unwrap_or_else(|e| {
        let unread = matches!(e.status.as_u16(), 408 | 413);
        let mut r = e.into_response();
        if unread {
            // The body was not read to its end.
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        r
    });
    finish(&state, "files", r)
}

/// Query of `GET /v1/files`.
#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    purpose: Option<String>,
    limit: Option<usize>,
    after: Option<String>,
    order: Option<String>,
}

/// `GET /v1/files`: newest first (or `order=asc`), `after` a file id.
pub(crate) async fn list(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let r = async {
        let key = authenticate(&state, &headers)?;
        let Query(q) = query.map_err(|e| ApiError::invalid("query", e.body_text()))?;
        let limit = q.limit.unwrap_or(10_000).clamp(1, 10_000);
        let files = state.files.clone();
        let tenant = key.tenant_id.clone();
        let mut all = blocking(move || files.list(&tenant)).await?;
        if q.order.as_deref() == Some("asc") {
            all.reverse();
        }
        if let Some(p) = q.purpose.as_deref() {
            all.retain(|f| f.purpose.as_str() == p);
        }
        let page = crate::list_page(all, q.after.as_deref(), limit, |f| f.id.as_str(), FileRecord::to_json);
        Ok::<_, ApiError>(page)
    }
    .await;
    finish(&state, "files", r.unwrap_or_else(IntoResponse::into_response))
}

async fn owned(
    state: &AppState,
    headers: &HeaderMap,
    id: &str,
) -> Result<(String, FileRecord), ApiError> {
    let key = authenticate(state, headers)?;
    let (files, tenant, fid) = (state.files.clone(), key.tenant_id.clone(), id.to_string());
    let rec = blocking(move || files.get(&tenant, &fid)).await?;
    rec.map(|r| (key.tenant_id, r)).ok_or_else(|| not_found(id))
}

/// `GET /v1/files/{id}`.
pub(crate) async fn retrieve(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = owned(&state, &headers, &id).await.map(|(_, f)| json_body(&f.to_json()));
    finish(&state, "files", r.unwrap_or_else(IntoResponse::into_response))
}

/// `GET /v1/files/{id}/content`: the bytes as uploaded or written.
pub(crate) async fn content(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let (tenant, _) = owned(&state, &headers, &id).await?;
        let (files, fid) = (state.files.clone(), id.clone());
        let opened = blocking(move || files.open_content(&tenant, &fid)).await?;
        let (file, len) = opened.ok_or_else(|| not_found(&id))?;
        let body = axum::body::Body::from_stream(chunks(tokio::fs::File::from_std(file)));
        let headers = [
            (axum::http::header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (axum::http::header::CONTENT_LENGTH, len.to_string()),
        ];
        Ok::<_, ApiError>((headers, body).into_response())
    }
    .await;
    finish(&state, "files", r.unwrap_or_else(IntoResponse::into_response))
}

/// A file's bytes in chunks of up to 64 KiB, each read when the client
/// takes the one before (a batch's output can be far larger than the
/// memory a download should hold).
fn chunks(
    mut file: tokio::fs::File,
) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> + Send {
    use std::task::Poll;
    use tokio::io::AsyncRead;
    let mut buf = vec![0u8; 64 * 1024];
    futures::stream::poll_fn(move |cx| {
        let mut rb = tokio::io::ReadBuf::new(&mut buf);
        match std::pin::Pin::new(&mut file).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) if rb.filled().is_empty() => Poll::Ready(None),
            Poll::Ready(Ok(())) => Poll::Ready(Some(Ok(bytes::Bytes::copy_from_slice(rb.filled())))),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    })
}

/// `DELETE /v1/files/{id}`.
pub(crate) async fn delete(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let (tenant, _) = owned(&state, &headers, &id).await?;
        let (files, fid) = (state.files.clone(), id.clone());
        if !blocking(move || files.delete(&tenant, &fid)).await? {
            return Err(not_found(&id));
        }
        Ok(json_body(&json!({"id": id, "object": "file", "deleted": true})))
    }
    .await;
    finish(&state, "files", r.unwrap_or_else(IntoResponse::into_response))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_keep_only_their_last_component() {
        assert_eq!(file_name(Some("../../etc/passwd")), "passwd");
        assert_eq!(file_name(Some("C:\\x\\in.jsonl")), "in.jsonl");
        assert_eq!(file_name(Some("a\nb")), "ab");
        assert_eq!(file_name(None), "upload.jsonl");
        assert_eq!(file_name(Some(&"x".repeat(1000))).len(), MAX_FILENAME);
    }
}
