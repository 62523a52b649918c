//! llama.cpp prefixes a space to SentencePiece text (at the start and after
//! every special token) unless the GGUF sets
//! `tokenizer.ggml.add_space_prefix = false`; a file without the key gets
//! the prefix. Compared with llama.cpp's own tokenization of Gemma 3's
//! vocabulary, with the key removed and as stored (fixture
//! `spm_prefix_llamacpp.json`, scripts/fixtures/spm_prefix_reference.sh).

mod common;
#[path = "common/vocab_gguf.rs"]
mod vocab_gguf;

use gcs_engine::gguf::GgufFile;
use gcs_engine::tokenizer::GgufTokenizer;
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Every case of one fixture half against a tokenizer of that vocabulary.
fn check(tok: &GgufTokenizer, half: &Value, what: &str) -> usize {
    let cases = half["cases"].as_array().unwrap();
    assert!(cases.len() >= 10, "{what}: fixture has {} cases", cases.len());
    for c in cases {
        let text = c["text"].as_str().unwrap();
        assert_eq!(tok.encode_with(text, false, false).unwrap(), ids(&c["plain"]), "{what} plain {text:?}");
        assert_eq!(tok.encode_with(text, true, false).unwrap(), ids(&c["special"]), "{what} special {text:?}");
        assert_eq!(tok.encode_with(text, true, true).unwrap(), ids(&c["bos_special"]), "{what} bos {text:?}");
    }
    cases.len()
}

#[test]
fn space_prefix_follows_llama_cpp() {
    let Some(path) = common::gemma_path() else { return };
    let Some(fx) = common::fixture("spm_prefix_llamacpp.json") else { return };
    let src = std::fs::read(&path).unwrap();
    let dir = std::env::temp_dir().join(format!("gcs-spm-prefix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut checked = 0;
    for (name, drop) in [("without_key", vec!["tokenizer.ggml.add_space_prefix"]), ("as_is", vec![])] {
        let half = &fx[name];
        let file = dir.join(format!("{name}.gguf"));
        std::fs::write(&file, vocab_gguf::vocab_only(&src, &drop).unwrap()).unwrap();
        let g = GgufFile::open(&file).unwrap();
        assert_eq!(g.get("tokenizer.ggml.add_space_prefix").is_some(), name == "as_is");
        assert_eq!(half["add_space_prefix_key"].is_null(), name == "without_key");
        let tok = GgufTokenizer::from_gguf(&g).unwrap();
        checked += check(&tok, half, name);
    }
    std::fs::remove_dir_all(&dir).ok();
    // The key matters: some text tokenizes differently with and without it.
    let differ = fx["without_key"]["cases"]
        .as_array()
        .unwrap()
        .iter()
        .zip(fx["as_is"]["cases"].as_array().unwrap())
        .filter(|(a, b)| a["plain"] != b["plain"])
        .count();
    assert!(differ >= 5, "only {differ} cases differ between the two vocabularies");
    eprintln!("{checked} tokenizations equal to llama.cpp's; {differ} texts change with the prefix");
}
