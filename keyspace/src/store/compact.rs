//! Reading a namespace in pages and compacting it in batches. Both walk a
//! RocksDB iterator from a key; neither decodes more than it returns, and
//! compaction takes the write lock only to delete one batch, never across
//! the scan (writers wait at most one batch, not a namespace).

use super::*;

/// Expired entries deleted per write batch.
pub const COMPACT_BATCH: usize = 1000;
/// Entries a compaction step scans before it deletes what it found, so a
/// namespace with few expired entries still yields between steps.
const SCAN_STEP: usize = 16 * COMPACT_BATCH;

/// One step of a compaction scan.
struct Expired {
    /// (key, stored bytes as scanned).
    entries: Vec<(Vec<u8>, Vec<u8>)>,
    /// Where the next step starts (exclusive).
    last_key: Option<Vec<u8>>,
    /// Whether the namespace has entries after `last_key`.
    more: bool,
}

impl Keyspace {
    /// Every entry of a namespace as deltas (small namespaces and tests;
    /// anti-entropy pages with [`Keyspace::snapshot_page`]).
    pub fn snapshot(&self, ns: Namespace) -> Result<Vec<Delta>, KeyspaceError> {
        Ok(self.snapshot_page(ns, None, usize::MAX, usize::MAX)?.0)
    }

    /// The entries of `ns` whose keys sort after `after` (from the start
    /// when `None`), in key order, read from an iterator positioned at
    /// `after`: at most `max_entries`, and no more once the stored bytes
    /// reach `max_bytes` (a page holds at least one entry). Returns the
    /// page and whether entries remain after it. Unreadable values are
    /// skipped with a warning.
    pub fn snapshot_page(
        &self,
        ns: Namespace,
        after: Option<&str>,
        max_entries: usize,
        max_bytes: usize,
    ) -> Result<(Vec<Delta>, bool), KeyspaceError> {
        let prefix = ns.prefix().as_bytes();
        let start = after.map_or(prefix, str::as_bytes);
        let iter =
            self.db.iterator_cf(self.cf(ns.cf())?, IteratorMode::From(start, Direction::Forward));
        let (mut out, mut bytes) = (Vec::new(), 0usize);
        for item in iter {
            let (k, v) = item?;
            if !k.starts_with(prefix) {
                break;
            }
            if after.is_some_and(|a| k.as_ref() <= a.as_bytes()) {
                continue;
            }
            if out.len() >= max_entries || (bytes >= max_bytes && !out.is_empty()) {
                return Ok((out, true));
            }
            let Ok(key) = std::str::from_utf8(&k) else {
                tracing::warn!(cf = ns.cf(), "skipping non-UTF-8 key");
                continue;
            };
            match decode_value(key, &v) {
                Ok(value) => {
                    bytes = bytes.saturating_add(k.len() + v.len());
                    out.push(Delta { key: key.to_string(), value });
                }
                Err(e) => tracing::warn!(key, error = %e, "skipping unreadable value"),
            }
        }
        Ok((out, false))
    }

    /// The entries with `from <= key < to` (both in one namespace), in key
    /// order, at most `limit`: an index read of one range, not a prefix.
    pub fn scan_range(
        &self,
        from: &str,
        to: &str,
        limit: usize,
    ) -> Result<Vec<(String, CrdtValue)>, KeyspaceError> {
        let ns = Namespace::of_key(from)?;
        let iter = self
            .db
            .iterator_cf(self.cf(ns.cf())?, IteratorMode::From(from.as_bytes(), Direction::Forward));
        let mut out = Vec::new();
        for item in iter {
            let (k, v) = item?;
            if k.as_ref() >= to.as_bytes() || out.len() >= limit {
                break;
            }
            let Ok(key) = std::str::from_utf8(&k) else { continue };
            match decode_value(key, &v) {
                Ok(val) => out.push((key.to_string(), val)),
                Err(e) => tracing::warn!(key, error = %e, "skipping unreadable value"),
            }
        }
        Ok(out)
    }

    /// Removes entries older than their namespace's retention, in batches
    /// of [`COMPACT_BATCH`].
    pub fn compact(&self, now_ms: u64) -> Result<CompactStats, KeyspaceError> {
        self.compact_in_batches(now_ms, COMPACT_BATCH)
    }

    /// [`Keyspace::compact`] with a batch size: scan a step without the
    /// lock, then delete the step's expired entries under it — each only if
    /// its bytes are still those scanned (a write in between keeps it).
    pub fn compact_in_batches(
        &self,
        now_ms: u64,
        batch: usize,
    ) -> Result<CompactStats, KeyspaceError> {
        let mut stats = CompactStats::default();
        let batch = batch.max(1);
        for &ns in self.opts.retention_ms.keys() {
            let mut after: Option<Vec<u8>> = None;
            loop {
                let step = self.expired_step(ns, after.as_deref(), now_ms, batch)?;
                for chunk in step.entries.chunks(batch) {
                    let removed = self.delete_unchanged(ns, chunk)?;
                    if removed > 0 {
                        *stats.removed.entry(ns).or_default() += removed;
                    }
                }
                stats.batches += step.entries.len().div_ceil(batch) as u64;
                if !step.more {
                    break;
                }
                after = step.last_key;
            }
            if let Some(n) = stats.removed.get(&ns) {
                tracing::debug!(namespace = ns.cf(), removed = n, "compacted expired entries");
            }
        }
        Ok(stats)
    }

    fn expired_step(
        &self,
        ns: Namespace,
        after: Option<&[u8]>,
        now_ms: u64,
        batch: usize,
    ) -> Result<Expired, KeyspaceError> {
        let prefix = ns.prefix().as_bytes();
        let start = after.unwrap_or(prefix);
        let iter =
            self.db.iterator_cf(self.cf(ns.cf())?, IteratorMode::From(start, Direction::Forward));
        let mut step = Expired { entries: vec![], last_key: None, more: false };
        let mut scanned = 0usize;
        for item in iter {
            let (k, v) = item?;
            if !k.starts_with(prefix) {
                break;
            }
            if after.is_some_and(|a| k.as_ref() <= a) {
                continue;
            }
            if step.entries.len() >= batch || scanned >= SCAN_STEP {
                step.more = true;
                break;
            }
            scanned += 1;
            let key = String::from_utf8_lossy(&k);
            if let Ok(val) = decode_value(&key, &v) {
                if self.is_expired(ns, val.updated(), now_ms) {
                    step.entries.push((k.to_vec(), v.to_vec()));
                }
            }
            step.last_key = Some(k.to_vec());
        }
        Ok(step)
    }

    /// Deletes the entries whose stored bytes are still those scanned, in
    /// one batch with the namespace's digest.
    fn delete_unchanged(
        &self,
        ns: Namespace,
        entries: &[(Vec<u8>, Vec<u8>)],
    ) -> Result<u64, KeyspaceError> {
        let _st = self.lock();
        let cf = self.cf(ns.cf())?;
        let mut digest = self.digest(ns)?;
        let mut batch = WriteBatch::default();
        let mut removed = 0u64;
        for (k, scanned) in entries {
            if self.db.get_cf(cf, k)?.as_deref() == Some(scanned.as_slice()) {
                batch.delete_cf(cf, k);
                digest.toggle(k, scanned, false);
                removed += 1;
            }
        }
        if removed > 0 {
            batch.put_cf(self.cf(META_CF)?, Self::digest_key(ns), digest.to_bytes());
            self.write(batch)?;
        }
        Ok(removed)
    }

    #[cfg(test)]
    pub(crate) fn delete_unchanged_for_test(
        &self,
        ns: Namespace,
        entries: &[(Vec<u8>, Vec<u8>)],
    ) -> Result<u64, KeyspaceError> {
        self.delete_unchanged(ns, entries)
    }
}
