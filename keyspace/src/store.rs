//! The keyspace on RocksDB: one column family per namespace, a delta log, a
//! digest per namespace, prefix watches and retention.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use rocksdb::{
    ColumnFamily, ColumnFamilyDescriptor, Direction, IteratorMode, Options, WriteBatch,
    WriteOptions, DB,
};
use tokio::sync::broadcast;

use crate::codec::{decode_value, encode_value, Delta};
use crate::crdt::{AwSet, CrdtValue, Register};
use crate::error::KeyspaceError;
use crate::hlc::{Hlc, HlcClock};
use crate::namespace::{Namespace, ValueKind};

mod compact;
pub use compact::COMPACT_BATCH;
mod migrate;
mod memory;
pub use memory::{CfMemory, MemoryUsage};

const LOG_CF: &str = "log";
const META_CF: &str = "meta";
const META_SEQ: &[u8] = b"seq";
const META_LOG_START: &[u8] = b"log_start";
const META_HLC: &[u8] = b"hlc";

/// Keyspace settings.
#[derive(Clone, Debug)]
pub struct KeyspaceOptions {
    /// fsync every write (survives power loss, not only a process kill).
    pub sync_writes: bool,
    /// Remote HLCs further ahead than this are refused.
    pub max_clock_drift_ms: u64,
    /// Delta-log entries kept; older ones are dropped (peers that far behind
    /// catch up from a namespace snapshot instead).
    pub log_capacity: u64,
    /// Buffered changes per watcher before it is told it lagged.
    pub watch_capacity: usize,
    /// Per-namespace retention: entries not written for this long are
    /// compacted away, and deltas older than it are not accepted back.
    pub retention_ms: BTreeMap<Namespace, u64>,
    /// Writes are refused while the file system has less than this free
    /// (RocksDB must never meet a full disk: a failed log write leaves its
    /// writer in an error state, and the system library asserts on it).
    pub min_free_bytes: u64,
}

impl Default for KeyspaceOptions {
    fn default() -> Self {
        Self {
            sync_writes: false,
            max_clock_drift_ms: 30_000,
            log_capacity: 1_000_000,
            watch_capacity: 4096,
            retention_ms: Namespace::ALL
                .iter()
                .filter_map(|ns| Some((*ns, ns.retention_ms()?)))
                .collect(),
            min_free_bytes: 64 << 20,
        }
    }
}

/// One applied change, as watchers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// Log sequence number.
    pub seq: u64,
    /// Key.
    pub key: String,
    /// New state.
    pub value: CrdtValue,
}

/// What a merge did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MergeOutcome {
    /// The state changed; logged at this sequence number.
    Changed(u64),
    /// Nothing new (a duplicate or an older state).
    Unchanged,
    /// Older than the namespace's retention; dropped.
    Expired,
}

/// Order-independent summary of a namespace: XOR of blake3(key, value bytes)
/// over its entries, and their count. Equal states give equal digests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digest {
    /// XOR of entry hashes.
    pub hash: [u8; 32],
    /// Entries.
    pub count: u64,
}

impl Digest {
    fn toggle(&mut self, key: &[u8], value: &[u8], add: bool) {
        let mut h = blake3::Hasher::new();
        h.update(key).update(&[0]).update(value);
        for (d, s) in self.hash.iter_mut().zip(h.finalize().as_bytes()) {
            *d ^= s;
        }
        self.count = if add { self.count + 1 } else { self.count.saturating_sub(1) };
    }
    fn to_bytes(self) -> Vec<u8> {
        let mut v = self.hash.to_vec();
        v.extend(self.count.to_be_bytes());
        v
    }
    fn from_bytes(b: &[u8]) -> Self {
        let mut d = Digest::default();
        if b.len() == 40 {
            d.hash.copy_from_slice(&b[..32]);
            d.count = u64::from_be_bytes(b[32..].try_into().unwrap_or([0; 8]));
        }
        d
    }
}

/// Deltas since a sequence number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Since {
    /// Every change after the requested number, in order, up to the limit.
    Deltas(Vec<(u64, Delta)>),
    /// The log no longer reaches back that far: fetch namespace snapshots.
    Truncated {
        /// Oldest sequence number still in the log.
        log_start: u64,
    },
}

/// What a compaction removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactStats {
    /// Entries removed per namespace.
    pub removed: BTreeMap<Namespace, u64>,
    /// Write batches it took (each under the write lock briefly).
    pub batches: u64,
}

struct WriteState {
    clock: HlcClock,
    next_seq: u64,
    log_start: u64,
}

/// A node's replica of the keyspace.
pub struct Keyspace {
    db: DB,
    actor: String,
    opts: KeyspaceOptions,
    state: Mutex<WriteState>,
    changes: broadcast::Sender<Arc<Change>>,
    /// Set by the first failed write (see `write_opt`).
    write_failed: std::sync::atomic::AtomicBool,
    /// The database directory, for the free-space check.
    path: std::path::PathBuf,
}

impl std::fmt::Debug for Keyspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyspace").field("actor", &self.actor).finish_non_exhaustive()
    }
}

fn be(b: Option<Vec<u8>>) -> u64 {
    b.and_then(|b| b.try_into().ok()).map(u64::from_be_bytes).unwrap_or(0)
}

impl Keyspace {
    /// Opens (or creates) the keyspace at `path`; `actor` is this node's id,
    /// the writer name in every CRDT it writes.
    pub fn open(path: &Path, actor: &str, opts: KeyspaceOptions) -> Result<Self, KeyspaceError> {
        let mut db_opts = Options::default();
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        db_opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        // One memory budget for every column family (store/memory.rs).
        let cache = memory::block_cache()?;
        memory::db_options(&mut db_opts);
        let cfs = memory::all_cfs()
            .map(|name| ColumnFamilyDescriptor::new(name, memory::cf_options(&cache)));
        let db = DB::open_cf_descriptors(&db_opts, path, cfs)?;
        let meta = db.cf_handle(META_CF).ok_or_else(|| KeyspaceError::Db("no meta cf".into()))?;
        let next_seq = be(db.get_cf(meta, META_SEQ)?).max(1);
        let log_start = be(db.get_cf(meta, META_LOG_START)?).max(1);
        let mut clock = HlcClock::new(opts.max_clock_drift_ms);
        if let Some(b) = db.get_cf(meta, META_HLC)? {
            if let Ok(h) = gcs_protocol::codec::from_cbor_bytes::<Hlc>(&b) {
                // Never issue a timestamp below one already written, even if
                // the wall clock went back across the restart.
                let _ = clock.observe(h, u64::MAX / 2);
            }
        }
        migrate::split_local(&db)?;
        let (changes, _) = broadcast::channel(opts.watch_capacity.max(1));
        Ok(Self {
            db,
            actor: actor.into(),
            opts,
            state: Mutex::new(WriteState { clock, next_seq, log_start }),
            changes,
            write_failed: std::sync::atomic::AtomicBool::new(false),
            path: path.to_path_buf(),
        })
    }

    /// How far ahead of this node's clock a peer's HLC may be.
    pub fn max_clock_drift_ms(&self) -> u64 {
        self.opts.max_clock_drift_ms
    }

    /// This replica's writer name.
    pub fn actor(&self) -> &str {
        &self.actor
    }

    fn cf(&self, name: &str) -> Result<&ColumnFamily, KeyspaceError> {
        self.db
            .cf_handle(name)
            .ok_or_else(|| KeyspaceError::Db(format!("missing column family {name}")))
    }

    fn lock(&self) -> MutexGuard<'_, WriteState> {
        // A panic while holding the lock cannot leave RocksDB half-written
        // (writes are atomic batches), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state at `key`.
    pub fn get(&self, key: &str) -> Result<Option<CrdtValue>, KeyspaceError> {
        let ns = Namespace::of_key(key)?;
        match self.db.get_cf(self.cf(ns.cf())?, key.as_bytes())? {
            None => Ok(None),
            Some(b) => decode_value(key, &b).map(Some).map_err(|e| {
                tracing::warn!(key, error = %e, "unreadable keyspace value");
                e
            }),
        }
    }

    /// The bytes in the register at `key`, if present and not deleted.
    pub fn get_bytes(&self, key: &str) -> Result<Option<Vec<u8>>, KeyspaceError> {
        Ok(match self.get(key)? {
            Some(CrdtValue::Register(r)) => r.value().map(<[u8]>::to_vec),
            _ => None,
        })
    }

    /// The CBOR value in the register at `key`; a value that does not
    /// decode as `T` is an error naming the key.
    pub fn get_cbor<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, KeyspaceError> {
        self.get_bytes(key)?.map(|b| decode_cbor(key, &b)).transpose()
    }

    /// Like [`Keyspace::get_cbor`], but a value that does not decode as `T`
    /// counts as absent (garbage is no record); a failing store is an error.
    pub fn find_cbor<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, KeyspaceError> {
        match self.get_cbor(key) {
            Err(KeyspaceError::Corrupt { .. }) => Ok(None),
            other => other,
        }
    }

    /// Every register under `prefix` whose value decodes as `T`, in key
    /// order; undecodable and deleted entries are skipped (a peer's
    /// garbage never hides the rest).
    pub fn scan_cbor<T: serde::de::DeserializeOwned>(
        &self,
        prefix: &str,
    ) -> Result<Vec<(String, T)>, KeyspaceError> {
        Ok(self
            .scan_prefix(prefix)?
            .into_iter()
            .filter_map(|(k, v)| {
                let b = v.as_register().and_then(|r| r.value())?;
                let t = decode_cbor(&k, b).ok()?;
                Some((k, t))
            })
            .collect())
    }

    fn expect_kind(key: &str, kind: ValueKind) -> Result<Namespace, KeyspaceError> {
        let ns = Namespace::of_key(key)?;
        if ns.kind() != kind {
            return Err(KeyspaceError::KindMismatch {
                key: key.into(),
                expected: ns.kind().name(),
                found: kind.name(),
            });
        }
        Ok(ns)
    }

    /// Writes `value` into the register at `key`; returns the delta to replicate.
    pub fn put(&self, key: &str, value: Vec<u8>, now_ms: u64) -> Result<Delta, KeyspaceError> {
        self.write_register(key, Some(value), now_ms)
    }

    /// `put` as a synced write (the write-ahead log is on disk before it
    /// returns): for records that must survive a power loss once
    /// acknowledged (usage, 26.23). On error the caller fails the request,
    /// so nothing is acknowledged that was not stored.
    pub fn put_durable(
        &self,
        key: &str,
        value: Vec<u8>,
        now_ms: u64,
    ) -> Result<Delta, KeyspaceError> {
        self.write_register_opt(key, Some(value), now_ms, true)
    }

    /// Deletes the register at `key` (a replicated tombstone).
    pub fn delete(&self, key: &str, now_ms: u64) -> Result<Delta, KeyspaceError> {
        self.write_register(key, None, now_ms)
    }

    fn write_register(
        &self,
        key: &str,
        value: Option<Vec<u8>>,
        now_ms: u64,
    ) -> Result<Delta, KeyspaceError> {
        self.write_register_opt(key, value, now_ms, false)
    }

    fn write_register_opt(
        &self,
        key: &str,
        value: Option<Vec<u8>>,
        now_ms: u64,
        sync: bool,
    ) -> Result<Delta, KeyspaceError> {
        let ns = Self::expect_kind(key, ValueKind::Register)?;
        let mut st = self.lock();
        let hlc = st.clock.tick(now_ms);
        let v = CrdtValue::Register(Register::new(value, hlc, &self.actor));
        let merged = self.apply_locked(&mut st, ns, key, v, sync)?;
        Ok(Delta { key: key.into(), value: merged.1 })
    }

    /// Adds `element` to the set at `key`.
    pub fn set_add(&self, key: &str, element: &[u8], now_ms: u64) -> Result<Delta, KeyspaceError> {
        self.write_set(key, now_ms, |s, actor, hlc| s.add(actor, element.to_vec(), hlc))
    }

    /// Removes `element` from the set at `key`.
    pub fn set_remove(
        &self,
        key: &str,
        element: &[u8],
        now_ms: u64,
    ) -> Result<Delta, KeyspaceError> {
        self.write_set(key, now_ms, |s, _, hlc| s.remove(element, hlc))
    }

    fn write_set(
        &self,
        key: &str,
        now_ms: u64,
        f: impl FnOnce(&mut AwSet, &str, Hlc),
    ) -> Result<Delta, KeyspaceError> {
        let ns = Self::expect_kind(key, ValueKind::Set)?;
        let mut st = self.lock();
        let hlc = st.clock.tick(now_ms);
        let mut set = match self.read_raw(ns, key)?.map(|b| decode_value(key, &b)) {
            Some(Ok(CrdtValue::Set(s))) => s,
            _ => AwSet::default(),
        };
        f(&mut set, &self.actor, hlc);
        let merged = self.apply_locked(&mut st, ns, key, CrdtValue::Set(set), false)?;
        Ok(Delta { key: key.into(), value: merged.1 })
    }

    /// Merges a peer's delta. Deltas arrive in any order, any number of times.
    pub fn merge(&self, delta: Delta, now_ms: u64) -> Result<MergeOutcome, KeyspaceError> {
        let ns = Namespace::of_key(&delta.key)?;
        if ns.kind() != delta.value.kind() {
            return Err(KeyspaceError::KindMismatch {
                key: delta.key,
                expected: ns.kind().name(),
                found: delta.value.kind().name(),
            });
        }
        if self.is_expired(ns, delta.value.updated(), now_ms) {
            return Ok(MergeOutcome::Expired);
        }
        let mut st = self.lock();
        st.clock.observe(delta.value.updated(), now_ms)?;
        Ok(match self.apply_locked(&mut st, ns, &delta.key, delta.value, false)?.0 {
            Some(seq) => MergeOutcome::Changed(seq),
            None => MergeOutcome::Unchanged,
        })
    }

    /// Decodes and merges wire bytes; garbage gives a typed error.
    pub fn merge_bytes(&self, bytes: &[u8], now_ms: u64) -> Result<MergeOutcome, KeyspaceError> {
        self.merge(Delta::decode(bytes)?, now_ms)
    }

    fn is_expired(&self, ns: Namespace, updated: Hlc, now_ms: u64) -> bool {
        self.opts
            .retention_ms
            .get(&ns)
            .is_some_and(|max| updated.wall_ms.saturating_add(*max) < now_ms)
    }

    fn read_raw(&self, ns: Namespace, key: &str) -> Result<Option<Vec<u8>>, KeyspaceError> {
        Ok(self.db.get_cf(self.cf(ns.cf())?, key.as_bytes())?)
    }

    fn digest_key(ns: Namespace) -> Vec<u8> {
        format!("digest/{}", ns.cf()).into_bytes()
    }

    /// Joins `incoming` into the stored state in one atomic batch (value,
    /// digest, log entry, sequence, clock). Returns the log sequence number
    /// if the state changed, and the resulting state. `sync`: the write is
    /// on disk when this returns.
    fn apply_locked(
        &self,
        st: &mut WriteState,
        ns: Namespace,
        key: &str,
        incoming: CrdtValue,
        sync: bool,
    ) -> Result<(Option<u64>, CrdtValue), KeyspaceError> {
        let old_bytes = self.read_raw(ns, key)?;
        let merged = match old_bytes.as_deref().map(|b| decode_value(key, b)) {
            Some(Ok(mut cur)) => {
                if cur.join(incoming.clone()).is_err() {
                    // A stored value of the wrong kind can only be corruption.
                    tracing::warn!(key, "stored value has the wrong kind; replacing it");
                    incoming
                } else {
                    cur
                }
            }
            Some(Err(e)) => {
                tracing::warn!(key, error = %e, "repairing unreadable value with the incoming state");
                incoming
            }
            None => incoming,
        };
        let new_bytes = encode_value(&merged);
        if old_bytes.as_deref() == Some(new_bytes.as_slice()) {
            return Ok((None, merged));
        }
        let seq = st.next_seq;
        let meta = self.cf(META_CF)?;
        let mut digest =
            Digest::from_bytes(&self.db.get_cf(meta, Self::digest_key(ns))?.unwrap_or_default());
        if let Some(old) = &old_bytes {
            digest.toggle(key.as_bytes(), old, false);
        }
        digest.toggle(key.as_bytes(), &new_bytes, true);
        let delta = Delta { key: key.into(), value: merged.clone() };
        let mut batch = WriteBatch::default();
        batch.put_cf(self.cf(ns.cf())?, key.as_bytes(), &new_bytes);
        batch.put_cf(meta, Self::digest_key(ns), digest.to_bytes());
        batch.put_cf(self.cf(LOG_CF)?, seq.to_be_bytes(), delta.encode());
        batch.put_cf(meta, META_SEQ, (seq + 1).to_be_bytes());
        let hlc = st.clock.last().max(merged.updated());
        batch.put_cf(
            meta,
            META_HLC,
            gcs_protocol::codec::to_canonical_bytes(&hlc).unwrap_or_default(),
        );
        let mut new_log_start = st.log_start;
        if seq + 1 - st.log_start > self.opts.log_capacity {
            new_log_start = seq + 1 - self.opts.log_capacity;
            batch.delete_range_cf(
                self.cf(LOG_CF)?,
                st.log_start.to_be_bytes(),
                new_log_start.to_be_bytes(),
            );
            batch.put_cf(meta, META_LOG_START, new_log_start.to_be_bytes());
        }
        self.write_opt(batch, sync)?;
        st.next_seq = seq + 1;
        st.log_start = new_log_start;
        // No receivers is fine: nobody is watching.
        let _ = self.changes.send(Arc::new(Change { seq, key: key.into(), value: merged.clone() }));
        Ok((Some(seq), merged))
    }

    fn write(&self, batch: WriteBatch) -> Result<(), KeyspaceError> {
        self.write_opt(batch, false)
    }

    /// Writes a batch (synced when `sync` or `KeyspaceOptions::sync_writes`).
    /// After one failed write (a full disk) every later write fails at once
    /// until the keyspace is reopened: RocksDB's log writer is then in an
    /// error state that a further write or sync must not touch (the system
    /// librocksdb asserts on it and aborts), and a node that cannot store
    /// must say so rather than half-store.
    fn write_opt(&self, batch: WriteBatch, sync: bool) -> Result<(), KeyspaceError> {
        if self.write_failed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(KeyspaceError::Db(
                "an earlier write failed (disk full?); reopen the keyspace".into(),
            ));
        }
        self.check_space()?;
        let mut wo = WriteOptions::default();
        wo.set_sync(sync || self.opts.sync_writes);
        self.db.write_opt(batch, &wo).map_err(|e| {
            self.write_failed.store(true, std::sync::atomic::Ordering::Release);
            tracing::error!(error = %e, "keyspace write failed; refusing writes until reopened");
            KeyspaceError::from(e)
        })
    }

    /// Refuses a write while the disk is below the reserve (one statvfs,
    /// about a microsecond; the reserve leaves room for RocksDB's own
    /// flushes and for the writes already admitted).
    fn check_space(&self) -> Result<(), KeyspaceError> {
        let reserve = self.opts.min_free_bytes;
        if reserve == 0 {
            return Ok(());
        }
        #[cfg(unix)]
        if let Ok(st) = rustix::fs::statvfs(&self.path) {
            let free = st.f_bavail.saturating_mul(st.f_frsize);
            if free < reserve {
                tracing::debug!(free, reserve, "keyspace write refused: disk below its reserve");
                return Err(KeyspaceError::NoSpace { free_bytes: free, reserve_bytes: reserve });
            }
        }
        Ok(())
    }

    /// Every entry whose key starts with `prefix`, in key order. Unreadable
    /// values are logged and skipped, so one corrupt key never hides the rest.
    pub fn scan_prefix(&self, prefix: &str) -> Result<Vec<(String, CrdtValue)>, KeyspaceError> {
        let mut out = Vec::new();
        for ns in Namespace::ALL
            .iter()
            .filter(|ns| ns.prefix().starts_with(prefix) || prefix.starts_with(ns.prefix()))
        {
            self.for_each_raw(*ns, prefix, |k, v| {
                match decode_value(k, v) {
                    Ok(val) => out.push((k.to_string(), val)),
                    Err(e) => tracing::warn!(key = k, error = %e, "skipping unreadable value"),
                }
                Ok(())
            })?;
        }
        Ok(out)
    }

    fn for_each_raw(
        &self,
        ns: Namespace,
        prefix: &str,
        mut f: impl FnMut(&str, &[u8]) -> Result<(), KeyspaceError>,
    ) -> Result<(), KeyspaceError> {
        let start = if prefix.len() > ns.prefix().len() { prefix } else { ns.prefix() };
        let iter = self.db.iterator_cf(
            self.cf(ns.cf())?,
            IteratorMode::From(start.as_bytes(), Direction::Forward),
        );
        for item in iter {
            let (k, v) = item?;
            if !k.starts_with(start.as_bytes()) {
                break;
            }
            match std::str::from_utf8(&k) {
                Ok(key) => f(key, &v)?,
                Err(_) => tracing::warn!(cf = ns.cf(), "skipping non-UTF-8 key"),
            }
        }
        Ok(())
    }

    /// The digest of a namespace (O(1): maintained on every write).
    pub fn digest(&self, ns: Namespace) -> Result<Digest, KeyspaceError> {
        Ok(Digest::from_bytes(
            &self.db.get_cf(self.cf(META_CF)?, Self::digest_key(ns))?.unwrap_or_default(),
        ))
    }

    /// The sequence number of the newest logged change (0 if none).
    pub fn last_seq(&self) -> u64 {
        self.lock().next_seq - 1
    }

    /// Logged changes after `seq`, at most `limit`.
    pub fn deltas_since(&self, seq: u64, limit: usize) -> Result<Since, KeyspaceError> {
        let log_start = self.lock().log_start;
        if seq + 1 < log_start {
            return Ok(Since::Truncated { log_start });
        }
        let from = (seq + 1).to_be_bytes();
        let mut out = Vec::new();
        for item in
            self.db.iterator_cf(self.cf(LOG_CF)?, IteratorMode::From(&from, Direction::Forward))
        {
            let (k, v) = item?;
            let s = u64::from_be_bytes(
                k.as_ref().try_into().map_err(|_| KeyspaceError::Db("bad log key".into()))?,
            );
            match Delta::decode(&v) {
                Ok(d) => out.push((s, d)),
                Err(e) => tracing::warn!(seq = s, error = %e, "skipping unreadable log entry"),
            }
            if out.len() >= limit {
                break;
            }
        }
        Ok(Since::Deltas(out))
    }

    /// A stream of changes under `prefix`.
    pub fn watch(&self, prefix: &str) -> Watcher {
        Watcher { rx: self.changes.subscribe(), prefix: prefix.into() }
    }

    #[cfg(test)]
    pub(crate) fn raw_put(&self, key: &str, bytes: &[u8]) -> Result<(), KeyspaceError> {
        let ns = Namespace::of_key(key)?;
        Ok(self.db.put_cf(self.cf(ns.cf())?, key.as_bytes(), bytes)?)
    }
}

/// Changes under one prefix.
#[derive(Debug)]
pub struct Watcher {
    rx: broadcast::Receiver<Arc<Change>>,
    prefix: String,
}

/// Why a watch yielded no change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WatchError {
    /// The watcher fell behind and missed this many changes; rescan the prefix.
    #[error("watcher lagged by {0} changes")]
    Lagged(u64),
    /// The keyspace was dropped.
    #[error("keyspace closed")]
    Closed,
}

impl Watcher {
    /// The next change under the prefix.
    pub async fn recv(&mut self) -> Result<Arc<Change>, WatchError> {
        loop {
            match self.rx.recv().await {
                Ok(c) if c.key.starts_with(&self.prefix) => return Ok(c),
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Lagged(n)) => return Err(WatchError::Lagged(n)),
                Err(broadcast::error::RecvError::Closed) => return Err(WatchError::Closed),
            }
        }
    }

    /// The next buffered change under the prefix, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Arc<Change>>, WatchError> {
        loop {
            match self.rx.try_recv() {
                Ok(c) if c.key.starts_with(&self.prefix) => return Ok(Some(c)),
                Ok(_) => continue,
                Err(broadcast::error::TryRecvError::Empty) => return Ok(None),
                Err(broadcast::error::TryRecvError::Lagged(n)) => {
                    return Err(WatchError::Lagged(n))
                }
                Err(broadcast::error::TryRecvError::Closed) => return Err(WatchError::Closed),
            }
        }
    }
}

fn decode_cbor<T: serde::de::DeserializeOwned>(
    key: &str,
    bytes: &[u8],
) -> Result<T, KeyspaceError> {
    gcs_protocol::codec::from_cbor_bytes(bytes).map_err(|e| KeyspaceError::Corrupt {
        key: key.chars().take(80).collect(),
        reason: e.to_string(),
    })
}
