//! Tokenizer and chat template built from a GGUF file's own metadata.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

/// One chat message, OpenAI style.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// The tokenizer model of the file: byte-level BPE (`gpt2`) or
/// SentencePiece-style (`llama`, [`crate::spm`]).
enum Model {
    Bpe {
        inner: Box<Tokenizer>,
        /// Same tokenizer without the special tokens, for text that must not
        /// have them parsed (llama.cpp's parse_special = false).
        plain: Box<Tokenizer>,
    },
    Spm(crate::spm::Spm),
}

impl Model {
    fn token_to_id(&self, t: &str) -> Option<u32> {
        match self {
            Model::Bpe { inner, .. } => inner.token_to_id(t),
            Model::Spm(s) => s.token_to_id(t),
        }
    }
    fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            Model::Bpe { inner, .. } => inner.id_to_token(id),
            Model::Spm(s) => s.id_to_token(id).map(str::to_owned),
        }
    }
}

/// Tokenizer plus chat template, as llama.cpp would use them.
pub struct GgufTokenizer {
    inner: Model,
    /// Raw bytes each token stands for (empty for control tokens), so that
    /// streaming can emit text without splitting UTF-8 characters.
    token_bytes: Vec<Vec<u8>>,
    is_control: Vec<bool>,
    pub bos_id: Option<u32>,
    pub eos_id: u32,
    pub add_bos: bool,
    /// Token ids that end generation (EOS and the chat turn terminator).
    pub stop_ids: Vec<u32>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for GgufTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufTokenizer")
            .field("vocab", &self.token_bytes.len())
            .field("eos_id", &self.eos_id)
            .field("stop_ids", &self.stop_ids)
            .finish()
    }
}

/// GPT-2's reversible byte <-> printable-char mapping.
#[allow(clippy::expect_used)] // the expect guards an invariant of the code right here
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut bs: Vec<u32> =
        (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter().zip(cs).map(|(b, c)| (char::from_u32(c).expect("valid char"), b as u8)).collect()
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

impl GgufTokenizer {
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" && model != "llama" {
            return Err(tok_err(format!(
                "unsupported tokenizer model {model:?} (byte-level BPE \"gpt2\" or SentencePiece \"llama\")"
            )));
        }
        let tokens: Vec<String> = g
            .get_array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| tok_err("non-string token")))
            .collect::<Result<_>>()?;
        let types: Vec<i64> = match g.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
            Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(tok_err("tokenizer.ggml.token_type and tokens differ in length"));
        }
        if model == "llama" {
            return Self::spm(g, tokens, types);
        }
        let merges: Vec<(String, String)> = g
            .get_array("tokenizer.ggml.merges")?
            .iter()
            .map(|v| {
                let s = v.as_str().ok_or_else(|| tok_err("non-string merge"))?;
                let (a, b) =
                    s.split_once(' ').ok_or_else(|| tok_err(format!("bad merge {s:?}")))?;
                Ok((a.to_owned(), b.to_owned()))
            })
            .collect::<Result<_>>()?;
        let pre = g.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");

        let vocab: tokenizers::models::bpe::Vocab =
            tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut inner = Tokenizer::new(bpe);
        // llama.cpp's pre-tokenizer regexes: the "smollm"/"starcoder"/"refact"
        // family split every digit on its own before the GPT-2 regex; plain
        // "gpt2"/"default" do not.
        let byte_level: PreTokenizerWrapper = ByteLevel::new(false, true, true).into();
        let pretok = match pre {
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
                Digits::new(true).into(),
                byte_level,
            ])),
            "gpt2" | "default" => byte_level,
            other => {
                tracing::warn!(pre = other, "unknown tokenizer.ggml.pre; using GPT-2 regex");
                byte_level
            }
        };
        inner.with_pre_tokenizer(Some(pretok));
        inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));

        // Control (3) and user-defined (4) tokens are matched verbatim in the
        // text, like llama.cpp does with parse_special = true.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        let plain = Box::new(inner.clone());
        inner.add_special_tokens(&specials);
        let inner = Model::Bpe { inner: Box::new(inner), plain };

        let u2b = unicode_to_byte();
        let is_control: Vec<bool> = types.iter().map(|&t| t == 3).collect();
        let token_bytes = tokens
            .iter()
            .zip(&is_control)
            .map(|(t, &ctl)| {
                if ctl {
                    Vec::new()
                } else {
                    // User-defined tokens are literal text; normal tokens use
                    // the byte-level alphabet.
                    t.chars()
                        .flat_map(|c| match u2b.get(&c) {
                            Some(&b) => vec![b],
                            None => c.to_string().into_bytes(),
                        })
                        .collect()
                }
            })
            .collect();

        Self::finish(g, inner, token_bytes, is_control, tokens.len(), pre)
    }

    /// A SentencePiece-style vocabulary (`tokenizer.ggml.model = "llama"`).
    fn spm(g: &GgufFile, tokens: Vec<String>, types: Vec<i64>) -> Result<Self> {
        let scores: Vec<f32> = match g.get("tokenizer.ggml.scores").and_then(|v| v.as_array()) {
            Some(a) => a.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
            None => vec![0.0; tokens.len()],
        };
        if scores.len() != tokens.len() {
            return Err(tok_err("tokenizer.ggml.scores and tokens differ in length"));
        }
        let n = tokens.len();
        let is_control: Vec<bool> = types.iter().map(|&t| t == 3).collect();
        // llama.cpp: SPM vocabularies prefix a space unless the file says not to.
        let space_prefix = !matches!(
            g.get("tokenizer.ggml.add_space_prefix"),
            Some(crate::gguf::Value::Bool(false))
        );
        let spm = crate::spm::Spm::new(tokens, scores, types).with_space_prefix(space_prefix);
        let token_bytes = (0..n as u32).map(|i| spm.piece(i)).collect();
        Self::finish(g, Model::Spm(spm), token_bytes, is_control, n, "spm")
    }

    /// Special ids, stop ids and the chat template, common to both models.
    fn finish(
        g: &GgufFile,
        inner: Model,
        token_bytes: Vec<Vec<u8>>,
        is_control: Vec<bool>,
        n_tokens: usize,
        pre: &str,
    ) -> Result<Self> {
        let eos_id = g.get_u64("tokenizer.ggml.eos_token_id")? as u32;
        let bos_id = g.get_u64("tokenizer.ggml.bos_token_id").ok().map(|v| v as u32);
        let add_bos =
            matches!(g.get("tokenizer.ggml.add_bos_token"), Some(crate::gguf::Value::Bool(true)));
        let mut stop_ids = vec![eos_id];
        for name in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"] {
            if let Some(id) = inner.token_to_id(name) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        if let Some(id) = g.get("tokenizer.ggml.eot_token_id").and_then(|v| v.as_i64()) {
            if !stop_ids.contains(&(id as u32)) {
                stop_ids.push(id as u32);
            }
        }
        let mut chat_template =
            g.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_owned);
        if chat_template.is_none() && g.get_str("general.architecture").ok() == Some("gemma3") {
            // Base Gemma files carry no template; the Gemma turn format is
            // what their vocabulary's turn tokens are for.
            chat_template = Some(crate::gemma3::CHAT_TEMPLATE.to_owned());
        }
        tracing::debug!(vocab = n_tokens, pre, eos_id, ?stop_ids, "built tokenizer from gguf");
        Ok(Self {
            inner,
            token_bytes,
            is_control,
            bos_id,
            eos_id,
            add_bos,
            stop_ids,
            chat_template,
        })
    }

    /// Whether chat prompts can be rendered (the file's template or the
    /// architecture's built-in one).
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Tokenize text, parsing special tokens, adding BOS if the model wants it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true, self.add_bos)
    }

    /// Tokenize with explicit llama.cpp-style flags.
    pub fn encode_with(&self, text: &str, parse_special: bool, add_bos: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if add_bos {
            if let Some(b) = self.bos_id {
                ids.push(b);
            }
        }
        match &self.inner {
            Model::Bpe { inner, plain } => {
                let tk = if parse_special { inner } else { plain };
                ids.extend_from_slice(tk.encode(text, false).map_err(tok_err)?.get_ids());
            }
            Model::Spm(s) => ids.extend(s.encode(text, parse_special)),
        }
        Ok(ids)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The bytes a token contributes to the output text (control tokens: none).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map(Vec::as_slice).unwrap_or(&[])
    }

    /// A token's own text in the vocabulary (e.g. `<|im_end|>` for a control token).
    pub fn token_name(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn is_control(&self, id: u32) -> bool {
        self.is_control.get(id as usize).copied().unwrap_or(false)
    }

    /// Decode ids to text, dropping control tokens.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> =
            ids.iter().flat_map(|&i| self.token_bytes(i).iter().copied()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Decode ids to text; with `special`, control tokens are rendered as
    /// their literal text (like llama.cpp's detokenize(special = true)).
    pub fn decode_with(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::new();
        for &i in ids {
            if special && self.is_control(i) {
                if let Some(t) = self.inner.id_to_token(i) {
                    bytes.extend_from_slice(t.as_bytes());
                }
            } else {
                bytes.extend_from_slice(self.token_bytes(i));
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The prompt tokens of a chat: the chat template rendered with the
    /// generation prompt, then tokenized.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, true)?;
        // A template that writes the BOS itself (Gemma's) gets no second one.
        let bos_text = self.bos_id.and_then(|b| self.inner.id_to_token(b));
        let has_bos = bos_text.is_some_and(|b| !b.is_empty() && text.starts_with(&b));
        self.encode_with(&text, true, self.add_bos && !has_bos)
    }

    /// Render the GGUF's own chat template (`tokenizer.chat_template`).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
        })
    }

    /// Whether the chat template renders a `tools` variable itself (Qwen
    /// 2.5's, Llama 3.1's do; SmolLM2's does not, and a caller then puts
    /// the tools into the messages it passes).
    pub fn template_renders_tools(&self) -> bool {
        self.chat_template.as_deref().is_some_and(|t| t.contains("tools"))
    }

    /// Render the chat template over OpenAI-shaped messages (any fields:
    /// `tool_calls`, `tool_call_id`) with the request's `tools`, as
    /// `transformers`' `apply_chat_template(messages, tools=…)` does.
    pub fn render_chat(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
        })
    }

    fn render(&self, ctx: minijinja::Value) -> Result<String> {
        let tpl = self
            .chat_template
            .as_deref()
            .ok_or_else(|| EngineError::Template("model has no tokenizer.chat_template".into()))?;
        let mut env = minijinja::Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template("chat", tpl).map_err(|e| EngineError::Template(e.to_string()))?;
        let t = env.get_template("chat").map_err(|e| EngineError::Template(e.to_string()))?;
        let bos =
            self.bos_id.map(|i| self.inner.id_to_token(i).unwrap_or_default()).unwrap_or_default();
        let eos = self.inner.id_to_token(self.eos_id).unwrap_or_default();
        t.render(minijinja::context! {
            bos_token => bos,
            eos_token => eos,
            ..ctx
        })
        .map_err(|e| EngineError::Template(e.to_string()))
    }
}

/// Turns a stream of token bytes into text deltas that never split a UTF-8
/// character: incomplete trailing bytes are held back until completed.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) => match e.error_len() {
                // Invalid sequence (not just incomplete): emit it lossily so
                // the stream cannot stall forever.
                Some(_) => self.pending.len(),
                None => e.valid_up_to(),
            },
        };
        let rest = self.pending.split_off(valid);
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending = rest;
        out
    }

    /// Flush whatever is left at the end of generation.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_stream_holds_partial_chars() {
        let mut s = Utf8Stream::default();
        let bytes = "é😀".as_bytes();
        let mut out = String::new();
        for b in bytes {
            out.push_str(&s.push(&[*b]));
        }
        out.push_str(&s.finish());
        assert_eq!(out, "é😀");
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(&bytes[..1]), "");
        assert_eq!(s.push(&bytes[1..3]), "é");
    }
}
