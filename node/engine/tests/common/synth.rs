//! Small synthetic GGUF chat models for the model matrix (tests/matrix.rs):
//! every supported architecture × weight type, a few layers of small
//! dimensions, random weights from a seed, and a tiny SentencePiece
//! vocabulary that llama.cpp loads. The same bytes are written by
//! `examples/matrix_gguf.rs` for `scripts/fixtures/matrix_reference.sh`,
//! which runs llama.cpp on them; the generator is our own SplitMix64, so the
//! files never change with a dependency's version.
//!
//! Weights are random *blocks*, not quantized floats: random quants and
//! scale bytes with f16 scales chosen so each matrix has about the wanted
//! spread. No quantizer of ours is involved; the values are what the blocks
//! decode to, for llama.cpp and for the engine alike.
#![allow(dead_code)]

use half::{bf16, f16};

/// Hidden size (a multiple of 256 so every K-quant fits).
pub const HIDDEN: usize = 256;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 64;
pub const FFN: usize = 512;
pub const CONTEXT: usize = 256;
/// gemma3's sliding window, small enough that a short test crosses it.
pub const WINDOW: usize = 8;

/// The weight formats of the matrix: a ggml type for every 2-D tensor, or
/// `Mixed` (a Q4_K_M-like mix, so a fused q/k/v and gate/up have parts of
/// different types).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q4_K,
    Q5_K,
    Q6_K,
    Mixed,
}

pub const WTYPES: [WType; 11] = [
    WType::F32,
    WType::F16,
    WType::BF16,
    WType::Q8_0,
    WType::Q4_0,
    WType::Q4_1,
    WType::Q5_0,
    WType::Q4_K,
    WType::Q5_K,
    WType::Q6_K,
    WType::Mixed,
];

pub const ARCHS: [&str; 3] = ["llama", "qwen2", "gemma3"];

impl WType {
    pub fn name(self) -> &'static str {
        match self {
            WType::F32 => "f32",
            WType::F16 => "f16",
            WType::BF16 => "bf16",
            WType::Q8_0 => "q8_0",
            WType::Q4_0 => "q4_0",
            WType::Q4_1 => "q4_1",
            WType::Q5_0 => "q5_0",
            WType::Q4_K => "q4_k",
            WType::Q5_K => "q5_k",
            WType::Q6_K => "q6_k",
            WType::Mixed => "mixed",
        }
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            WType::F32 => 0,
            WType::F16 => 1,
            WType::BF16 => 32,
            WType::Q8_0 => 7,
            WType::Q4_0 => 2,
            WType::Q4_1 => 3,
            WType::Q5_0 => 8,
            WType::Q4_K => 14,
            WType::Q5_K => 16,
            WType::Q6_K => 18,
            WType::Mixed => 15,
        }
    }

    /// The ggml type id of tensor `name` in a file of this format.
    fn ggml_type(self, name: &str) -> u32 {
        let one = |t: WType| match t {
            WType::F32 => 0,
            WType::F16 => 1,
            WType::BF16 => 30,
            WType::Q8_0 => 8,
            WType::Q4_0 => 2,
            WType::Q4_1 => 3,
            WType::Q5_0 => 6,
            WType::Q4_K => 12,
            WType::Q5_K => 13,
            WType::Q6_K => 14,
            WType::Mixed => unreachable!(),
        };
        if self != WType::Mixed {
            return one(self);
        }
        let part = name.split('.').rev().nth(1).unwrap_or(name);
        one(match part {
            "token_embd" => WType::Q8_0,
            "output" | "attn_v" | "ffn_down" => WType::Q6_K,
            "attn_output" => WType::Q5_0,
            "ffn_up" => WType::Q5_K,
            _ => WType::Q4_K,
        })
    }
}

/// SplitMix64: small, fixed, and the same everywhere.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly normal, mean 0, standard deviation 1 (Irwin–Hall of 4).
    pub fn gauss(&mut self) -> f32 {
        ((0..4).map(|_| self.unit()).sum::<f32>() - 2.0) * 3f32.sqrt()
    }
    fn bytes(&mut self, out: &mut [u8]) {
        out.iter_mut().for_each(|b| *b = self.next_u64() as u8);
    }
}

/// One random tensor of ggml type `ty` with `n` elements of spread ~`std`.
fn tensor_bytes(rng: &mut Rng, ty: u32, n: usize, std: f32) -> Vec<u8> {
    let mut out = Vec::new();
    let put_f16 = |b: &mut [u8], v: f32| b.copy_from_slice(&f16::from_f32(v).to_le_bytes());
    // (block elements, block bytes, offsets of f16 scale fields, scale of
    // the quants' spread, f16 min field offset and its centring factor)
    let layout: (usize, usize, usize, f32, Option<(usize, f32)>) = match ty {
        0 | 1 | 30 => {
            for _ in 0..n {
                let v = std * rng.gauss();
                match ty {
                    0 => out.extend_from_slice(&v.to_le_bytes()),
                    1 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
                    _ => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
                }
            }
            return out;
        }
        8 => (32, 34, 0, 73.3, None),
        2 => (32, 18, 0, 4.6, None),
        3 => (32, 20, 0, 4.6, Some((2, -7.5))),
        6 => (32, 22, 0, 9.2, None),
        12 => (256, 144, 0, 200.0, Some((2, 7.5))),
        13 => (256, 176, 0, 400.0, Some((2, 15.5))),
        14 => (256, 210, 208, 1370.0, None),
        other => panic!("no random blocks for ggml type {other}"),
    };
    let (per, bytes, d_at, spread, min) = layout;
    assert_eq!(n % per, 0, "{n} elements in blocks of {per}");
    for _ in 0..n / per {
        let mut blk = vec![0u8; bytes];
        rng.bytes(&mut blk);
        let d = std / spread * (0.75 + 0.5 * rng.unit());
        put_f16(&mut blk[d_at..d_at + 2], d);
        if let Some((at, centre)) = min {
            // Q4_1's m is an offset (w = d·q + m); the K-quants' dmin a
            // scale of the 6-bit mins (w = d·sc·q − dmin·m).
            let f16_d = f16::from_f32(d).to_f32();
            put_f16(&mut blk[at..at + 2], centre * f16_d * (1.0 + 0.1 * rng.gauss()));
        }
        out.extend_from_slice(&blk);
    }
    out
}

/// The tiny SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte
/// tokens, the letters and `▁`, and pieces that merge into a few words.
pub fn vocab() -> Vec<(String, f32, i32)> {
    let mut v =
        vec![("<unk>".to_string(), 0.0, 2), ("<s>".into(), 0.0, 3), ("</s>".into(), 0.0, 3)];
    for b in 0..=255u8 {
        v.push((format!("<0x{b:02X}>"), 0.0, 6));
    }
    let pieces = [
        "▁t",
        "he",
        "in",
        "er",
        "an",
        "on",
        "re",
        "at",
        "▁a",
        "▁th",
        "▁the",
        "▁m",
        "od",
        "el",
        "▁mod",
        "▁model",
        "▁s",
        "ma",
        "tr",
        "ix",
        "▁ma",
        "▁mat",
        "▁matr",
        "▁matrix",
        "es",
        "st",
        "▁te",
        "▁tes",
        "▁test",
        "or",
        "en",
        "▁o",
        "▁of",
        "▁is",
    ];
    for (i, p) in pieces.iter().enumerate() {
        v.push((p.to_string(), -(i as f32) - 1.0, 1));
    }
    for (i, c) in "▁abcdefghijklmnopqrstuvwxyz".chars().enumerate() {
        v.push((c.to_string(), -100.0 - i as f32, 1));
    }
    v
}

/// The prompt both sides tokenize (`<s>` is parsed as the BOS token).
pub const PROMPT: &str = "<s>the model of the matrix is a test of the model";

enum Val {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn put_val(b: &mut Vec<u8>, v: &Val) {
    let arr = |b: &mut Vec<u8>, ty: u32, n: usize| {
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&(n as u64).to_le_bytes());
    };
    match v {
        Val::U32(x) => {
            b.extend_from_slice(&4u32.to_le_bytes());
            b.extend_from_slice(&x.to_le_bytes());
        }
        Val::F32(x) => {
            b.extend_from_slice(&6u32.to_le_bytes());
            b.extend_from_slice(&x.to_le_bytes());
        }
        Val::Bool(x) => {
            b.extend_from_slice(&7u32.to_le_bytes());
            b.push(*x as u8);
        }
        Val::Str(s) => {
            b.extend_from_slice(&8u32.to_le_bytes());
            put_str(b, s);
        }
        Val::Strs(v) => {
            arr(b, 8, v.len());
            v.iter().for_each(|s| put_str(b, s));
        }
        Val::F32s(v) => {
            arr(b, 6, v.len());
            v.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        }
        Val::I32s(v) => {
            arr(b, 5, v.len());
            v.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        }
    }
}

/// Layers of each architecture: gemma3 gets one full period of 6 (5 local
/// sliding-window layers, then a global one).
pub fn layers(arch: &str) -> usize {
    if arch == "gemma3" {
        6
    } else {
        2
    }
}

/// The seed of a combination (printed by the test), fixed per name.
pub fn seed(arch: &str, ty: WType) -> u64 {
    let name = format!("{arch}-{}", ty.name());
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The GGUF bytes of `arch` × `ty`.
pub fn gguf(arch: &str, ty: WType) -> Vec<u8> {
    gguf_retyped(arch, ty, None)
}

/// [`gguf`] with tensor `retype.0`'s header claiming ggml type id
/// `retype.1` (its data unchanged): a file with a type the engine lacks.
pub fn gguf_retyped(arch: &str, ty: WType, retype: Option<(&str, u32)>) -> Vec<u8> {
    let mut rng = Rng::new(seed(arch, ty));
    let vocab = vocab();
    let nv = vocab.len();
    let k = |s: &str| format!("{arch}.{s}");
    let mut kv: Vec<(String, Val)> = vec![
        ("general.architecture".into(), Val::Str(arch.into())),
        ("general.name".into(), Val::Str(format!("matrix-{arch}-{}", ty.name()))),
        ("general.file_type".into(), Val::U32(ty.file_type())),
        (k("context_length"), Val::U32(CONTEXT as u32)),
        (k("embedding_length"), Val::U32(HIDDEN as u32)),
        (k("block_count"), Val::U32(layers(arch) as u32)),
        (k("feed_forward_length"), Val::U32(FFN as u32)),
        (k("attention.head_count"), Val::U32(HEADS as u32)),
        (k("attention.head_count_kv"), Val::U32(KV_HEADS as u32)),
        (k("attention.layer_norm_rms_epsilon"), Val::F32(1e-6)),
        (k("rope.freq_base"), Val::F32(if arch == "llama" { 10000.0 } else { 1e6 })),
        ("tokenizer.ggml.model".into(), Val::Str("llama".into())),
        ("tokenizer.ggml.tokens".into(), Val::Strs(vocab.iter().map(|t| t.0.clone()).collect())),
        ("tokenizer.ggml.scores".into(), Val::F32s(vocab.iter().map(|t| t.1).collect())),
        ("tokenizer.ggml.token_type".into(), Val::I32s(vocab.iter().map(|t| t.2).collect())),
        ("tokenizer.ggml.bos_token_id".into(), Val::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Val::U32(2)),
        ("tokenizer.ggml.unknown_token_id".into(), Val::U32(0)),
        ("tokenizer.ggml.add_bos_token".into(), Val::Bool(true)),
        // Explicit: llama.cpp defaults to a space prefix for SPM files without
        // the key, which the engine's tokenizer does not do (Gemma sets false).
        ("tokenizer.ggml.add_space_prefix".into(), Val::Bool(false)),
    ];
    match arch {
        "llama" => kv.push((k("rope.dimension_count"), Val::U32(HEAD_DIM as u32))),
        "gemma3" => {
            kv.push((k("attention.key_length"), Val::U32(HEAD_DIM as u32)));
            kv.push((k("attention.value_length"), Val::U32(HEAD_DIM as u32)));
            kv.push((k("attention.sliding_window"), Val::U32(WINDOW as u32)));
            kv.push((k("rope.freq_base_swa"), Val::F32(10000.0)));
        }
        _ => {}
    }

    // (name, ggml type, dims in ggml order, bytes)
    let mut tensors: Vec<(String, u32, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut mat = |rng: &mut Rng, name: String, rows: usize, cols: usize, std: f32| {
        let t = ty.ggml_type(&name);
        tensors.push((name, t, vec![cols, rows], tensor_bytes(rng, t, rows * cols, std)));
    };
    let (qd, kvd) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    // Tied embeddings (qwen2, gemma3): a small embedding, so the residual
    // stream is not mostly the input token's own row (which would make
    // every step repeat it), and a larger output norm for a logit spread
    // of a few nats.
    let tied = arch != "llama";
    let embed_std = match arch {
        "llama" => 0.25,
        "gemma3" => 0.02, // × √hidden = 16 at the input
        _ => 0.06,
    };
    mat(&mut rng, "token_embd.weight".into(), nv, HIDDEN, embed_std);
    let mut vecs: Vec<(String, Vec<f32>)> = Vec::new();
    let mut norm = |rng: &mut Rng, name: String, n: usize, base: f32, std: f32| {
        vecs.push((name, (0..n).map(|_| base + std * rng.gauss()).collect()));
    };
    for i in 0..layers(arch) {
        let p = |s: &str| format!("blk.{i}.{s}.weight");
        norm(&mut rng, p("attn_norm"), HIDDEN, 1.0, 0.1);
        norm(&mut rng, p("ffn_norm"), HIDDEN, 1.0, 0.1);
        if arch == "gemma3" {
            norm(&mut rng, p("attn_q_norm"), HEAD_DIM, 1.0, 0.1);
            norm(&mut rng, p("attn_k_norm"), HEAD_DIM, 1.0, 0.1);
            norm(&mut rng, p("post_attention_norm"), HIDDEN, 1.0, 0.1);
            norm(&mut rng, p("post_ffw_norm"), HIDDEN, 1.0, 0.1);
        }
        if arch == "qwen2" {
            let b = |s: &str| format!("blk.{i}.{s}.bias");
            norm(&mut rng, b("attn_q"), qd, 0.0, 0.3);
            norm(&mut rng, b("attn_k"), kvd, 0.0, 0.3);
            norm(&mut rng, b("attn_v"), kvd, 0.0, 0.3);
        }
        mat(&mut rng, p("attn_q"), qd, HIDDEN, 0.1);
        mat(&mut rng, p("attn_k"), kvd, HIDDEN, 0.1);
        mat(&mut rng, p("attn_v"), kvd, HIDDEN, 0.1);
        mat(&mut rng, p("attn_output"), HIDDEN, qd, 0.06);
        mat(&mut rng, p("ffn_gate"), FFN, HIDDEN, 0.08);
        mat(&mut rng, p("ffn_up"), FFN, HIDDEN, 0.08);
        mat(&mut rng, p("ffn_down"), HIDDEN, FFN, 0.05);
    }
    let out_norm = if tied { 4.0 } else { 1.0 };
    norm(&mut rng, "output_norm.weight".into(), HIDDEN, out_norm, 0.1);
    match arch {
        // llama: a separate output matrix; qwen2: tied, with a logit bias;
        // gemma3: tied.
        "llama" => mat(&mut rng, "output.weight".into(), nv, HIDDEN, 0.25),
        "qwen2" => norm(&mut rng, "output.bias".into(), nv, 0.0, 0.5),
        _ => {}
    }
    for (name, v) in vecs {
        let n = v.len();
        tensors.push((name, 0, vec![n], v.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }

    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    b.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (key, v) in &kv {
        put_str(&mut b, key);
        put_val(&mut b, v);
    }
    let mut offset = 0usize;
    for (name, t, dims, data) in &tensors {
        put_str(&mut b, name);
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| b.extend_from_slice(&(*d as u64).to_le_bytes()));
        let t = match retype {
            Some((n, id)) if n == name => id,
            _ => *t,
        };
        b.extend_from_slice(&t.to_le_bytes());
        b.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += data.len().div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for (_, _, _, data) in &tensors {
        b.extend_from_slice(data);
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    b
}
