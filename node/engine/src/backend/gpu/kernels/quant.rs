//! Matmul over quantized weights, dequantized inside the kernel.
//!
//! The weights stay in their GGUF blocks, uploaded as little-endian `u32`
//! words, one block in a whole number of words ([`WeightKind`]): Q4_1's
//! 20-byte block is 5 words as stored; Q4_0 (18 bytes) and Q8_0 (34 bytes)
//! get two zero bytes after their f16 scale, so their quants start on a
//! word. `out[j, off + r] = Σ_c x[j, c] · W[r, c]` for batch rows `j < n`
//! (`x[j, c]` read as [`InputKind`] says: the rows, their SwiGLU or their
//! RMSNorm; with `add` the products are added to `out`, the residual).
//!
//! Work split: a cube is `LANES × ROWS` units; unit `(lane, ry)` owns weight
//! row `cube_x · ROWS + ry` and walks its blocks `lane, lane + LANES, …`,
//! dequantizing each block once into registers and using it for `NB` batch
//! rows (`cube_y` picks which `NB`); the lanes' partial sums meet in a
//! shared-memory tree. Weights are read once per `NB` batch rows.
//!
//! **The summation order** every matmul kernel here follows, so that a
//! sequence's logits do not depend on the batch it ran in (a batch picks
//! the kernel): `s_b = Σ_e w·x` over a block's 32 elements in order; lane
//! `l`'s `P_l = Σ s_b` over its blocks `b ≡ l (mod LANES)` in increasing
//! `b`; the output is the 32 lanes' tree: `P_l + P_{l+16}`, then stride 8,
//! 4, 2, 1. The tiled kernel (`tiled.rs`) walks the lanes in the tree's
//! post-order to the same effect.

use cubecl::prelude::*;

use super::ops::{gelu_mul, row_scales, silu_mul};

/// Units along a weight row (over its blocks); the tiled kernel's tree is
/// written for 32.
pub const LANES: usize = 32;
/// Weight rows per cube.
pub const ROWS: usize = 4;
/// Batch rows per cube (accumulators per unit).
pub const NB: usize = 8;
/// Outputs a lane writes per weight row at the end: lane `l` writes batch
/// rows `l, l + LANES, …` below `NB`.
const WRITES: usize = NB.div_ceil(LANES);

/// The block formats the kernel reads (`#[comptime]`: one compiled kernel
/// per format).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightKind {
    /// `w = d · (q − 8)`, 5 words: `d | pad`, 16 nibble bytes.
    Q4_0,
    /// `w = d · q + m`, 5 words: `d | m << 16`, 16 nibble bytes.
    Q4_1,
    /// `w = d · q`, 9 words: `d | pad`, 32 signed bytes.
    Q8_0,
    /// `w = d · (q − 16)`, 6 words: `d | pad`, the 32 high bits, 16 nibble
    /// bytes (GGUF's Q5_0 with its scale padded to a word).
    Q5_0,
    /// A K-quant's 32-element sub-block (`quant::rows::KSub`):
    /// `w = a[e / 16] · q − m`, 11 words: `a[0]`, `a[1]`, `m` as f32, 32
    /// signed bytes. Q5_K and Q6_K, repacked on upload.
    KSub,
    /// A Q4_K sub-block, whose 32 elements share one scale and whose
    /// quants are nibbles: `w = a · q − m`, 6 words: `a`, `m` as f32, 16
    /// nibble bytes in Q4_0's order (24 bytes against [`WeightKind::KSub`]'s
    /// 44; the same values).
    K4Sub,
}

impl WeightKind {
    /// `u32` words per 32-element block on the device.
    pub const fn words(self) -> usize {
        match self {
            WeightKind::Q4_0 | WeightKind::Q4_1 => 5,
            WeightKind::Q8_0 => 9,
            WeightKind::Q5_0 | WeightKind::K4Sub => 6,
            WeightKind::KSub => 11,
        }
    }
}

/// An f16 (the low 16 bits of `h`) as f32, exactly; inf/NaN are not
/// expected in scales and come out as large finite values.
#[cube]
pub fn f16_to_f32(h: u32) -> f32 {
    let sign = (h >> 15) & 1;
    let exp = (h >> 10) & 31;
    let mant = h & 1023;
    let normal = f32::reinterpret((sign << 31) | ((exp + 112) << 23) | (mant << 13));
    // Subnormal: mant · 2^-24.
    let sub = f32::cast_from(mant) * 5.9604645e-8f32;
    let sub = select(sign == 1, -sub, sub);
    select(exp == 0, sub, normal)
}

/// What a matmul reads as batch row `j`'s input (`#[comptime]`: one
/// compiled kernel each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// `x[j, c]`.
    Rows,
    /// The SwiGLU of `x`'s `[gate | up]` rows (`ops::silu_mul`, the
    /// same operations as `ops::glu`): the down projection reads the
    /// gate/up output itself, one launch and one buffer fewer a layer.
    Glu,
    /// The GeGLU of `x`'s `[gate | up]` rows (`ops::gelu_mul`; gemma3's
    /// FFN), read as `Glu`.
    GeGlu,
    /// `x[j]` RMS-normed, `(x[j, c] · scale_j) · nw[c]` with the row's
    /// scale from `ops::row_scales` (the operations of `ops::rms_norm`):
    /// the layer's norms before Q/K/V and gate/up, computed by the matmul
    /// that reads them, two launches fewer a layer.
    Norm,
}

/// Input element `c` of batch row `j` (see [`InputKind`]); `sc` is row
/// `j`'s norm scale (read with `Norm` only).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn input(
    x: &[f32],
    nw: &[f32],
    sc: f32,
    j: usize,
    c: usize,
    cols: usize,
    #[comptime] kind: InputKind,
) -> f32 {
    match comptime!(kind) {
        InputKind::Glu => {
            let o = j * 2 * cols + c;
            silu_mul(x[o], x[o + cols])
        }
        InputKind::GeGlu => {
            let o = j * 2 * cols + c;
            gelu_mul(x[o], x[o + cols])
        }
        InputKind::Norm => (x[j * cols + c] * sc) * nw[c],
        InputKind::Rows => x[j * cols + c],
    }
}

/// The norm scales a cube of a matmul reading `kind` needs: those of
/// batch rows `j0 .. j0 + rows` ([`row_scales`]) with `Norm`, else none
/// (a one-element slice never read). Every unit of the cube calls it.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scales_for(
    x: &[f32],
    j0: usize,
    n: usize,
    cols: usize,
    eps: f32,
    tid: usize,
    units: usize,
    #[comptime] rows: usize,
    #[comptime] kind: InputKind,
) -> Shared<[f32]> {
    if comptime!(kind == InputKind::Norm) {
        row_scales(x, j0, n, cols, eps, tid, units, rows)
    } else {
        Shared::new_slice(1usize)
    }
}

/// Row `j`'s scale from [`scales_for`]'s slice (0 unless `Norm`).
#[cube]
pub fn scale_of(sc: &Shared<[f32]>, j: usize, #[comptime] kind: InputKind) -> f32 {
    let mut s = 0.0f32;
    if comptime!(kind == InputKind::Norm) {
        s = sc[j];
    }
    s
}

/// `v`, or with `add` (the residual stream as the output: the O and down
/// projections add to it) `out[o] + v`.
#[cube]
pub fn store(out: &mut [f32], o: usize, v: f32, #[comptime] add: bool) {
    if comptime!(add) {
        out[o] = out[o] + v;
    } else {
        out[o] = v;
    }
}

/// The 32 weights of the block at word `base`, into `wv`.
#[cube]
pub fn dequant_block(w: &[u32], base: usize, wv: &mut Array<f32>, #[comptime] kind: WeightKind) {
    let w0 = w[base];
    let d = f16_to_f32(w0 & 0xffff);
    match comptime!(kind) {
        WeightKind::Q5_0 | WeightKind::KSub | WeightKind::K4Sub =>
        {
            #[unroll]
            for c in 0..4usize {
                dequant_eighth(w, base, c, wv, c * 8, kind);
            }
        }
        WeightKind::Q8_0 =>
        {
            #[unroll]
            for wi in 0..8usize {
                let word = w[base + 1 + wi];
                #[unroll]
                for k in 0..4usize {
                    let byte = (word >> (8 * k as u32)) & 0xff;
                    let q = i32::cast_from(byte) - select(byte >= 128, 256i32, 0i32);
                    wv[wi * 4 + k] = f32::cast_from(q) * d;
                }
            }
        }
        _ => {
            // Q4_1: d · q + m; Q4_0: d · (q − 8).
            let q4_1 = comptime!(kind == WeightKind::Q4_1);
            let m = select(q4_1, f16_to_f32(w0 >> 16), 0.0f32.runtime());
            let off = select(q4_1, 0.0f32.runtime(), (-8.0f32).runtime());
            #[unroll]
            for wi in 0..4usize {
                let word = w[base + 1 + wi];
                #[unroll]
                for k in 0..4usize {
                    let byte = (word >> (8 * k as u32)) & 0xff;
                    let e = wi * 4 + k;
                    wv[e] = (f32::cast_from(byte & 15) + off) * d + m;
                    wv[e + 16] = (f32::cast_from(byte >> 4) + off) * d + m;
                }
            }
        }
    }
}

/// See the module docs. Launch with `CubeDim (LANES, ROWS)` and
/// `CubeCount (rows.div_ceil(ROWS), n.div_ceil(NB))`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn matmul_q(
    w: &[u32],
    x: &[f32],
    nw: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    n: usize,
    out_stride: usize,
    out_off: usize,
    eps: f32,
    #[comptime] kind: WeightKind,
    #[comptime] input_kind: InputKind,
    #[comptime] add: bool,
) {
    let lane = UNIT_POS_X as usize;
    let ry = UNIT_POS_Y as usize;
    let r = CUBE_POS_X as usize * ROWS + ry;
    let j0 = CUBE_POS_Y as usize * NB;
    let nb = cols / 32;
    let words = comptime!(kind.words());
    let tid = ry * LANES + lane;
    let sc = scales_for(x, j0, n, cols, eps, tid, LANES * ROWS, NB, input_kind);
    let mut acc = Array::<f32>::new(NB);
    #[unroll]
    for j in 0..NB {
        acc[j] = 0.0;
    }
    let mut wv = Array::<f32>::new(32usize);
    if r < rows {
        let mut b = lane;
        while b < nb {
            dequant_block(w, (r * nb + b) * words, &mut wv, kind);
            #[unroll]
            for j in 0..NB {
                if j0 + j < n {
                    let scj = scale_of(&sc, j, input_kind);
                    let mut s = 0.0f32;
                    #[unroll]
                    for e in 0..32usize {
                        s += wv[e] * input(x, nw, scj, j0 + j, b * 32 + e, cols, input_kind);
                    }
                    acc[j] += s;
                }
            }
            b += LANES;
        }
    }
    let mut sh = Shared::new_slice(ROWS * NB * LANES);
    #[unroll]
    for j in 0..NB {
        sh[(ry * NB + j) * LANES + lane] = acc[j];
    }
    sync_cube();
    let mut stride = (LANES / 2).runtime();
    while stride > 0 {
        if lane < stride {
            #[unroll]
            for j in 0..NB {
                let i = (ry * NB + j) * LANES + lane;
                sh[i] = sh[i] + sh[i + stride];
            }
        }
        sync_cube();
        stride /= 2;
    }
    // Lane l writes batch rows l, l + LANES, … of the cube's NB.
    #[unroll]
    for k in 0..WRITES {
        let j = lane + k * LANES;
        if j < NB && r < rows && j0 + j < n {
            store(out, (j0 + j) * out_stride + out_off + r, sh[(ry * NB + j) * LANES], add);
        }
    }
}

/// Embedding lookup: row `tokens[cube_x]` of the quantized table, times
/// `scale` (gemma3's `sqrt(hidden)`; 1 leaves every value as it is), into
/// `x[cube_x, ..]`, where that row is in this part of the table (its rows
/// `row0 .. row0 + rows`). Launch with `CubeCount (n_tokens, cols / 32)`, one
/// unit per block.
#[cube(launch)]
pub fn embed_q(
    w: &[u32],
    tokens: &[u32],
    x: &mut [f32],
    cols: usize,
    scale: f32,
    row0: usize,
    rows: usize,
    #[comptime] kind: WeightKind,
) {
    let t = tokens[CUBE_POS_X as usize] as usize;
    let b = CUBE_POS_Y as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let nb = cols / 32;
    // A part of the table holds rows row0 .. row0 + rows; the others are
    // another launch's.
    let inside = t >= row0 && t < row0 + rows;
    let t = select(inside, t - row0, 0usize);
    if b < nb && inside {
        let words = comptime!(kind.words());
        let mut wv = Array::<f32>::new(32usize);
        dequant_block(w, (t * nb + b) * words, &mut wv, kind);
        let o = CUBE_POS_X as usize * cols + b * 32;
        #[unroll]
        for e in 0..32usize {
            x[o + e] = wv[e] * scale;
        }
    }
}

/// Weight rows per unit of [`matmul_q_wide`].
pub const RPU: usize = 4;

/// Element `el` (0..32) of 16 nibble bytes from word `at`: byte `el`'s low
/// nibble below 16, byte `el − 16`'s high one from 16.
#[cube]
fn nibble(w: &[u32], at: usize, el: usize) -> u32 {
    let bi = el % 16;
    let byte = (w[at + bi / 4] >> (8 * (bi % 4) as u32)) & 0xff;
    (byte >> (4 * (el / 16) as u32)) & 15
}

/// Element `el` of 32 signed bytes from word `at`.
#[cube]
fn signed_byte(w: &[u32], at: usize, el: usize) -> i32 {
    let byte = (w[at + el / 4] >> (8 * (el % 4) as u32)) & 0xff;
    i32::cast_from(byte) - select(byte >= 128, 256i32, 0i32)
}

/// Elements `8c .. 8c + 8` of the block at word `base`, into
/// `wv[o .. o + 8]`: the same values, by the same float operations, as
/// [`dequant_block`] gives those elements.
#[cube]
pub fn dequant_eighth(
    w: &[u32],
    base: usize,
    c: usize,
    wv: &mut Array<f32>,
    o: usize,
    #[comptime] kind: WeightKind,
) {
    let w0 = w[base];
    let d = f16_to_f32(w0 & 0xffff);
    match comptime!(kind) {
        WeightKind::Q5_0 => {
            let qh = w[base + 1];
            #[unroll]
            for e in 0..8usize {
                // Nibbles as Q4_0's; element el's fifth bit is bit el.
                let el = c * 8 + e;
                let q = nibble(w, base + 2, el) | (((qh >> el as u32) & 1) << 4);
                wv[o + e] = (f32::cast_from(q) - 16.0f32) * d;
            }
        }
        WeightKind::KSub => {
            // Elements 0..16 (eighths 0, 1) take a[0], 16..32 a[1].
            let a = f32::reinterpret(w[base + c / 2]);
            let m = f32::reinterpret(w[base + 2]);
            #[unroll]
            for e in 0..8usize {
                wv[o + e] = a * f32::cast_from(signed_byte(w, base + 3, c * 8 + e)) - m;
            }
        }
        WeightKind::K4Sub => {
            let (a, m) = (f32::reinterpret(w[base]), f32::reinterpret(w[base + 1]));
            #[unroll]
            for e in 0..8usize {
                wv[o + e] = a * f32::cast_from(nibble(w, base + 2, c * 8 + e)) - m;
            }
        }
        WeightKind::Q8_0 =>
        {
            #[unroll]
            for e in 0..8usize {
                wv[o + e] = f32::cast_from(signed_byte(w, base + 1, c * 8 + e)) * d;
            }
        }
        _ => {
            let q4_1 = comptime!(kind == WeightKind::Q4_1);
            let m = select(q4_1, f16_to_f32(w0 >> 16), 0.0f32.runtime());
            let off = select(q4_1, 0.0f32.runtime(), (-8.0f32).runtime());
            #[unroll]
            for e in 0..8usize {
                let nib = nibble(w, base + 1, c * 8 + e);
                wv[o + e] = (f32::cast_from(nib) + off) * d + m;
            }
        }
    }
}

/// [`matmul_q`] with [`RPU`] weight rows a unit, and `nb_rows` batch rows a
/// cube (a power of two up to [`NB`]: a single sequence's step keeps one
/// accumulator a row, not eight, and its reduction tree is an eighth as
/// long): each `x` value loaded serves `RPU` rows instead of one.
/// Every output is the same sum in the same order as in [`matmul_q`]
/// (a lane's blocks `lane, lane + LANES, …`, each block's 32 products in
/// order, then the lanes' tree), whatever `nb_rows`, so the kernels agree bit
/// for bit and a sequence's logits do not depend on the size of its batch.
/// Launch with `CubeDim (LANES, ROWS)` and
/// `CubeCount (rows.div_ceil(ROWS · RPU), n.div_ceil(nb_rows))`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn matmul_q_wide(
    w: &[u32],
    x: &[f32],
    nw: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    n: usize,
    out_stride: usize,
    out_off: usize,
    eps: f32,
    #[comptime] kind: WeightKind,
    #[comptime] input_kind: InputKind,
    #[comptime] add: bool,
    #[comptime] nb_rows: usize,
) {
    let lane = UNIT_POS_X as usize;
    let ry = UNIT_POS_Y as usize;
    let r0 = (CUBE_POS_X as usize * ROWS + ry) * RPU;
    let j0 = CUBE_POS_Y as usize * nb_rows;
    let nb = cols / 32;
    let words = comptime!(kind.words());
    let tid = ry * LANES + lane;
    let sc = scales_for(x, j0, n, cols, eps, tid, LANES * ROWS, nb_rows, input_kind);
    let mut acc = Array::<f32>::new(comptime!(RPU * nb_rows));
    let mut s = Array::<f32>::new(comptime!(RPU * nb_rows));
    #[unroll]
    for i in 0..comptime!(RPU * nb_rows) {
        acc[i] = 0.0;
    }
    let mut wv = Array::<f32>::new(RPU * 8);
    let mut xv = Array::<f32>::new(8usize);
    let mut b = lane;
    while b < nb {
        #[unroll]
        for i in 0..comptime!(RPU * nb_rows) {
            s[i] = 0.0;
        }
        #[unroll]
        for c in 0..4usize {
            #[unroll]
            for ri in 0..RPU {
                let r = r0 + ri;
                // A row past the matrix reads row 0's block (in bounds);
                // its sums are never written.
                let rr = select(r < rows, r, 0usize);
                dequant_eighth(w, (rr * nb + b) * words, c, &mut wv, ri * 8, kind);
            }
            #[unroll]
            for j in 0..nb_rows {
                if j0 + j < n {
                    let scj = scale_of(&sc, j, input_kind);
                    #[unroll]
                    for e in 0..8usize {
                        xv[e] = input(x, nw, scj, j0 + j, b * 32 + c * 8 + e, cols, input_kind);
                    }
                    #[unroll]
                    for ri in 0..RPU {
                        let mut t = s[ri * nb_rows + j];
                        #[unroll]
                        for e in 0..8usize {
                            t += wv[ri * 8 + e] * xv[e];
                        }
                        s[ri * nb_rows + j] = t;
                    }
                }
            }
        }
        #[unroll]
        for i in 0..comptime!(RPU * nb_rows) {
            acc[i] += s[i];
        }
        b += LANES;
    }
    let mut sh = Shared::new_slice(comptime!(ROWS * RPU * nb_rows * LANES));
    #[unroll]
    for i in 0..comptime!(RPU * nb_rows) {
        sh[(ry * RPU * nb_rows + i) * LANES + lane] = acc[i];
    }
    sync_cube();
    let mut stride = (LANES / 2).runtime();
    while stride > 0 {
        if lane < stride {
            #[unroll]
            for i in 0..comptime!(RPU * nb_rows) {
                let k = (ry * RPU * nb_rows + i) * LANES + lane;
                sh[k] = sh[k] + sh[k + stride];
            }
        }
        sync_cube();
        stride /= 2;
    }
    // Lane l writes batch row l of the cube's nb_rows (≤ NB ≤ LANES),
    // for each of the unit's RPU weight rows.
    let j = lane;
    if j < nb_rows && j0 + j < n {
        #[unroll]
        for ri in 0..RPU {
            let r = r0 + ri;
            if r < rows {
                let v = sh[(ry * RPU * nb_rows + ri * nb_rows + j) * LANES];
                store(out, (j0 + j) * out_stride + out_off + r, v, add);
            }
        }
    }
}
