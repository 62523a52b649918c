//! GGUF parser robustness: valid synthetic files, every truncation, random
//! bytes, and a truncated copy of the real model.

mod common;

use gcs_engine::gguf::{GgmlType, GgufFile, Value};
use gcs_engine::GgufError;

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// A small valid GGUF v3 file: 3 metadata keys, one F32 tensor [4, 2].
fn synthetic() -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes()); // tensors
    b.extend_from_slice(&3u64.to_le_bytes()); // kv
    put_str(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    put_str(&mut b, "llama");
    put_str(&mut b, "test.u32");
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&7u32.to_le_bytes());
    put_str(&mut b, "test.arr");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes());
    put_str(&mut b, "a");
    put_str(&mut b, "bc");
    put_str(&mut b, "w");
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&4u64.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // F32
    b.extend_from_slice(&0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for i in 0..8 {
        b.extend_from_slice(&(i as f32).to_le_bytes());
    }
    b
}

#[test]
fn parses_synthetic_file() {
    let g = GgufFile::from_bytes("synthetic.gguf", synthetic()).expect("valid file parses");
    assert_eq!(g.version, 3);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u64("test.u32").unwrap(), 7);
    assert_eq!(
        g.get("test.arr"),
        Some(&Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]))
    );
    let t = g.tensor_info("w").unwrap();
    assert_eq!(t.ggml_type, GgmlType::F32);
    assert_eq!(g.tensor_f32("w").unwrap(), (0..8).map(|i| i as f32).collect::<Vec<_>>());
}

#[test]
fn every_truncation_is_an_error() {
    let full = synthetic();
    for n in 0..full.len() {
        let r = GgufFile::from_bytes("cut.gguf", full[..n].to_vec());
        let e = r.expect_err(&format!("prefix of {n} bytes must fail"));
        assert!(e.to_string().contains("cut.gguf"), "error names the file: {e}");
    }
}

#[test]
fn random_and_corrupted_bytes_never_panic() {
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..300 {
        let n = (next() % 512) as usize;
        let mut v: Vec<u8> = (0..n).map(|_| next() as u8).collect();
        let _ = GgufFile::from_bytes("random.gguf", v.clone());
        if v.len() >= 8 {
            v[..4].copy_from_slice(b"GGUF");
            v[4..8].copy_from_slice(&3u32.to_le_bytes());
            let _ = GgufFile::from_bytes("random.gguf", v);
        }
    }
    // Flip single bytes of a valid file.
    let full = synthetic();
    for i in 0..full.len() {
        for x in [0x01u8, 0x80, 0xff] {
            let mut v = full.clone();
            v[i] ^= x;
            let _ = GgufFile::from_bytes("flipped.gguf", v);
        }
    }
    let e = GgufFile::from_bytes("bad.gguf", b"NOPE\x03\0\0\0".to_vec()).unwrap_err();
    assert!(matches!(e, GgufError::BadMagic { .. }));
}

#[test]
fn truncated_real_model_is_a_clear_error() {
    let Some(path) = common::smollm_path() else { return };
    let bytes = std::fs::read(&path).unwrap();
    let dir = std::env::temp_dir().join(format!("gcs-engine-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cut = dir.join("truncated.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = GgufFile::open(&cut).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
    assert!(e.to_string().contains("truncated.gguf"), "{e}");
    std::fs::write(&cut, &bytes[..1000]).unwrap();
    assert!(GgufFile::open(&cut).is_err());
    std::fs::remove_dir_all(&dir).ok();

    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.tensor_info("token_embd.weight").unwrap().ggml_type, GgmlType::Q8_0);
}

/// A GGUF whose one tensor `w` ([256, 1]) has ggml type id `ty` and whose
/// architecture is `arch`.
fn with_type_and_arch(ty: u32, block_bytes: usize, arch: &str) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    put_str(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    put_str(&mut b, arch);
    put_str(&mut b, "w");
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&256u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.resize(b.len() + block_bytes, 0);
    b
}

#[test]
fn unknown_tensor_types_and_architectures_are_refused_by_name() {
    // IQ2_XXS (16), Q2_K (10), Q5_1 (7): real ggml types this build cannot run.
    for (id, name) in [(16u32, "IQ2_XXS"), (10, "Q2_K"), (7, "Q5_1"), (99, "unknown")] {
        let err =
            GgufFile::from_bytes("t.gguf", with_type_and_arch(id, 4096, "llama")).unwrap_err();
        assert!(matches!(err, GgufError::UnsupportedType { ggml_type, .. } if ggml_type == id));
        let msg = err.to_string();
        assert!(msg.contains(name) && msg.contains("tensor w"), "{msg}");
    }
    // Q4_K (12) loads: one 144-byte super-block of 256 elements.
    let g = GgufFile::from_bytes("t.gguf", with_type_and_arch(12, 144, "mamba")).unwrap();
    assert_eq!(g.tensor_info("w").unwrap().ggml_type, GgmlType::Q4_K);
    let err = gcs_engine::llama::LlamaConfig::from_gguf(&g).unwrap_err().to_string();
    assert!(err.contains("unsupported architecture \"mamba\""), "{err}");
}
