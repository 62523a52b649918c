//! A vocabulary-only copy of a GGUF file: its metadata key/values with some
//! keys left out, no tensors. Both llama.cpp (`vocab_only`) and the engine's
//! tokenizer load it, so a tokenizer rule that depends on a missing key can
//! be compared on a real vocabulary (tests/spm_prefix.rs,
//! scripts/fixtures/spm_prefix_reference.sh).

/// Bytes of `src`'s GGUF v2/v3 header with the keys in `drop` removed and
/// zero tensors, padded to ggml's default 32-byte alignment.
pub fn vocab_only(src: &[u8], drop: &[&str]) -> Result<Vec<u8>, String> {
    let mut r = Reader { b: src, at: 0 };
    if r.take(4)? != b"GGUF" {
        return Err("not a GGUF file".into());
    }
    let version = r.u32()?;
    if version < 2 {
        return Err(format!("GGUF version {version}"));
    }
    let _n_tensors = r.u64()?;
    let n_kv = r.u64()?;
    let mut kept = Vec::new();
    let mut n_kept = 0u64;
    for _ in 0..n_kv {
        let start = r.at;
        let key_len = r.u64()? as usize;
        let key = std::str::from_utf8(r.take(key_len)?).map_err(|e| e.to_string())?.to_owned();
        let ty = r.u32()?;
        r.skip_value(ty)?;
        if !drop.contains(&key.as_str()) {
            kept.extend_from_slice(&src[start..r.at]);
            n_kept += 1;
        }
    }
    let mut out = Vec::with_capacity(kept.len() + 64);
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&n_kept.to_le_bytes());
    out.extend_from_slice(&kept);
    out.resize(out.len().div_ceil(32) * 32, 0);
    Ok(out)
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or_else(|| format!("truncated at byte {}", self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| "u32")?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| "u64")?))
    }
    /// Skip one value of GGUF type `ty` (gguf.h `gguf_type`).
    fn skip_value(&mut self, ty: u32) -> Result<(), String> {
        let fixed = |ty: u32| match ty {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        match ty {
            8 => {
                let n = self.u64()? as usize;
                self.take(n)?;
            }
            9 => {
                let ety = self.u32()?;
                let n = self.u64()? as usize;
                match fixed(ety) {
                    Some(w) => {
                        self.take(n.checked_mul(w).ok_or("array size")?)?;
                    }
                    None => {
                        for _ in 0..n {
                            self.skip_value(ety)?;
                        }
                    }
                }
            }
            t => {
                let w = fixed(t).ok_or_else(|| format!("GGUF value type {t}"))?;
                self.take(w)?;
            }
        }
        Ok(())
    }
}
