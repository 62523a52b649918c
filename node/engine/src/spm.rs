//! SentencePiece-style tokenizer (GGUF `tokenizer.ggml.model = "llama"`,
//! e.g. Gemma 3), a transcription of llama.cpp's `llm_tokenizer_spm` and
//! its special-token partition:
//!
//! 1. the text is split on special tokens (control and unknown tokens only
//!    with `parse_special`; user-defined tokens always), longest first;
//! 2. a text fragment at the start or right after a special token gets a
//!    leading space when `tokenizer.ggml.add_space_prefix` is true (llama.cpp's
//!    default for SPM files that lack the key; Gemma's files set it false);
//! 3. in every remaining fragment spaces become `▁` (U+2581), the fragment
//!    is split into UTF-8 characters, and adjacent symbols are merged
//!    repeatedly, always the pair whose concatenation is the vocabulary
//!    token of the highest score (ties: the leftmost pair);
//! 4. a final symbol that is not a token is re-split along the merges that
//!    built it, and what still is no token becomes `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// GGUF token types (llama.cpp `LLAMA_TOKEN_TYPE_*`).
const NORMAL: i64 = 1;
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const BYTE: i64 = 6;

#[derive(Debug)]
pub struct Spm {
    tokens: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i64>,
    index: HashMap<String, u32>,
    byte_tokens: Vec<Option<u32>>,
    /// Control, user-defined and unknown tokens, longest text first.
    specials: Vec<u32>,
    /// Prefix a space to text at the start and after a special token.
    add_space_prefix: bool,
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    n: usize,
    prev: isize,
    next: isize,
}

#[derive(PartialEq)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    // Max-heap: highest score first, then the smallest `left`.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then_with(|| o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

impl Spm {
    pub fn new(tokens: Vec<String>, scores: Vec<f32>, types: Vec<i64>) -> Self {
        let index = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let mut byte_tokens = vec![None; 256];
        for (i, t) in tokens.iter().enumerate() {
            if types.get(i) == Some(&BYTE) && t.len() == 6 && t.starts_with("<0x") {
                if let Ok(b) = u8::from_str_radix(&t[3..5], 16) {
                    byte_tokens[b as usize] = Some(i as u32);
                }
            }
        }
        let mut specials: Vec<u32> = (0..tokens.len() as u32)
            .filter(|&i| matches!(types[i as usize], CONTROL | USER_DEFINED | UNKNOWN))
            .filter(|&i| !tokens[i as usize].is_empty())
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
        Self { tokens, scores, types, index, byte_tokens, specials, add_space_prefix: true }
    }

    /// Set `tokenizer.ggml.add_space_prefix` (default true, as in llama.cpp's
    /// `llama_vocab::impl::load` for SPM vocabularies).
    pub fn with_space_prefix(mut self, on: bool) -> Self {
        self.add_space_prefix = on;
        self
    }

    pub fn token_to_id(&self, t: &str) -> Option<u32> {
        self.index.get(t).copied()
    }

    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The bytes token `id` stands for in the output text (control
    /// tokens: none), as llama.cpp's `token_to_piece(special = false)`.
    pub fn piece(&self, id: u32) -> Vec<u8> {
        let (Some(t), Some(&ty)) = (self.tokens.get(id as usize), self.types.get(id as usize))
        else {
            return Vec::new();
        };
        match ty {
            NORMAL => t.replace('\u{2581}', " ").into_bytes(),
            USER_DEFINED => t.clone().into_bytes(),
            UNKNOWN => "\u{2585}".as_bytes().to_vec(),
            BYTE => u8::from_str_radix(t.get(3..5).unwrap_or(""), 16)
                .map(|b| vec![b])
                .unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    /// Tokenize `text` (no BOS; a BOS before it is a special token, so
    /// the space prefix is the same with or without one).
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        // llama.cpp's `is_prev_special`: true at the start.
        let mut prev_special = true;
        for frag in self.partition(text, parse_special) {
            match frag {
                Frag::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                // llama.cpp tokenizes no fragment for empty text.
                Frag::Text("") => {}
                Frag::Text(s) => {
                    let pre = if self.add_space_prefix && prev_special { "\u{2581}" } else { "" };
                    let text = format!("{pre}{}", s.replace(' ', "\u{2581}"));
                    self.tokenize_fragment(&text, &mut out);
                    prev_special = false;
                }
            }
        }
        out
    }

    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Frag<'a>> {
        let mut frags = vec![Frag::Text(text)];
        for &id in &self.specials {
            let ty = self.types[id as usize];
            if !parse_special && (ty == CONTROL || ty == UNKNOWN) {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Frag::Text(mut s) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = s.find(pat) {
                    if at > 0 {
                        next.push(Frag::Text(&s[..at]));
                    }
                    next.push(Frag::Token(id));
                    s = &s[at + pat.len()..];
                }
                if !s.is_empty() {
                    next.push(Frag::Text(s));
                }
            }
            frags = next;
        }
        frags
    }

    fn tokenize_fragment(&self, text: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Sym> = Vec::new();
        for (i, (start, c)) in text.char_indices().enumerate() {
            let end = start + c.len_utf8();
            let next = if end == text.len() { -1 } else { i as isize + 1 };
            syms.push(Sym { start, n: c.len_utf8(), prev: i as isize - 1, next });
        }
        if syms.is_empty() {
            return;
        }
        let mut queue = BinaryHeap::new();
        let mut rev_merge: HashMap<&str, (usize, usize)> = HashMap::new();
        let mut try_add = |syms: &[Sym], l: isize, r: isize, queue: &mut BinaryHeap<Bigram>| {
            if l < 0 || r < 0 {
                return;
            }
            let (l, r) = (l as usize, r as usize);
            let s = &text[syms[l].start..syms[l].start + syms[l].n + syms[r].n];
            if let Some(&id) = self.index.get(s) {
                queue.push(Bigram {
                    left: l,
                    right: r,
                    score: self.scores[id as usize],
                    size: s.len(),
                });
                rev_merge.insert(s, (l, r));
            }
        };
        for i in 1..syms.len() {
            try_add(&syms, i as isize - 1, i as isize, &mut queue);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (syms[b.left], syms[b.right]);
            if l.n == 0 || r.n == 0 || l.n + r.n != b.size {
                continue;
            }
            syms[b.left].n += r.n;
            syms[b.right].n = 0;
            syms[b.left].next = r.next;
            if r.next >= 0 {
                syms[r.next as usize].prev = b.left as isize;
            }
            let (prev, next) = (syms[b.left].prev, syms[b.left].next);
            try_add(&syms, prev, b.left as isize, &mut queue);
            try_add(&syms, b.left as isize, next, &mut queue);
        }
        let mut i = 0isize;
        while i != -1 {
            self.resegment(text, &syms, &rev_merge, i as usize, out, 0);
            i = syms[i as usize].next;
        }
    }

    fn resegment(
        &self,
        text: &str,
        syms: &[Sym],
        rev_merge: &HashMap<&str, (usize, usize)>,
        i: usize,
        out: &mut Vec<u32>,
        depth: usize,
    ) {
        let s = &text[syms[i].start..syms[i].start + syms[i].n];
        if let Some(&id) = self.index.get(s) {
            out.push(id);
            return;
        }
        match rev_merge.get(s) {
            // The depth bound only guards against a cycle in a hostile vocabulary.
            Some(&(a, b)) if depth < 64 => {
                self.resegment(text, syms, rev_merge, a, out, depth + 1);
                self.resegment(text, syms, rev_merge, b, out, depth + 1);
            }
            _ => {
                for &byte in s.as_bytes() {
                    if let Some(id) = self.byte_tokens[byte as usize] {
                        out.push(id);
                    }
                }
            }
        }
    }
}

enum Frag<'a> {
    Text(&'a str),
    Token(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> Spm {
        let mut toks: Vec<(&str, f32, i64)> = vec![
            ("<unk>", 0.0, UNKNOWN),
            ("<bos>", 0.0, CONTROL),
            ("<start_of_turn>", 0.0, CONTROL),
            ("\n", 0.0, USER_DEFINED),
            ("\n\n", 0.0, USER_DEFINED),
            ("\u{2581}", -1.0, NORMAL),
            ("h", -5.0, NORMAL),
            ("e", -5.0, NORMAL),
            ("l", -5.0, NORMAL),
            ("o", -5.0, NORMAL),
            ("he", -3.0, NORMAL),
            ("ll", -2.0, NORMAL),
            ("hell", -2.5, NORMAL),
            ("hello", -1.0, NORMAL),
            ("\u{2581}hello", -0.5, NORMAL),
            ("lo", -4.0, NORMAL),
        ];
        for b in 0..=255u8 {
            toks.push((Box::leak(format!("<0x{b:02X}>").into_boxed_str()), 0.0, BYTE));
        }
        Spm::new(
            toks.iter().map(|t| t.0.to_string()).collect(),
            toks.iter().map(|t| t.1).collect(),
            toks.iter().map(|t| t.2).collect(),
        )
        .with_space_prefix(false)
    }

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let v = vocab();
        let id = |s: &str| v.token_to_id(s).unwrap();
        assert_eq!(v.encode("hello", false), [id("hello")]);
        assert_eq!(v.encode(" hello", false), [id("\u{2581}hello")]);
        // "hel": he(-3) vs el(none) → "he" + "l".
        assert_eq!(v.encode("hel", false), [id("he"), id("l")]);
        // 'z' is no token: its byte.
        assert_eq!(v.encode("z", false), [id("<0x7A>")]);
        // Multi-byte character without a token: every byte.
        assert_eq!(v.encode("é", false), [id("<0xC3>"), id("<0xA9>")]);
        let text: String =
            v.encode(" hello\n", false).iter().flat_map(|&i| v.piece(i)).map(char::from).collect();
        assert_eq!(text, " hello\n");
    }

    #[test]
    fn space_prefix_at_start_and_after_specials() {
        let v = vocab().with_space_prefix(true);
        let id = |s: &str| v.token_to_id(s).unwrap();
        assert_eq!(v.encode("hello", false), [id("\u{2581}hello")]);
        // After a special token the next text gets the prefix again; after
        // text (the user-defined "\n" is special) likewise.
        assert_eq!(
            v.encode("<start_of_turn>hello\nhello", true),
            [id("<start_of_turn>"), id("\u{2581}hello"), id("\n"), id("\u{2581}hello")]
        );
        // A leading space is one more `▁`: "▁" + "▁hello".
        assert_eq!(v.encode(" hello", false), [id("\u{2581}"), id("\u{2581}hello")]);
        assert!(v.encode("", false).is_empty());
        // Text that follows a control token not parsed as special is plain text.
        let plain = v.encode("<bos>hello", false);
        assert_eq!(plain[0], id("\u{2581}"));
    }

    #[test]
    fn specials_partition_longest_first() {
        let v = vocab();
        let id = |s: &str| v.token_to_id(s).unwrap();
        assert_eq!(
            v.encode("<start_of_turn>hello\n\n", true),
            [id("<start_of_turn>"), id("hello"), id("\n\n")]
        );
        // Without parse_special a control token is text; user-defined still split.
        let plain = v.encode("<bos>\n", false);
        assert_ne!(plain[0], id("<bos>"));
        assert_eq!(*plain.last().unwrap(), id("\n"));
        assert!(v.piece(id("<bos>")).is_empty());
    }
}
