//! Reads tool calls out of generated text, incrementally: the stream and
//! the blocking answer feed the same [`CallReader`], so both say the same.
//!
//! An answer is calls when it begins with `<tool_call>` (the grammar lets
//! an `auto` answer's text begin any other way). Each call is
//! `<tool_call>` `{"name": "…", "arguments": ` *object* `}` `</tool_call>`
//! (whitespace between the parts tolerated); its arguments are passed on
//! as generated, byte for byte, as OpenAI passes the model's. A worker is
//! not trusted to have kept to the grammar: text that is not a call before
//! any call was read is the answer's content; anything malformed after a
//! call, or calls past the request's `max_calls`, are dropped (and
//! counted), never a panic or an unbounded buffer.

use super::{CLOSE, OPEN};

/// Longest call header (`{"name": "…", "arguments": `) kept while it is
/// incomplete; names are at most 64 bytes, so an honest one is far shorter.
const MAX_HEADER: usize = 256;

/// What the text so far says, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallEvent {
    /// Text of the answer's content.
    Content(String),
    /// Call `index` begins: its function's name.
    Start {
        /// 0, 1, … in the answer.
        index: usize,
        /// The function.
        name: String,
    },
    /// More of call `index`'s arguments (JSON text).
    Arguments {
        /// The call.
        index: usize,
        /// The next bytes of its arguments.
        text: String,
    },
}

#[derive(Debug)]
enum State {
    /// Everything so far is a prefix of `<tool_call>`.
    Undecided,
    /// Plain text: passed through.
    Text,
    /// After `<tool_call>`: the header so far.
    Header(String),
    /// Inside the arguments object.
    Arguments(JsonEnd),
    /// After the arguments: `}` and `</tool_call>` so far.
    Trailer(String),
    /// After a call: whitespace, or the next `<tool_call>` so far.
    Between(String),
    /// Off the format after a call: the rest is dropped.
    Dropped,
}

/// The incremental reader of one choice's text.
#[derive(Debug)]
pub struct CallReader {
    state: State,
    /// The raw text until the first call starts: the content if it never does.
    raw: String,
    calls: usize,
    max_calls: usize,
    /// Bytes dropped (off the format after a call).
    pub dropped: usize,
}

impl CallReader {
    /// A reader that accepts at most `max_calls` calls.
    pub fn new(max_calls: usize) -> Self {
        Self { state: State::Undecided, raw: String::new(), calls: 0, max_calls, dropped: 0 }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Reads the next piece of text.
    pub fn push(&mut self, text: &str) -> Vec<CallEvent> {
        let mut out = Vec::new();
        if self.calls == 0 && !matches!(self.state, State::Text) {
            self.raw.push_str(text);
        }
        let mut rest = text;
        while !rest.is_empty() {
            rest = self.step(rest, &mut out);
        }
        out
    }

    /// The text ended: what was held back.
    pub fn finish(&mut self) -> Vec<CallEvent> {
        let mut out = Vec::new();
        match std::mem::replace(&mut self.state, State::Dropped) {
            State::Undecided | State::Header(_) if self.calls == 0 => {
                self.become_text(&mut out);
            }
            State::Trailer(b) | State::Between(b) => self.dropped += b.trim().len(),
            State::Header(b) => self.dropped += b.len(),
            _ => {}
        }
        out
    }

    /// Nothing was a call: all the raw text is content.
    fn become_text(&mut self, out: &mut Vec<CallEvent>) {
        self.state = State::Text;
        let raw = std::mem::take(&mut self.raw);
        if !raw.is_empty() {
            out.push(CallEvent::Content(raw));
        }
    }

    /// Consumes a prefix of `s`; returns the rest.
    fn step<'a>(&mut self, s: &'a str, out: &mut Vec<CallEvent>) -> &'a str {
        match &mut self.state {
            State::Text => {
                out.push(CallEvent::Content(s.to_string()));
                ""
            }
            State::Dropped => {
                self.dropped += s.len();
                ""
            }
            State::Undecided => {
                // How much of `<tool_call>` the raw text (this piece included) holds.
                let have = self.raw.len();
                if have >= OPEN.len() {
                    if self.raw.starts_with(OPEN) {
                        let rest = &self.raw[OPEN.len()..];
                        self.state = State::Header(rest.to_string());
                        self.header(out);
                    } else {
                        self.become_text(out);
                    }
                } else if !OPEN.starts_with(self.raw.as_str()) {
                    self.become_text(out);
                }
                ""
            }
            State::Header(h) => {
                h.push_str(s);
                self.header(out);
                ""
            }
            State::Arguments(j) => {
                let (n, done) = j.feed(s);
                let index = self.calls - 1;
                if n > 0 {
                    out.push(CallEvent::Arguments { index, text: s[..n].to_string() });
                }
                if done {
                    self.state = State::Trailer(String::new());
                }
                &s[n..]
            }
            State::Trailer(t) => {
                t.push_str(s);
                let want = format!("}}{CLOSE}");
                let squeezed: String = t.chars().filter(|c| !c.is_whitespace()).collect();
                if squeezed.len() >= want.len() {
                    if squeezed.starts_with(&want) {
                        // What follows `</tool_call>` is the next part.
                        let end = t.find(CLOSE).map_or(t.len(), |i| i + CLOSE.len());
                        let rest = t[end..].to_string();
                        self.state = State::Between(String::new());
                        return self.reenter(rest, out);
                    }
                    self.drop_rest();
                } else if !want.starts_with(&squeezed) {
                    self.drop_rest();
                }
                ""
            }
            State::Between(b) => {
                b.push_str(s);
                let t = b.trim_start();
                if t.len() >= OPEN.len() {
                    if t.starts_with(OPEN) && self.calls < self.max_calls {
                        let rest = t[OPEN.len()..].to_string();
                        self.state = State::Header(rest);
                        self.header(out);
                    } else {
                        self.drop_rest();
                    }
                } else if !OPEN.starts_with(t) {
                    self.drop_rest();
                }
                ""
            }
        }
    }

    /// Feeds text again after a state change within one piece.
    fn reenter(&mut self, rest: String, out: &mut Vec<CallEvent>) -> &'static str {
        let mut r = rest.as_str();
        while !r.is_empty() {
            r = self.step(r, out);
        }
        ""
    }

    fn drop_rest(&mut self) {
        if let State::Trailer(b) | State::Between(b) | State::Header(b) = &self.state {
            self.dropped += b.len();
        }
        self.state = State::Dropped;
    }

    /// The header so far is complete, incomplete, or off the format.
    fn header(&mut self, out: &mut Vec<CallEvent>) {
        let State::Header(h) = &self.state else { return };
        match read_header(h) {
            Header::More if h.len() <= MAX_HEADER => {}
            Header::More | Header::Bad => {
                if self.calls == 0 {
                    self.become_text(out);
                } else {
                    self.drop_rest();
                }
            }
            Header::Done { name, used } => {
                let rest = h[used..].to_string();
                out.push(CallEvent::Start { index: self.calls, name });
                self.calls += 1;
                self.raw.clear();
                self.state = State::Arguments(JsonEnd::default());
                self.reenter(rest, out);
            }
        }
    }
}

enum Header {
    More,
    Bad,
    Done { name: String, used: usize },
}

/// Reads `{"name": "…", "arguments": ` (any whitespace between parts) at
/// the start of `h`.
fn read_header(h: &str) -> Header {
    let b = h.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    // Each expected literal: a prefix of it at the end is "more".
    macro_rules! expect {
        ($lit:expr) => {{
            ws(&mut i);
            let l: &[u8] = $lit;
            let n = l.len().min(b.len() - i);
            if b[i..i + n] != l[..n] {
                return Header::Bad;
            }
            if n < l.len() {
                return Header::More;
            }
            i += n;
        }};
    }
    expect!(b"{");
    expect!(b"\"name\"");
    expect!(b":");
    expect!(b"\"");
    let start = i;
    while i < b.len() && b[i] != b'"' {
        if !(b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'-') || i - start >= 64 {
            return Header::Bad;
        }
        i += 1;
    }
    if i == b.len() {
        return Header::More;
    }
    if i == start {
        return Header::Bad;
    }
    let name = h[start..i].to_string();
    i += 1;
    expect!(b",");
    expect!(b"\"arguments\"");
    expect!(b":");
    ws(&mut i);
    if i == b.len() {
        return Header::More;
    }
    if b[i] != b'{' {
        return Header::Bad;
    }
    Header::Done { name, used: i }
}

/// Finds where one JSON object ends, byte by byte.
#[derive(Debug, Default)]
pub struct JsonEnd {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl JsonEnd {
    /// Feeds `s` (which starts inside or at the object); returns the bytes
    /// that belong to it and whether it closed there.
    pub fn feed(&mut self, s: &str) -> (usize, bool) {
        for (i, c) in s.bytes().enumerate() {
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return (i + 1, true);
                    }
                }
                _ => {}
            }
        }
        (s.len(), false)
    }
}

/// A whole answer's calls (a blocking answer, a stored result).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    /// Content text, if any.
    pub content: String,
    /// (name, arguments) of each call, in order.
    pub calls: Vec<(String, String)>,
}

/// Reads all of `text` (what a stream of the same text would say).
pub fn answer(text: &str, max_calls: usize) -> Answer {
    let mut r = CallReader::new(max_calls);
    let mut ev = r.push(text);
    ev.extend(r.finish());
    collect(ev)
}

/// Folds events into an answer.
pub fn collect(events: Vec<CallEvent>) -> Answer {
    let mut a = Answer::default();
    for e in events {
        match e {
            CallEvent::Content(t) => a.content.push_str(&t),
            CallEvent::Start { name, .. } => a.calls.push((name, String::new())),
            CallEvent::Arguments { index, text } => {
                if let Some(c) = a.calls.get_mut(index) {
                    c.1.push_str(&text);
                }
            }
        }
    }
    a
}

#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
