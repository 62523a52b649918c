//! A small HTTP/1.1 client over std sockets that records a chat completion
//! exactly as it arrived: status, headers, every SSE event in order. It is
//! deliberately not an OpenAI SDK: SDKs hide duplicates, merge frames and
//! retry, and the point here is to see what the wire carried.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

use crate::Error;

/// What a request asks for.
#[derive(Clone, Debug)]
pub struct ChatRequest {
    /// User message.
    pub prompt: String,
    /// `max_tokens`.
    pub max_tokens: u32,
    /// SSE or one JSON body.
    pub stream: bool,
    /// `logit_bias` that bans the end-of-sequence tokens, so generation runs
    /// to `max_tokens` and a fault can land mid-stream.
    pub ban_eos: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Read at most this many bytes per second (a slow client).
    pub read_bytes_per_s: Option<u32>,
    /// Receive buffer, so a slow client is not hidden by kernel buffering.
    pub rcvbuf: Option<u32>,
    /// Hang up after this many content frames (a vanishing client).
    pub vanish_after_frames: Option<u32>,
    /// Give up reading after this long.
    pub timeout: Duration,
    /// `gnus.network`, if not public.
    pub network: Option<String>,
    /// `gnus.continuation` (`auto` / `off`), if set.
    pub continuation: Option<String>,
    /// Sampled instead of greedy: (temperature, seed).
    pub sampled: Option<(f32, u64)>,
}

impl ChatRequest {
    fn body(&self) -> Vec<u8> {
        let mut b = json!({"model": "gnus-auto", "stream": self.stream, "max_tokens": self.max_tokens,
                           "temperature": 0, "messages": [{"role": "user", "content": self.prompt}]});
        if self.ban_eos {
            b["logit_bias"] = json!({"0": -100, "1": -100, "2": -100});
        }
        if self.stream && self.include_usage {
            b["stream_options"] = json!({"include_usage": true});
        }
        if let Some((t, seed)) = self.sampled {
            b["temperature"] = json!(t);
            b["seed"] = json!(seed);
        }
        if let Some(n) = &self.network {
            b["gnus"]["network"] = json!(n);
        }
        if let Some(c) = &self.continuation {
            b["gnus"]["continuation"] = json!(c);
        }
        b.to_string().into_bytes()
    }
}

/// Progress visible to the fault scheduler while the request runs.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// Response headers arrived.
    pub accepted: bool,
    /// `x-request-id`.
    pub job_id: Option<String>,
    /// Content frames so far.
    pub content_frames: u64,
    /// The request ended.
    pub ended: bool,
}

/// Shared progress of one request.
pub type Shared = Arc<Mutex<Progress>>;

/// Locks progress; a poisoned lock still holds usable counters.
pub fn progress(p: &Shared) -> std::sync::MutexGuard<'_, Progress> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// How the request ended, as the client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Terminal {
    /// 200 and a complete answer (`[DONE]` for streams).
    Complete,
    /// An HTTP error status, or an SSE error event.
    Error,
    /// The connection closed without a terminal frame.
    Closed,
    /// No terminal frame within the timeout.
    Timeout,
    /// The client stopped reading on purpose (slow client).
    ClientGaveUp,
    /// Could not connect or send.
    ConnectFailed,
}

/// Everything the client observed.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    /// HTTP status (0 when none arrived).
    pub status: u16,
    /// `x-request-id`.
    pub job_id: Option<String>,
    /// How it ended.
    pub terminal: Terminal,
    /// Concatenated content.
    pub content: String,
    /// Data frames that carried non-empty content.
    pub content_frames: u64,
    /// Finish chunks.
    pub finishes: u32,
    /// `data: [DONE]` frames.
    pub dones: u32,
    /// `completion_tokens` of the usage chunk (or of a JSON body).
    pub usage_tokens: Option<u64>,
    /// The whole usage object of the usage chunk (or of a JSON body).
    pub usage: Option<Value>,
    /// The finish chunk's `finish_reason` (or the JSON body's).
    pub finish_reason: Option<String>,
    /// The error object (event or JSON body).
    pub error: Option<Value>,
    /// Wire-order violations noticed while reading.
    pub violations: Vec<String>,
    /// Milliseconds to the first content frame.
    pub ttft_ms: Option<u64>,
    /// The longest wait between two content frames, in ms (an exact
    /// continuation's seam as the client sees it).
    pub max_gap_ms: u64,
    /// When the last content frame came, in ms from the start.
    #[serde(skip)]
    last_frame_ms: Option<u64>,
    /// Milliseconds to the end.
    pub total_ms: u64,
}

impl Record {
    fn new() -> Self {
        Record {
            status: 0,
            job_id: None,
            terminal: Terminal::ConnectFailed,
            content: String::new(),
            content_frames: 0,
            finishes: 0,
            dones: 0,
            usage_tokens: None,
            usage: None,
            finish_reason: None,
            error: None,
            violations: vec![],
            ttft_ms: None,
            max_gap_ms: 0,
            last_frame_ms: None,
            total_ms: 0,
        }
    }

    /// A request whose client died (a bug in netsim, reported as such).
    pub fn lost(why: &str) -> Self {
        let mut r = Record::new();
        r.violations.push(why.into());
        r
    }

    /// Tokens the client received: the usage chunk's count when the stream
    /// carried one, else one per content frame (the gateway sends one frame
    /// per token that produced text).
    pub fn received_tokens(&self) -> u64 {
        self.usage_tokens.unwrap_or(self.content_frames)
    }
}

fn connect(addr: SocketAddr, rcvbuf: Option<u32>) -> Result<TcpStream, Error> {
    let Some(size) = rcvbuf else {
        return Ok(TcpStream::connect_timeout(&addr, Duration::from_secs(5))?);
    };
    // std cannot set SO_RCVBUF before connecting (it must be set before the
    // handshake to bound the window); tokio's socket can, so borrow it.
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
    let s = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4()?;
        sock.set_recv_buffer_size(size)?;
        sock.connect(addr).await
    })?;
    let s = s.into_std()?;
    s.set_nonblocking(false)?;
    Ok(s)
}

/// Status, headers, the socket, and the body bytes read with the head.
type Head = (u16, Vec<(String, String)>, TcpStream, Vec<u8>);

/// Sends one JSON request and reads the response head.
fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: &str,
    body: &[u8],
    rcvbuf: Option<u32>,
) -> Result<Head, Error> {
    send_as(addr, method, path, key, "application/json", body, rcvbuf)
}

/// [`send`] with any content type (a multipart upload).
fn send_as(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: &str,
    content_type: &str,
    body: &[u8],
    rcvbuf: Option<u32>,
) -> Result<Head, Error> {
    let mut s = connect(addr, rcvbuf)?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut buf = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if Instant::now() > deadline {
            return Err(Error::Http("no response head".into()));
        }
        let mut b = [0u8; 1024];
        match s.read(&mut b) {
            Ok(0) => return Err(Error::Http("closed before the response head".into())),
            Ok(n) => buf.extend_from_slice(&b[..n]),
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(e.into()),
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let rest = buf[end + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|c| c.parse().ok());
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok((status.unwrap_or(0), headers, s, rest))
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// A GET or POST that returns the status and the JSON body.
pub fn request_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: &str,
    body: &[u8],
) -> Result<(u16, Value), Error> {
    let (status, body) = request_bytes(addr, method, path, key, "application/json", body)?;
    Ok((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

/// A request with any content type whose answer is read whole as text
/// (a JSONL file's content, a multipart upload's answer).
pub fn request_text(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: &str,
    content_type: &str,
    body: &[u8],
) -> Result<(u16, String), Error> {
    let (status, body) = request_bytes(addr, method, path, key, content_type, body)?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The status and the whole (de-chunked) body.
fn request_bytes(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: &str,
    content_type: &str,
    body: &[u8],
) -> Result<(u16, Vec<u8>), Error> {
    let (status, headers, mut s, mut rest) =
        send_as(addr, method, path, key, content_type, body, None)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.read_to_end(&mut rest)?;
    if header(&headers, "transfer-encoding") == Some("chunked") {
        return Ok((status, Dechunker::default().push(&rest)));
    }
    Ok((status, rest))
}

/// Incremental decoder of a chunked HTTP/1.1 body.
#[derive(Default)]
struct Dechunker {
    raw: Vec<u8>,
    finished: bool,
}

impl Dechunker {
    fn push(&mut self, b: &[u8]) -> Vec<u8> {
        self.raw.extend_from_slice(b);
        let mut out = vec![];
        while !self.finished {
            let Some(eol) = self.raw.windows(2).position(|w| w == b"\r\n") else { break };
            let line = String::from_utf8_lossy(&self.raw[..eol]).to_string();
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16);
            let Ok(size) = size else {
                self.finished = true;
                break;
            };
            if size == 0 {
                self.finished = true;
                break;
            }
            if self.raw.len() < eol + 2 + size + 2 {
                break;
            }
            out.extend_from_slice(&self.raw[eol + 2..eol + 2 + size]);
            self.raw.drain(..eol + 2 + size + 2);
        }
        out
    }
}

/// Runs one chat completion and records it. `give_up` is asked about once a
/// second whether a slow client should stop reading.
pub fn chat(
    addr: SocketAddr,
    key: &str,
    req: &ChatRequest,
    shared: &Shared,
    give_up: &dyn Fn() -> bool,
) -> Record {
    let start = Instant::now();
    let mut rec = Record::new();
    let r = send(addr, "POST", "/v1/chat/completions", key, &req.body(), req.rcvbuf);
    let (status, headers, mut s, rest) = match r {
        Ok(x) => x,
        Err(e) => {
            tracing::debug!(error = %e, "request failed before a response");
            rec.total_ms = ms(start);
            progress(shared).ended = true;
            return rec;
        }
    };
    rec.status = status;
    rec.job_id = header(&headers, "x-request-id").map(str::to_string);
    {
        let mut p = progress(shared);
        p.accepted = status == 200;
        p.job_id.clone_from(&rec.job_id);
    }
    let chunked = header(&headers, "transfer-encoding") == Some("chunked");
    let is_sse = header(&headers, "content-type").is_some_and(|c| c.contains("event-stream"));
    let mut reader = Sse { dechunk: Dechunker::default(), chunked, text: Vec::new(), id: None };
    let mut body = Vec::new();
    let mut feed = |bytes: &[u8], rec: &mut Record, body: &mut Vec<u8>| {
        if is_sse {
            reader.feed(bytes, rec, shared, start);
        } else if chunked {
            body.extend(reader.dechunk.push(bytes));
        } else {
            body.extend_from_slice(bytes);
        }
    };
    feed(&rest, &mut rec, &mut body);
    let per_read = if req.read_bytes_per_s.is_some() { 1 } else { 16384 };
    let pause = req.read_bytes_per_s.map(|r| Duration::from_millis(1000 / u64::from(r.max(1))));
    let mut last_ask = Instant::now();
    rec.terminal = loop {
        if is_sse && (rec.dones > 0 || rec.error.is_some()) && req.read_bytes_per_s.is_none() {
            // Keep reading to the close to catch anything sent after the end.
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        }
        if start.elapsed() > req.timeout {
            break Terminal::Timeout;
        }
        if pause.is_some() && last_ask.elapsed() >= Duration::from_secs(1) {
            last_ask = Instant::now();
            if give_up() {
                break Terminal::ClientGaveUp;
            }
        }
        let mut b = vec![0u8; per_read];
        match s.read(&mut b) {
            Ok(0) => break end_of(is_sse, status, &rec),
            Ok(n) => {
                feed(&b[..n], &mut rec, &mut body);
                if req.vanish_after_frames.is_some_and(|k| rec.content_frames >= u64::from(k)) {
                    // Dropping the socket is the hang-up.
                    break Terminal::ClientGaveUp;
                }
            }
            Err(e) if is_timeout(&e) => {
                if is_sse && (rec.dones > 0 || rec.error.is_some()) {
                    break end_of(is_sse, status, &rec);
                }
            }
            Err(_) => break end_of(is_sse, status, &rec),
        }
        if let Some(p) = pause {
            std::thread::sleep(p);
        }
    };
    if !is_sse {
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status == 200 && rec.terminal == Terminal::Complete {
            rec.content =
                v["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
            rec.usage_tokens = v["usage"]["completion_tokens"].as_u64();
            rec.usage = v.get("usage").cloned();
            rec.finishes = u32::from(v["choices"][0]["finish_reason"].is_string());
            rec.finish_reason = v["choices"][0]["finish_reason"].as_str().map(str::to_string);
        } else if !v.is_null() {
            rec.error = Some(v["error"].clone());
        }
    }
    rec.total_ms = ms(start);
    progress(shared).ended = true;
    rec
}

/// The terminal outcome once the connection closed.
fn end_of(is_sse: bool, status: u16, rec: &Record) -> Terminal {
    if status != 200 {
        Terminal::Error
    } else if !is_sse {
        Terminal::Complete
    } else if rec.error.is_some() {
        Terminal::Error
    } else if rec.dones > 0 {
        Terminal::Complete
    } else {
        Terminal::Closed
    }
}

fn ms(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// SSE framing over the (possibly chunked) body.
struct Sse {
    dechunk: Dechunker,
    chunked: bool,
    text: Vec<u8>,
    id: Option<String>,
}

impl Sse {
    fn feed(&mut self, bytes: &[u8], rec: &mut Record, shared: &Shared, start: Instant) {
        let plain = if self.chunked { self.dechunk.push(bytes) } else { bytes.to_vec() };
        self.text.extend(plain);
        while let Some(i) = self.text.windows(2).position(|w| w == b"\n\n") {
            let ev = String::from_utf8_lossy(&self.text[..i]).to_string();
            self.text.drain(..i + 2);
            self.event(&ev, rec, shared, start);
        }
    }

    fn event(&mut self, ev: &str, rec: &mut Record, shared: &Shared, start: Instant) {
        if ev.starts_with(':') {
            return;
        }
        let Some(data) = ev.strip_prefix("data: ") else {
            rec.violations.push(format!("not an SSE data or comment line: {ev:.80}"));
            return;
        };
        if rec.dones > 0 {
            rec.violations.push(format!("frame after [DONE]: {data:.80}"));
        }
        if rec.error.is_some() {
            rec.violations.push(format!("frame after the error event: {data:.80}"));
        }
        if data == "[DONE]" {
            rec.dones += 1;
            if rec.finishes == 0 {
                rec.violations.push("[DONE] without a finish chunk".into());
            }
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            rec.violations.push(format!("data frame is not JSON: {data:.80}"));
            return;
        };
        if !v["error"].is_null() {
            rec.error = Some(v["error"].clone());
            return;
        }
        match (&self.id, v["id"].as_str()) {
            (None, Some(id)) => self.id = Some(id.to_string()),
            (Some(a), Some(b)) if a != b => rec.violations.push(format!("chunk id {b} != {a}")),
            _ => {}
        }
        if let Some(u) = v["usage"]["completion_tokens"].as_u64() {
            rec.usage_tokens = Some(u);
            rec.usage = Some(v["usage"].clone());
        }
        let Some(choice) = v["choices"].get(0) else { return };
        if let Some(c) = choice["delta"]["content"].as_str().filter(|c| !c.is_empty()) {
            if rec.finishes > 0 {
                rec.violations.push("content after the finish chunk".into());
            }
            rec.content.push_str(c);
            rec.content_frames += 1;
            rec.ttft_ms.get_or_insert_with(|| ms(start));
            let at = ms(start);
            if let Some(prev) = rec.last_frame_ms.replace(at) {
                rec.max_gap_ms = rec.max_gap_ms.max(at.saturating_sub(prev));
            }
            progress(shared).content_frames = rec.content_frames;
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            rec.finishes += 1;
            rec.finish_reason = Some(f.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunked(body: &str) -> Vec<u8> {
        let mut out = Vec::new();
        for part in body.as_bytes().chunks(7) {
            out.extend(format!("{:x}\r\n", part.len()).as_bytes());
            out.extend(part);
            out.extend(b"\r\n");
        }
        out.extend(b"0\r\n\r\n");
        out
    }

    fn parse(body: &str) -> Record {
        let mut rec = Record::lost("");
        rec.violations.clear();
        let mut sse = Sse { dechunk: Dechunker::default(), chunked: true, text: vec![], id: None };
        let shared = Shared::default();
        // Odd split points: frames and chunk headers straddle reads.
        for piece in chunked(body).chunks(5) {
            sse.feed(piece, &mut rec, &shared, Instant::now());
        }
        rec
    }

    const C: &str = r#"{"id":"x","object":"chat.completion.chunk","choices":[{"delta":{"content":"hi "},"finish_reason":null}]}"#;
    const F: &str = r#"{"id":"x","object":"chat.completion.chunk","choices":[{"delta":{},"finish_reason":"length"}]}"#;

    #[test]
    fn a_well_formed_stream_parses_clean() {
        let body = format!(
            ": gcs job accepted\n\ndata: {C}\n\ndata: {C}\n\ndata: {F}\n\ndata: [DONE]\n\n"
        );
        let r = parse(&body);
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        assert_eq!((r.content_frames, r.finishes, r.dones), (2, 1, 1));
        assert_eq!(r.content, "hi hi ");
        assert_eq!(r.finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn frames_after_an_error_or_done_are_violations() {
        let err = r#"{"error":{"code":"gnus_worker_lost"}}"#;
        let r = parse(&format!("data: {C}\n\ndata: {err}\n\ndata: {C}\n\n"));
        assert!(r.violations.iter().any(|v| v.contains("after the error")), "{:?}", r.violations);
        let r = parse(&format!("data: {F}\n\ndata: [DONE]\n\ndata: {C}\n\n"));
        assert!(r.violations.iter().any(|v| v.contains("after [DONE]")), "{:?}", r.violations);
        let r = parse(&format!("data: {F}\n\ndata: {C}\n\n"));
        assert!(r.violations.iter().any(|v| v.contains("after the finish")), "{:?}", r.violations);
    }
}
