//! Stop strings matched on decoded text, with hold-back: text that could
//! still turn out to be the start of a stop string, or an incomplete UTF-8
//! character, is kept back until it is resolved, so no part of a stop
//! string (and no broken character) is ever emitted, even when the stop
//! string is split across tokens.

use crate::tokenizer::Utf8Stream;

/// Streams token bytes to text deltas and detects stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    utf8: Utf8Stream,
    /// Decoded text not emitted yet (a possible stop-string prefix).
    pending: String,
    stopped: bool,
}

/// What one pushed token produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopStep {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string was found; `text` is everything before it, and nothing
    /// more may be emitted.
    pub stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        Self { stops, ..Self::default() }
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feed one token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> StopStep {
        if self.stopped {
            return StopStep { text: String::new(), stopped: true };
        }
        let new = self.utf8.push(bytes);
        self.pending.push_str(&new);
        if let Some(pos) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            self.stopped = true;
            let text = self.pending[..pos].to_string();
            self.pending.clear();
            return StopStep { text, stopped: true };
        }
        let hold = self.held_suffix();
        let emit_to = self.pending.len() - hold;
        let rest = self.pending.split_off(emit_to);
        let text = std::mem::replace(&mut self.pending, rest);
        StopStep { text, stopped: false }
    }

    /// Length in bytes of the longest suffix of `pending` that is a proper
    /// prefix of some stop string (on a char boundary).
    fn held_suffix(&self) -> usize {
        let p = &self.pending;
        let mut best = 0;
        for s in &self.stops {
            let max = (s.len() - 1).min(p.len());
            for k in (best + 1..=max).rev() {
                if s.is_char_boundary(k) && p.is_char_boundary(p.len() - k) && p.ends_with(&s[..k])
                {
                    best = k;
                    break;
                }
            }
        }
        best
    }

    /// End of generation without a stop string: release what was held
    /// (including any incomplete UTF-8 bytes, lossily).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.pending);
        out.push_str(&self.utf8.finish());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut deltas = Vec::new();
        let mut stopped = false;
        for p in pieces {
            let st = m.push(p);
            deltas.push(st.text);
            if st.stopped {
                stopped = true;
                break;
            }
        }
        if !stopped {
            deltas.push(m.finish());
        }
        let all = deltas.concat();
        (deltas, all, stopped)
    }

    #[test]
    fn stop_split_across_tokens_never_leaks() {
        let (deltas, all, stopped) = run(&["STOP"], &[b"hello S", b"T", b"O", b"P and more"]);
        assert!(stopped);
        assert_eq!(all, "hello ");
        assert_eq!(deltas[0], "hello ", "the text before a possible stop is emitted");
        assert!(deltas.iter().all(|d| !d.contains('S')), "{deltas:?}");
    }

    #[test]
    fn false_prefix_is_released() {
        let (deltas, all, stopped) = run(&["STOP"], &[b"a ST", b"AR", b" b"]);
        assert!(!stopped);
        assert_eq!(all, "a STAR b");
        assert_eq!(deltas[0], "a ");
        assert_eq!(deltas[1], "STAR");
    }

    #[test]
    fn held_prefix_released_at_finish() {
        let (deltas, all, stopped) = run(&["\n\n"], &[b"line\n"]);
        assert!(!stopped);
        assert_eq!(deltas[0], "line");
        assert_eq!(all, "line\n");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (_, all, stopped) = run(&["world", "lo w"], &[b"hello world"]);
        assert!(stopped);
        assert_eq!(all, "hel");
        // Stop inside one token: the text before it is emitted.
        let (_, all, _) = run(&["."], &[b"One. Two."]);
        assert_eq!(all, "One");
    }

    #[test]
    fn utf8_is_never_split_and_multibyte_stops_match() {
        let e = "é".as_bytes();
        let (deltas, all, stopped) = run(&[], &[&e[..1], &e[1..], b"x"]);
        assert!(!stopped);
        assert_eq!(deltas[0], "");
        assert_eq!(all, "éx");
        let s = "😀".as_bytes();
        let (deltas, all, stopped) = run(&["😀!"], &[b"ok ", &s[..2], &s[2..], b"!"]);
        assert!(stopped);
        assert_eq!(all, "ok ");
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')));
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let (_, all, stopped) = run(&[""], &[b"abc"]);
        assert!(!stopped);
        assert_eq!(all, "abc");
    }
}
