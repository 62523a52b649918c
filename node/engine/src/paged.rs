//! Paged KV block manager (pure bookkeeping, no model).
//!
//! KV memory is split into fixed blocks of [`BLOCK_SIZE`] positions. Each
//! sequence has a block table (position `p` lives in `table[p / 16]` at
//! offset `p % 16`). Blocks are reference counted so that sequences can
//! share them: forked samples share their prompt, and prompts that start
//! with the same full blocks share them through the prefix cache.
//!
//! Prefix cache: once every position of a block has been computed, the
//! block is registered under `hash(tenant salt, parent block hash, its 16
//! tokens)`. The chain through the parent hash makes a block's key depend
//! on the whole prefix (its K/V do too), and the salt keeps tenants from
//! ever sharing (or probing) each other's prefixes. The key also holds how
//! many of the block's positions were computed in prefill (multi-row) order
//! rather than decode order: the two orders give different K/V bits, so a
//! prompt never reuses a block another sequence decoded (see
//! [`crate::attn::PagedSeqRef::decode_from`]). A block whose last user
//! goes away stays cached until it is needed again: unreferenced cached
//! blocks are evicted least recently released first.
//!
//! Every block is in exactly one state: on the free list (unreferenced,
//! not cached), on the LRU list (unreferenced, cached), or used (referenced).

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

/// Positions per KV block.
pub const BLOCK_SIZE: usize = 16;

pub type BlockId = u32;
pub type SeqId = u64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PagedError {
    #[error("out of KV blocks: need {need}, {available} available")]
    OutOfBlocks { need: usize, available: usize },
    #[error("unknown sequence {0}")]
    UnknownSeq(SeqId),
    #[error("sequence {0} already exists")]
    DuplicateSeq(SeqId),
    #[error("empty prompt")]
    EmptyPrompt,
}

/// Copy the first `tokens` positions of block `src` into `dst` (all
/// layers): the copy-on-write of a shared, partly filled block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    pub src: BlockId,
    pub dst: BlockId,
    pub tokens: usize,
}

/// What a cached block was registered under, checked on every hit so a
/// 64-bit hash collision can never hand out the wrong K/V.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CacheKey {
    salt: u64,
    parent: u64,
    tokens: Vec<u32>,
    /// Leading positions of the block computed in prefill order.
    prefill_rows: u8,
}

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    refs: u32,
    /// Set while the block is in the prefix cache.
    hash: Option<u64>,
    key: Option<CacheKey>,
    /// Release tick, the LRU order key while unreferenced and cached.
    released: u64,
}

#[derive(Debug, Clone)]
struct SeqState {
    table: Vec<BlockId>,
    /// Every token that has a slot (prompt, then appended ones).
    tokens: Vec<u32>,
    salt: u64,
    /// Positions from here on are computed in decode order.
    decode_from: usize,
    /// Hashes of the leading full, computed blocks.
    chain: Vec<u64>,
}

/// The block allocator, block tables and prefix cache.
#[derive(Debug, Clone)]
pub struct BlockManager {
    blocks: Vec<BlockMeta>,
    free: Vec<BlockId>,
    cached: HashMap<u64, BlockId>,
    lru: BTreeSet<(u64, BlockId)>,
    seqs: HashMap<SeqId, SeqState>,
    tick: u64,
}

fn hash_of(x: impl Hash) -> u64 {
    // DefaultHasher::new() has fixed keys: hashes are stable in a process.
    let mut h = DefaultHasher::new();
    x.hash(&mut h);
    h.finish()
}

/// The prefix-cache salt of a tenant.
pub fn tenant_salt(tenant: &str) -> u64 {
    hash_of(("gcs-kv-tenant", tenant))
}

fn block_hash(salt: u64, parent: u64, tokens: &[u32], prefill_rows: u8) -> u64 {
    hash_of((salt, parent, tokens, prefill_rows))
}

/// Positions of block `i` before `decode_from` (computed in prefill order).
fn prefill_rows(i: usize, decode_from: usize) -> u8 {
    decode_from.saturating_sub(i * BLOCK_SIZE).min(BLOCK_SIZE) as u8
}

/// Where decode order starts for a prompt of `len` tokens: after the
/// prompt, except that a one-token prompt is a single-row batch (as in
/// llama.cpp, whose order the kernels follow).
pub fn prompt_decode_from(len: usize) -> usize {
    if len >= 2 {
        len
    } else {
        0
    }
}

/// Blocks needed for `tokens` positions.
pub fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_SIZE)
}

impl BlockManager {
    pub fn new(total_blocks: usize) -> Self {
        Self {
            blocks: vec![BlockMeta::default(); total_blocks],
            // Reversed so that block 0 is handed out first.
            free: (0..total_blocks as BlockId).rev().collect(),
            cached: HashMap::new(),
            lru: BTreeSet::new(),
            seqs: HashMap::new(),
            tick: 0,
        }
    }

    pub fn total_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be allocated now (free plus evictable cached ones).
    pub fn available_blocks(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn used_blocks(&self) -> usize {
        self.blocks.len() - self.available_blocks()
    }

    /// Blocks in the prefix cache (referenced or not).
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// The block table of a sequence.
    pub fn block_table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.seqs.get(&seq).map(|s| s.table.as_slice())
    }

    /// Number of token slots a sequence holds.
    pub fn seq_len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.tokens.len())
    }

    fn state(&mut self, seq: SeqId) -> Result<&mut SeqState, PagedError> {
        self.seqs.get_mut(&seq).ok_or(PagedError::UnknownSeq(seq))
    }

    /// Take a block for exclusive use (refcount 1), evicting the least
    /// recently released cached block if the free list is empty.
    fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (t, b) = self.lru.first().copied()?;
                self.lru.remove(&(t, b));
                let meta = &mut self.blocks[b as usize];
                if let Some(h) = meta.hash.take() {
                    self.cached.remove(&h);
                }
                meta.key = None;
                b
            }
        };
        self.blocks[b as usize].refs = 1;
        Some(b)
    }

    fn release(&mut self, b: BlockId) {
        self.tick += 1;
        let meta = &mut self.blocks[b as usize];
        meta.refs = meta.refs.saturating_sub(1);
        if meta.refs == 0 {
            if meta.hash.is_some() {
                meta.released = self.tick;
                self.lru.insert((self.tick, b));
            } else {
                self.free.push(b);
            }
        }
    }

    fn retain(&mut self, b: BlockId) {
        let meta = &mut self.blocks[b as usize];
        if meta.refs == 0 {
            self.lru.remove(&(meta.released, b));
        }
        meta.refs += 1;
    }

    /// Add a sequence with its prompt: reuse the longest run of cached full
    /// blocks of the same tenant, and allocate the rest. Returns the number
    /// of prompt tokens whose K/V are already there. At least the last
    /// prompt token is always left to compute, since its logits are needed.
    /// Nothing changes on error.
    pub fn admit(&mut self, seq: SeqId, salt: u64, prompt: &[u32]) -> Result<usize, PagedError> {
        self.admit_at(seq, salt, prompt, prompt_decode_from(prompt.len()))
    }

    /// Like [`BlockManager::admit`] for a sequence whose `tokens` are a
    /// prompt and tokens already generated (a preempted or resumed
    /// sequence): positions from `decode_from` on are in decode order.
    pub fn admit_at(
        &mut self,
        seq: SeqId,
        salt: u64,
        prompt: &[u32],
        decode_from: usize,
    ) -> Result<usize, PagedError> {
        if self.seqs.contains_key(&seq) {
            return Err(PagedError::DuplicateSeq(seq));
        }
        if prompt.is_empty() {
            return Err(PagedError::EmptyPrompt);
        }
        let max_hits = (prompt.len() - 1) / BLOCK_SIZE;
        let mut hits: Vec<(BlockId, u64)> = Vec::new();
        let mut parent = 0u64;
        for (i, chunk) in prompt.chunks_exact(BLOCK_SIZE).take(max_hits).enumerate() {
            let rows = prefill_rows(i, decode_from);
            let h = block_hash(salt, parent, chunk, rows);
            let Some(&b) = self.cached.get(&h) else { break };
            let key = CacheKey { salt, parent, tokens: chunk.to_vec(), prefill_rows: rows };
            if self.blocks[b as usize].key.as_ref() != Some(&key) {
                break;
            }
            hits.push((b, h));
            parent = h;
        }
        let need = blocks_for(prompt.len()) - hits.len();
        let idle_hits = hits.iter().filter(|(b, _)| self.blocks[*b as usize].refs == 0).count();
        let available = self.available_blocks() - idle_hits;
        if need > available {
            return Err(PagedError::OutOfBlocks { need, available });
        }
        let mut table = Vec::with_capacity(blocks_for(prompt.len()) + 1);
        for &(b, _) in &hits {
            self.retain(b);
            table.push(b);
        }
        for _ in 0..need {
            // Checked above, so allocation cannot fail.
            if let Some(b) = self.allocate() {
                table.push(b);
            }
        }
        let cached = hits.len() * BLOCK_SIZE;
        let chain = hits.into_iter().map(|(_, h)| h).collect();
        self.seqs
            .insert(seq, SeqState { table, tokens: prompt.to_vec(), salt, decode_from, chain });
        Ok(cached)
    }

    /// Give the next token of a sequence a slot. Returns a copy to perform
    /// when the last block was shared (copy-on-write). Nothing changes on
    /// error.
    pub fn append(&mut self, seq: SeqId, token: u32) -> Result<Option<CopyOp>, PagedError> {
        let pos = self.state(seq)?.tokens.len();
        let off = pos % BLOCK_SIZE;
        let last = self.state(seq)?.table.last().copied();
        let shared = last.filter(|&b| off != 0 && self.blocks[b as usize].refs > 1);
        let mut copy = None;
        if off == 0 || shared.is_some() {
            let available = self.available_blocks();
            let nb = self.allocate().ok_or(PagedError::OutOfBlocks { need: 1, available })?;
            if let Some(old) = shared {
                self.release(old);
                copy = Some(CopyOp { src: old, dst: nb, tokens: off });
                if let Some(slot) = self.state(seq)?.table.last_mut() {
                    *slot = nb;
                }
            } else {
                self.state(seq)?.table.push(nb);
            }
        }
        self.state(seq)?.tokens.push(token);
        Ok(copy)
    }

    /// Record that the first `computed` positions of a sequence hold K/V,
    /// and put its newly completed full blocks into the prefix cache.
    pub fn commit(&mut self, seq: SeqId, computed: usize) -> Result<(), PagedError> {
        let st = self.seqs.get_mut(&seq).ok_or(PagedError::UnknownSeq(seq))?;
        let full = computed.min(st.tokens.len()) / BLOCK_SIZE;
        while st.chain.len() < full {
            let i = st.chain.len();
            let parent = st.chain.last().copied().unwrap_or(0);
            let tokens = &st.tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            let rows = prefill_rows(i, st.decode_from);
            let h = block_hash(st.salt, parent, tokens, rows);
            st.chain.push(h);
            let b = st.table[i];
            let meta = &mut self.blocks[b as usize];
            // A block already cached (a hit) keeps its key; an identical
            // block computed twice is simply not cached a second time.
            if meta.hash.is_none() && !self.cached.contains_key(&h) {
                meta.hash = Some(h);
                meta.key = Some(CacheKey {
                    salt: st.salt,
                    parent,
                    tokens: tokens.to_vec(),
                    prefill_rows: rows,
                });
                self.cached.insert(h, b);
            }
        }
        Ok(())
    }

    /// Share all of `parent`'s blocks with a new sequence `child` (n > 1
    /// samples of one prompt). Later appends copy the shared last block.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), PagedError> {
        if self.seqs.contains_key(&child) {
            return Err(PagedError::DuplicateSeq(child));
        }
        let st = self.seqs.get(&parent).ok_or(PagedError::UnknownSeq(parent))?.clone();
        for &b in &st.table {
            self.retain(b);
        }
        self.seqs.insert(child, st);
        Ok(())
    }

    /// Drop a sequence (finished, cancelled or preempted) and release its
    /// blocks. Tail blocks are released first so they are evicted first.
    pub fn free(&mut self, seq: SeqId) -> Result<(), PagedError> {
        let st = self.seqs.remove(&seq).ok_or(PagedError::UnknownSeq(seq))?;
        for &b in st.table.iter().rev() {
            self.release(b);
        }
        Ok(())
    }

    /// Check every internal invariant; used by the property tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut refs = vec![0u32; self.blocks.len()];
        for (id, s) in &self.seqs {
            if s.table.len() != blocks_for(s.tokens.len()) {
                return Err(format!(
                    "seq {id}: {} blocks for {} tokens",
                    s.table.len(),
                    s.tokens.len()
                ));
            }
            for &b in &s.table {
                refs[b as usize] += 1;
            }
        }
        let mut seen = vec![0u8; self.blocks.len()];
        for &b in &self.free {
            let m = &self.blocks[b as usize];
            if m.refs != 0 || m.hash.is_some() {
                return Err(format!("free block {b} has refs {} hash {:?}", m.refs, m.hash));
            }
            seen[b as usize] += 1;
        }
        for &(t, b) in &self.lru {
            let m = &self.blocks[b as usize];
            if m.refs != 0 || m.released != t || m.hash.is_none() {
                return Err(format!("lru block {b}: refs {} hash {:?}", m.refs, m.hash));
            }
            seen[b as usize] += 1;
        }
        for (b, m) in self.blocks.iter().enumerate() {
            if m.refs != refs[b] {
                return Err(format!(
                    "block {b}: refcount {} but {} table entries",
                    m.refs, refs[b]
                ));
            }
            let expect = u8::from(m.refs == 0);
            if seen[b] != expect {
                return Err(format!("block {b} (refs {}) listed {} times", m.refs, seen[b]));
            }
            if let Some(h) = m.hash {
                if self.cached.get(&h) != Some(&(b as BlockId)) || m.key.is_none() {
                    return Err(format!("block {b} hash {h} not in the cache map"));
                }
            }
        }
        for (&h, &b) in &self.cached {
            if self.blocks[b as usize].hash != Some(h) {
                return Err(format!("cache entry {h} -> {b} stale"));
            }
        }
        let used = self.blocks.iter().filter(|m| m.refs > 0).count();
        if used + self.free.len() + self.lru.len() != self.blocks.len() {
            return Err("free + cached + used != total".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "paged_tests.rs"]
mod tests;
