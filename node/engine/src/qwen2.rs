//! What the `qwen2` architecture (Qwen 1.5 / Qwen 2 / Qwen 2.5) adds to the
//! llama decoder of [`crate::llama`], following llama.cpp's
//! `llama_model_qwen2` graph:
//!
//! - biases on the Q, K and V projections (`blk.N.attn_{q,k,v}.bias`),
//!   added in f32 right after each projection, before RoPE;
//! - NEOX RoPE (first half / second half pairs, not adjacent pairs), base
//!   `qwen2.rope.freq_base` (1e6 in Qwen 2.5 files);
//! - an optional `output.bias` on the logits; the output projection is tied
//!   to the embedding when `output.weight` is absent (the small models).
//!
//! Everything else (RMSNorm, SwiGLU, GQA, scores × 1/√head_dim) is llama's.
//! llama.cpp treats the Q/K/V and attention-output biases as optional for
//! `llama` files too (`create_tensor_qkv`), so they are loaded whenever a
//! file has them; a `llama` or `gemma3` file without them runs exactly as
//! before.

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

/// Optional bias vectors of one block.
#[derive(Debug, Clone, Default)]
pub struct BlockBiases {
    /// `[q_dim + 2 * kv_dim]`, laid out like the fused q/k/v rows; zeros for
    /// a part the file has no bias for (adding 0.0 changes no value).
    pub qkv: Option<Vec<f32>>,
    /// `[hidden]`, added to the attention output projection.
    pub attn_out: Option<Vec<f32>>,
}

fn bias(g: &GgufFile, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
    if g.tensor_info(name).is_err() {
        return Ok(None);
    }
    let v = g.tensor_f32(name)?;
    if v.len() != n {
        return Err(EngineError::Model {
            path: g.path.clone(),
            reason: format!("{name}: expected {n} values, got {}", v.len()),
        });
    }
    Ok(Some(v))
}

impl BlockBiases {
    /// The biases of block `i` (q: `qd` rows, k and v: `kvd` each).
    pub fn load(g: &GgufFile, i: usize, qd: usize, kvd: usize, hidden: usize) -> Result<Self> {
        let p = |s: &str| format!("blk.{i}.{s}.bias");
        let parts =
            [bias(g, &p("attn_q"), qd)?, bias(g, &p("attn_k"), kvd)?, bias(g, &p("attn_v"), kvd)?];
        let qkv = parts.iter().any(Option::is_some).then(|| {
            let mut v = Vec::with_capacity(qd + 2 * kvd);
            for (part, n) in parts.iter().zip([qd, kvd, kvd]) {
                match part {
                    Some(b) => v.extend_from_slice(b),
                    None => v.resize(v.len() + n, 0.0),
                }
            }
            v
        });
        Ok(Self { qkv, attn_out: bias(g, &p("attn_output"), hidden)? })
    }
}

/// The logits' bias (`output.bias`, `[vocab]`), if the file has one.
pub fn output_bias(g: &GgufFile, vocab: usize) -> Result<Option<Vec<f32>>> {
    bias(g, "output.bias", vocab)
}

/// `x[r] += b` for every row of `x` (`ggml_add` with a broadcast row).
pub fn add_rows(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        row.iter_mut().zip(b).for_each(|(v, &b)| *v += b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bias_is_added_to_every_row() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        add_rows(&mut x, &[0.5, -1.0, 0.0]);
        assert_eq!(x, [1.5, 1.0, 3.0, 4.5, 4.0, 6.0]);
    }
}
