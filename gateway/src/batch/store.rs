//! Batches on the gateway's disk (specs/batch.md, "Storage"):
//! `<data>/batches/<tenant dir>/<batch id>.json` is the versioned record
//! (replaced whole on every change), `<batch id>.results` the append-only
//! JSONL of finished requests, so a restarted gateway resumes a batch
//! without re-running what it already has.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::validate::{Line, LineError};
use crate::durable::write_atomic;
use crate::files::store::{tenant_dir, well_formed};
use crate::files::FileError;

/// The record format's version.
pub const BATCH_RECORD_VERSION: u16 = 1;

/// OpenAI's batch statuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// The input is being checked.
    Validating,
    /// The input failed validation.
    Failed,
    /// Requests are running.
    InProgress,
    /// The output files are being written.
    Finalizing,
    /// Done: every request has an output or error line.
    Completed,
    /// The completion window ended first.
    Expired,
    /// Cancel asked; requests in flight are being stopped.
    Cancelling,
    /// Cancelled; the output holds what finished before.
    Cancelled,
}

impl Status {
    /// Whether nothing more happens to the batch.
    pub fn terminal(self) -> bool {
        matches!(self, Status::Failed | Status::Completed | Status::Expired | Status::Cancelled)
    }

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Validating => "validating",
            Status::Failed => "failed",
            Status::InProgress => "in_progress",
            Status::Finalizing => "finalizing",
            Status::Completed => "completed",
            Status::Expired => "expired",
            Status::Cancelling => "cancelling",
            Status::Cancelled => "cancelled",
        }
    }
}

/// One batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchRecord {
    /// Always [`BATCH_RECORD_VERSION`].
    pub v: u16,
    /// `batch_…`.
    pub id: String,
    /// Owner.
    pub tenant_id: String,
    /// The creating key's project.
    pub project_id: String,
    /// The creating key: its requests run, are limited and metered as it.
    pub api_key_id: String,
    /// `/v1/chat/completions`, `/v1/completions` or `/v1/embeddings`.
    pub endpoint: String,
    /// The uploaded input.
    pub input_file_id: String,
    /// Always `24h`.
    pub completion_window: String,
    /// The client's metadata.
    pub metadata: Option<serde_json::Map<String, Value>>,
    /// Where it is.
    pub status: Status,
    /// Unix seconds of each step.
    pub created_at: u64,
    pub expires_at: u64,
    pub in_progress_at: Option<u64>,
    pub finalizing_at: Option<u64>,
    pub completed_at: Option<u64>,
    pub failed_at: Option<u64>,
    pub expired_at: Option<u64>,
    pub cancelling_at: Option<u64>,
    pub cancelled_at: Option<u64>,
    /// `request_counts`.
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
    /// Tokens metered by the requests that succeeded (OpenAI's `usage`).
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    /// Output files, once written.
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    /// Validation errors (status `failed`).
    pub errors: Vec<LineError>,
    /// The processing tasks its requests run as, once enqueued (one per
    /// model); absent while it runs through the gateway's handlers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processing: Option<Vec<TaskRef>>,
    /// The gateway that created it, when this one took it over
    /// (`super::adopt`): its lines come from the network, not a file here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopted_from: Option<String>,
    /// The batch price (percent of the standard) its answers are metered
    /// at, when not this gateway's own (an adopted batch keeps its
    /// creator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_percent: Option<u8>,
}

impl Entry {
    /// (prompt, completion) tokens of a successful request's answer.
    pub fn tokens(&self) -> (u64, u64) {
        if !self.ok {
            return (0, 0);
        }
        let u = &self.out["response"]["body"]["usage"];
        let n = |k: &str| u[k].as_u64().unwrap_or(0);
        (n("prompt_tokens"), n("completion_tokens"))
    }
}

impl BatchRecord {
    /// Counts `e` in `request_counts` and `usage`.
    pub fn count(&mut self, e: &Entry) {
        if e.ok {
            self.completed += 1;
        } else {
            self.failed += 1;
        }
        let (i, o) = e.tokens();
        self.input_tokens = self.input_tokens.saturating_add(i);
        self.output_tokens = self.output_tokens.saturating_add(o);
    }

    /// OpenAI's batch object.
    pub fn to_json(&self) -> Value {
        let errors =
            (!self.errors.is_empty()).then(|| json!({"object": "list", "data": self.errors}));
        json!({"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": errors,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status.as_str(), "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at,
            "failed_at": self.failed_at, "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "usage": {"input_tokens": self.input_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": self.output_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens},
            "metadata": self.metadata})
    }
}

/// One finished request of a batch, as the results file keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Its index among the batch's requests.
    pub i: u64,
    /// Whether it goes to the output file (HTTP 200) or the error file.
    pub ok: bool,
    /// Its output line.
    pub out: Value,
}

fn io(path: &Path, e: impl std::fmt::Display) -> FileError {
    FileError::Io(format!("{}: {e}", path.display()))
}

/// Every tenant's batches.
#[derive(Debug)]
pub struct BatchStore {
    root: PathBuf,
}

impl BatchStore {
    /// Batches under `root`.
    pub fn new(root: PathBuf) -> Self {
        Self { root }
    }

    fn path(&self, tenant: &str, id: &str, ext: &str) -> PathBuf {
        self.root.join(tenant_dir(tenant)).join(format!("{id}.{ext}"))
    }

    /// Writes the record (whole, crash-safe).
    pub fn save(&self, rec: &BatchRecord) -> Result<(), FileError> {
        let p = self.path(&rec.tenant_id, &rec.id, "json");
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).map_err(|e| io(d, e))?;
        }
        let bytes = serde_json::to_vec(rec).map_err(|e| io(&p, e))?;
        write_atomic(&p, &bytes).map_err(|e| io(&p, e))
    }

    fn read(p: &Path) -> Result<Option<BatchRecord>, FileError> {
        let bytes = match std::fs::read(p) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(p, e)),
        };
        match serde_json::from_slice::<BatchRecord>(&bytes) {
            Ok(r) if r.v == BATCH_RECORD_VERSION => Ok(Some(r)),
            Ok(r) => {
                tracing::warn!(path = %p.display(), v = r.v, "batch record of another version");
                Ok(None)
            }
            Err(e) => Err(io(p, format!("corrupt record: {e}"))),
        }
    }

    /// The record of `id` if `tenant` owns it.
    pub fn load(&self, tenant: &str, id: &str) -> Result<Option<BatchRecord>, FileError> {
        if !well_formed(id, "batch_") {
            return Ok(None);
        }
        Ok(Self::read(&self.path(tenant, id, "json"))?.filter(|r| r.tenant_id == tenant))
    }

    fn scan(dir: &Path) -> Result<Vec<BatchRecord>, FileError> {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(io(dir, e)),
        };
        let mut out = vec![];
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "json") {
                match Self::read(&p) {
                    Ok(Some(r)) => out.push(r),
                    Ok(None) => {}
                    Err(e) => tracing::warn!(error = %e, "skipping an unreadable batch record"),
                }
            }
        }
        out.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| b.id.cmp(&a.id)));
        Ok(out)
    }

    /// Every batch of `tenant`, newest first.
    pub fn list(&self, tenant: &str) -> Result<Vec<BatchRecord>, FileError> {
        Ok(Self::scan(&self.root.join(tenant_dir(tenant)))?
            .into_iter()
            .filter(|r| r.tenant_id == tenant)
            .collect())
    }

    /// Every batch of every tenant that has not ended (to resume at start).
    pub fn unfinished(&self) -> Result<Vec<BatchRecord>, FileError> {
        Ok(self.all()?.into_iter().filter(|r| !r.status.terminal()).collect())
    }

    /// Every batch of every tenant, newest first (`gcs-node batches`).
    pub fn all(&self) -> Result<Vec<BatchRecord>, FileError> {
        let dirs = match std::fs::read_dir(&self.root) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(io(&self.root, e)),
        };
        let mut out = vec![];
        for d in dirs.flatten() {
            out.extend(Self::scan(&d.path())?);
        }
        out.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| b.id.cmp(&a.id)));
        Ok(out)
    }

    /// Removes an ended batch's record and results (retention).
    pub fn remove(&self, rec: &BatchRecord) {
        let _ = std::fs::remove_file(self.path(&rec.tenant_id, &rec.id, "results"));
        let _ = std::fs::remove_file(self.path(&rec.tenant_id, &rec.id, "json"));
    }

    /// Appends finished requests to the batch's results (not synced: a
    /// request lost by a crash runs again under the same idempotency key,
    /// and the network answers it from its stored result).
    pub fn append(&self, rec: &BatchRecord, entries: &[Entry]) -> Result<(), FileError> {
        let p = self.path(&rec.tenant_id, &rec.id, "results");
        let mut buf = vec![];
        for e in entries {
            serde_json::to_writer(&mut buf, e).map_err(|e| io(&p, e))?;
            buf.push(b'\n');
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .map_err(|e| io(&p, e))?;
        f.write_all(&buf).map_err(|e| io(&p, e))
    }

    /// The finished requests of a batch, one per index (a torn last line
    /// of a crash is skipped; its request runs again).
    pub fn results(&self, rec: &BatchRecord) -> Result<Vec<Entry>, FileError> {
        let p = self.path(&rec.tenant_id, &rec.id, "results");
        let bytes = match std::fs::read(&p) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(io(&p, e)),
        };
        let mut seen = std::collections::BTreeMap::new();
        for l in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            if let Ok(e) = serde_json::from_slice::<Entry>(l) {
                seen.entry(e.i).or_insert(e);
            }
        }
        Ok(seen.into_values().collect())
    }
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A batch of 2 requests in progress (for the other modules' tests too).
    pub(in crate::batch) fn record(tenant: &str, id: &str) -> BatchRecord {
        BatchRecord {
            v: BATCH_RECORD_VERSION,
            id: id.into(),
            tenant_id: tenant.into(),
            project_id: "p".into(),
            api_key_id: "key_1".into(),
            endpoint: "/v1/embeddings".into(),
            input_file_id: "file-000000000000000000000000".into(),
            completion_window: "24h".into(),
            metadata: None,
            status: Status::InProgress,
            created_at: 1,
            expires_at: 86_401,
            in_progress_at: Some(1),
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
            total: 2,
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
        }
    }

    #[test]
    fn records_round_trip_per_tenant_and_unfinished_ones_are_found() {
        let d = tempfile::tempdir().unwrap();
        let s = BatchStore::new(d.path().to_path_buf());
        let id = "batch_0123456789abcdef01234567";
        let mut r = record("a", id);
        s.save(&r).unwrap();
        assert_eq!(s.load("a", id).unwrap().unwrap(), r);
        assert!(s.load("b", id).unwrap().is_none());
        assert!(s.load("a", "batch_../x").unwrap().is_none());
        assert_eq!(s.unfinished().unwrap().len(), 1);
        r.status = Status::Completed;
        s.save(&r).unwrap();
        assert!(s.unfinished().unwrap().is_empty());
        assert_eq!(s.list("a").unwrap().len(), 1);
    }

    #[test]
    fn results_survive_a_torn_last_line_and_keep_the_first_of_an_index() {
        let d = tempfile::tempdir().unwrap();
        let s = BatchStore::new(d.path().to_path_buf());
        let r = record("a", "batch_0123456789abcdef01234567");
        s.save(&r).unwrap();
        let e = |i, ok| Entry { i, ok, out: json!({"custom_id": i}) };
        s.append(&r, &[e(1, true), e(0, false)]).unwrap();
        s.append(&r, &[e(1, false)]).unwrap();
        let p = d.path().join(tenant_dir("a")).join(format!("{}.results", r.id));
        let mut f = std::fs::OpenOptions::new().append(true).open(p).unwrap();
        f.write_all(b"{\"i\":2,\"ok\":tr").unwrap();
        assert_eq!(s.results(&r).unwrap(), vec![e(0, false), e(1, true)]);
    }
}

/// One processing task of a batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRef {
    /// The model its requests name.
    pub model: String,
    /// The task id (`task_…`).
    pub task_id: String,
}

pub(super) fn entry(i: u64, line: &Line, status: u16, request_id: Option<String>, body: Value) -> Entry {
    let out = json!({"id": crate::files::store::fresh_id("batch_req_"), "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": null});
    Entry { i, ok: status == 200, out }
}

/// The error line of a request the window closed on.
pub(super) fn expired(i: u64, line: &Line) -> Entry {
    let out = json!({"id": crate::files::store::fresh_id("batch_req_"),
        "custom_id": line.custom_id, "response": null,
        "error": {"code": "batch_expired",
                  "message": "This request could not be executed before the completion window expired."}});
    Entry { i, ok: false, out }
}
