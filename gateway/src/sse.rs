//! Streaming answers (26.16): the status is held until there is something
//! to stream (see [`hold`]), then the headers, `: gcs job accepted`,
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
use serde_json::Value;
use tokio::sync::mpsc;

use crate::admit::{InFlight, EDGE_GRACE};
use crate::backend::JobEvent;
use crate::codec::{self, StreamShape};
use crate::error::ApiError;
use crate::request::GenerationRequest;
use crate::tools::parse::{CallEvent, CallReader};

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

/// A submitted job: its events read while the status was held, then the rest.
struct Held {
    id: String,
    early: Vec<JobEvent>,
    rx: mpsc::Receiver<JobEvent>,
}

/// Holds the HTTP status until every choice has something to stream (a
/// chunk, or a stored result), for at most `--stream-hold-ms` and never
/// longer than one keepalive interval. A job that fails or is cancelled
/// meanwhile is answered with its own status as JSON (503 + Retry-After,
/// 504, 400), which SDKs retry by status; after the bound the headers are
/// committed and the stream continues as before.
async fn hold(
    f: &mut InFlight,
    jobs: Vec<(String, mpsc::Receiver<JobEvent>)>,
) -> Result<Vec<Held>, ApiError> {
    let c = &f.state.config;
    let until = tokio::time::Instant::now() + c.stream_hold.min(c.keepalive);
    let mut held: Vec<Held> =
        jobs.into_iter().map(|(id, rx)| Held { id, early: vec![], rx }).collect();
    for h in &mut held {
        loop {
            let ev = match tokio::time::timeout_at(until, h.rx.recv()).await {
                Ok(Some(ev)) => ev,
                // Closed: the stream reports it. Past the bound: commit.
                Ok(None) | Err(_) => break,
            };
            match ev {
                JobEvent::Failed { error, .. } => {
                    f.ended(&h.id);
                    return Err(ApiError::from_info(&error));
                }
                JobEvent::Cancelled => {
                    f.ended(&h.id);
                    return Err(ApiError::unavailable("the request was cancelled in the network"));
                }
                JobEvent::Leased { .. } => h.early.push(ev),
                JobEvent::Chunk(_) | JobEvent::Completed(_) => {
                    h.early.push(ev);
                    break;
                }
            }
        }
    }
    Ok(held)
}

/// Starts the stream of request `g` for its submitted jobs (one per choice),
/// once [`hold`] lets it.
pub(crate) async fn respond(
    mut f: InFlight,
    g: &GenerationRequest,
    jobs: Vec<(String, mpsc::Receiver<JobEvent>)>,
) -> Result<Response, ApiError> {
    let accepted = Instant::now();
    let jobs = hold(&mut f, jobs).await?;
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
    if let Some(Ok(v)) = jobs.first().map(|j| HeaderValue::from_str(&j.id)) {
        h.insert("x-request-id", v.clone());
        h.insert("x-gcs-job-id", v);
    }
    let first = jobs.first().map_or("", |j| j.id.as_str());
    let shape = StreamShape {
        api: f.common.api_type,
        id: codec::response_id(f.common.api_type, first),
        created: f.created_s,
        model: f.common.model.clone(),
        include_usage: g.include_usage,
        logprobs: g.job.logprobs.is_some(),
        tools: g.job.tools.as_ref().map(|t| usize::from(t.max_calls)),
    };
    tokio::spawn(pump(f, shape, jobs, out, accepted));
    Ok(r)
}

/// One choice's stream state.
#[derive(Default)]
struct Choice {
    role_sent: bool,
    finish_sent: bool,
    /// Tokens delivered.
    tokens: u64,
    leases: u32,
    /// Its job ended (completed, failed or cancelled).
    done: bool,
    /// Metered by the worker, once completed.
    metering: Option<gcs_protocol::Metering>,
    /// A request with tools: the reader of its calls.
    reader: Option<CallReader>,
    /// Log-probabilities not yet sent with a content delta (tools only).
    pending_lp: Vec<gcs_protocol::TokenLogprob>,
    /// Characters of the text sent so far, for a completion's
    /// `logprobs.text_offset`.
    chars: usize,
}

/// The whole stream's state.
struct Progress {
    choices: Vec<Choice>,
    first_at: Option<Instant>,
    last_at: Instant,
    /// When the idle timeout counts from: the last chunk, or a later lease
    /// (an exact continuation's grant: the new worker replays the delivered
    /// prefix before its first chunk, and the network's tracker restarts
    /// its own idle timer there too).
    idle_from: Instant,
}

async fn pump(mut f: InFlight, shape: StreamShape, jobs: Vec<Held>, out: Out, accepted: Instant) {
    use futures::StreamExt as _;
    let state = f.state.clone();
    state.metrics.active_streams.fetch_add(1, Ordering::Relaxed);
    let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
    // One merged, ordered-per-choice event stream, tagged by choice index:
    // what was read while the status was held, then the rest.
    let mut events = futures::stream::select_all(jobs.into_iter().enumerate().map(|(i, j)| {
        let early = futures::stream::iter(j.early.into_iter().map(move |ev| (i, ev)));
        let rest = futures::stream::unfold(j.rx, move |mut rx| async move {
            rx.recv().await.map(|ev| ((i, ev), rx))
        });
        Box::pin(early.chain(rest))
    }));
    let keepalive = state.config.keepalive;
    let wall = f.started + Duration::from_millis(f.limits.wall_timeout_ms) + EDGE_GRACE;
    let idle = Duration::from_millis(f.limits.idle_stream_timeout_ms) + EDGE_GRACE;
    let mut p = Progress {
        choices: ids.iter().map(|_| Choice::default()).collect(),
        first_at: None,
        last_at: Instant::now(),
        idle_from: Instant::now(),
    };
    let mut outcome = out.send(": gcs job accepted\n\n".into());
    // Keepalives count from acceptance: a hold that lasted a keepalive
    // interval is followed by one at once.
    let mut last_write = accepted;
    while outcome.is_ok() {
        let idle_deadline = if p.first_at.is_some() { p.idle_from + idle } else { wall };
        let deadline = wall.min(idle_deadline);
        tokio::select! {
            ev = events.next() => match ev {
                Some((i, ev)) => match on_event(&mut f, &ids[i], i, &shape, &mut p, &out, ev) {
                    Ok(true) => { last_write = Instant::now(); }
                    Ok(false) => break,
                    Err(stop) => outcome = Err(stop),
                },
                None => {
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
                cancel_open(&mut f, &ids, &p, CancellationReason::Timeout).await;
                let _ = out.data(&ApiError::timeout(code, "the stream timed out").body());
                break;
            }
            _ = out.tx.closed() => outcome = Err(Stop::Gone),
        }
    }
    match outcome {
        Err(Stop::Gone) => {
            cancel_open(&mut f, &ids, &p, CancellationReason::ClientDisconnected).await
        }
        Err(Stop::Backpressure) => {
            tracing::info!(job_id = %ids[0], "client too slow: cancelling its jobs");
            cancel_open(&mut f, &ids, &p, CancellationReason::ClientBackpressure).await;
        }
        Ok(()) => {}
    }
    // Any choice still running after an error in another is cancelled when
    // `f` drops.
    let delivered: u64 = p.choices.iter().map(|c| c.tokens).sum();
    state.metrics.tokens_delivered.fetch_add(delivered, Ordering::Relaxed);
    state.metrics.active_streams.fetch_sub(1, Ordering::Relaxed);
}

async fn cancel_open(f: &mut InFlight, ids: &[String], p: &Progress, reason: CancellationReason) {
    for (id, c) in ids.iter().zip(&p.choices) {
        if !c.done {
            f.cancel(id, reason).await;
        }
    }
}

/// Handles one event of choice `i`; Ok(false) when the stream is over.
fn on_event(
    f: &mut InFlight,
    job_id: &str,
    i: usize,
    shape: &StreamShape,
    p: &mut Progress,
    out: &Out,
    ev: JobEvent,
) -> Result<bool, Stop> {
    let state = f.state.clone();
    let m = &state.metrics;
    match ev {
        JobEvent::Leased { .. } => {
            p.idle_from = Instant::now();
            let c = &mut p.choices[i];
            c.leases += 1;
            if c.leases == 1 {
                m.claim.observe(f.started.elapsed().as_secs_f64());
            } else {
                m.requeues.fetch_add(1, Ordering::Relaxed);
            }
            Ok(true)
        }
        JobEvent::Chunk(c) => {
            chunk(f, i, shape, p, out, &c)?;
            Ok(true)
        }
        JobEvent::Completed(r) => {
            f.ended(job_id);
            completed(f, i, shape, p, out, &r)
        }
        JobEvent::Failed { error, after_partial_output } => {
            f.ended(job_id);
            p.choices[i].done = true;
            tracing::info!(job_id, code = %error.code, after_partial_output, "stream failed");
            m.error(&error.code);
            out.data(&ApiError::from_info(&error).body())?;
            Ok(false)
        }
        JobEvent::Cancelled => {
            f.ended(job_id);
            p.choices[i].done = true;
            Ok(false)
        }
    }
}

fn chunk(
    f: &InFlight,
    i: usize,
    shape: &StreamShape,
    p: &mut Progress,
    out: &Out,
    c: &StreamChunk,
) -> Result<(), Stop> {
    let now = Instant::now();
    let text = c.delta.content.as_deref().filter(|t| !t.is_empty());
    let ch = &mut p.choices[i];
    let wrote = if let Some(max) = shape.tools {
        ch.pending_lp.extend(c.delta.logprobs.iter().cloned());
        let r = ch.reader.get_or_insert_with(|| CallReader::new(max));
        let mut ev = text.map(|t| r.push(t)).unwrap_or_default();
        if c.finish_reason.is_some() {
            ev.extend(r.finish());
        }
        send_calls(shape, i, ch, out, ev)?
    } else if text.is_some() || (!ch.role_sent && shape.api == ApiType::ChatCompletion) {
        let role = !ch.role_sent;
        let lp = if shape.logprobs && text.is_some() {
            codec::logprobs_of(shape.api, &c.delta.logprobs, &mut ch.chars)
        } else {
            Value::Null
        };
        out.data(&shape.chunk(i, text.or(role.then_some("")), role, None, lp))?;
        ch.role_sent = true;
        true
    } else {
        false
    };
    if wrote {
        match p.first_at {
            None => {
                p.first_at = Some(now);
                f.state.metrics.ttft.observe(f.started.elapsed().as_secs_f64());
            }
            Some(_) => f.state.metrics.inter_token.observe((now - p.last_at).as_secs_f64()),
        }
    }
    ch.tokens += u64::from(c.usage_delta.output_tokens);
    p.last_at = now;
    p.idle_from = now;
    if let Some(fr) = c.finish_reason {
        if !ch.finish_sent {
            let calls = ch.reader.as_ref().map_or(0, CallReader::calls);
            let finish = codec::calls_finish(fr.as_str(), calls);
            out.data(&shape.chunk(i, None, false, Some(finish), Value::Null))?;
            ch.finish_sent = true;
        }
    }
    Ok(())
}

/// Sends what a tools request's text said as OpenAI deltas: content, a
/// call's opening (index, id, type, name, empty arguments), its argument
/// pieces. Whether anything was sent.
fn send_calls(
    shape: &StreamShape,
    i: usize,
    ch: &mut Choice,
    out: &Out,
    events: Vec<CallEvent>,
) -> Result<bool, Stop> {
    let wrote = !events.is_empty();
    for e in events {
        let role = !ch.role_sent;
        let frame = match e {
            CallEvent::Content(t) => {
                let lp = std::mem::take(&mut ch.pending_lp);
                let lp = if shape.logprobs { codec::logprobs(&lp) } else { Value::Null };
                shape.chunk(i, Some(&t), role, None, lp)
            }
            CallEvent::Start { index, name } => {
                ch.pending_lp.clear();
                let id = crate::tools::call_id(&shape.id, i, index);
                shape.tool_chunk(
                    i,
                    role,
                    serde_json::json!({"index": index, "id": id,
                    "type": "function", "function": {"name": name, "arguments": ""}}),
                )
            }
            CallEvent::Arguments { index, text } => {
                ch.pending_lp.clear();
                shape.tool_chunk(
                    i,
                    role,
                    serde_json::json!({"index": index,
                    "function": {"arguments": text}}),
                )
            }
        };
        out.data(&frame)?;
        ch.role_sent = true;
    }
    Ok(wrote)
}

/// Choice `i` completed; when every choice has, the usage chunk and `[DONE]`.
fn completed(
    f: &mut InFlight,
    i: usize,
    shape: &StreamShape,
    p: &mut Progress,
    out: &Out,
    r: &FinalResult,
) -> Result<bool, Stop> {
    let ch = &mut p.choices[i];
    if !ch.finish_sent {
        // Text held back by the call reader goes out before the finish.
        let held = ch.reader.as_mut().map(CallReader::finish).unwrap_or_default();
        send_calls(shape, i, ch, out, held)?;
        let finish = codec::result_finish(r);
        let calls = ch.reader.as_ref().map_or(0, CallReader::calls);
        out.data(&shape.chunk(
            i,
            None,
            false,
            Some(codec::calls_finish(&finish, calls)),
            Value::Null,
        ))?;
        ch.finish_sent = true;
    }
    ch.done = true;
    ch.metering = r.metering.clone();
    if let Some(m) = &r.metering {
        f.state.metrics.tokens_generated.fetch_add(m.output_tokens, Ordering::Relaxed);
    }
    if !p.choices.iter().all(|c| c.done) {
        return Ok(true);
    }
    // One prompt, n completions.
    let prompt = p.choices[0].metering.clone().unwrap_or_default();
    let completion: u64 = p
        .choices
        .iter()
        .map(|c| c.metering.as_ref().map_or(c.tokens, |m| m.output_tokens.max(c.tokens)))
        .sum();
    f.used_tokens = Some(prompt.input_tokens + completion);
    if shape.include_usage {
        let total = gcs_protocol::Metering { output_tokens: completion, ..prompt };
        out.data(&shape.usage_chunk(codec::metered_usage(Some(&total), completion)))?;
    }
    out.send("data: [DONE]\n\n".into())?;
    Ok(false)
}
