//! One round of gcs-engine's side of `engine-bench --model`, run in a child
//! process of its own (`--measure-one PATH`): like llama-bench, each round
//! loads the file fresh, and the peak RSS is that model's alone.
//!
//! Everything runs through the `BatchEngine`, the path a worker serves
//! with (paged f16 KV, continuous batching), not `Engine::generate`.

use std::time::{Duration, Instant};

use gcs_engine::{cpu_device, BatchConfig, BatchEngine, Engine, Prompt, SeqEvent, SeqRequest};
use serde::{Deserialize, Serialize};

/// What one round measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Round {
    pub name: String,
    pub arch: String,
    pub quantization: String,
    pub weights_mb: f64,
    pub load_s: f64,
    /// Prompt tokens / time to the first token, one sequence alone.
    pub prefill_64: f64,
    pub prefill_512: f64,
    pub ttft_64_ms: f64,
    /// Steady-state decode, tokens/s summed over the streams: the tokens
    /// after each stream's first over the time after the last first token.
    pub decode_1: f64,
    pub decode_8: f64,
    pub decode_16: f64,
    /// One stream decoding after a `ctx`-token prompt (0: not measured).
    #[serde(default)]
    pub ctx: usize,
    #[serde(default)]
    pub decode_ctx: f64,
    pub peak_rss_mib: f64,
    pub kv_blocks: usize,
}

/// The line prefix the parent looks for on the child's stdout.
pub const MARK: &str = "ENGINE_BENCH_ROUND ";

/// Decode streams measured, as in the targets.
pub const STREAMS: [usize; 3] = [1, 8, 16];

const TEXT: &str = "The lighthouse keeper climbed the spiral stairs each evening, \
    trimmed the wick, polished the great lens and wrote the weather in his log. \
    Ships passed far out at sea; some signalled, most did not. ";

pub fn peak_rss_mib() -> f64 {
    // VmHWM is the peak resident set size of this process.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| status_kib(&s, "VmHWM:"))
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

/// A `/proc/<pid>/status` field in KiB.
pub fn status_kib(status: &str, field: &str) -> Option<f64> {
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
}

/// Measures one round of `path` with `tokens` decode tokens per stream,
/// and (`ctx > 0`) one stream decoding after a `ctx`-token prompt.
pub fn measure(path: &str, tokens: usize, ctx: usize) -> Result<Round, Box<dyn std::error::Error>> {
    let t = Instant::now();
    let engine = Engine::load(path, &cpu_device())?;
    let load_s = t.elapsed().as_secs_f64();
    let card = engine.card.clone();
    let weights_mb = engine.model.weight_bytes() as f64 / 1e6;
    let want = ctx.max(512);
    let corpus = engine.tokenizer.encode(&TEXT.repeat(40 * want.div_ceil(512)))?;
    if corpus.len() < want {
        return Err(format!("the bench text is {} tokens, fewer than {want}", corpus.len()).into());
    }
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| engine.tokenizer.encode(&format!("Story {i}: the history of the printing press")))
        .collect::<Result<_, _>>()?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    // Room for 16 streams of prompt + tokens (no preemption skews a
    // figure) and for the 512-token prompt.
    let per_stream = (longest + tokens + 1).div_ceil(16);
    let kv_blocks = (16 * per_stream).max(512 / 16 + 1).max((ctx + tokens).div_ceil(16) + 1) + 8;
    let cfg = BatchConfig {
        max_running: 16,
        kv_blocks,
        // One forward for the whole 512-token prompt, as llama-bench's
        // ubatch of 512 (a worker's default chunk is 256).
        prefill_chunk: 512,
        ..BatchConfig::default()
    };
    let be = BatchEngine::start(engine, cfg);
    // Warm-up: thread pool, page faults, first-use allocations.
    run(&be, vec![(prompts[0].clone(), 8)], "warm")?;
    let ttft = |n: usize, tag: &str| -> Result<f64, Box<dyn std::error::Error>> {
        let (r, _) = run(&be, vec![(corpus[..n].to_vec(), 1)], tag)?;
        r.first().map(|x| x.0).ok_or_else(|| "no first token".into())
    };
    let ttft_64 = ttft(64, "p64")?;
    let ttft_512 = ttft(512, "p512")?;
    let mut decode = [0.0; 3];
    for (d, c) in decode.iter_mut().zip(STREAMS) {
        let reqs = prompts[..c].iter().map(|p| (p.clone(), tokens)).collect();
        let (r, wall) = run(&be, reqs, &format!("c{c}"))?;
        let after_first: usize = r.iter().map(|x| x.2.saturating_sub(1)).sum();
        let last_first = r.iter().map(|x| x.0).fold(0.0, f64::max);
        *d = after_first as f64 / (wall - last_first).max(1e-9);
    }
    let mut decode_ctx = 0.0;
    if ctx > 0 {
        let (r, wall) = run(&be, vec![(corpus[..ctx].to_vec(), tokens)], "ctx")?;
        let (first, n) = r.first().map(|x| (x.0, x.2)).ok_or("no long-context stream")?;
        decode_ctx = n.saturating_sub(1) as f64 / (wall - first).max(1e-9);
    }
    be.shutdown();
    Ok(Round {
        name: card.name.unwrap_or_default(),
        arch: card.arch,
        quantization: card.quantization,
        weights_mb,
        load_s,
        prefill_64: 64.0 / ttft_64,
        prefill_512: 512.0 / ttft_512,
        ttft_64_ms: ttft_64 * 1e3,
        decode_1: decode[0],
        decode_8: decode[1],
        decode_16: decode[2],
        ctx,
        decode_ctx,
        peak_rss_mib: peak_rss_mib(),
        kv_blocks,
    })
}

/// Per request: (time to first token, end, completion tokens), seconds
/// from submission; and the wall time.
type Timings = (Vec<(f64, f64, usize)>, f64);

/// Submits all `(prompt, max_tokens)` at once (greedy, EOS ignored, each
/// under its own prefix-cache salt so none reuses another's K/V) and waits.
fn run(
    be: &BatchEngine,
    reqs: Vec<(Vec<u32>, usize)>,
    tag: &str,
) -> Result<Timings, Box<dyn std::error::Error>> {
    let t0 = Instant::now();
    let streams = reqs
        .into_iter()
        .enumerate()
        .map(|(i, (ids, n))| {
            be.submit(SeqRequest {
                ignore_eos: true,
                tenant: format!("bench-{tag}-{i}"),
                ..SeqRequest::new(Prompt::Tokens(ids), n)
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // One reader per stream, so each first token is timed when it comes.
    let out = std::thread::scope(|sc| {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|s| {
                sc.spawn(move || -> Result<(f64, f64, usize), String> {
                    let mut first = f64::NAN;
                    loop {
                        match s.recv_timeout(Duration::from_secs(600)) {
                            Ok(SeqEvent::Delta { token_ids, .. }) => {
                                if first.is_nan() && !token_ids.is_empty() {
                                    first = t0.elapsed().as_secs_f64();
                                }
                            }
                            Ok(SeqEvent::Done(r)) => {
                                return Ok((first, t0.elapsed().as_secs_f64(), r.completion_tokens))
                            }
                            Ok(SeqEvent::Error(e)) => return Err(e),
                            Err(e) => return Err(format!("stream ended: {e}")),
                        }
                    }
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|h| h.join().map_err(|_| "a stream reader panicked".to_string())?)
            .collect::<Result<Vec<_>, String>>()
    })?;
    let wall = t0.elapsed().as_secs_f64();
    Ok((out, wall))
}
