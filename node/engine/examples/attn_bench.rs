//! Attention kernel timing at one layer's shape: the paged kernel
//! (`KvPool::attend`, what the batch engine runs) against the contiguous
//! reference (`attn::attend`), decode at a long context and a 512-row
//! prefill. `cargo run --release -p gcs-engine --example attn_bench [-- CTX]`

use std::time::Instant;

use gcs_engine::attn::{attend, AttnShape, KvPool, LayerKv, PagedSeqRef, Rope};

fn main() {
    let ctx: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    // `attn_bench CTX decode`: only the paged decode, 4096 steps (for perf: 4096 steps).
    let decode_only = std::env::args().nth(2).as_deref() == Some("decode");
    // SmolLM2-135M and Gemma 3 270M attention shapes.
    for (name, sh) in [
        ("smollm2", AttnShape { n_heads: 9, n_kv_heads: 3, head_dim: 64 }),
        ("gemma3", AttnShape { n_heads: 4, n_kv_heads: 1, head_dim: 256 }),
    ] {
        let width = (sh.n_heads + 2 * sh.n_kv_heads) * sh.head_dim;
        let qd = sh.n_heads * sh.head_dim;
        let rope = Rope::new(sh.head_dim, 10000.0, ctx + 64);
        let row = |p: usize| -> Vec<f32> {
            (0..width).map(|i| (((p * 131 + i * 7919) % 2003) as f32 / 1000.0) - 1.0).collect()
        };
        let blocks = (ctx + 64).div_ceil(16);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let mut pool = KvPool::new(1, sh, blocks);
        let mut kv = LayerKv::default();
        // Fill ctx positions: paged in 512-row chunks, contiguous in one go.
        let mut all: Vec<f32> = (0..ctx).flat_map(row).collect();
        let t = Instant::now();
        for c0 in (0..ctx).step_by(512) {
            let c1 = (c0 + 512).min(ctx);
            let mut rows = all[c0 * width..c1 * width].to_vec();
            let seqs = [PagedSeqRef { past: c0, t: c1 - c0, table: &table, decode_from: ctx }];
            let mut out = vec![0f32; (c1 - c0) * qd];
            pool.attend(0, &rope, &mut rows, &seqs, &mut out);
        }
        let paged_prefill = t.elapsed().as_secs_f64();
        if decode_only {
            let t = Instant::now();
            for s in 0..4096 {
                let mut r = row(ctx + s % 64);
                let seqs = [PagedSeqRef { past: ctx + s % 64, t: 1, table: &table, decode_from: 0 }];
                let mut o = vec![0f32; qd];
                pool.attend(0, &rope, &mut r, &seqs, &mut o);
            }
            println!("{name}: decode at {ctx} per layer paged {:.1} us", t.elapsed().as_secs_f64() * 1e6 / 4096.0);
            continue;
        }
        let t = Instant::now();
        let mut out = vec![0f32; ctx * qd];
        attend(sh, &rope, &mut all, 0, &mut kv, &mut out);
        let contiguous_prefill = t.elapsed().as_secs_f64();
        // Decode steps at ctx (each step appends one position).
        let steps = 32;
        let t = Instant::now();
        for s in 0..steps {
            let mut r = row(ctx + s);
            let seqs = [PagedSeqRef { past: ctx + s, t: 1, table: &table, decode_from: 0 }];
            let mut o = vec![0f32; qd];
            pool.attend(0, &rope, &mut r, &seqs, &mut o);
        }
        let paged_decode = t.elapsed().as_secs_f64() / steps as f64;
        let t = Instant::now();
        for s in 0..steps {
            let mut r = row(ctx + s);
            let mut o = vec![0f32; qd];
            attend(sh, &rope, &mut r, ctx + s, &mut kv, &mut o);
        }
        let contiguous_decode = t.elapsed().as_secs_f64() / steps as f64;
        println!(
            "{name}: prefill {ctx} rows (paged: 512-row chunks) paged {:.1} ms, contiguous {:.1} ms ({:.2}x); \
             decode at {ctx} per layer paged {:.1} us, contiguous {:.1} us ({:.2}x)",
            paged_prefill * 1e3,
            contiguous_prefill * 1e3,
            contiguous_prefill / paged_prefill,
            paged_decode * 1e6,
            contiguous_decode * 1e6,
            contiguous_decode / paged_decode
        );
    }
}
