//! The model catalogue: every model a worker can serve, as data — its id,
//! aliases, the file that must be in the model cache, its context and what
//! it answers. Registrations advertise these entries; `gcs-node --model`
//! and `models list` read them; `jobs::engine_exec` loads the files.

use std::path::{Path, PathBuf};

use gcs_protocol::{ApiType, ModelInfo};

/// The burn backend the engine runs on (advertised in registrations).
pub const BACKEND: &str = "burn-flex";
/// The engine build registrations advertise (`models[].engine_build`): a
/// stream is continued only on a worker whose build matches. The engine
/// crate shares the workspace version; no git id is built in.
pub const ENGINE_BUILD: &str = concat!("gcs-engine ", env!("CARGO_PKG_VERSION"));

/// One model of the catalogue.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// Model id, also its directory in the model cache.
    pub model_id: &'static str,
    /// Other names a request may use.
    pub aliases: &'static [&'static str],
    /// The weights file inside the model's directory.
    pub file: &'static str,
    /// Context length in tokens.
    pub context_tokens: u32,
    /// Weight format.
    pub quantization: &'static str,
    /// What it answers.
    pub tasks: &'static [ApiType],
    /// Vocabulary size of the weights (checked against the file by
    /// node/tests/catalog_gguf.rs).
    pub vocab_size: u32,
    /// Served when a worker names no models and the file is in the cache.
    /// A worker runs one chat engine today, so only one chat model may be.
    pub by_default: bool,
}

/// Every model this build can serve.
pub const CATALOG: &[Entry] = &[
    Entry {
        model_id: "smollm2-135m-instruct",
        aliases: &["gnus-auto", "gnus-small"],
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        context_tokens: 8192,
        quantization: "q4_1",
        tasks: &[ApiType::ChatCompletion, ApiType::Completion],
        vocab_size: 49_152,
        by_default: true,
    },
    // google/gemma-3-270m (the pretrained model, not the -it one: the
    // packaged GGUF says so and has no chat template; the engine renders
    // the Gemma turn format for it). Served only when named (--model).
    Entry {
        model_id: "gemma-3-270m",
        aliases: &["gnus-medium"],
        file: "gemma-3-270m-q4_k_m.gguf",
        // The file declares 32768; the engine serves at most 8192 (its
        // RoPE tables are sized by the context).
        context_tokens: 8192,
        quantization: "q4_k_m",
        tasks: &[ApiType::ChatCompletion, ApiType::Completion],
        vocab_size: 262_144,
        by_default: false,
    },
    Entry {
        model_id: "all-minilm-l6-v2",
        aliases: &["gnus-embed"],
        file: "model.safetensors",
        context_tokens: 256,
        quantization: "f32",
        tasks: &[ApiType::Embedding],
        vocab_size: 30_522,
        by_default: true,
    },
];

/// A model asked for that this node cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// No catalogue entry has this id or alias.
    #[error("no model {0:?} in the catalogue (known: {known})", known = known())]
    Unknown(String),
    /// Known, but its file is not in the model cache.
    #[error("model {name:?} is not in the model cache {} (run scripts/fetch-models.sh)", dir.display())]
    NotFetched {
        /// The name asked for.
        name: String,
        /// The model cache.
        dir: PathBuf,
    },
    /// Its file could not be read to hash it.
    #[error("reading {}: {source}", path.display())]
    Read {
        /// The weights file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

fn known() -> String {
    CATALOG.iter().map(|e| e.model_id).collect::<Vec<_>>().join(", ")
}

impl Entry {
    /// Whether `name` is this model's id or one of its aliases.
    pub fn answers_to(&self, name: &str) -> bool {
        self.model_id == name || self.aliases.contains(&name)
    }

    /// The weights file in the model cache `dir`.
    pub fn path(&self, dir: &Path) -> PathBuf {
        dir.join(self.model_id).join(self.file)
    }

    /// What registrations advertise.
    pub fn info(&self) -> ModelInfo {
        ModelInfo {
            model_id: self.model_id.into(),
            aliases: self.aliases.iter().map(|a| a.to_string()).collect(),
            context_tokens: self.context_tokens,
            quantization: self.quantization.into(),
            backend: BACKEND.into(),
            tasks: self.tasks.to_vec(),
            vocab_size: self.vocab_size,
            engine_build: ENGINE_BUILD.into(),
            model_hash: String::new(),
        }
    }

    /// [`Entry::info`] of the file in `dir`, with its blake3 (hex) as the
    /// `model_hash` a continuation is matched on.
    pub fn hosted_info(&self, dir: &Path) -> Result<ModelInfo, CatalogError> {
        let path = self.path(dir);
        let read = |source| CatalogError::Read { path: path.clone(), source };
        let mut file = std::fs::File::open(&path).map_err(read)?;
        let mut h = blake3::Hasher::new();
        std::io::copy(&mut file, &mut h).map_err(read)?;
        Ok(ModelInfo { model_hash: h.finalize().to_hex().to_string(), ..self.info() })
    }
}

/// The catalogue entry of a model id.
pub fn entry(model_id: &str) -> Option<&'static Entry> {
    CATALOG.iter().find(|e| e.model_id == model_id)
}

/// The models a worker hosts from the model cache `dir`: the ones named
/// (by id or alias), or every one whose file is there.
pub fn available(dir: &Path, names: &[String]) -> Result<Vec<ModelInfo>, CatalogError> {
    if names.is_empty() {
        return CATALOG
            .iter()
            .filter(|e| e.by_default && e.path(dir).is_file())
            .map(|e| e.hosted_info(dir))
            .collect();
    }
    let mut out: Vec<ModelInfo> = vec![];
    for n in names {
        let e = CATALOG
            .iter()
            .find(|e| e.answers_to(n))
            .ok_or_else(|| CatalogError::Unknown(n.clone()))?;
        if !e.path(dir).is_file() {
            return Err(CatalogError::NotFetched { name: n.clone(), dir: dir.to_path_buf() });
        }
        if !out.iter().any(|m| m.model_id == e.model_id) {
            out.push(e.hosted_info(dir)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_to_fetched_entries_once() {
        let dir = tempfile::tempdir().unwrap();
        assert!(available(dir.path(), &[]).unwrap().is_empty(), "an empty cache serves nothing");
        let chat = &CATALOG[0];
        std::fs::create_dir_all(dir.path().join(chat.model_id)).unwrap();
        std::fs::write(chat.path(dir.path()), b"gguf").unwrap();
        let all = available(dir.path(), &[]).unwrap();
        assert_eq!(all.iter().map(|m| m.model_id.as_str()).collect::<Vec<_>>(), [chat.model_id]);
        let named = available(dir.path(), &["gnus-auto".into(), chat.model_id.into()]).unwrap();
        assert_eq!(named.len(), 1, "an id and its alias are one model");
        assert_eq!(named[0].backend, BACKEND);
        // Continuations are matched on these: this build, this file's blake3.
        assert_eq!(named[0].engine_build, ENGINE_BUILD);
        assert_eq!(named[0].model_hash, blake3::hash(b"gguf").to_hex().to_string());
        assert!(matches!(
            available(dir.path(), &["gnus-embed".into()]),
            Err(CatalogError::NotFetched { .. })
        ));
        assert!(matches!(available(dir.path(), &["gpt-9".into()]), Err(CatalogError::Unknown(_))));
        // A model served only when named: fetched, not picked by default.
        let gemma = entry("gemma-3-270m").unwrap();
        assert!(!gemma.by_default);
        std::fs::create_dir_all(dir.path().join(gemma.model_id)).unwrap();
        std::fs::write(gemma.path(dir.path()), b"gguf").unwrap();
        assert_eq!(available(dir.path(), &[]).unwrap().len(), 1);
        let named = available(dir.path(), &["gnus-medium".into()]).unwrap();
        assert_eq!(named[0].model_id, "gemma-3-270m");
        assert_eq!(named[0].quantization, "q4_k_m");
    }
}
