//! What the `gemma3` architecture adds to the llama decoder of
//! [`crate::llama`], read from GGUF metadata (`gemma3.*`) and following
//! llama.cpp's `llama_model_gemma3` graph:
//!
//! - the token embedding is scaled by `sqrt(hidden)`;
//! - Q and K are RMS-normalised per head (`attn_q_norm`, `attn_k_norm`)
//!   before NEOX RoPE, and Q is then scaled by `1/sqrt(head_dim)` (the
//!   scores themselves by 1.0);
//! - the attention output and the FFN output are RMS-normalised again
//!   (`post_attention_norm`, `post_ffw_norm`) before their residual adds;
//! - the FFN is GeGLU with ggml's tanh GELU looked up through f16;
//! - layers alternate sliding-window (local) and global attention: layer
//!   `il` is local when `il % period < period - 1` (period 6 unless
//!   `gemma3.attention.sliding_window_pattern`), local layers use RoPE base
//!   `gemma3.rope.freq_base_swa` (10000 by default) and global layers
//!   `gemma3.rope.freq_base`;
//! - norm weights are used as stored: llama.cpp's converter already wrote
//!   Gemma's `1 + w` into the file (conversion/gemma.py, `Gemma3Model.norm_shift`);
//! - the output projection is tied to the embedding when `output.weight`
//!   is absent, and logits are soft-capped if `final_logit_softcapping` is set.

use half::f16;

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

/// The gemma3-only hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
    /// Keys a local layer's query sees (itself included).
    pub sliding_window: usize,
    /// Every `period`-th layer (the last of each period) is global.
    pub swa_period: usize,
    pub rope_base_local: f32,
    /// Multiplies Q after RoPE.
    pub attn_scale: f32,
    /// `logits = cap * tanh(logits / cap)` when set.
    pub final_softcap: Option<f32>,
}

impl Gemma3Config {
    pub fn from_gguf(g: &GgufFile, head_dim: usize) -> Result<Self> {
        let bad = |reason: String| EngineError::Model { path: g.path.clone(), reason };
        let window = g.get_u64("gemma3.attention.sliding_window").unwrap_or(0) as usize;
        let period = match g.get("gemma3.attention.sliding_window_pattern") {
            None => 6,
            Some(v) => v.as_i64().filter(|&p| p > 0).ok_or_else(|| {
                bad(format!("unsupported gemma3.attention.sliding_window_pattern {v:?}"))
            })? as usize,
        };
        let softcap = g.get_f32("gemma3.final_logit_softcapping").ok().filter(|&c| c != 0.0);
        Ok(Self {
            // 0: no sliding window at all (every layer global).
            sliding_window: if window == 0 { usize::MAX } else { window },
            swa_period: period,
            rope_base_local: g.get_f32("gemma3.rope.freq_base_swa").unwrap_or(10000.0),
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            final_softcap: softcap,
        })
    }

    /// Whether layer `il` attends through the sliding window.
    pub fn is_local(&self, il: usize) -> bool {
        self.sliding_window != usize::MAX && il % self.swa_period < self.swa_period - 1
    }
}

/// A gemma3 block's extra norm weights.
#[derive(Debug, Clone)]
pub struct Gemma3Norms {
    /// `[head_dim]`
    pub q_norm: Vec<f32>,
    /// `[head_dim]`
    pub k_norm: Vec<f32>,
    /// `[hidden]`
    pub post_attn: Vec<f32>,
    /// `[hidden]`
    pub post_ffn: Vec<f32>,
}

/// The Gemma 3 chat format (Google's template for the instruct models, for
/// string contents): a leading system message is prepended to the first
/// user turn, `assistant` is the `model` role, turns end with
/// `<end_of_turn>`.
pub const CHAT_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}
{%- else -%}{%- set role = message['role'] -%}{%- endif -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
{{- message['content'] | trim -}}
{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"#;

const GELU_COEF_A: f32 = 0.044715;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// ggml's `ggml_gelu_f32` (tanh approximation), as GCC contracts it.
fn gelu_f32(x: f32) -> f32 {
    let inner = (GELU_COEF_A * x).mul_add(x, 1.0);
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh())
}

/// ggml's `ggml_table_gelu_f16`: GELU of every f16, rounded to f16.
fn gelu_table() -> &'static [u16] {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|i| f16::from_f32(gelu_f32(f16::from_bits(i).to_f32())).to_bits())
            .collect()
    })
}

/// `act[r] = gelu(gate[r]) * up[r]` for rows laid out `[gate | up]`, as
/// ggml's `ggml_vec_geglu_f32` with `GGML_GELU_FP16`.
pub fn geglu_rows(gu: &[f32], act: &mut [f32], inter: usize) {
    let table = gelu_table();
    for (a, r) in act.chunks_exact_mut(inter).zip(gu.chunks_exact(2 * inter)) {
        let (g, u) = r.split_at(inter);
        for ((a, &x), &u) in a.iter_mut().zip(g).zip(u) {
            *a = if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x * u
            } else {
                f16::from_bits(table[f16::from_f32(x).to_bits() as usize]).to_f32() * u
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geglu_follows_the_f16_table() {
        let inter = 4;
        let gu = [-11.0, -1.0, 0.5, 12.0, 2.0, 3.0, 4.0, 0.5];
        let mut act = [0f32; 4];
        geglu_rows(&gu, &mut act, inter);
        assert_eq!(act[0], 0.0);
        assert_eq!(act[3], 6.0);
        // gelu(0.5) = 0.3457..., through f16.
        let want = f16::from_f32(gelu_f32(0.5)).to_f32() * 4.0;
        assert_eq!(act[2], want);
        assert!((act[2] / 4.0 - 0.345_714).abs() < 1e-3);
        assert!((act[1] / 3.0 + 0.158_808).abs() < 1e-3);
    }

    #[test]
    fn every_sixth_layer_is_global() {
        let c = Gemma3Config {
            sliding_window: 512,
            swa_period: 6,
            rope_base_local: 1e4,
            attn_scale: 0.0625,
            final_softcap: None,
        };
        let global: Vec<usize> = (0..18).filter(|&l| !c.is_local(l)).collect();
        assert_eq!(global, [5, 11, 17]);
        let all_global = Gemma3Config { sliding_window: usize::MAX, ..c };
        assert!((0..18).all(|l| !all_global.is_local(l)));
    }
}
