//! Compute backends: where a decoder's forward step runs, chosen once at
//! load from the device ([`ComputeDevice`]).
//!
//! The boundary is the paged forward step ([`PagedDecoder`]): a backend owns
//! the weights' compute form and its K/V storage, and takes the block tables
//! the shared [`crate::paged::BlockManager`] hands out. The batch scheduler,
//! prefix cache, preemption and sampling stay above it, one copy for every
//! backend. [`CpuDecoder`] is today's host path, unchanged (bit-parity with
//! llama.cpp); a CUDA decoder is not written yet, so [`paged_decoder`] on a
//! GPU probes the driver and then refuses with
//! [`BackendError::CudaDecoderMissing`].

#[allow(unsafe_code)] // dlopen + the driver's C API
pub mod driver;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod gpu;

use crate::attn::KvPool;
use crate::error::Result;
use crate::llama::{Llama, LlamaConfig, PagedSeq};

pub use driver::{probe_cuda, CudaDeviceInfo};

/// The device a decoder computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDevice {
    Cpu,
    /// CUDA device by index (`gcs-node --gpu N`).
    Cuda(u32),
}

impl ComputeDevice {
    /// `--gpu N` or none.
    pub fn from_gpu_flag(gpu: Option<u32>) -> Self {
        gpu.map_or(ComputeDevice::Cpu, ComputeDevice::Cuda)
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
        "CUDA device {index} is {name} ({mib} MiB), but the CUDA decoder is not implemented \
         yet; run the worker without --gpu (CPU)"
    )]
    CudaDecoderMissing { index: u32, name: String, mib: u64 },
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
}

/// The host backend: [`Llama::forward_paged`] over a host [`KvPool`].
#[derive(Debug)]
pub struct CpuDecoder {
    model: Llama,
    pool: KvPool,
}

impl CpuDecoder {
    pub fn new(model: Llama, kv_blocks: usize) -> Self {
        let pool = model.new_kv_pool(kv_blocks);
        Self { model, pool }
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
        let (model, pool) = (&self.model, &mut self.pool);
        // On a rayon worker, so the calling thread takes part in the matmuls.
        rayon::scope(|_| model.forward_paged(pool, seqs))
    }
}

/// Check that `device` can be used by this build and machine, without
/// loading a model: nothing on the CPU; on a GPU, the driver probe (so a
/// worker fails at start with a clear message, not on its first job).
pub fn check_device(device: ComputeDevice) -> Result<Option<CudaDeviceInfo>, BackendError> {
    match device {
        ComputeDevice::Cpu => Ok(None),
        ComputeDevice::Cuda(index) if !cfg!(feature = "cuda") => {
            Err(BackendError::NoCudaSupport { index })
        }
        ComputeDevice::Cuda(index) => probe_cuda(index).map(Some),
    }
}

/// Whether this build and machine can serve on `device` now: on a GPU, the
/// checks of [`check_device`] and then [`BackendError::CudaDecoderMissing`]
/// (there is no CUDA decoder yet). `gcs-node --gpu N` calls this at start,
/// before any model is loaded.
pub fn ensure_servable(device: ComputeDevice) -> Result<(), BackendError> {
    match check_device(device)? {
        None => Ok(()),
        Some(gpu) => Err(BackendError::CudaDecoderMissing {
            index: gpu.index,
            name: gpu.name,
            mib: gpu.total_memory_bytes >> 20,
        }),
    }
}

/// The decoder for `model` on `device`, with `kv_blocks` K/V blocks.
pub fn paged_decoder(
    device: ComputeDevice,
    model: Llama,
    kv_blocks: usize,
) -> Result<Box<dyn PagedDecoder>, BackendError> {
    // Refuses every GPU until a CUDA decoder exists, so only the CPU one
    // is reached here.
    ensure_servable(device)?;
    Ok(Box::new(CpuDecoder::new(model, kv_blocks)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_flag_maps_to_device() {
        assert_eq!(ComputeDevice::from_gpu_flag(None), ComputeDevice::Cpu);
        assert_eq!(ComputeDevice::from_gpu_flag(Some(2)), ComputeDevice::Cuda(2));
    }

    #[test]
    fn cpu_needs_no_probe() {
        assert!(matches!(check_device(ComputeDevice::Cpu), Ok(None)));
        assert!(ensure_servable(ComputeDevice::Cpu).is_ok());
    }

    #[test]
    fn gpu_without_the_feature_or_a_driver_is_a_clear_error() {
        // Nowhere servable yet: no CUDA decoder, whatever the machine.
        assert!(ensure_servable(ComputeDevice::Cuda(0)).is_err());
        let res = check_device(ComputeDevice::Cuda(0));
        if cfg!(feature = "cuda") {
            // On a machine with a driver and a GPU the probe succeeds and
            // there is nothing to refuse.
            if let Err(err) = res {
                assert!(!matches!(err, BackendError::NoCudaSupport { .. }), "{err}");
            }
        } else {
            let err = res.expect_err("no CUDA support in this build");
            assert!(matches!(err, BackendError::NoCudaSupport { index: 0 }), "{err:?}");
            assert!(err.to_string().contains("--features cuda"), "{err}");
        }
    }
}
