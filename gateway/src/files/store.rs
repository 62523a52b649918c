//! Files on the gateway's disk, per tenant (specs/batch.md, "Storage"):
//! `<data>/files/<tenant dir>/<file id>.json` is the versioned record,
//! `<file id>.data` its bytes. Never replicated: a file belongs to the
//! gateway it was uploaded to. The record is written after the bytes (a
//! crash leaves at most an orphan `.data`, removed at start), so a record
//! always names complete bytes.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::durable::{create_atomic, write_atomic};

/// The record format's version.
pub const FILE_RECORD_VERSION: u16 = 1;

/// Bounds of the Files API.
#[derive(Clone, Debug)]
pub struct FileLimits {
    /// Largest uploaded file.
    pub max_file_bytes: usize,
    /// Most JSONL lines (requests) in an uploaded file.
    pub max_lines: usize,
    /// Bytes of uploaded files one tenant may hold.
    pub max_tenant_bytes: u64,
    /// Files one tenant may hold (uploads and batch outputs).
    pub max_tenant_files: usize,
    /// Uploads read at once by this gateway (each holds its body in memory).
    pub concurrent_uploads: usize,
}

impl Default for FileLimits {
    fn default() -> Self {
        Self {
            max_file_bytes: 32 << 20,
            max_lines: 50_000,
            max_tenant_bytes: 512 << 20,
            max_tenant_files: 1000,
            concurrent_uploads: 2,
        }
    }
}

/// What a file is for (OpenAI's `purpose`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// An uploaded batch input.
    Batch,
    /// A batch's output or error file, written by the gateway.
    BatchOutput,
}

impl Purpose {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Purpose::Batch => "batch",
            Purpose::BatchOutput => "batch_output",
        }
    }
}

/// One stored file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Always [`FILE_RECORD_VERSION`].
    pub v: u16,
    /// `file-…`.
    pub id: String,
    /// Owner.
    pub tenant_id: String,
    /// Size.
    pub bytes: u64,
    /// Unix seconds.
    pub created_at: u64,
    /// The client's name for it (last path component, bounded).
    pub filename: String,
    /// What it is for.
    pub purpose: Purpose,
}

impl FileRecord {
    /// OpenAI's file object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"id": self.id, "object": "file", "bytes": self.bytes,
            "created_at": self.created_at, "filename": self.filename,
            "purpose": self.purpose.as_str(), "status": "processed",
            "expires_at": null, "status_details": null})
    }
}

/// Why a file operation failed.
#[derive(Debug, Error)]
pub enum FileError {
    /// The disk (logged; a client sees a 503).
    #[error("file storage: {0}")]
    Io(String),
    /// The tenant holds too much already.
    #[error("this tenant's files would exceed {limit}")]
    Quota {
        /// Which bound, in words.
        limit: String,
    },
}

fn io(path: &Path, e: impl std::fmt::Display) -> FileError {
    FileError::Io(format!("{}: {e}", path.display()))
}

/// A directory name for a tenant id that no id can escape.
pub(crate) fn tenant_dir(tenant: &str) -> String {
    format!("t{}", &blake3::hash(tenant.as_bytes()).to_hex()[..32])
}

/// A fresh id: `prefix` and 24 random hex digits.
pub(crate) fn fresh_id(prefix: &str) -> String {
    let mut raw = [0u8; 12];
    let _ = getrandom::getrandom(&mut raw);
    format!("{prefix}{}", hex::encode(raw))
}

/// Whether `id` is one [`fresh_id`] could have made (so it is safe in a
/// path).
pub(crate) fn well_formed(id: &str, prefix: &str) -> bool {
    id.strip_prefix(prefix)
        .is_some_and(|h| h.len() == 24 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The files of every tenant of this gateway.
#[derive(Debug)]
pub struct FileStore {
    root: PathBuf,
    /// Bounds.
    pub limits: FileLimits,
    /// Serialises quota checks with the writes they admit.
    write: Mutex<()>,
}

impl FileStore {
    /// Files under `root` (created on first write). Orphan bytes of a
    /// crashed upload are removed.
    pub fn new(root: PathBuf, limits: FileLimits) -> Self {
        let s = Self { root, limits, write: Mutex::new(()) };
        s.remove_orphans();
        s
    }

    fn remove_orphans(&self) {
        let Ok(tenants) = std::fs::read_dir(&self.root) else { return };
        for t in tenants.flatten() {
            let Ok(files) = std::fs::read_dir(t.path()) else { continue };
            for f in files.flatten() {
                let p = f.path();
                if p.extension().is_some_and(|e| e == "data") && !p.with_extension("json").exists()
                {
                    tracing::info!(path = %p.display(), "removing the bytes of an unfinished upload");
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
    }

    fn dir(&self, tenant: &str) -> PathBuf {
        self.root.join(tenant_dir(tenant))
    }

    /// Stores `data` for `tenant`. `counted`: whether the tenant's byte
    /// quota applies (uploads); batch outputs are written even past it, so
    /// that finished work is never lost (they count towards later uploads).
    pub fn create(
        &self,
        tenant: &str,
        filename: &str,
        purpose: Purpose,
        data: &[u8],
        counted: bool,
        now_s: u64,
    ) -> Result<FileRecord, FileError> {
        let _w = self.write.lock().unwrap_or_else(|p| p.into_inner());
        let held = self.list(tenant)?;
        let lim = &self.limits;
        if counted {
            if held.len() >= lim.max_tenant_files {
                return Err(FileError::Quota { limit: format!("{} files", lim.max_tenant_files) });
            }
            let bytes: u64 = held.iter().map(|f| f.bytes).sum();
            if bytes.saturating_add(data.len() as u64) > lim.max_tenant_bytes {
                return Err(FileError::Quota { limit: format!("{} bytes", lim.max_tenant_bytes) });
            }
        }
        let dir = self.dir(tenant);
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        let rec = FileRecord {
            v: FILE_RECORD_VERSION,
            id: fresh_id("file-"),
            tenant_id: tenant.to_string(),
            bytes: data.len() as u64,
            created_at: now_s,
            filename: filename.to_string(),
            purpose,
        };
        let data_path = dir.join(format!("{}.data", rec.id));
        write_atomic(&data_path, data).map_err(|e| io(&data_path, e))?;
        let rec_path = dir.join(format!("{}.json", rec.id));
        let json = serde_json::to_vec(&rec).map_err(|e| io(&rec_path, e))?;
        create_atomic(&rec_path, &json).map_err(|e| io(&rec_path, e))?;
        Ok(rec)
    }

    /// The record of `id` if `tenant` owns it.
    pub fn get(&self, tenant: &str, id: &str) -> Result<Option<FileRecord>, FileError> {
        if !well_formed(id, "file-") {
            return Ok(None);
        }
        let p = self.dir(tenant).join(format!("{id}.json"));
        let bytes = match std::fs::read(&p) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&p, e)),
        };
        match serde_json::from_slice::<FileRecord>(&bytes) {
            Ok(r) if r.v == FILE_RECORD_VERSION && r.tenant_id == tenant => Ok(Some(r)),
            Ok(r) => {
                tracing::warn!(path = %p.display(), v = r.v, "file record of another version or tenant");
                Ok(None)
            }
            Err(e) => Err(io(&p, format!("corrupt record: {e}"))),
        }
    }

    /// The bytes of `id` if `tenant` owns it.
    pub fn content(&self, tenant: &str, id: &str) -> Result<Option<Vec<u8>>, FileError> {
        if self.get(tenant, id)?.is_none() {
            return Ok(None);
        }
        let p = self.dir(tenant).join(format!("{id}.data"));
        std::fs::read(&p).map(Some).map_err(|e| io(&p, e))
    }

    /// The bytes of `id` if `tenant` owns it, as the open file and its
    /// length: a download streams them instead of holding them in memory
    /// (a deletion meanwhile unlinks the name, not the open file).
    pub fn open_content(&self, tenant: &str, id: &str) -> Result<Option<(std::fs::File, u64)>, FileError> {
        if self.get(tenant, id)?.is_none() {
            return Ok(None);
        }
        let p = self.dir(tenant).join(format!("{id}.data"));
        let f = match std::fs::File::open(&p) {
            Ok(f) => f,
            // Deleted since the record was read: as if never there.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&p, e)),
        };
        let len = f.metadata().map_err(|e| io(&p, e))?.len();
        Ok(Some((f, len)))
    }

    /// Deletes `id`; false if `tenant` has no such file.
    pub fn delete(&self, tenant: &str, id: &str) -> Result<bool, FileError> {
        let _w = self.write.lock().unwrap_or_else(|p| p.into_inner());
        if self.get(tenant, id)?.is_none() {
            return Ok(false);
        }
        let dir = self.dir(tenant);
        // The record first: a crash in between leaves orphan bytes, which
        // the next start removes.
        let rec = dir.join(format!("{id}.json"));
        std::fs::remove_file(&rec).map_err(|e| io(&rec, e))?;
        let _ = std::fs::remove_file(dir.join(format!("{id}.data")));
        crate::durable::sync_dir_of(&rec).map_err(|e| io(&rec, e))?;
        Ok(true)
    }

    /// Every file of `tenant`, newest first.
    pub fn list(&self, tenant: &str) -> Result<Vec<FileRecord>, FileError> {
        let dir = self.dir(tenant);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(io(&dir, e)),
        };
        let mut out = vec![];
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".json")) else { continue };
            if let Some(r) = self.get(tenant, id)? {
                out.push(r);
            }
        }
        out.sort_by(|a, b| b.created_at.cmp(&a.created_at).then_with(|| b.id.cmp(&a.id)));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn store(dir: &Path, limits: FileLimits) -> FileStore {
        FileStore::new(dir.join("files"), limits)
    }

    #[test]
    fn files_are_per_tenant() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), FileLimits::default());
        let f = s.create("a", "in.jsonl", Purpose::Batch, b"{}\n", true, 10).unwrap();
        assert!(well_formed(&f.id, "file-"));
        assert_eq!(s.get("a", &f.id).unwrap().unwrap(), f);
        assert_eq!(s.content("a", &f.id).unwrap().unwrap(), b"{}\n");
        assert!(s.get("b", &f.id).unwrap().is_none(), "another tenant sees nothing");
        assert!(s.content("b", &f.id).unwrap().is_none());
        assert!(!s.delete("b", &f.id).unwrap());
        assert_eq!(s.list("a").unwrap().len(), 1);
        assert!(s.delete("a", &f.id).unwrap());
        assert!(s.get("a", &f.id).unwrap().is_none());
        assert!(s.list("a").unwrap().is_empty());
    }

    #[test]
    fn ids_that_could_leave_the_directory_are_not_read() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), FileLimits::default());
        for id in ["../x", "file-../../etc", "file-", "file-zz", "batch_0123456789abcdef01234567"] {
            assert!(s.get("a", id).unwrap().is_none(), "{id}");
        }
    }

    #[test]
    fn a_tenants_quota_bounds_uploads_but_not_outputs() {
        let d = tempfile::tempdir().unwrap();
        let lim = FileLimits { max_tenant_bytes: 10, max_tenant_files: 2, ..FileLimits::default() };
        let s = store(d.path(), lim);
        s.create("a", "x", Purpose::Batch, b"12345678", true, 1).unwrap();
        let e = s.create("a", "y", Purpose::Batch, b"123", true, 2).unwrap_err();
        assert!(matches!(e, FileError::Quota { .. }), "{e}");
        s.create("b", "y", Purpose::Batch, b"123", true, 2).unwrap();
        s.create("a", "out", Purpose::BatchOutput, b"123", false, 3).unwrap();
        let e = s.create("a", "z", Purpose::Batch, b"", true, 4).unwrap_err();
        assert!(e.to_string().contains("2 files"), "{e}");
    }

    #[test]
    fn orphan_bytes_are_removed_at_start() {
        let d = tempfile::tempdir().unwrap();
        let s = store(d.path(), FileLimits::default());
        let f = s.create("a", "x", Purpose::Batch, b"1", true, 1).unwrap();
        let orphan = d.path().join("files").join(tenant_dir("a")).join("file-x.data");
        std::fs::write(&orphan, b"torn").unwrap();
        let s = store(d.path(), FileLimits::default());
        assert!(!orphan.exists());
        assert!(s.content("a", &f.id).unwrap().is_some());
    }
}
