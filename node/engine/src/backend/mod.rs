//! Compute backends: where a decoder's forward step runs, chosen once at
//! load from the device ([`ComputeDevice`]).
//!
//! The boundary is the paged forward step ([`PagedDecoder`]): a backend owns
//! the weights' compute form and its K/V storage, and takes the block tables
//! the shared [`crate::paged::BlockManager`] hands out. The batch scheduler,
//! prefix cache, preemption and sampling stay above it, one copy for every
//! backend. [`CpuDecoder`] is the host path, unchanged (bit-parity with
//! llama.cpp); [`gpu::GpuDecoder`] (CubeCL) runs on CUDA (`--features cuda`)
//! or wgpu (`--features wgpu`, the tests on lavapipe). [`select`] chooses.

#[allow(unsafe_code)] // dlopen + the driver's C API
pub mod driver;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod gpu;
pub mod rows;
pub mod select;

use crate::attn::KvPool;
use crate::error::{EngineError, Result};
use crate::llama::{Llama, LlamaConfig, PagedSeq};
use crate::par::SpinPool;
use crate::sampling::TopCandidates;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use driver::{probe_cuda, CudaDeviceInfo};
pub use select::{
    check_device, dense_from, dense_from_env, ensure_servable, exact_from_env, gpu_arithmetic,
    gpu_kv_budget, gpu_max_kv_blocks, gpu_max_running, gpu_weight_bytes, paged_decoder,
    weight_bytes, GpuInfo, GpuOptions, WGPU_MAX_BUFFER_BYTES,
};

/// The device a decoder computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDevice {
    Cpu,
    /// CUDA device by index (`gcs-node --gpu N` on a cuda build).
    Cuda(u32),
    /// A wgpu adapter (`--gpu 0` on a build with `wgpu` and not `cuda`:
    /// the default adapter, lavapipe on a machine without a GPU).
    Wgpu(u32),
}

impl ComputeDevice {
    /// `--gpu N` or none: CUDA where the build has it, else wgpu where it
    /// has that, else CUDA (refused with [`BackendError::NoCudaSupport`]).
    pub fn from_gpu_flag(gpu: Option<u32>) -> Self {
        match gpu {
            None => ComputeDevice::Cpu,
            Some(i) if cfg!(feature = "wgpu") && !cfg!(feature = "cuda") => ComputeDevice::Wgpu(i),
            Some(i) => ComputeDevice::Cuda(i),
        }
    }

    /// The `--gpu` index, if a GPU.
    pub fn gpu_index(self) -> Option<u32> {
        match self {
            ComputeDevice::Cpu => None,
            ComputeDevice::Cuda(i) | ComputeDevice::Wgpu(i) => Some(i),
        }
    }
}

/// The burn device of a model that runs on burn tensors (the BERT
/// embedder) when the worker serves on `device`: burn-cuda for a CUDA GPU
/// on a cuda build; the CPU (burn's Flex) otherwise, a wgpu device
/// included (this build has no burn wgpu backend).
pub fn burn_device(device: ComputeDevice) -> burn::tensor::Device {
    match device {
        #[cfg(feature = "cuda")]
        ComputeDevice::Cuda(i) => crate::cuda_device(i as usize),
        _ => crate::cpu_device(),
    }
}

/// The backend name a registration gives a burn model on [`burn_device`].
pub fn burn_backend_name(device: ComputeDevice) -> &'static str {
    match device {
        ComputeDevice::Cuda(_) if cfg!(feature = "cuda") => "burn-cuda",
        _ => BackendKind::Cpu.name(),
    }
}

/// Whether a new GPU decoder of `kind` replays decode steps as recorded
/// graphs (`gpu::graph`) unless told (`GpuOptions::graphs`): on CUDA
/// unless `GCS_GPU_GRAPHS=0`.
pub fn graphs_default(kind: BackendKind) -> bool {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        kind != BackendKind::Cpu && gpu::graph::graphs_enabled(kind == BackendKind::Cuda)
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    {
        let _ = kind;
        false
    }
}

/// Which backend a decoder is, for logs and registrations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
    /// The CubeCL decoder on wgpu (`--features wgpu`: the kernel tests on
    /// a machine without a GPU, through Mesa's lavapipe).
    Wgpu,
}

impl BackendKind {
    /// The name registrations advertise (`ModelInfo::backend`, and the
    /// suffix of a GPU engine's `engine_build`).
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "burn-flex",
            BackendKind::Cuda => "cubecl-cuda",
            BackendKind::Wgpu => "cubecl-wgpu",
        }
    }
}

/// Why a backend cannot be used; every message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(
        "this build has no CUDA support (device {index}); rebuild with `--features cuda` \
         (after scripts/setup-cuda.sh), or run the worker without --gpu (CPU)"
    )]
    NoCudaSupport { index: u32 },
    #[error("no CUDA driver found: {tried}; install the NVIDIA driver (libcuda.so.1) or set LD_LIBRARY_PATH")]
    NoCudaDriver { tried: String },
    #[error("{library} is not a usable CUDA driver: {reason}")]
    NotACudaDriver { library: String, reason: String },
    #[error("CUDA driver call {call} failed with CUresult {code}")]
    CudaCall { call: String, code: i32 },
    #[error("no CUDA device {index}: the driver sees {count} device(s)")]
    NoSuchGpu { index: u32, count: u32 },
    #[error(
        "this build has no wgpu support (device {index}); rebuild with `--features wgpu`, \
         or run the worker without --gpu (CPU)"
    )]
    NoWgpuSupport { index: u32 },
    #[error("no GPU {index}: {reason}")]
    GpuUnavailable { index: u32, reason: String },
    /// The model has something the GPU decoder has no kernel for (a weight
    /// type such as Q4_K, an architecture); the message names it.
    #[error("{0}; serve this model without --gpu (CPU)")]
    ModelUnsupported(String),
    #[error("GPU decoder failed to load: {0}")]
    GpuLoad(String),
}

/// What one sequence of a step needs back ([`PagedDecoder::forward_select`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pick {
    /// Its logits: a grammar whose mask is not ready, a top-k past
    /// [`crate::sampling::TOP_CANDIDATES`], samples sharing the row (the
    /// host's [`crate::sampling::Sampler`]).
    Logits,
    /// Its argmax: greedy (over the logits its [`Adjust`] made).
    Argmax,
    /// The token plain temperature sampling draws at `u`
    /// ([`crate::sampling::draw_temperature`]): no copy of the logits.
    Draw { temperature: f32, u: f32 },
    /// Its [`TopCandidates`] at this temperature, and its token as
    /// [`Pick::Argmax`] (`temperature` 0) or [`Pick::Draw`] (`u >= 0`)
    /// pick it: a sequence with logprobs, which come from the candidates.
    /// With `u < 0`, a top-k / top-p / min-p draw the host finishes from
    /// them ([`crate::sampling::Sampler::sample_top`]). Where they miss
    /// the cut or the token, the row comes from
    /// [`PagedDecoder::last_logits`].
    Top { temperature: f32, u: f32 },
    /// A sequence with logprobs whose [`Adjust`] adds a bias or penalties:
    /// its token picked as by [`Pick::Top`] from the adjusted row (with
    /// `u < 0` the adjusted row's candidates come back for the host's
    /// draw, in [`StepLogits::tops`]), and the candidates its logprobs
    /// come from, of its row before the additions (after its mask), in
    /// [`StepLogits::scored`], with the logits of every token the
    /// additions touch and of the picked token in their `known`.
    Scored { temperature: f32, u: f32 },
}

/// What the host's sampler does to the logits of the rows a backend
/// picks from, before it picks: a grammar's mask (a token it does not
/// allow gets −inf), then the additions of a bias and penalties
/// ([`crate::sampling::Sampler::adjustments`]), which leave −inf as it is.
/// Sequence `i`'s additions are `(ids, adds)[off[i]..off[i + 1]]`, grouped
/// by token id, each id's run in the order given (so a backend may apply
/// the runs in parallel and get the host's logits bit for bit); its mask,
/// where it has one, is `mask_words[mask_off[i]..mask_off[i + 1]]`, token
/// `t` allowed when bit `t % 32` of word `t / 32` is set. A row whose
/// logits come back ([`Pick::Logits`]) gets neither: the host applies them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Adjust {
    off: Vec<u32>,
    ids: Vec<u32>,
    adds: Vec<f32>,
    mask_off: Vec<u32>,
    mask_words: Vec<u32>,
}

impl Adjust {
    /// Each sequence's additions, one slice a sequence in step order.
    pub fn new<'a>(per_seq: impl IntoIterator<Item = &'a [(u32, f32)]>) -> Self {
        let mut a = Self { off: vec![0], ..Self::default() };
        for adds in per_seq {
            let mut adds = adds.to_vec();
            // Stable: each id's additions keep their order.
            adds.sort_by_key(|x| x.0);
            a.ids.extend(adds.iter().map(|x| x.0));
            a.adds.extend(adds.iter().map(|x| x.1));
            a.off.push(a.ids.len() as u32);
        }
        a
    }

    /// Each sequence's grammar mask, where it has one (in step order): an
    /// empty one allows no token.
    pub fn with_masks<'a>(mut self, per_seq: impl IntoIterator<Item = Option<&'a [u32]>>) -> Self {
        self.mask_off = vec![0];
        for m in per_seq {
            match m {
                Some([]) => self.mask_words.push(0),
                Some(words) => self.mask_words.extend_from_slice(words),
                None => {}
            }
            self.mask_off.push(self.mask_words.len() as u32);
        }
        self
    }

    /// No sequence has an addition or a mask.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty() && self.mask_words.is_empty()
    }

    /// The range of sequence `seq`'s mask in [`Adjust::mask_words`]
    /// (empty: no mask).
    pub fn mask_range(&self, seq: usize) -> std::ops::Range<usize> {
        span(&self.mask_off, seq)
    }

    /// Every sequence's mask words, one after another.
    pub fn mask_words(&self) -> &[u32] {
        &self.mask_words
    }

    /// Sequence `seq` has additions or a mask.
    pub fn touches(&self, seq: usize) -> bool {
        !self.range(seq).is_empty() || !self.mask_range(seq).is_empty()
    }

    /// The range of sequence `seq`'s additions in [`Adjust::ids`] and
    /// [`Adjust::adds`] (empty past the sequences given).
    pub fn range(&self, seq: usize) -> std::ops::Range<usize> {
        span(&self.off, seq)
    }

    /// The token ids added to, every sequence's one after another.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// What is added to each of [`Adjust::ids`].
    pub fn adds(&self) -> &[f32] {
        &self.adds
    }
}

/// `off[seq]..off[seq + 1]`, empty past the offsets given.
fn span(off: &[u32], seq: usize) -> std::ops::Range<usize> {
    match (off.get(seq), off.get(seq + 1)) {
        (Some(&a), Some(&b)) => a as usize..b as usize,
        _ => 0..0,
    }
}

/// A step's output as [`PagedDecoder::forward_select`] returns it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepLogits {
    /// `[seqs × vocab]` logits (`rows` is `None`), or those of the
    /// sequences `rows` names, in its order; empty when no sequence asked
    /// for them and `picked` is given.
    pub logits: Vec<f32>,
    /// The sequences whose rows `logits` holds when not all, ascending: a
    /// GPU copies back only the rows asked for ([`Pick::Logits`]).
    pub rows: Option<Vec<usize>>,
    /// Each sequence's pick, where the backend computes it: for
    /// [`Pick::Draw`] the drawn token, for the others the argmax (ties to
    /// the lowest id, as [`crate::sampling::argmax`]).
    pub picked: Option<Vec<u32>>,
    /// The [`TopCandidates`] of the sequences that asked ([`Pick::Top`]),
    /// by sequence (ascending), where the backend computes them.
    pub tops: Vec<(usize, TopCandidates)>,
    /// The logprob candidates of the sequences that asked
    /// ([`Pick::Scored`]), by sequence (ascending).
    pub scored: Vec<(usize, TopCandidates)>,
    /// The backend applied the step's [`Adjust`] (masks and additions):
    /// its picks, candidates and rows read after the step
    /// ([`PagedDecoder::last_logits`]) are of the adjusted logits (those in
    /// `logits` never are). `false`: every row came back raw, for the host
    /// to adjust.
    pub adjusted: bool,
}

impl StepLogits {
    /// Sequence `seq`'s logits, where they came back.
    pub fn row(&self, seq: usize, vocab: usize) -> Option<&[f32]> {
        let at = match &self.rows {
            None => seq,
            // Found by halves: a step looks up each of its (up to 256) rows.
            Some(rows) => rows.binary_search(&seq).ok()?,
        };
        self.logits.get(at * vocab..(at + 1) * vocab)
    }

    /// Sequence `seq`'s candidates, where they came back.
    pub fn top(&self, seq: usize) -> Option<&TopCandidates> {
        of_seq(&self.tops, seq)
    }

    /// Sequence `seq`'s logprob candidates before its additions, where
    /// they came back ([`Pick::Scored`]).
    pub fn scored(&self, seq: usize) -> Option<&TopCandidates> {
        of_seq(&self.scored, seq)
    }
}

/// Sequence `seq`'s entry of a list by sequence (ascending).
fn of_seq(list: &[(usize, TopCandidates)], seq: usize) -> Option<&TopCandidates> {
    let at = list.binary_search_by_key(&seq, |(s, _)| *s).ok()?;
    Some(&list[at].1)
}

/// A decoder's paged forward step over the K/V storage it owns.
pub trait PagedDecoder: Send + std::fmt::Debug {
    fn kind(&self) -> BackendKind;
    fn config(&self) -> &LlamaConfig;
    /// Rows of the logits per sequence (the output projection's rows).
    fn vocab(&self) -> usize;
    /// K/V blocks held (the block manager's capacity).
    fn kv_blocks(&self) -> usize;
    /// Bytes of K/V storage per cached position.
    fn kv_bytes_per_token(&self) -> usize;
    /// Copy block `src` into `dst` in every layer (copy-on-write).
    fn copy_block(&mut self, src: u32, dst: u32);
    /// One step over a batch of sequences (prefill chunks and decode rows);
    /// host logits `[seqs.len() * vocab]` for each sequence's last new row.
    fn forward_paged(&mut self, seqs: &[PagedSeq<'_>]) -> Result<Vec<f32>>;
    /// Whether [`PagedDecoder::forward_select`] picks tokens itself and
    /// applies an [`Adjust`] (a GPU). Default: no, every row's logits come
    /// back raw, and the scheduler asks for nothing else (it builds no
    /// picks, additions or masks: work a step would only throw away).
    fn picks_on_device(&self) -> bool {
        false
    }
    /// The same step, where each sequence needs what `picks` says: a GPU
    /// adds `adjust` to the rows it picks from, picks each sequence's
    /// token on the device (its argmax or its draw) and copies logits back
    /// only when one needs them. Default: every row's logits, raw, the
    /// host picks.
    fn forward_select(
        &mut self,
        seqs: &[PagedSeq<'_>],
        picks: &[Pick],
        adjust: &Adjust,
    ) -> Result<StepLogits> {
        let _ = (picks, adjust);
        Ok(StepLogits { logits: self.forward_paged(seqs)?, ..StepLogits::default() })
    }
    /// Rows `seqs` (indices into the last step's sequences) of the last
    /// [`PagedDecoder::forward_select`]'s logits, which it did not return
    /// (after its [`Adjust`]): a [`Pick::Top`] row whose candidates missed
    /// its cut, a pick outside a grammar's mask. Valid until
    /// the next step. Default: none kept (such a decoder returns every
    /// row's logits).
    fn last_logits(&mut self, seqs: &[usize]) -> Result<Vec<f32>> {
        Err(EngineError::Backend(format!("no logits of rows {seqs:?} kept")))
    }
    /// `Some` while the steps carry batch work only (no interactive
    /// sequence in them). A host decoder runs such steps on threads of a
    /// low OS priority (nice 19 by default), so that whatever else wants a
    /// core (the node's network threads, the gateway, another worker's
    /// interactive step) takes it first, and gives one up with
    /// [`EngineError::Yielded`] at a layer boundary once
    /// [`Interrupt::due`]: batch work fills idle capacity. Default:
    /// nothing (the step runs to its end).
    fn set_background(&mut self, background: Option<Interrupt>) {
        let _ = background;
    }
}

/// How a batch-only step learns that an interactive request arrived after
/// it was planned: a count of interactive arrivals, and the count the step
/// saw.
#[derive(Clone, Debug)]
pub struct Interrupt {
    arrivals: Arc<AtomicU64>,
    seen: u64,
}

impl Interrupt {
    /// Due once `arrivals` moves past `seen`.
    pub fn new(arrivals: Arc<AtomicU64>, seen: u64) -> Self {
        Self { arrivals, seen }
    }

    pub fn due(&self) -> bool {
        self.arrivals.load(Ordering::Relaxed) != self.seen
    }
}

/// The host backend: [`Llama::forward_paged`] over a host [`KvPool`].
#[derive(Debug)]
pub struct CpuDecoder {
    model: Llama,
    pool: KvPool,
    /// The threads of each forward pass (rayon's count, the caller included).
    threads: SpinPool,
    /// Threads of the same count at a low OS priority for batch-only
    /// steps; started by the first such step (`Some(None)`: turned off).
    low: Option<Option<LowThreads>>,
    /// The next steps are batch-only ([`PagedDecoder::set_background`]).
    background: Option<Interrupt>,
    /// What a batch-only step does differently (`GCS_ENGINE_BACKGROUND`).
    mode: BackgroundMode,
}

/// `GCS_ENGINE_BACKGROUND`, for side-by-side runs of one binary: unset,
/// a batch-only step runs on low-priority threads and yields to an
/// interactive arrival; `low` or `yield` does one of the two; `off`
/// neither (every step as an interactive one).
#[derive(Clone, Copy, Debug)]
struct BackgroundMode {
    low: bool,
    yields: bool,
}

impl BackgroundMode {
    fn from_env() -> Self {
        match std::env::var("GCS_ENGINE_BACKGROUND").as_deref() {
            Ok("off") => Self { low: false, yields: false },
            Ok("low") => Self { low: true, yields: false },
            Ok("yield") => Self { low: false, yields: true },
            _ => Self { low: true, yields: true },
        }
    }
}

/// The threads of batch-only steps, each at `par::batch_nice` for its
/// whole life (an unprivileged thread cannot raise its priority again, so
/// the threads of interactive steps are others).
#[derive(Debug)]
struct LowThreads {
    rayon: rayon::ThreadPool,
    threads: SpinPool,
}

impl LowThreads {
    /// `None` when a thread cannot start.
    fn start() -> Option<Self> {
        let n = rayon::current_num_threads().max(1);
        let rayon = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("gcs-low-rayon-{i}"))
            .start_handler(|_| crate::par::lower_thread_priority())
            .build()
            .map_err(|e| tracing::warn!(error = %e, "no low-priority threads for batch steps"))
            .ok()?;
        Some(Self { rayon, threads: SpinPool::background(n) })
    }
}

impl CpuDecoder {
    pub fn new(model: Llama, kv_blocks: usize) -> Self {
        let pool = model.new_kv_pool(kv_blocks);
        let mode = BackgroundMode::from_env();
        Self { model, pool, threads: SpinPool::for_rayon(), low: None, background: None, mode }
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }
}

impl PagedDecoder for CpuDecoder {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }
    fn config(&self) -> &LlamaConfig {
        &self.model.config
    }
    fn vocab(&self) -> usize {
        self.model.lm_head.rows
    }
    fn kv_blocks(&self) -> usize {
        self.pool.n_blocks()
    }
    fn kv_bytes_per_token(&self) -> usize {
        self.pool.bytes_per_token()
    }
    fn copy_block(&mut self, src: u32, dst: u32) {
        self.pool.copy_block(src, dst);
    }
    fn forward_paged(&mut self, seqs: &[PagedSeq<'_>]) -> Result<Vec<f32>> {
        let Some(interrupt) =
            self.background.as_ref().filter(|_| self.mode.low || self.mode.yields)
        else {
            let (model, pool, threads) = (&self.model, &mut self.pool, &self.threads);
            // The matmuls and attention run on the spinning pool (the calling
            // thread takes part); on a rayon worker still for burn's own ops.
            return rayon::scope(|_| threads.install(|| model.forward_paged(pool, seqs)));
        };
        let (model, pool, yields) = (&self.model, &mut self.pool, self.mode.yields);
        let run = move || model.forward_paged_until(pool, seqs, &|| yields && interrupt.due());
        let low = match self.mode.low {
            true => self.low.get_or_insert_with(LowThreads::start).as_ref(),
            false => None,
        };
        match low {
            Some(low) => low.rayon.install(|| low.threads.install(run)),
            None => {
                let threads = &self.threads;
                rayon::scope(|_| threads.install(run))
            }
        }
    }
    fn set_background(&mut self, background: Option<Interrupt>) {
        self.background = background;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_flag_maps_to_device() {
        assert_eq!(ComputeDevice::from_gpu_flag(None), ComputeDevice::Cpu);
        let d = ComputeDevice::from_gpu_flag(Some(2));
        assert_eq!(d.gpu_index(), Some(2));
        if cfg!(feature = "wgpu") && !cfg!(feature = "cuda") {
            assert_eq!(d, ComputeDevice::Wgpu(2));
        } else {
            assert_eq!(d, ComputeDevice::Cuda(2));
        }
    }

    #[test]
    fn cpu_needs_no_probe() {
        assert!(matches!(check_device(ComputeDevice::Cpu), Ok(None)));
        assert!(matches!(ensure_servable(ComputeDevice::Cpu), Ok(None)));
    }

    #[test]
    fn gpu_without_the_feature_or_a_driver_is_a_clear_error() {
        let res = check_device(ComputeDevice::Cuda(0));
        if cfg!(feature = "cuda") {
            // On a machine with a driver and a GPU the probe succeeds.
            if let Err(err) = res {
                assert!(!matches!(err, BackendError::NoCudaSupport { .. }), "{err}");
            }
        } else {
            let err = res.expect_err("no CUDA support in this build");
            assert!(matches!(err, BackendError::NoCudaSupport { index: 0 }), "{err:?}");
            assert!(err.to_string().contains("--features cuda"), "{err}");
        }
        if !cfg!(feature = "wgpu") {
            let err = check_device(ComputeDevice::Wgpu(0)).expect_err("no wgpu in this build");
            assert!(matches!(err, BackendError::NoWgpuSupport { index: 0 }), "{err:?}");
        }
    }

    #[test]
    fn burn_models_stay_on_the_cpu_without_cuda() {
        assert_eq!(burn_backend_name(ComputeDevice::Cpu), "burn-flex");
        assert_eq!(burn_backend_name(ComputeDevice::Wgpu(0)), "burn-flex");
        let cuda = if cfg!(feature = "cuda") { "burn-cuda" } else { "burn-flex" };
        assert_eq!(burn_backend_name(ComputeDevice::Cuda(0)), cuda);
    }

    #[test]
    fn backend_names_differ() {
        let names = [BackendKind::Cpu, BackendKind::Cuda, BackendKind::Wgpu].map(BackendKind::name);
        assert_eq!(names[0], "burn-flex", "the CPU's name is what registrations carry today");
        assert!(names[0] != names[1] && names[1] != names[2] && names[0] != names[2]);
    }
}
