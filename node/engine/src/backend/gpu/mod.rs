//! The GPU decoder's CubeCL kernels. They are written against CubeCL's
//! runtime-erased [`cubecl::client::Client`], so one kernel runs on CUDA
//! (`--features cuda`) and on wgpu (`--features wgpu`, which the tests use on
//! Mesa's lavapipe, a Vulkan driver on the CPU).

pub mod buf;
pub mod decoder;
pub mod dense;
pub mod graph;
pub mod kernels;
pub mod launch;
pub mod step;
pub mod weights;

pub use buf::DeviceBuf;
pub use decoder::{Anatomy, GpuDecoder, StepPart};
pub use weights::check_model;

/// A GPU runtime failure, with the runtime's own message.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("GPU runtime error: {0}")]
    Server(String),
    #[error("GPU decoder cannot use this model: {0}")]
    Unsupported(String),
}

impl GpuError {
    pub(crate) fn server(e: impl std::fmt::Debug) -> Self {
        GpuError::Server(format!("{e:?}"))
    }
}
