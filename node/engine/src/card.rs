//! What a GGUF chat file says about itself, for the worker that serves it
//! by path (`gcs-node --model PATH.gguf`): its name, architecture, weight
//! format, the context actually served and whether it can chat.

use crate::gguf::GgufFile;
use crate::llama::LlamaConfig;

/// The self-description of a loaded chat model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCard {
    /// `general.name`, if the file has one.
    pub name: Option<String>,
    /// `general.architecture` (`llama`, `qwen2` or `gemma3`).
    pub arch: String,
    /// The weight format as llama.cpp names its file types (`q4_k_m`),
    /// lowercased; from `general.file_type`, else the type of the first
    /// layer's Q projection.
    pub quantization: String,
    /// Context served: the file's, capped by the engine and the operator.
    pub context_tokens: usize,
    /// Vocabulary size of the weights.
    pub vocab: usize,
    /// Whether chat prompts can be rendered: the file has
    /// `tokenizer.chat_template`, or its architecture has a built-in one
    /// (gemma3). Without one the model serves completions only.
    pub chat: bool,
}

impl ModelCard {
    pub(crate) fn of(g: &GgufFile, config: &LlamaConfig, chat: bool) -> Self {
        let quantization = g
            .get("general.file_type")
            .and_then(|v| v.as_i64())
            .and_then(file_type_name)
            .map(str::to_owned)
            .or_else(|| {
                g.tensor_info("blk.0.attn_q.weight")
                    .ok()
                    .map(|t| format!("{:?}", t.ggml_type).to_lowercase())
            })
            .unwrap_or_else(|| "unknown".into());
        Self {
            name: g.get("general.name").and_then(|v| v.as_str()).map(str::to_owned),
            arch: config.arch.clone(),
            quantization,
            context_tokens: config.context_length,
            vocab: config.vocab,
            chat,
        }
    }
}

/// llama.cpp's `llama_ftype` names (`LLAMA_FTYPE_MOSTLY_*`), lowercased.
pub fn file_type_name(ftype: i64) -> Option<&'static str> {
    Some(match ftype {
        0 => "f32",
        1 => "f16",
        2 => "q4_0",
        3 => "q4_1",
        7 => "q8_0",
        8 => "q5_0",
        9 => "q5_1",
        10 => "q2_k",
        11 => "q3_k_s",
        12 => "q3_k_m",
        13 => "q3_k_l",
        14 => "q4_k_s",
        15 => "q4_k_m",
        16 => "q5_k_s",
        17 => "q5_k_m",
        18 => "q6_k",
        32 => "bf16",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_types_have_llama_cpp_names() {
        assert_eq!(file_type_name(3), Some("q4_1"));
        assert_eq!(file_type_name(15), Some("q4_k_m"));
        assert_eq!(file_type_name(18), Some("q6_k"));
        assert_eq!(file_type_name(4), None, "a retired ftype is not guessed");
    }
}
