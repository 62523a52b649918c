//! Op-by-op comparison with llama.cpp's own intermediate tensors.
//!
//! Needs `GCS_LLAMA_DUMP`, a directory written by
//! `scripts/fixtures/llama_dump.cpp` (scripts/fixtures/README.md, section 3);
//! the README's test command makes one with `scripts/fixtures/llama-dump.sh`.
//! Without it the test says SKIP (a failure under `CI=true`). Each of our ops is fed llama.cpp's input to that op and its
//! output is compared bit for bit, so the first op whose float order differs
//! is named directly instead of being inferred from diverging generations.
//!
//! The engine's weight matmuls follow the order of ggml's AMX kernels (the
//! `sapphirerapids` CPU variant, scripts/fixtures/README.md section 3), on
//! every CPU: one order everywhere is what makes workers interchangeable.
//! A dump made by another AVX-512 variant (the dump's `variant` file,
//! written by llama-dump.sh; e.g. `zen4`, whose VNNI `vec_dot` sums in
//! another order) still holds every other op to the bit, and each matmul
//! value to within [`MATMUL_TOL`] of its row's magnitude: the same
//! products, summed differently. A dump by an AVX2 variant (`haswell`, on
//! CPUs without AVX-512) also sums attention and SiLU 8 lanes wide, so those
//! are held to [`ATTN_TOL`] and [`SWIGLU_TOL`]; norms and RoPE stay exact.
//!
//! ```sh
//! GCS_LLAMA_DUMP=/tmp/lh/dump cargo test --workspace --test llamacpp_ops -- --nocapture
//! ```

mod common;

use std::path::{Path, PathBuf};

use gcs_engine::attn::{attend, LayerKv, Rope};
use gcs_engine::cpu_device;
use gcs_engine::gguf::GgufFile;
use gcs_engine::llama::Llama;
use gcs_engine::numerics::{rms_norm_rows, swiglu_rows};

/// The `nth` dump of tensor `name` in `step` (names repeat: e.g. `Qcur-0`
/// is the matmul output, then a reshape, then the RoPE output).
fn load(dir: &Path, step: usize, name: &str, nth: usize) -> Option<Vec<f32>> {
    let pre = format!("s{step}_");
    let suffix = format!("{name}.bin");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&pre) && n.len() > pre.len() + 5 && n[pre.len() + 5..] == suffix)
        .collect();
    files.sort();
    let b = std::fs::read(dir.join(files.get(nth)?)).ok()?;
    Some(b[20..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// The variant whose matmul order the engine follows.
const EXACT_VARIANT: &str = "sapphirerapids";

/// ggml variants without AVX-512: their f16 attention dot products and
/// SiLU run 8 lanes wide where the engine (and every AVX-512 variant) runs
/// 16, so those sums round differently too.
const AVX2_VARIANTS: &[&str] = &["haswell", "alderlake", "sandybridge", "ivybridge", "piledriver", "sse42", "x64"];

/// Bound on a matmul value summed in another order, relative to the
/// largest value of its row (at least 1): Q8 products summed over 576..1536
/// inputs round differently by a few ulps of the partial sums, which for a
/// value near 0 after cancellation is large relative to the value itself
/// (seen: 4.4e-5 absolute in down-projection rows peaking near 10), while a
/// wrong weight, scale or block is off by orders of magnitude more.
const MATMUL_TOL: f32 = 1e-4;

/// The same bound for attention (per head) and SwiGLU outputs of an AVX2
/// dump. ggml rounds the softmax weights to f16 before the V product, so a
/// score summed in another order can flip a weight by one f16 ulp (4.9e-4
/// relative); a few such flips in one head add up (seen, haswell
/// 2026-12-03: 8.2e-4 of the head's largest value in layer 19, below 2e-4
/// elsewhere), while a wrong position, mask or head is off by whole units.
const ATTN_TOL: f32 = 4e-3;

/// SwiGLU of an AVX2 dump: its 8-lane SiLU rounds differently by an ulp or
/// two (seen: 1.8e-7 of the row's largest value).
const SWIGLU_TOL: f32 = 1e-5;

/// How closely a dump can be matched, from the variant that made it.
#[derive(Clone, Copy, PartialEq)]
enum Match {
    /// Every op to the bit (the AMX variant, or an unrecorded dump).
    Bits,
    /// Matmuls within [`MATMUL_TOL`], every other op to the bit (AVX-512).
    Matmuls,
    /// Matmuls, attention and SwiGLU within their bounds (AVX2 and older).
    Vectors,
}

/// Values (rows of `width`) outside `tol` of their row's largest value
/// (at least 1), or, with `tol == None`, whose bits differ.
fn cmp_within(what: &str, ours: &[f32], want: &[f32], width: usize, tol: Option<f32>) -> usize {
    let differ = cmp(what, ours, want);
    let Some(tol) = tol else { return differ };
    let (mut far, mut worst) = (0, 0f32);
    for (a, b) in ours.chunks(width).zip(want.chunks(width)) {
        let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
        for (x, y) in a.iter().zip(b) {
            let d = (x - y).abs() / scale;
            worst = worst.max(d);
            far += usize::from(!(d <= tol));
        }
    }
    if differ > 0 {
        eprintln!("{what:24} largest gap {worst:e} of the row's scale (bound {tol:e})");
    }
    if far > 0 {
        eprintln!("{what:24} {far:6}/{:6} outside the bound", ours.len());
    }
    far
}

/// Number of elements whose bits differ (printed with the largest gap).
fn cmp(what: &str, ours: &[f32], want: &[f32]) -> usize {
    assert_eq!(ours.len(), want.len(), "{what}: length");
    let (mut bad, mut maxd) = (0, 0f32);
    for (a, b) in ours.iter().zip(want) {
        if a.to_bits() != b.to_bits() {
            bad += 1;
            maxd = maxd.max((a - b).abs());
        }
    }
    if bad > 0 {
        eprintln!("{what:24} {bad:6}/{:6} differ, max |d| {maxd:e}", ours.len());
    }
    bad
}

/// Columns `a..b` of each `width`-wide row.
fn cols(x: &[f32], width: usize, a: usize, b: usize) -> Vec<f32> {
    x.chunks_exact(width).flat_map(|r| r[a..b].to_vec()).collect()
}

#[test]
fn ops_match_llamacpp_dump() {
    let fix = "run `bash scripts/test.sh`, or set it to a scripts/fixtures/llama-dump.sh output";
    let Some(dir) = common::prereq::env("GCS_LLAMA_DUMP", fix).map(PathBuf::from) else {
        return;
    };
    let Some(path) = common::smollm_path() else { return };
    let variant = std::fs::read_to_string(dir.join("variant")).unwrap_or_default();
    let variant = variant.trim();
    // No variant file: a dump made by hand, held to the bit.
    let level = if variant.is_empty() || variant == EXACT_VARIANT {
        Match::Bits
    } else if AVX2_VARIANTS.contains(&variant) {
        Match::Vectors
    } else {
        Match::Matmuls
    };
    eprintln!(
        "dump by ggml's {} CPU variant: {}",
        if variant.is_empty() { "(unrecorded)" } else { variant },
        match level {
            Match::Bits => "every op to the bit",
            Match::Matmuls => "matmuls within the bound, every other op to the bit",
            Match::Vectors => "matmuls, attention and SwiGLU within their bounds, every other op to the bit",
        }
    );
    let mm_tol = (level != Match::Bits).then_some(MATMUL_TOL);
    let attn_tol = (level == Match::Vectors).then_some(ATTN_TOL);
    let swiglu_tol = (level == Match::Vectors).then_some(SWIGLU_TOL);
    let g = GgufFile::open(&path).unwrap();
    let m = Llama::from_gguf(&g, &cpu_device()).unwrap();
    let c = m.config.clone();
    let (h, ff) = (c.hidden, c.intermediate);
    let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let width = qd + 2 * kvd;
    let rope = Rope::new(c.head_dim, c.rope_base, c.context_length);
    let mut kvs: Vec<LayerKv> = (0..c.n_layers).map(|_| LayerKv::default()).collect();
    let (mut past, mut total_bad, mut steps) = (0, 0, 0);
    let ld = |s: usize, name: String, nth: usize| {
        load(&dir, s, &name, nth).unwrap_or_else(|| panic!("dump of {name} (#{nth}) at step {s}"))
    };
    for s in 0.. {
        let Some(embd) = load(&dir, s, "embd", 0) else { break };
        let n = embd.len() / h;
        steps += 1;
        let mut bad = 0;
        let mut prev = embd;
        for li in 0..c.n_layers {
            let b = &m.blocks[li].q;
            let mut x = prev.clone();
            rms_norm_rows(
                &mut x,
                &g.tensor_f32(&format!("blk.{li}.attn_norm.weight")).unwrap(),
                c.rms_eps,
            );
            let an = ld(s, format!("attn_norm-{li}"), 0);
            bad += cmp(&format!("L{li} attn_norm"), &x, &an);
            let mut qkv = vec![0f32; n * width];
            b.wqkv.matmul(&an, n, &mut qkv);
            let (q, k, v) = (
                ld(s, format!("Qcur-{li}"), 0),
                ld(s, format!("Kcur-{li}"), 0),
                ld(s, format!("Vcur-{li}"), 0),
            );
            bad += cmp_within(&format!("L{li} q matmul"), &cols(&qkv, width, 0, qd), &q, qd, mm_tol);
            bad += cmp_within(&format!("L{li} k matmul"), &cols(&qkv, width, qd, qd + kvd), &k, kvd, mm_tol);
            bad += cmp_within(&format!("L{li} v matmul"), &cols(&qkv, width, qd + kvd, width), &v, kvd, mm_tol);
            // RoPE + f16 cache + attention from llama.cpp's projections.
            let mut lqkv = vec![0f32; n * width];
            for r in 0..n {
                lqkv[r * width..][..qd].copy_from_slice(&q[r * qd..][..qd]);
                lqkv[r * width + qd..][..kvd].copy_from_slice(&k[r * kvd..][..kvd]);
                lqkv[r * width + qd + kvd..][..kvd].copy_from_slice(&v[r * kvd..][..kvd]);
            }
            let mut att = vec![0f32; n * qd];
            attend(m.shape(), &rope, &mut lqkv, past, &mut kvs[li], &mut att);
            // Our K after RoPE is still f32 here (Q was rounded to f16).
            bad += cmp(
                &format!("L{li} k rope"),
                &cols(&lqkv, width, qd, qd + kvd),
                &ld(s, format!("Kcur-{li}"), 2),
            );
            let kvo = ld(s, format!("kqv_out-{li}"), 0);
            // The last layer keeps only the output row.
            bad += cmp_within(
                &format!("L{li} attention"),
                &att[att.len() - kvo.len()..],
                &kvo,
                c.head_dim,
                attn_tol,
            );
            let nr = kvo.len() / qd;
            let mut o = vec![0f32; nr * h];
            b.wo.matmul(&kvo, nr, &mut o);
            let ao = ld(s, format!("attn_out-{li}"), 0);
            bad += cmp_within(&format!("L{li} wo matmul"), &o[o.len() - ao.len()..], &ao, h, mm_tol);
            let mut x = ld(s, format!("ffn_inp-{li}"), 0);
            rms_norm_rows(
                &mut x,
                &g.tensor_f32(&format!("blk.{li}.ffn_norm.weight")).unwrap(),
                c.rms_eps,
            );
            let fnm = ld(s, format!("ffn_norm-{li}"), 0);
            bad += cmp(&format!("L{li} ffn_norm"), &x, &fnm);
            let nr = fnm.len() / h;
            let mut gu = vec![0f32; nr * 2 * ff];
            b.w_gate_up.matmul(&fnm, nr, &mut gu);
            let (gate, up) = (ld(s, format!("ffn_gate-{li}"), 0), ld(s, format!("ffn_up-{li}"), 0));
            bad += cmp_within(&format!("L{li} gate matmul"), &cols(&gu, 2 * ff, 0, ff), &gate, ff, mm_tol);
            bad += cmp_within(&format!("L{li} up matmul"), &cols(&gu, 2 * ff, ff, 2 * ff), &up, ff, mm_tol);
            let lgu: Vec<f32> = gate
                .chunks_exact(ff)
                .zip(up.chunks_exact(ff))
                .flat_map(|(a, b)| a.iter().chain(b).copied().collect::<Vec<_>>())
                .collect();
            let mut act = vec![0f32; nr * ff];
            swiglu_rows(&lgu, &mut act, ff);
            let sw = ld(s, format!("ffn_swiglu-{li}"), 0);
            bad += cmp_within(&format!("L{li} swiglu"), &act, &sw, ff, swiglu_tol);
            let mut d = vec![0f32; nr * h];
            b.w_down.matmul(&sw, nr, &mut d);
            bad += cmp_within(&format!("L{li} down matmul"), &d, &ld(s, format!("ffn_out-{li}"), 0), h, mm_tol);
            prev = ld(s, format!("l_out-{li}"), 0);
        }
        let mut x = prev;
        rms_norm_rows(&mut x, &g.tensor_f32("output_norm.weight").unwrap(), c.rms_eps);
        let rn = ld(s, "result_norm".into(), 0);
        bad += cmp("result_norm", &x, &rn);
        let mut lg = vec![0f32; m.lm_head.rows];
        m.lm_head.matmul(&rn, 1, &mut lg);
        bad += cmp_within("logits", &lg, &ld(s, "result_output".into(), 0), lg.len(), mm_tol);
        eprintln!("step {s} ({n} rows): {bad} values off (in bits, or past the bound where one applies)");
        total_bad += bad;
        past += n;
    }
    assert!(steps > 0, "no dumps in {}", dir.display());
    assert_eq!(total_bad, 0, "ops differ from llama.cpp's");
}
