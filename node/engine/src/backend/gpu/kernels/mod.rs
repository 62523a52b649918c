//! CubeCL kernels of the decoder step, one file per kind of op.

pub mod attention;
pub mod basic;
pub mod dense;
pub mod exact;
pub mod gemma;
pub mod ops;
pub mod pick;
pub mod q8;
pub mod q8_tiled;
pub mod quant;
pub mod rounding;
pub mod tiled;
pub mod top;
