//! Decode steps as captured graphs. A decode step of SmolLM2 is ~280
//! small kernel launches; launched one by one it is bound by the host's
//! launch path, not by the GPU (issue 17's naive loop: 7 ms a step at any
//! batch). So a decode step (one row per sequence) runs in a *bucket*: the
//! batch padded to a power of two, buffers allocated once, its kernel
//! sequence recorded the first time (CubeCL's `start_capture`: a CUDA
//! graph on CUDA) and replayed after, with only the inputs written in
//! place between replays. Prefill and mixed steps stay eager.

use std::collections::HashMap;

use cubecl::client::Graph;

use super::step::StepIo;

/// Largest decode bucket: batches above it run eagerly.
pub const MAX_BUCKET: usize = 512;

/// The bucket of a decode step of `n` sequences.
pub fn bucket_of(n: usize) -> usize {
    n.max(1).next_power_of_two()
}

/// One decode bucket: its buffers and, once recorded, its graph. The graph
/// is declared first so it goes before the buffers it points into.
#[derive(Debug)]
pub struct Bucket {
    pub graph: Option<Graph>,
    pub io: StepIo,
}

/// A decoder's buckets, and whether it records graphs at all.
#[derive(Debug)]
pub struct Graphs {
    pub enabled: bool,
    pub buckets: HashMap<usize, Bucket>,
    /// Block-table entries a bucket row may need (the context's blocks).
    pub max_table: usize,
}

impl Graphs {
    pub fn new(enabled: bool, max_table: usize) -> Self {
        Self { enabled, buckets: HashMap::new(), max_table }
    }

    /// Entries of a bucket's block-table buffer: every row's whole table
    /// and the scratch entry.
    pub fn tables_len(&self, rows: usize) -> usize {
        rows * self.max_table + 1
    }
}

/// Whether a new decoder records graphs unless told
/// ([`super::GpuDecoder::with_graphs`]): `GCS_GPU_GRAPHS` (`0` off, `1`
/// on), else on CUDA only (wgpu replays a software graph, which saves
/// little).
pub fn graphs_enabled(cuda: bool) -> bool {
    match std::env::var("GCS_GPU_GRAPHS").ok().as_deref() {
        Some("0") => false,
        Some("1") => true,
        _ => cuda,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two() {
        let got: Vec<usize> = [0, 1, 2, 3, 5, 8, 9, 200, 256].map(bucket_of).to_vec();
        assert_eq!(got, vec![1, 1, 2, 4, 8, 8, 16, 256, 256]);
    }
}
