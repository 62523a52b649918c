//! Writes a vocabulary-only copy of a GGUF (metadata only, no tensors)
//! without the keys named after it, for
//! `scripts/fixtures/spm_prefix_reference.sh` to tokenize with llama.cpp.
//!
//! usage: cargo run -p gcs-engine --example vocab_gguf -- SRC DST [KEY...]

#[path = "../tests/common/vocab_gguf.rs"]
mod vocab_gguf;

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let (Some(src), Some(dst)) = (args.next(), args.next()) else {
        return Err("usage: vocab_gguf SRC DST [KEY...]".into());
    };
    let drop: Vec<String> = args.collect();
    let drop: Vec<&str> = drop.iter().map(String::as_str).collect();
    let bytes = std::fs::read(&src).map_err(|e| format!("{src}: {e}"))?;
    let out = vocab_gguf::vocab_only(&bytes, &drop)?;
    std::fs::write(&dst, out).map_err(|e| format!("{dst}: {e}"))
}
