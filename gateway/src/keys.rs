//! API keys (26.20.1): `gnus_` + 256 random bits, shown once, stored only
//! as a blake3 hash in `<data dir>/api_keys.json`, scoped to a tenant and
//! project, optionally restricted to models and routing modes, with rate
//! limits and a token budget.
//!
//! The file is written by `gcs-node keys ...` under an advisory lock (so
//! concurrent `create`/`revoke` cannot undo each other) and crash-safely
//! (`durable::write_atomic`: temp file, fsync, rename, directory fsync), and
//! re-read by a running gateway when its content hash changes, so keys can be
//! created and revoked without a restart. A lookup hashes the presented key
//! and compares the stored hash with blake3's constant-time equality.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gcs_protocol::RoutingMode;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::durable::{write_atomic, FileLock};

/// The key file's format version.
pub const KEY_FILE_VERSION: u32 = 1;
/// The key file's name inside the data directory.
pub const KEY_FILE: &str = "api_keys.json";
/// How often a running gateway looks for changes to the key file.
const RELOAD_EVERY: Duration = Duration::from_millis(500);

/// Key store failures.
#[derive(Debug, Error)]
pub enum KeyError {
    /// Reading or writing the key file failed.
    #[error("key file {path}: {reason}")]
    Io {
        /// File.
        path: String,
        /// Why.
        reason: String,
    },
    /// The key file is not a key file this version understands.
    #[error("key file {path} is corrupt or of an unknown version: {reason}")]
    Corrupt {
        /// File.
        path: String,
        /// Why.
        reason: String,
    },
    /// No key with that id or prefix.
    #[error("no key {0}")]
    NotFound(String),
    /// Bad arguments.
    #[error("{0}")]
    Invalid(String),
}

/// One stored key. The secret itself is never stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// Public id (`key_<ulid>`), used in usage records.
    pub id: String,
    /// blake3 of the full key, hex.
    pub hash: String,
    /// The first characters of the key, to recognise it in listings.
    pub prefix: String,
    /// Tenant.
    pub tenant_id: String,
    /// Project.
    pub project_id: String,
    /// Models and aliases the key may use (empty: all).
    #[serde(default)]
    pub models: Vec<String>,
    /// Routing modes the key may use (empty: all).
    #[serde(default)]
    pub routing: Vec<RoutingMode>,
    /// Requests per minute.
    #[serde(default)]
    pub rpm: Option<u32>,
    /// Tokens (prompt + completion) per minute.
    #[serde(default)]
    pub tpm: Option<u64>,
    /// Total tokens this key may ever consume.
    #[serde(default)]
    pub budget_tokens: Option<u64>,
    /// Per-key timeouts (26.16.7 defaults when absent).
    #[serde(default)]
    pub first_token_timeout_ms: Option<u64>,
    /// Idle-stream timeout.
    #[serde(default)]
    pub idle_timeout_ms: Option<u64>,
    /// Wall-clock timeout.
    #[serde(default)]
    pub wall_timeout_ms: Option<u64>,
    /// Creation time.
    pub created_at_ms: u64,
    /// Expiry, if any.
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
    /// Revocation time, if revoked.
    #[serde(default)]
    pub revoked_at_ms: Option<u64>,
}

impl KeyRecord {
    /// Whether the key may be used at `now_ms`.
    pub fn is_live(&self, now_ms: u64) -> bool {
        self.revoked_at_ms.is_none() && self.expires_at_ms.is_none_or(|e| now_ms < e)
    }

    /// Whether the key may use `model` (its id or any alias it was asked by).
    pub fn allows_model(&self, names: &[&str]) -> bool {
        self.models.is_empty() || names.iter().any(|n| self.models.iter().any(|m| m == n))
    }

    /// Whether the key may use a routing mode.
    pub fn allows_routing(&self, mode: RoutingMode) -> bool {
        self.routing.is_empty() || self.routing.contains(&mode)
    }
}

#[derive(Serialize, Deserialize)]
struct KeyFile {
    version: u32,
    keys: Vec<KeyRecord>,
}

/// What `create` needs.
#[derive(Clone, Debug, Default)]
pub struct NewKey {
    /// Tenant.
    pub tenant_id: String,
    /// Project.
    pub project_id: String,
    /// Allowed models (empty: all).
    pub models: Vec<String>,
    /// Allowed routing modes (empty: all).
    pub routing: Vec<RoutingMode>,
    /// Requests per minute.
    pub rpm: Option<u32>,
    /// Tokens per minute.
    pub tpm: Option<u64>,
    /// Token budget.
    pub budget_tokens: Option<u64>,
    /// Lifetime from now.
    pub ttl_ms: Option<u64>,
    /// Per-key first-token timeout.
    pub first_token_timeout_ms: Option<u64>,
    /// Per-key idle-stream timeout.
    pub idle_timeout_ms: Option<u64>,
    /// Per-key wall-clock timeout.
    pub wall_timeout_ms: Option<u64>,
}

struct Loaded {
    /// blake3 of the file's bytes when it was parsed (mtime alone misses a
    /// rewrite within the file system's timestamp granularity).
    content: blake3::Hash,
    checked: Instant,
    by_hash: HashMap<String, KeyRecord>,
}

/// The key file of one data directory.
#[derive(Debug)]
pub struct KeyStore {
    path: PathBuf,
    loaded: Mutex<Option<Loaded>>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded").field("keys", &self.by_hash.len()).finish()
    }
}

fn hash_key(secret: &str) -> blake3::Hash {
    blake3::hash(secret.as_bytes())
}

fn io(path: &Path, e: impl std::fmt::Display) -> KeyError {
    KeyError::Io { path: path.display().to_string(), reason: e.to_string() }
}

impl KeyStore {
    /// The key store of `data_dir` (the file need not exist yet).
    pub fn new(data_dir: &Path) -> Self {
        Self { path: data_dir.join(KEY_FILE), loaded: Mutex::new(None) }
    }

    /// The key file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's bytes (empty when it does not exist yet).
    fn read_bytes(&self) -> Result<Vec<u8>, KeyError> {
        match std::fs::read(&self.path) {
            Ok(b) => Ok(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(vec![]),
            Err(e) => Err(io(&self.path, e)),
        }
    }

    fn parse(&self, bytes: &[u8]) -> Result<Vec<KeyRecord>, KeyError> {
        if bytes.is_empty() {
            return Ok(vec![]);
        }
        let corrupt =
            |r: String| KeyError::Corrupt { path: self.path.display().to_string(), reason: r };
        let f: KeyFile = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if f.version != KEY_FILE_VERSION {
            return Err(corrupt(format!("version {}", f.version)));
        }
        Ok(f.keys)
    }

    fn read(&self) -> Result<Vec<KeyRecord>, KeyError> {
        self.parse(&self.read_bytes()?)
    }

    /// Read, change and write the file while holding its lock, so a second
    /// writer (another `gcs-node keys` process) sees this one's change.
    fn modify<T>(
        &self,
        change: impl FnOnce(&mut Vec<KeyRecord>) -> Result<T, KeyError>,
    ) -> Result<T, KeyError> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        }
        let _lock = FileLock::exclusive(&self.path).map_err(|e| io(&self.path, e))?;
        let mut keys = self.read()?;
        let out = change(&mut keys)?;
        let f = KeyFile { version: KEY_FILE_VERSION, keys };
        let bytes = serde_json::to_vec_pretty(&f).map_err(|e| io(&self.path, e))?;
        write_atomic(&self.path, &bytes).map_err(|e| io(&self.path, e))?;
        *self.loaded.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(out)
    }

    /// Creates a key; returns the secret (shown once) and its record.
    pub fn create(&self, new: NewKey, now_ms: u64) -> Result<(String, KeyRecord), KeyError> {
        if new.tenant_id.is_empty() || new.project_id.is_empty() {
            return Err(KeyError::Invalid("a key needs a tenant and a project".into()));
        }
        let mut raw = [0u8; 32];
        getrandom::getrandom(&mut raw)
            .map_err(|e| KeyError::Invalid(format!("no entropy: {e}")))?;
        let secret = format!("gnus_{}", hex::encode(raw));
        let id = gcs_protocol::ids::new_id("key_", now_ms)
            .map_err(|e| KeyError::Invalid(e.to_string()))?;
        let rec = KeyRecord {
            id,
            hash: hash_key(&secret).to_hex().to_string(),
            prefix: secret.chars().take(12).collect(),
            tenant_id: new.tenant_id,
            project_id: new.project_id,
            models: new.models,
            routing: new.routing,
            rpm: new.rpm,
            tpm: new.tpm,
            budget_tokens: new.budget_tokens,
            first_token_timeout_ms: new.first_token_timeout_ms,
            idle_timeout_ms: new.idle_timeout_ms,
            wall_timeout_ms: new.wall_timeout_ms,
            created_at_ms: now_ms,
            expires_at_ms: new.ttl_ms.map(|t| now_ms + t),
            revoked_at_ms: None,
        };
        self.modify(|keys| {
            keys.push(rec.clone());
            Ok(())
        })?;
        Ok((secret, rec))
    }

    /// Every key, revoked ones included.
    pub fn list(&self) -> Result<Vec<KeyRecord>, KeyError> {
        self.read()
    }

    /// Revokes the key with this id (or unique prefix of the secret).
    pub fn revoke(&self, id_or_prefix: &str, now_ms: u64) -> Result<KeyRecord, KeyError> {
        self.modify(|keys| Self::revoke_in(keys, id_or_prefix, now_ms))
    }

    fn revoke_in(
        keys: &mut [KeyRecord],
        id_or_prefix: &str,
        now_ms: u64,
    ) -> Result<KeyRecord, KeyError> {
        let hits: Vec<usize> = keys
            .iter()
            .enumerate()
            .filter(|(_, k)| {
                k.id == id_or_prefix
                    || (id_or_prefix.len() >= 9 && k.prefix.starts_with(id_or_prefix))
            })
            .map(|(i, _)| i)
            .collect();
        let [i] = hits[..] else {
            return Err(KeyError::NotFound(id_or_prefix.into()));
        };
        keys[i].revoked_at_ms.get_or_insert(now_ms);
        Ok(keys[i].clone())
    }

    /// The live key record for a presented secret, if any. Re-reads the file
    /// at most every 500 ms and re-parses it when its content hash changed.
    pub fn authenticate(&self, secret: &str, now_ms: u64) -> Result<Option<KeyRecord>, KeyError> {
        let presented = hash_key(secret);
        let mut guard = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let due = guard.as_ref().is_none_or(|l| l.checked.elapsed() >= RELOAD_EVERY);
        if due {
            let bytes = self.read_bytes()?;
            let content = blake3::hash(&bytes);
            if guard.as_ref().is_none_or(|l| l.content != content) {
                let by_hash =
                    self.parse(&bytes)?.into_iter().map(|k| (k.hash.clone(), k)).collect();
                *guard = Some(Loaded { content, checked: Instant::now(), by_hash });
            } else if let Some(l) = guard.as_mut() {
                l.checked = Instant::now();
            }
        }
        let Some(l) = guard.as_ref() else { return Ok(None) };
        let Some(rec) = l.by_hash.get(presented.to_hex().as_str()) else { return Ok(None) };
        // The map lookup found it by hash; confirm in constant time.
        let stored = blake3::Hash::from_hex(&rec.hash).ok();
        Ok((stored == Some(presented) && rec.is_live(now_ms)).then(|| rec.clone()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn new_key() -> NewKey {
        NewKey { tenant_id: "t".into(), project_id: "p".into(), ..Default::default() }
    }

    #[test]
    fn a_created_key_authenticates_and_is_stored_only_as_a_hash() {
        let dir = tempfile::tempdir().unwrap();
        let store = KeyStore::new(dir.path());
        let (secret, rec) = store.create(new_key(), 1_000).unwrap();
        assert!(secret.starts_with("gnus_") && secret.len() == 5 + 64);
        let file = std::fs::read_to_string(store.path()).unwrap();
        assert!(!file.contains(&secret), "the key file holds the key text");
        assert!(!file.contains(&secret[5..]), "the key file holds the key's random part");
        assert_eq!(store.authenticate(&secret, 2_000).unwrap(), Some(rec));
        assert_eq!(store.authenticate("gnus_00", 2_000).unwrap(), None);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(store.path()).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "key file readable by others: {mode:o}");
        }
    }

    #[test]
    fn revoked_and_expired_keys_do_not_authenticate() {
        let dir = tempfile::tempdir().unwrap();
        let store = KeyStore::new(dir.path());
        let (a, ra) = store.create(new_key(), 1_000).unwrap();
        let (b, _) = store.create(NewKey { ttl_ms: Some(500), ..new_key() }, 1_000).unwrap();
        assert!(store.authenticate(&a, 1_200).unwrap().is_some());
        assert!(store.authenticate(&b, 1_200).unwrap().is_some());
        assert!(store.authenticate(&b, 1_500).unwrap().is_none(), "expired key accepted");
        store.revoke(&ra.id, 1_300).unwrap();
        assert!(store.authenticate(&a, 1_400).unwrap().is_none(), "revoked key accepted");
        assert!(matches!(store.revoke("key_nope", 1), Err(KeyError::NotFound(_))));
        assert_eq!(store.list().unwrap().len(), 2);
    }

    #[test]
    fn a_second_store_sees_keys_created_by_another_process() {
        let dir = tempfile::tempdir().unwrap();
        let gateway = KeyStore::new(dir.path());
        assert!(gateway.authenticate("gnus_x", 1).unwrap().is_none());
        let cli = KeyStore::new(dir.path());
        let (secret, _) = cli.create(new_key(), 1).unwrap();
        std::thread::sleep(RELOAD_EVERY + Duration::from_millis(50));
        assert!(gateway.authenticate(&secret, 2).unwrap().is_some());
    }

    #[test]
    fn concurrent_writers_lose_no_key() {
        // Each thread has its own store (its own lock file descriptor), as
        // separate `gcs-node keys create` processes do.
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let store = KeyStore::new(dir.path());
                        (0..5).map(|_| store.create(new_key(), 1).unwrap().1.id).collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let stored: Vec<String> =
            KeyStore::new(dir.path()).list().unwrap().into_iter().map(|k| k.id).collect();
        assert_eq!(stored.len(), 40, "keys lost to concurrent writers");
        for id in &ids {
            assert!(stored.contains(id), "{id} missing");
        }
    }

    #[test]
    fn a_revoke_racing_creates_is_not_undone() {
        let dir = tempfile::tempdir().unwrap();
        let (_, victim) = KeyStore::new(dir.path()).create(new_key(), 1).unwrap();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let store = KeyStore::new(dir.path());
                    for _ in 0..5 {
                        store.create(new_key(), 1).unwrap();
                    }
                });
            }
            s.spawn(|| KeyStore::new(dir.path()).revoke(&victim.id, 2).unwrap());
        });
        let keys = KeyStore::new(dir.path()).list().unwrap();
        assert_eq!(keys.len(), 21);
        let v = keys.iter().find(|k| k.id == victim.id).unwrap();
        assert_eq!(v.revoked_at_ms, Some(2), "the revocation was overwritten");
    }

    #[test]
    fn a_rewrite_with_the_same_mtime_is_still_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let gateway = KeyStore::new(dir.path());
        let cli = KeyStore::new(dir.path());
        let (a, _) = cli.create(new_key(), 1).unwrap();
        assert!(gateway.authenticate(&a, 2).unwrap().is_some());
        let mtime = std::fs::metadata(cli.path()).unwrap().modified().unwrap();
        let (b, _) = cli.create(new_key(), 1).unwrap();
        std::fs::File::options().write(true).open(cli.path()).unwrap().set_modified(mtime).unwrap();
        std::thread::sleep(RELOAD_EVERY + Duration::from_millis(50));
        assert!(gateway.authenticate(&b, 2).unwrap().is_some(), "reload went by mtime");
    }

    #[test]
    fn a_corrupt_key_file_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(KEY_FILE), b"{not json").unwrap();
        let store = KeyStore::new(dir.path());
        assert!(matches!(store.list(), Err(KeyError::Corrupt { .. })));
    }
}
