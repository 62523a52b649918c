//! Choosing a decoder for a device: the probe a worker runs at start
//! ([`ensure_servable`]), the decoder itself ([`paged_decoder`]) and the
//! K/V budget a GPU's memory allows ([`gpu_kv_budget`]).

use super::{BackendError, BackendKind, ComputeDevice, CpuDecoder, PagedDecoder};
use crate::llama::{Llama, LlamaConfig};
use crate::quant::{QData, QMatrix};

/// A GPU as a worker advertises it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    pub kind: BackendKind,
    /// The `--gpu` index.
    pub index: u32,
    /// As the driver names it (`NVIDIA H200`, `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub name: String,
    /// Device memory in bytes; 0 where the runtime reports none.
    pub memory_bytes: u64,
}

/// Check that `device` can be used by this build and machine, without
/// loading a model: nothing on the CPU; on CUDA the driver probe
/// (`driver.rs`: burn-cuda/cudarc panic without a driver, so nothing of
/// theirs runs before it); on wgpu the adapter. A worker calls this at
/// start so it fails with a clear message, not on its first job.
pub fn check_device(device: ComputeDevice) -> Result<Option<GpuInfo>, BackendError> {
    match device {
        ComputeDevice::Cpu => Ok(None),
        ComputeDevice::Cuda(index) if !cfg!(feature = "cuda") => {
            Err(BackendError::NoCudaSupport { index })
        }
        ComputeDevice::Cuda(index) => {
            let d = super::probe_cuda(index)?;
            Ok(Some(GpuInfo {
                kind: BackendKind::Cuda,
                index,
                name: d.name,
                memory_bytes: d.total_memory_bytes,
            }))
        }
        ComputeDevice::Wgpu(index) => wgpu_info(index).map(Some),
    }
}

/// Whether this build and machine can serve on `device` now, and the GPU
/// if it is one: what `gcs-node --gpu N` calls before any model loads.
pub fn ensure_servable(device: ComputeDevice) -> Result<Option<GpuInfo>, BackendError> {
    check_device(device)
}

/// Most K/V bytes one model's pools may take on a GPU: the kernels index a
/// pool with 32-bit element offsets, and K and V are two f16 pools.
pub const GPU_KV_CAP_BYTES: u64 = 2 * 2 * (i32::MAX as u64);

/// Memory left on the GPU for activations, the kernels and the runtime's
/// pools, beyond weights and K/V.
pub const GPU_HEADROOM_BYTES: u64 = 2 << 30;

/// The K/V budget on `gpu` for models of `weight_bytes` together: 90% of
/// its memory less the weights and [`GPU_HEADROOM_BYTES`], at most
/// [`GPU_KV_CAP_BYTES`] per model. `None` when the runtime reports no
/// memory size (then the operator's `--kv-cache-mb` applies) or nothing is
/// left.
pub fn gpu_kv_budget(gpu: &GpuInfo, weight_bytes: u64, models: usize) -> Option<u64> {
    if gpu.memory_bytes == 0 {
        return None;
    }
    let usable = gpu.memory_bytes / 10 * 9;
    let left = usable.checked_sub(weight_bytes)?.checked_sub(GPU_HEADROOM_BYTES)?;
    let cap = GPU_KV_CAP_BYTES.saturating_mul(models.max(1) as u64);
    (left > 0).then_some(left.min(cap))
}

/// Most K/V blocks a GPU pool of `config` may have on a `kind` device:
/// `GpuDecoder`'s pools (every layer, one scratch block more) are indexed
/// with 32-bit offsets (on an H200 the memory budget alone would give
/// SmolLM2 one block more than that: the first device run's served
/// request), and on wgpu each pool is one buffer within wgpu's default
/// binding limit ([`WGPU_MAX_BUFFER_BYTES`]: lavapipe failed Gemma's
/// default 189 MB pools).
pub fn gpu_max_kv_blocks(config: &LlamaConfig, kind: BackendKind) -> usize {
    let per_block =
        config.n_layers * crate::paged::BLOCK_SIZE * config.n_kv_heads * config.head_dim;
    let elements = match kind {
        BackendKind::Wgpu => WGPU_MAX_BUFFER_BYTES / 2,
        _ => i32::MAX as usize,
    };
    (elements / per_block.max(1)).saturating_sub(1)
}

/// wgpu's default `max_storage_buffer_binding_size`: the largest buffer a
/// kernel binds on adapters that keep the default.
pub const WGPU_MAX_BUFFER_BYTES: usize = 128 << 20;

/// Bytes of `model`'s projection and embedding weights (what a GPU holds
/// of it, within a few norm vectors).
pub fn weight_bytes(model: &Llama) -> u64 {
    fn bytes(m: &QMatrix) -> u64 {
        match &m.data {
            QData::Stack(parts) => parts.iter().map(bytes).sum(),
            QData::Rows { bytes, .. } => bytes.len() as u64,
            QData::F32(w) => 4 * w.len() as u64,
            QData::Quant { d, m, qs, .. } => (2 * (d.len() + m.len()) + qs.len()) as u64,
        }
    }
    let tied = std::sync::Arc::ptr_eq(&model.embed, &model.lm_head);
    let head = if tied { 0 } else { bytes(&model.lm_head) };
    let blocks: u64 = model
        .blocks
        .iter()
        .map(|b| bytes(&b.q.wqkv) + bytes(&b.q.wo) + bytes(&b.q.w_gate_up) + bytes(&b.q.w_down))
        .sum();
    bytes(&model.embed) + head + blocks
}

/// Positions a job is assumed to hold when sizing a GPU batch from its
/// K/V capacity: most jobs are far shorter than a model's context, and
/// the scheduler preempts (and resumes exactly) when the pool runs out.
pub const GPU_JOB_TOKENS: usize = 2048;

/// Most sequences a GPU engine batches by default.
pub const GPU_MAX_RUNNING: usize = 256;

/// `--max-jobs` on a GPU when the operator gives none: the jobs of
/// [`GPU_JOB_TOKENS`] (or the context, if shorter) the K/V capacity holds
/// at once, 1 to [`GPU_MAX_RUNNING`].
pub fn gpu_max_running(kv_tokens: usize, context: usize) -> usize {
    (kv_tokens / GPU_JOB_TOKENS.min(context).max(1)).clamp(1, GPU_MAX_RUNNING)
}

/// How a GPU decoder runs; `None` leaves each to its default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuOptions {
    /// Replay decode steps as recorded graphs (default: [`super::graphs_default`]).
    pub graphs: Option<bool>,
    /// Every op in the CPU's arithmetic, bit for bit (default: off unless
    /// `GCS_GPU_EXACT=1`; `gpu::GpuDecoder::with_exact`).
    pub exact: Option<bool>,
    /// The matmuls over f16 copies of the weights by cubek's routines in
    /// steps of `n` rows or more, `Some(n)`; `Some(0)`: never (default:
    /// `GCS_GPU_DENSE=n`, [`dense_from_env`]; `gpu::GpuDecoder::with_dense`).
    pub dense: Option<usize>,
}

/// `GCS_GPU_DENSE`'s value: the rows from which a GPU step multiplies by
/// f16 copies of the weights (`1`: every step), or `0` (and unset): never.
/// Anything else is refused, not read as off.
pub fn dense_from_env(value: Option<&str>) -> Result<usize, BackendError> {
    match value.map(str::trim) {
        None | Some("") => Ok(0),
        Some(v) => v.parse().map_err(|_| {
            BackendError::GpuLoad(format!(
                "GCS_GPU_DENSE={v}: expected a row count (1: every step, 0: never)"
            ))
        }),
    }
}

/// [`GpuOptions::dense`], or the environment's where it says nothing.
pub fn dense_from(opts: GpuOptions) -> Result<usize, BackendError> {
    match opts.dense {
        Some(n) => Ok(n),
        None => dense_from_env(std::env::var("GCS_GPU_DENSE").ok().as_deref()),
    }
}

/// `GCS_GPU_EXACT=1`: a GPU decoder in the CPU's arithmetic unless
/// [`GpuOptions::exact`] says otherwise (`gpu::GpuDecoder::with_exact`).
pub fn exact_from_env() -> bool {
    std::env::var("GCS_GPU_EXACT").is_ok_and(|v| v == "1")
}

/// What a GPU decoder run as `opts` computes in, as a suffix of a worker's
/// `engine_build` after its backend: `""` (the quantized float kernels),
/// `" exact"` (the CPU's arithmetic) or `" dense-from-N"` (f16 copies from
/// N rows). Each gives other logits, and a stream continues only on a
/// worker whose build matches, so two GPU workers computing differently
/// never continue each other's streams.
pub fn gpu_arithmetic(opts: GpuOptions) -> Result<String, BackendError> {
    let exact = opts.exact.unwrap_or_else(exact_from_env);
    Ok(match (exact, dense_from(opts)?) {
        (true, _) => " exact".into(),
        (false, 0) => String::new(),
        (false, n) => format!(" dense-from-{n}"),
    })
}

/// What a GPU decoder run as `opts` says holds of `model`: its
/// [`weight_bytes`], and where steps may be dense ([`dense_from`]) the
/// f16 copies of its matrices beside them (2 bytes a weight), so the K/V
/// budget ([`gpu_kv_budget`]) leaves room for them.
pub fn gpu_weight_bytes(model: &Llama, opts: GpuOptions) -> Result<u64, BackendError> {
    let copies = if dense_from(opts)? == 0 {
        0
    } else {
        let n = |m: &QMatrix| (m.rows * m.cols) as u64;
        let layers: u64 = model
            .blocks
            .iter()
            .map(|b| n(&b.q.wqkv) + n(&b.q.wo) + n(&b.q.w_gate_up) + n(&b.q.w_down))
            .sum();
        2 * (layers + n(&model.lm_head))
    };
    Ok(weight_bytes(model) + copies)
}

/// The decoder for `model` on `device`, with `kv_blocks` K/V blocks and,
/// on a GPU, as `gpu` says. A GPU
/// is probed first; a model the GPU kernels do not cover (a weight type
/// without a kernel, an architecture other than llama and gemma3, biases)
/// is refused before anything is uploaded, with an error naming what is
/// missing.
pub fn paged_decoder(
    device: ComputeDevice,
    model: Llama,
    kv_blocks: usize,
    gpu: GpuOptions,
) -> Result<Box<dyn PagedDecoder>, BackendError> {
    match device {
        ComputeDevice::Cpu => Ok(Box::new(CpuDecoder::new(model, kv_blocks))),
        dev => gpu_decoder(dev, &model, kv_blocks, gpu),
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn gpu_decoder(
    device: ComputeDevice,
    model: &Llama,
    kv_blocks: usize,
    opts: GpuOptions,
) -> Result<Box<dyn PagedDecoder>, BackendError> {
    use super::gpu::{check_model, GpuDecoder, GpuError};
    let info = check_device(device)?.ok_or(BackendError::GpuLoad("not a GPU".into()))?;
    check_model(model).map_err(|e| BackendError::ModelUnsupported(e.to_string()))?;
    let client = client(device)?;
    let refused = |e: GpuError| match e {
        GpuError::Unsupported(_) => BackendError::ModelUnsupported(e.to_string()),
        GpuError::Server(m) => BackendError::GpuLoad(m),
    };
    let dec = GpuDecoder::new(client, info.kind, model, kv_blocks).map_err(refused)?;
    let dec = match opts.graphs {
        Some(on) => dec.with_graphs(on),
        None => dec,
    };
    let dec = dec.with_exact(opts.exact.unwrap_or_else(exact_from_env)).map_err(refused)?;
    let dec = match dense_from(opts)? {
        0 => dec,
        n => dec.with_dense(model, Some(n)).map_err(refused)?,
    };
    tracing::info!(gpu = %info.name, backend = info.kind.name(), weight_mib = dec.weight_bytes() >> 20, kv_blocks, exact = dec.exact(), dense_from = ?dec.dense(), "GPU decoder loaded");
    Ok(Box::new(dec))
}

#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn gpu_decoder(
    device: ComputeDevice,
    _model: &Llama,
    _kv_blocks: usize,
    _opts: GpuOptions,
) -> Result<Box<dyn PagedDecoder>, BackendError> {
    // Refuses every GPU in a build without a GPU runtime.
    check_device(device)?;
    Err(BackendError::GpuLoad("this build has no GPU runtime".into()))
}

/// The CubeCL client of a probed device.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub fn client(device: ComputeDevice) -> Result<cubecl::client::Client, BackendError> {
    let (index, d) = match device {
        ComputeDevice::Cuda(i) => (i, cubecl::Device::cuda(i as usize)),
        ComputeDevice::Wgpu(0) => {
            (0, cubecl::Device::wgpu(cubecl::device::WgpuDeviceKind::DefaultDevice))
        }
        ComputeDevice::Wgpu(index) => {
            return Err(BackendError::GpuUnavailable {
                index,
                reason: "a wgpu build serves on the default adapter only: use --gpu 0".into(),
            })
        }
        ComputeDevice::Cpu => return Err(BackendError::GpuLoad("not a GPU".into())),
    };
    let d = d.map_err(|e| BackendError::GpuUnavailable { index, reason: e.to_string() })?;
    Ok(d.client())
}

#[cfg(feature = "wgpu")]
fn wgpu_info(index: u32) -> Result<GpuInfo, BackendError> {
    let client = client(ComputeDevice::Wgpu(index))?;
    let p = client.properties();
    Ok(GpuInfo {
        kind: BackendKind::Wgpu,
        index,
        name: p.identity.name.clone(),
        memory_bytes: p.memory.max_memory().unwrap_or(0),
    })
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_info(index: u32) -> Result<GpuInfo, BackendError> {
    Err(BackendError::NoWgpuSupport { index })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(memory_bytes: u64) -> GpuInfo {
        GpuInfo { kind: BackendKind::Cuda, index: 0, name: "test".into(), memory_bytes }
    }

    #[test]
    fn the_dense_threshold_is_a_row_count_or_refused() {
        assert_eq!(dense_from_env(None).unwrap(), 0);
        assert_eq!(dense_from_env(Some("")).unwrap(), 0);
        assert_eq!(dense_from_env(Some("0")).unwrap(), 0);
        assert_eq!(dense_from_env(Some("1")).unwrap(), 1);
        assert_eq!(dense_from_env(Some(" 64 ")).unwrap(), 64);
        for bad in ["on", "-1", "1.5", "yes"] {
            let e = dense_from_env(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("GCS_GPU_DENSE") && e.contains(bad), "{e}");
        }
        // The options win over the environment.
        let opts = GpuOptions { dense: Some(8), ..Default::default() };
        assert_eq!(dense_from(opts).unwrap(), 8);
    }

    #[test]
    fn each_gpu_arithmetic_has_its_own_build_suffix() {
        let of = |exact, dense| {
            gpu_arithmetic(GpuOptions { exact: Some(exact), dense: Some(dense), graphs: None })
                .unwrap()
        };
        assert_eq!(of(false, 0), "");
        assert_eq!(of(true, 0), " exact");
        assert_eq!(of(false, 1), " dense-from-1");
        assert_ne!(of(false, 1), of(false, 64));
    }

    #[test]
    fn kv_budget_is_what_the_weights_and_headroom_leave() {
        let gib = 1u64 << 30;
        // 10 GiB: 9 usable, less 1 of weights and 2 of headroom.
        assert_eq!(gpu_kv_budget(&gpu(10 * gib), gib, 1), Some(9 * gib - gib - GPU_HEADROOM_BYTES));
        // A large GPU: capped per model (32-bit pool offsets).
        assert_eq!(gpu_kv_budget(&gpu(140 * gib), gib, 1), Some(GPU_KV_CAP_BYTES));
        assert_eq!(gpu_kv_budget(&gpu(140 * gib), gib, 2), Some(2 * GPU_KV_CAP_BYTES));
        // Nothing left, or no figure: the operator's budget applies.
        assert_eq!(gpu_kv_budget(&gpu(2 * gib), gib, 1), None);
        assert_eq!(gpu_kv_budget(&gpu(0), 0, 1), None);
    }

    #[test]
    fn the_largest_gpu_pool_fits_32_bit_offsets() {
        // SmolLM2's shape; the H200's budget gave 23301 blocks, one too many.
        let c = LlamaConfig {
            arch: "llama".into(),
            gemma3: None,
            n_layers: 30,
            hidden: 576,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            intermediate: 1536,
            vocab: 49152,
            rope_base: 1e5,
            rms_eps: 1e-5,
            context_length: 8192,
        };
        let per_block = 30 * 16 * 3 * 64;
        let n = gpu_max_kv_blocks(&c, BackendKind::Cuda);
        assert_eq!(n, 23300);
        // On wgpu a pool is one buffer of at most 128 MiB of f16.
        let w = gpu_max_kv_blocks(&c, BackendKind::Wgpu);
        assert_eq!(w, 727);
        assert!((w + 1) * per_block * 2 <= 128 << 20 && (w + 2) * per_block * 2 > 128 << 20);
        assert!((n + 1) * per_block <= i32::MAX as usize, "the pool with its scratch block");
        assert!((n + 2) * per_block > i32::MAX as usize, "and not a block less than it could");
    }

    #[test]
    fn gpu_batch_follows_the_kv_capacity() {
        // SmolLM2 on an H200: the 32-bit offsets' ~372k positions (8 GiB
        // of f16 K/V; 16 GiB of K/V would be 740k).
        assert_eq!(gpu_max_running(372_000, 8192), 181);
        assert_eq!(gpu_max_running(10_000_000, 8192), GPU_MAX_RUNNING);
        // A short context counts jobs of that length.
        assert_eq!(gpu_max_running(4096, 512), 8);
        // Never 0, whatever is left.
        assert_eq!(gpu_max_running(100, 8192), 1);
        assert_eq!(gpu_max_running(0, 0), 1);
    }
}
