//! Writes the model matrix's synthetic GGUFs (tests/common/synth.rs) into a
//! directory, one `<arch>-<type>.gguf` per combination, for
//! `scripts/fixtures/matrix_reference.sh` to run llama.cpp on.
//!
//! usage: cargo run -p gcs-engine --example matrix_gguf -- DIR

#[path = "../tests/common/synth.rs"]
mod synth;

fn main() -> std::io::Result<()> {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "matrix-gguf".into());
    std::fs::create_dir_all(&dir)?;
    std::fs::write(std::path::Path::new(&dir).join("prompt.txt"), synth::PROMPT)?;
    for arch in synth::ARCHS {
        for ty in synth::WTYPES {
            let path = std::path::Path::new(&dir).join(format!("{arch}-{}.gguf", ty.name()));
            std::fs::write(&path, synth::gguf(arch, ty))?;
            println!("{} seed {:#018x}", path.display(), synth::seed(arch, ty));
        }
    }
    Ok(())
}
