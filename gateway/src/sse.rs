//! Streaming answers (26.16): headers at once, `: gcs job accepted`,
//! keepalive comments during gaps, one OpenAI chunk per fenced internal
//! chunk flushed as it arrives, exactly one finish chunk, the usage chunk
//! when asked, `data: [DONE]` after a clean finish, an error-shaped event
//! after a failure. The bytes queued for the client are bounded: a client
//! that does not read has its job cancelled (`client_backpressure`); one
//! that hangs up has it cancelled at once (`client_disconnected`).

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use gcs_protocol::{ApiType, CancellationReason, FinalResult, StreamChunk};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::backend::JobEvent;
use crate::completion::{response_id, result_finish, usage_json, InFlight};
use crate::error::ApiError;

/// Frames queued between the producer and the HTTP body; the byte bound
/// below is the real limit, this only caps the channel.
const FRAME_QUEUE: usize = 4096;

/// Why a stream stopped early.
enum Stop {
    /// The client hung up.
    Gone,
    /// The client does not read fast enough.
    Backpressure,
}

struct Out {
    tx: mpsc::Sender<Bytes>,
    queued: Arc<AtomicUsize>,
    max: usize,
}

impl Out {
    fn send(&self, frame: String) -> Result<(), Stop> {
        let n = frame.len();
        if self.queued.load(Ordering::Acquire) + n > self.max {
            return Err(Stop::Backpressure);
        }
        self.queued.fetch_add(n, Ordering::AcqRel);
        match self.tx.try_send(Bytes::from(frame)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => Err(Stop::Backpressure),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(Stop::Gone),
        }
    }

    fn data(&self, v: &Value) -> Result<(), Stop> {
        self.send(format!("data: {v}\n\n"))
    }
}

/// Starts the stream for a submitted job.
pub(crate) fn respond(f: InFlight, job_id: String, rx: mpsc::Receiver<JobEvent>) -> Response {
    let (tx, frames) = mpsc::channel::<Bytes>(FRAME_QUEUE);
    let queued = Arc::new(AtomicUsize::new(0));
    let out = Out { tx, queued: queued.clone(), max: f.state.config.stream_buffer_bytes };
    let body = futures::stream::unfold((frames, queued), |(mut frames, queued)| async move {
        let b = frames.recv().await?;
        queued.fetch_sub(b.len(), Ordering::AcqRel);
        Some((Ok::<_, Infallible>(b), (frames, queued)))
    });
    let mut r = Response::new(Body::from_stream(body));
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache, no-transform"));
    h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    if let Ok(v) = HeaderValue::from_str(&job_id) {
        h.insert("x-request-id", v.clone());
        h.insert("x-gcs-job-id", v);
    }
    tokio::spawn(pump(f, job_id, rx, out));
    r
}

struct Shape {
    api: ApiType,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl Shape {
    fn chunk(&self, content: Option<&str>, role: bool, finish: Option<&str>) -> Value {
        let choice = if self.api == ApiType::ChatCompletion {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(c) = content {
                delta.insert("content".into(), json!(c));
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": content.unwrap_or(""), "logprobs": null,
                   "finish_reason": finish})
        };
        self.wrap(vec![choice])
    }

    fn wrap(&self, choices: Vec<Value>) -> Value {
        let object = if self.api == ApiType::ChatCompletion {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let mut v = json!({"id": self.id, "object": object, "created": self.created,
                           "model": self.model, "system_fingerprint": null, "choices": choices});
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

struct Progress {
    role_sent: bool,
    finish_sent: bool,
    tokens: u64,
    first_at: Option<Instant>,
    last_at: Instant,
    leases: u32,
}

async fn pump(mut f: InFlight, job_id: String, mut rx: mpsc::Receiver<JobEvent>, out: Out) {
    let state = f.state.clone();
    state.metrics.active_streams.fetch_add(1, Ordering::Relaxed);
    let shape = Shape {
        api: f.parsed.api_type,
        id: response_id(f.parsed.api_type, &job_id),
        created: f.created_s,
        model: f.parsed.model.clone(),
        include_usage: f.parsed.include_usage,
    };
    let keepalive = state.config.keepalive;
    let wall = f.started + Duration::from_millis(f.limits.wall_timeout_ms) + Duration::from_secs(2);
    let idle = Duration::from_millis(f.limits.idle_stream_timeout_ms) + Duration::from_secs(2);
    let mut p = Progress {
        role_sent: false,
        finish_sent: false,
        tokens: 0,
        first_at: None,
        last_at: Instant::now(),
        leases: 0,
    };
    let mut outcome = out.send(": gcs job accepted\n\n".into());
    let mut last_write = Instant::now();
    while outcome.is_ok() {
        let idle_deadline = if p.first_at.is_some() { p.last_at + idle } else { wall };
        let deadline = wall.min(idle_deadline);
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => match on_event(&mut f, &job_id, &shape, &mut p, &out, ev) {
                    Ok(true) => { last_write = Instant::now(); }
                    Ok(false) => break,
                    Err(stop) => outcome = Err(stop),
                },
                None => {
                    f.ended(&job_id);
                    let e = ApiError::internal("the network dropped the request");
                    let _ = out.data(&e.body());
                    break;
                }
            },
            _ = tokio::time::sleep_until((last_write + keepalive).into()) => {
                outcome = out.send(": keepalive\n\n".into());
                last_write = Instant::now();
            }
            _ = tokio::time::sleep_until(deadline.into()) => {
                let code = if p.first_at.is_some() && deadline < wall {
                    "gnus_idle_timeout"
                } else {
                    "gnus_wall_timeout"
                };
                f.cancel(&job_id, CancellationReason::Timeout).await;
                let _ = out.data(&ApiError::timeout(code, "the stream timed out").body());
                break;
            }
            _ = out.tx.closed() => outcome = Err(Stop::Gone),
        }
    }
    match outcome {
        Err(Stop::Gone) => f.cancel(&job_id, CancellationReason::ClientDisconnected).await,
        Err(Stop::Backpressure) => {
            tracing::info!(job_id, "client too slow: cancelling its job");
            f.cancel(&job_id, CancellationReason::ClientBackpressure).await;
        }
        Ok(()) => {}
    }
    state.metrics.tokens_delivered.fetch_add(p.tokens, Ordering::Relaxed);
    state.metrics.active_streams.fetch_sub(1, Ordering::Relaxed);
}

/// Handles one event; Ok(false) when the stream is over.
fn on_event(
    f: &mut InFlight,
    job_id: &str,
    shape: &Shape,
    p: &mut Progress,
    out: &Out,
    ev: JobEvent,
) -> Result<bool, Stop> {
    let state = f.state.clone();
    let m = &state.metrics;
    match ev {
        JobEvent::Leased { .. } => {
            p.leases += 1;
            if p.leases == 1 {
                m.claim.observe(f.started.elapsed().as_secs_f64());
            } else {
                m.requeues.fetch_add(1, Ordering::Relaxed);
            }
            Ok(true)
        }
        JobEvent::Chunk(c) => {
            chunk(f, shape, p, out, &c)?;
            Ok(true)
        }
        JobEvent::Completed(r) => {
            f.ended(job_id);
            completed(f, shape, p, out, &r)?;
            Ok(false)
        }
        JobEvent::Failed { error, after_partial_output } => {
            f.ended(job_id);
            tracing::info!(job_id, code = %error.code, after_partial_output, "stream failed");
            m.error(&error.code);
            out.data(&ApiError::from_info(&error).body())?;
            Ok(false)
        }
        JobEvent::Cancelled => {
            f.ended(job_id);
            Ok(false)
        }
    }
}

fn chunk(
    f: &InFlight,
    shape: &Shape,
    p: &mut Progress,
    out: &Out,
    c: &StreamChunk,
) -> Result<(), Stop> {
    let now = Instant::now();
    let text = c.delta.content.as_deref().filter(|t| !t.is_empty());
    if text.is_some() || (!p.role_sent && shape.api == ApiType::ChatCompletion) {
        let role = !p.role_sent;
        out.data(&shape.chunk(text.or(role.then_some("")), role, None))?;
        p.role_sent = true;
        match p.first_at {
            None => {
                p.first_at = Some(now);
                f.state.metrics.ttft.observe(f.started.elapsed().as_secs_f64());
            }
            Some(_) => f.state.metrics.inter_token.observe((now - p.last_at).as_secs_f64()),
        }
    }
    p.tokens += u64::from(c.usage_delta.output_tokens);
    p.last_at = now;
    if let Some(fr) = c.finish_reason {
        if !p.finish_sent {
            out.data(&shape.chunk(None, false, Some(fr.as_str())))?;
            p.finish_sent = true;
        }
    }
    Ok(())
}

fn completed(
    f: &mut InFlight,
    shape: &Shape,
    p: &mut Progress,
    out: &Out,
    r: &FinalResult,
) -> Result<(), Stop> {
    if !p.finish_sent {
        out.data(&shape.chunk(None, false, Some(&result_finish(r))))?;
        p.finish_sent = true;
    }
    let m = r.metering.as_ref();
    f.used_tokens = m.map(|m| m.input_tokens + m.output_tokens);
    if let Some(m) = m {
        f.state.metrics.tokens_generated.fetch_add(m.output_tokens, Ordering::Relaxed);
    }
    if shape.include_usage {
        let mut v = shape.wrap(vec![]);
        v["usage"] = usage_json(m, p.tokens);
        out.data(&v)?;
    }
    out.send("data: [DONE]\n\n".into())
}
