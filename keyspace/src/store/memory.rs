//! What the keyspace's RocksDB holds in memory, and the budget that bounds
//! it. Every column family (one per namespace, plus the delta log) would
//! otherwise get RocksDB's defaults: a 64 MiB memtable (two before a write
//! stall) and its own block cache, so a node that writes many namespaces
//! grows by tens of MiB before the first flush. One write-buffer budget and
//! one block cache are shared by all of them instead.

use rocksdb::{BlockBasedOptions, Cache};

use super::*;

/// Bytes of memtables all column families together may hold before the
/// largest is flushed (RocksDB's `db_write_buffer_size`).
pub const WRITE_BUFFER_BUDGET: usize = 16 << 20;
/// One column family's memtable size before it is switched and flushed.
pub const CF_WRITE_BUFFER: usize = 2 << 20;
/// The block cache every column family shares (index and filter blocks
/// included, so table readers are bounded by it too).
pub const BLOCK_CACHE: usize = 8 << 20;

/// In-memory bytes of one column family, from RocksDB's own properties.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CfMemory {
    /// Column family (a namespace's `cf()`, `log` or `meta`).
    pub cf: &'static str,
    /// `rocksdb.cur-size-all-mem-tables`: active and immutable memtables.
    pub memtables: u64,
    /// `rocksdb.estimate-table-readers-mem`: index and filter blocks held
    /// outside the block cache.
    pub table_readers: u64,
    /// `rocksdb.total-sst-files-size` (on disk, for scale).
    pub sst_bytes: u64,
}

/// The keyspace's RocksDB memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Per column family.
    pub column_families: Vec<CfMemory>,
    /// `rocksdb.block-cache-usage` of the shared block cache.
    pub block_cache: u64,
}

/// The options every column family opens with (see the module comment).
pub(super) fn cf_options(cache: &Cache) -> Options {
    let mut o = Options::default();
    o.set_write_buffer_size(CF_WRITE_BUFFER);
    o.set_max_write_buffer_number(2);
    let mut table = BlockBasedOptions::default();
    table.set_block_cache(cache);
    table.set_cache_index_and_filter_blocks(true);
    o.set_block_based_table_factory(&table);
    o
}

/// The database-wide write-buffer budget.
pub(super) fn db_options(o: &mut Options) {
    o.set_db_write_buffer_size(WRITE_BUFFER_BUDGET);
}

/// The shared block cache.
pub(super) fn block_cache() -> Result<Cache, KeyspaceError> {
    Cache::new_lru_cache(BLOCK_CACHE).map_err(KeyspaceError::from)
}

/// Every column family's name.
pub(super) fn all_cfs() -> impl Iterator<Item = &'static str> {
    Namespace::ALL.iter().map(|ns| ns.cf()).chain([LOG_CF, META_CF])
}

impl Keyspace {
    /// What RocksDB holds in memory now, per column family.
    pub fn memory(&self) -> Result<MemoryUsage, KeyspaceError> {
        let mut out = MemoryUsage::default();
        for name in all_cfs() {
            let cf = self.cf(name)?;
            let prop = |p: &str| -> Result<u64, KeyspaceError> {
                Ok(self.db.property_int_value_cf(cf, p)?.unwrap_or(0))
            };
            out.column_families.push(CfMemory {
                cf: name,
                memtables: prop("rocksdb.cur-size-all-mem-tables")?,
                table_readers: prop("rocksdb.estimate-table-readers-mem")?,
                sst_bytes: prop("rocksdb.total-sst-files-size")?,
            });
        }
        // The cache is shared: any column family reports the same usage.
        out.block_cache = self
            .db
            .property_int_value_cf(self.cf(META_CF)?, "rocksdb.block-cache-usage")?
            .unwrap_or(0);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::namespace::keys;

    /// 40 MiB of stream chunks (and as much again in the delta log) would
    /// sit in memtables under RocksDB's defaults (64 MiB per family, no
    /// flush yet); the shared budget flushes them down to it.
    #[test]
    fn memtables_stay_within_the_shared_budget() {
        let d = tempfile::tempdir().unwrap();
        let ks = Keyspace::open(d.path(), "a", KeyspaceOptions::default()).unwrap();
        let now = gcs_protocol::now_ms();
        let value = vec![7u8; 4096];
        for i in 0..10_240u64 {
            ks.put(&keys::stream_chunk("job", i), value.clone(), now).unwrap();
        }
        let total = |m: &MemoryUsage| m.column_families.iter().map(|c| c.memtables).sum::<u64>();
        // Flushes run in the background: give them a moment.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut m = ks.memory().unwrap();
        while total(&m) > WRITE_BUFFER_BUDGET as u64 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(100));
            m = ks.memory().unwrap();
        }
        assert!(total(&m) <= WRITE_BUFFER_BUDGET as u64, "memtables {} bytes", total(&m));
        let streams = m.column_families.iter().find(|c| c.cf == "api.streams").unwrap();
        assert!(streams.sst_bytes > 0, "the stream family was flushed: {streams:?}");
        // Reads go through the one shared cache.
        for i in (0..10_240u64).step_by(97) {
            assert!(ks.get_bytes(&keys::stream_chunk("job", i)).unwrap().is_some());
        }
        let m = ks.memory().unwrap();
        assert!(m.block_cache > 0 && m.block_cache <= BLOCK_CACHE as u64, "{m:?}");
    }
}
