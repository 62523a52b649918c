//! Smoke kernels: the toolchain and the test runtime work.

use cubecl::prelude::*;

#[cube(launch)]
pub fn add_f32(a: &[f32], b: &[f32], out: &mut [f32]) {
    if ABSOLUTE_POS < out.len() {
        out[ABSOLUTE_POS] = a[ABSOLUTE_POS] + b[ABSOLUTE_POS];
    }
}

/// Sum of `x` by one cube of `#[comptime] threads` units (shared-memory tree).
#[cube(launch)]
pub fn sum_f32(x: &[f32], out: &mut [f32], #[comptime] threads: usize) {
    let mut shared = Shared::new_slice(threads);
    let tid = UNIT_POS as usize;
    let mut acc = 0.0f32;
    let mut i = tid;
    while i < x.len() {
        acc += x[i];
        i += threads;
    }
    shared[tid] = acc;
    sync_cube();
    // A comptime value mutated in a runtime loop fails pliron's verifier
    // ("expected cube.ptr, found cube.index"): keep the stride runtime.
    let mut stride = (threads / 2).runtime();
    while stride > 0 {
        if tid < stride {
            shared[tid] = shared[tid] + shared[tid + stride];
        }
        sync_cube();
        stride /= 2;
    }
    if tid == 0 {
        out[0] = shared[0];
    }
}
