//! The model catalogue: every model a worker can serve, as data — its id,
//! aliases, the file that must be in the model cache, its context and what
//! it answers. Registrations advertise these entries; `gcs-node --model`
//! and `models list` read them; `jobs::engine_exec` loads the files.
//! Any other supported GGUF file is served by path (`--model PATH.gguf`):
//! [`wanted`] tells the two apart and [`load_chat`] describes such a file
//! from its own metadata.

use std::path::{Path, PathBuf};

use gcs_engine::{Engine, ModelCard};
use gcs_protocol::{ApiType, ModelInfo};

/// The burn backend the engine runs on (advertised in registrations).
pub const BACKEND: &str = "burn-flex";
/// The engine build registrations advertise (`models[].engine_build`): a
/// stream is continued only on a worker whose build matches. The engine
/// crate shares the workspace version, which does not change between
/// commits, so the build also names the engine's output revision
/// (`gcs_engine::output_revision!`, bumped whenever outputs change); no git
/// id is built in.
pub const ENGINE_BUILD: &str =
    concat!("gcs-engine ", env!("CARGO_PKG_VERSION"), "+out.", gcs_engine::output_revision!());

/// One model of the catalogue.
#[derive(Clone, Copy, Debug, PartialEq)]
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
    #[error("reading {}: {reason}", path.display())]
    Read {
        /// The weights file.
        path: PathBuf,
        /// Why (named `reason`, not `source`: the message already has
        /// it, and an error chain would print it twice).
        reason: std::io::Error,
    },
    /// The engine refused the file (its architecture, a tensor type, a
    /// malformed header: the engine's error names which).
    #[error("cannot serve {}: {reason}", path.display())]
    Load {
        /// The weights file.
        path: PathBuf,
        /// The engine's reason (it names the file itself).
        reason: gcs_engine::EngineError,
    },
    /// The engine cannot serve the model on the chosen device (`--gpu`: a
    /// weight type without a GPU kernel, an architecture, the device).
    #[error("cannot serve {model} on this device: {reason}")]
    Device {
        /// The model id.
        model: String,
        /// The backend's reason (names the type or part it lacks).
        reason: gcs_engine::backend::BackendError,
    },
    /// The command line names models inconsistently.
    #[error("{0}")]
    Usage(String),
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
            // Measured once the engine runs (`EngineExecutor::serve`).
            decode_tokens_per_s: 0.0,
        }
    }

    /// [`Entry::info`] of the file in `dir`, with its blake3 (hex) as the
    /// `model_hash` a continuation is matched on.
    pub fn hosted_info(&self, dir: &Path) -> Result<ModelInfo, CatalogError> {
        Ok(ModelInfo { model_hash: hash_file(&self.path(dir))?, ..self.info() })
    }
}

/// The catalogue entry of a model id.
pub fn entry(model_id: &str) -> Option<&'static Entry> {
    CATALOG.iter().find(|e| e.model_id == model_id)
}

/// The default catalogue models whose files the cache `dir` holds.
fn defaults(dir: &Path) -> impl Iterator<Item = &'static Entry> + '_ {
    CATALOG.iter().filter(move |e| e.by_default && e.path(dir).is_file())
}

/// The catalogue entry `name` (an id or alias) names, if its file is in
/// the cache `dir`.
fn fetched(dir: &Path, name: &str) -> Result<&'static Entry, CatalogError> {
    let e = CATALOG
        .iter()
        .find(|e| e.answers_to(name))
        .ok_or_else(|| CatalogError::Unknown(name.to_string()))?;
    if !e.path(dir).is_file() {
        return Err(CatalogError::NotFetched { name: name.to_string(), dir: dir.to_path_buf() });
    }
    Ok(e)
}

/// The models a worker hosts from the model cache `dir`: the ones named
/// (by id or alias), or every one whose file is there.
pub fn available(dir: &Path, names: &[String]) -> Result<Vec<ModelInfo>, CatalogError> {
    if names.is_empty() {
        return defaults(dir).map(|e| e.hosted_info(dir)).collect();
    }
    let mut out: Vec<ModelInfo> = vec![];
    for n in names {
        let e = fetched(dir, n)?;
        if !out.iter().any(|m| m.model_id == e.model_id) {
            out.push(e.hosted_info(dir)?);
        }
    }
    Ok(out)
}

/// One model the command line asks a worker to serve.
#[derive(Clone, Debug, PartialEq)]
pub enum Wanted {
    /// A catalogue model in the model cache.
    Catalog(&'static Entry),
    /// A GGUF file by path, with the id given by `--model-id`, if any.
    File {
        /// The file.
        path: PathBuf,
        /// Its id, else the one its metadata gives.
        id: Option<String>,
    },
}

/// Whether a `--model` value is a path rather than a catalogue name: it
/// ends in `.gguf` or contains a `/` (catalogue names have neither).
pub fn is_path(name: &str) -> bool {
    name.contains('/') || name.to_ascii_lowercase().ends_with(".gguf")
}

/// The models `names` (`--model`: catalogue ids, aliases or GGUF paths)
/// ask for; `ids` (`--model-id`) name the paths, paired in order. No
/// names: every default catalogue model the cache `dir` holds.
pub fn wanted(dir: &Path, names: &[String], ids: &[String]) -> Result<Vec<Wanted>, CatalogError> {
    let paths = names.iter().filter(|n| is_path(n)).count();
    if ids.len() > paths {
        return Err(CatalogError::Usage(format!(
            "{} --model-id for {paths} --model paths: each id names one path, in order",
            ids.len()
        )));
    }
    if names.is_empty() {
        return Ok(defaults(dir).map(Wanted::Catalog).collect());
    }
    let mut ids = ids.iter();
    let mut out: Vec<Wanted> = vec![];
    for n in names {
        let w = if is_path(n) {
            let path = PathBuf::from(n);
            if !path.is_file() {
                return Err(CatalogError::Read {
                    path,
                    reason: std::io::Error::from(std::io::ErrorKind::NotFound),
                });
            }
            Wanted::File { path, id: ids.next().cloned() }
        } else {
            Wanted::Catalog(fetched(dir, n)?)
        };
        if !out.contains(&w) {
            out.push(w);
        }
    }
    Ok(out)
}

/// A model id from a file's `general.name`: lowercase, runs of anything
/// but `[a-z0-9._-]` become one `-`, no `-` at either end, at most 128
/// bytes ("Gemma 3 270m" → `gemma-3-270m`).
pub fn normalise_id(name: &str) -> String {
    let mut id = String::new();
    for c in name.trim().chars().flat_map(char::to_lowercase) {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
            id.push(c);
        } else if !id.ends_with('-') {
            id.push('-');
        }
    }
    let mut id = id.trim_matches('-').to_string();
    id.truncate(gcs_protocol::validate::MAX_SHORT);
    id.trim_end_matches('-').to_string()
}

/// The blake3 (hex) of a model file: the `model_hash` continuations match.
pub fn hash_file(path: &Path) -> Result<String, CatalogError> {
    let read = |reason| CatalogError::Read { path: path.to_path_buf(), reason };
    let mut file = std::fs::File::open(path).map_err(read)?;
    let mut h = blake3::Hasher::new();
    std::io::copy(&mut file, &mut h).map_err(read)?;
    Ok(h.finalize().to_hex().to_string())
}

/// What registrations advertise for a file served by path: its id
/// (`id`, else its normalised `general.name`, else its file name), the
/// catalogue's aliases when that id is a catalogue model, its real format,
/// served context and vocabulary; chat only when it has a chat template.
pub fn file_info(
    card: &ModelCard,
    path: &Path,
    id: Option<&str>,
) -> Result<ModelInfo, CatalogError> {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let model_id = match id {
        Some(id) => id.to_string(),
        None => normalise_id(
            card.name.as_deref().filter(|n| !normalise_id(n).is_empty()).unwrap_or(&stem),
        ),
    };
    if model_id.is_empty()
        || model_id.len() > gcs_protocol::validate::MAX_SHORT
        || model_id.chars().any(|c| c.is_control() || c == ' ')
    {
        return Err(CatalogError::Usage(format!(
            "{}: no usable model id ({model_id:?}); give one with --model-id",
            path.display()
        )));
    }
    let tasks = if card.chat {
        vec![ApiType::ChatCompletion, ApiType::Completion]
    } else {
        vec![ApiType::Completion]
    };
    Ok(ModelInfo {
        aliases: entry(&model_id)
            .map(|e| e.aliases.iter().map(|a| a.to_string()).collect())
            .unwrap_or_default(),
        model_id,
        context_tokens: u32::try_from(card.context_tokens).unwrap_or(u32::MAX),
        quantization: card.quantization.clone(),
        backend: BACKEND.into(),
        tasks,
        vocab_size: u32::try_from(card.vocab).unwrap_or(0),
        engine_build: ENGINE_BUILD.into(),
        model_hash: hash_file(path)?,
        decode_tokens_per_s: 0.0,
    })
}

/// Loads the chat model `w` (a catalogue entry from the cache `dir`, or a
/// file) serving at most `max_context` positions, with what registrations
/// advertise for it. `None` for an embedding model (not a GGUF).
pub fn load_chat(
    w: &Wanted,
    dir: &Path,
    max_context: Option<u32>,
) -> Result<Option<(ModelInfo, Engine)>, CatalogError> {
    let (path, id) = match w {
        Wanted::Catalog(e) if e.tasks.contains(&ApiType::Embedding) => return Ok(None),
        Wanted::Catalog(e) => (e.path(dir), None),
        Wanted::File { path, id } => (path.clone(), id.as_deref()),
    };
    let device = gcs_engine::cpu_device();
    let cap = max_context.map(|c| c as usize);
    let engine = Engine::load_capped(&path, &device, cap)
        .map_err(|reason| CatalogError::Load { path: path.clone(), reason })?;
    let info = match w {
        Wanted::Catalog(e) => {
            let mut info = e.hosted_info(dir)?;
            info.context_tokens = info.context_tokens.min(engine.card.context_tokens as u32);
            info
        }
        Wanted::File { .. } => file_info(&engine.card, &path, id)?,
    };
    Ok(Some((info, engine)))
}

/// The KV budget a worker's chat models share, in bytes: 1024 blocks of 16
/// positions of SmolLM2-135M (the engine's single-model default).
pub const DEFAULT_KV_BYTES: u64 = 1024 * 16 * 23_040;

/// How the KV budget is shared: each chat model gets an equal share of
/// the bytes, as 16-position blocks of its own size (`per_token`: bytes
/// one position takes), at least one block each.
pub fn kv_blocks(budget_bytes: u64, per_token: &[usize]) -> Vec<usize> {
    let share = budget_bytes / per_token.len().max(1) as u64;
    per_token.iter().map(|&b| (share / (16 * b.max(1) as u64)).max(1) as usize).collect()
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

#[cfg(test)]
mod file_tests {
    use super::*;

    fn card(name: Option<&str>, chat: bool) -> ModelCard {
        ModelCard {
            name: name.map(str::to_owned),
            arch: "llama".into(),
            quantization: "q6_k".into(),
            context_tokens: 4096,
            vocab: 32_000,
            chat,
        }
    }

    #[test]
    fn ids_come_from_general_name_normalised() {
        assert_eq!(normalise_id("Gemma 3 270m"), "gemma-3-270m");
        assert_eq!(normalise_id("  Llama 3.2 1B Instruct  "), "llama-3.2-1b-instruct");
        assert_eq!(normalise_id("Qwen2.5 / Coder (7B)"), "qwen2.5-coder-7b");
        assert_eq!(normalise_id("---"), "");
        assert_eq!(normalise_id(&"x".repeat(300)).len(), 128);
    }

    #[test]
    fn paths_and_catalogue_names_are_told_apart() {
        assert!(is_path("/models/x.gguf") && is_path("x.GGUF") && is_path("./m"));
        assert!(!is_path("gnus-medium") && !is_path("smollm2-135m-instruct"));
    }

    #[test]
    fn model_ids_pair_with_paths_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"));
        std::fs::write(&a, b"gguf").unwrap();
        std::fs::write(&b, b"gguf").unwrap();
        let chat = &CATALOG[0];
        std::fs::create_dir_all(dir.path().join(chat.model_id)).unwrap();
        std::fs::write(chat.path(dir.path()), b"gguf").unwrap();
        let names = [a.display().to_string(), "gnus-small".into(), b.display().to_string()];
        let w = wanted(dir.path(), &names, &["first".into()]).unwrap();
        assert_eq!(
            w,
            [
                Wanted::File { path: a.clone(), id: Some("first".into()) },
                Wanted::Catalog(chat),
                Wanted::File { path: b.clone(), id: None },
            ]
        );
        let too_many = wanted(dir.path(), &names[..1], &["x".into(), "y".into()]);
        assert!(matches!(too_many, Err(CatalogError::Usage(_))), "{too_many:?}");
        let missing = wanted(dir.path(), &["/nonexistent/m.gguf".into()], &[]);
        assert!(matches!(missing, Err(CatalogError::Read { .. })), "{missing:?}");
        // No names: the default catalogue models in the cache, as before.
        assert_eq!(wanted(dir.path(), &[], &[]).unwrap(), [Wanted::Catalog(chat)]);
    }

    #[test]
    fn a_file_is_advertised_from_its_own_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("my-model.Q6_K.gguf");
        std::fs::write(&path, b"weights").unwrap();
        let info = file_info(&card(Some("My Model 1B"), true), &path, None).unwrap();
        assert_eq!(info.model_id, "my-model-1b");
        assert!(info.aliases.is_empty());
        assert_eq!((info.context_tokens, info.vocab_size), (4096, 32_000));
        assert_eq!(info.quantization, "q6_k");
        assert_eq!(info.tasks, [ApiType::ChatCompletion, ApiType::Completion]);
        assert_eq!(info.model_hash, blake3::hash(b"weights").to_hex().to_string());
        assert_eq!(info.engine_build, ENGINE_BUILD);
        // No template: completions only. No name: the file's name.
        let info = file_info(&card(None, false), &path, None).unwrap();
        assert_eq!(info.model_id, "my-model.q6_k");
        assert_eq!(info.tasks, [ApiType::Completion]);
        // --model-id wins; a catalogue id brings the catalogue's aliases.
        let info = file_info(&card(Some("x"), true), &path, Some("gemma-3-270m")).unwrap();
        assert_eq!(
            (info.model_id.as_str(), info.aliases.as_slice()),
            ("gemma-3-270m", &["gnus-medium".to_string()][..])
        );
        assert!(matches!(
            file_info(&card(None, true), &path, Some("a b")),
            Err(CatalogError::Usage(_))
        ));
    }

    #[test]
    fn the_kv_budget_is_shared_in_equal_bytes() {
        // SmolLM2-135M: 30 layers x 3 KV heads x 64 x f16 K and V.
        let smol = 2 * 2 * 30 * 3 * 64;
        // Gemma 3 270M: 18 layers x 1 KV head x 256.
        let gemma = 2 * 2 * 18 * 256;
        assert_eq!(kv_blocks(DEFAULT_KV_BYTES, &[smol]), [1024], "one model: the old default");
        let two = kv_blocks(DEFAULT_KV_BYTES, &[smol, gemma]);
        assert_eq!(two, [512, 640]);
        let bytes: Vec<u64> =
            two.iter().zip([smol, gemma]).map(|(n, b)| (n * 16 * b) as u64).collect();
        assert!(bytes.iter().sum::<u64>() <= DEFAULT_KV_BYTES);
        assert_eq!(kv_blocks(1, &[smol, gemma]), [1, 1], "at least one block each");
    }
}
