//! The device check (`gcs-node gpu-check`, `scripts/gpu-check.sh`): one
//! model on a device against the CPU decoder, and its speed through the
//! batch scheduler the worker serves with. Written for a GPU but generic
//! over [`ComputeDevice`], so CPU against CPU is its own unit test (exact
//! agreement).

pub mod anatomy;
pub mod dense;
pub mod embed;
pub mod naive;

use std::path::PathBuf;
use std::sync::mpsc::TryRecvError;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::backend::{self, paged_decoder, ComputeDevice, CpuDecoder, GpuOptions, PagedDecoder};
use crate::error::{EngineError, Result};
use crate::llama::PagedSeq;
use crate::paged::BLOCK_SIZE;
use crate::sampling::{argmax, Logprobs, SamplingOptions};
use crate::scheduler::{BatchConfig, BatchEngine, Prompt, SeqEvent, SeqRequest};
use crate::{cpu_device, Engine};

/// What to check.
#[derive(Debug, Clone)]
pub struct CheckConfig {
    pub model: PathBuf,
    pub device: ComputeDevice,
    /// Prompt token ids (the fixture's chat prompts).
    pub prompts: Vec<Vec<u32>>,
    /// Greedy tokens compared per prompt.
    pub greedy_tokens: usize,
    /// Prompts whose logits are compared in full (max |Δ logit|).
    pub logit_prompts: usize,
    /// Concurrent streams of each decode measurement.
    pub batches: Vec<usize>,
    /// Tokens each stream decodes in a measurement (after its first).
    pub decode_tokens: usize,
    /// Length of the prompt the prefill figure times.
    pub prefill_tokens: usize,
    /// Timed steps of the naive loop at each batch size (0: none).
    pub naive_steps: usize,
    /// A BERT embedder's folder to compare and time on the device too.
    pub embed_dir: Option<PathBuf>,
    /// Texts per batch of the embedder's figures.
    pub embed_batches: Vec<usize>,
}

/// One decode measurement: `batch` streams at once, steady state (from
/// the moment every stream has its first token).
#[derive(Debug, Clone, Serialize)]
pub struct DecodeFigure {
    pub batch: usize,
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Streams whose tokens equal the first stream's (all decode the
    /// same prompt greedily, so each row of a batch must agree).
    pub streams_equal: usize,
    /// Streams whose first tokens equal the CPU decoder's greedy
    /// continuation of the prompt (as many as the parity check compared).
    pub streams_match_cpu: usize,
    /// Rows read back after their step during the measurement: draws
    /// whose cut lay past the device's best candidates
    /// (`BatchEngine::rows_read_after_step`).
    pub rows_read_after: u64,
    /// Streams with logprobs ([`decode_logprobs`](CheckReport)): their
    /// logprobs against the CPU engine's, over each stream's tokens up to
    /// and including its first that differs from the CPU's (whose
    /// alternatives come from the same context as the CPU's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<LogprobAgreement>,
}

/// A device's logprobs against the CPU engine's, token by token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LogprobAgreement {
    /// Tokens compared (every stream's, summed).
    pub tokens: usize,
    /// Of those, the tokens whose alternatives are the CPU's ids in the
    /// CPU's order.
    pub top_ids_equal: usize,
    /// Largest |Δ logprob|, of the chosen tokens and of the alternatives
    /// both sides list at one rank.
    pub max_abs_delta: f32,
    /// Every logprob compared is the CPU's bit for bit: expected in the
    /// CPU's arithmetic (both sides weigh and sum the normaliser alike,
    /// ggml's `expf` on both).
    pub bit_equal: bool,
}

impl LogprobAgreement {
    /// Streams `ids` with their logprobs `lps` against the CPU's
    /// `reference`: each stream's logprobs while the tokens before them
    /// are the CPU's. In float arithmetic a draw can leave the CPU's
    /// stream at its first token (synthetic weights' logits are flat),
    /// and that token's alternatives are still comparable.
    fn of(ids: &[Vec<u32>], lps: &[Vec<Logprobs>], reference: &Stream) -> Self {
        let mut a = LogprobAgreement { bit_equal: true, ..Default::default() };
        for (t, l) in ids.iter().zip(lps) {
            let same = t.iter().zip(&reference.ids).take_while(|(x, y)| x == y).count();
            for (g, w) in l.iter().zip(&reference.logprobs).take(same + 1) {
                a.add(g, w);
            }
        }
        a
    }

    /// Adds one token's logprobs `got` against the CPU's `want`.
    fn add(&mut self, got: &Logprobs, want: &Logprobs) {
        let pairs =
            std::iter::once((&got.chosen, &want.chosen)).chain(got.top.iter().zip(&want.top));
        for (g, w) in pairs.filter(|(g, w)| g.token == w.token) {
            self.max_abs_delta = self.max_abs_delta.max((g.logprob - w.logprob).abs());
            self.bit_equal &= g.logprob.to_bits() == w.logprob.to_bits();
        }
        let ids = |l: &Logprobs| l.top.iter().map(|t| t.token).collect::<Vec<_>>();
        let same_ids = ids(got) == ids(want);
        self.bit_equal &= same_ids;
        self.top_ids_equal += usize::from(same_ids);
        self.tokens += 1;
    }
}

/// A decoder against the CPU decoder on the check's prompts.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Parity {
    /// Prompts whose greedy continuation equals the CPU's for
    /// `greedy_tokens` tokens (a free-running greedy decode diverges at
    /// the first step where the teacher-forced top-1 differs).
    pub greedy_identical: usize,
    pub prompts: usize,
    /// Teacher-forced (by the CPU's tokens) top-1 agreement.
    pub top1_agree: usize,
    pub top1_total: usize,
    pub max_abs_logit_delta: f32,
    /// Every logit compared (the first `logit_prompts` prompts, as
    /// `max_abs_logit_delta`) equals the CPU's bit for bit.
    pub logits_bit_equal: bool,
}

/// The decoder in the CPU's arithmetic (`GpuOptions::exact`): its parity
/// and decode speed, in the same run as the default's.
#[derive(Debug, Clone, Serialize)]
pub struct ExactFigures {
    #[serde(flatten)]
    pub parity: Parity,
    pub decode: Vec<DecodeFigure>,
    /// The penalised streams with logprobs (as `decode_logprobs`) at the
    /// first two batch sizes: in the CPU's arithmetic every draw, and so
    /// every stream, is the CPU engine's (the exact decoder only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sampled: Vec<DecodeFigure>,
}

/// The decoder over f16 copies of the weights (`GpuOptions::dense`): its
/// parity and decode speed, or why it has none.
#[derive(Debug, Clone, Serialize)]
pub struct DenseDecoder {
    pub figures: Option<ExactFigures>,
    pub error: Option<String>,
}

/// The check's findings (`gpu-check.json`).
#[derive(Debug, Clone, Serialize)]
pub struct CheckReport {
    pub device: String,
    pub backend: String,
    pub memory_bytes: u64,
    pub load_s: f64,
    /// The decoder as it serves by default.
    #[serde(flatten)]
    pub parity: Parity,
    pub decode: Vec<DecodeFigure>,
    /// The same streams sampled at temperature 1, all with one seed
    /// ([`SAMPLED_SEED`]; OpenAI's default request, each token drawn on a
    /// GPU): `streams_equal` counts the streams that drew the first's
    /// tokens (a draw does not depend on the batch), `streams_match_cpu`
    /// those whose first tokens equal the CPU engine's draws with that
    /// seed.
    pub decode_sampled: Vec<DecodeFigure>,
    /// The same with a nucleus ([`NUCLEUS_TOP_P`]): each draw finished on
    /// the host from the row's best candidates a GPU selects, or from its
    /// logits where the nucleus is wider.
    pub decode_nucleus: Vec<DecodeFigure>,
    /// The sampled streams with penalties ([`penalized`]): each row's
    /// penalties added on a GPU before its draw, no logits copied.
    pub decode_penalized: Vec<DecodeFigure>,
    /// The penalised streams with logprobs ([`LOGPROBS`] alternatives): a
    /// GPU picks each token from the adjusted row and selects the
    /// candidates its logprobs come from before the additions
    /// (`Pick::Scored`); their logprobs against the CPU engine's.
    pub decode_logprobs: Vec<DecodeFigure>,
    /// The same checks in the CPU's arithmetic (GPU only).
    pub exact: Option<ExactFigures>,
    /// Whether decode steps replayed recorded graphs (`decode`), and the
    /// same measurements launched eagerly, in the same run (GPU only).
    pub graphs: bool,
    pub decode_eager: Vec<DecodeFigure>,
    /// Where a decode step's time goes, part by part, at each batch (GPU
    /// only).
    pub anatomy: Vec<anatomy::AnatomyFigure>,
    /// Layer 0's gate/up and the LM head by the decoder's quantized
    /// kernels and over f16 copies by cubek's routines, at each batch
    /// (GPU only; the check's last part).
    pub dense: Vec<dense::DenseFigure>,
    /// The whole decoder on those copies in every step (`GCS_GPU_DENSE=1`):
    /// parity against the CPU and decode tok/s at each batch (GPU only;
    /// last).
    pub dense_decoder: Option<DenseDecoder>,
    /// Issue 17's naive burn loop on the same device, in the same run
    /// (`naive`): the step time of a launch-per-op decoder.
    pub naive: Vec<naive::NaiveFigure>,
    /// The embedder on the device against the CPU (`embed_dir`).
    pub embed: Option<embed::EmbedFigure>,
    /// The CPU engine's single-stream decode, in the same run.
    pub cpu_decode_tokens_per_s: f64,
    pub prefill_tokens: usize,
    pub ttft_ms: f64,
    pub prefill_tokens_per_s: f64,
}

fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK_SIZE)
}

/// Run the check. Errors are the engine's or the backend's, as text.
pub fn run(cfg: &CheckConfig) -> Result<CheckReport> {
    run_with(cfg, &mut |_| {})
}

/// [`run`], handing the report so far to `progress` after each phase (the
/// decoder, the naive loop, the embedder): a check stopped in a later
/// phase keeps what the earlier ones found.
pub fn run_with(cfg: &CheckConfig, progress: &mut dyn FnMut(&CheckReport)) -> Result<CheckReport> {
    let backend_err = |e: backend::BackendError| EngineError::Backend(e.to_string());
    let gpu = backend::check_device(cfg.device).map_err(backend_err)?;
    let reference = CpuReference::run(cfg)?;
    let cpu_ref = reference.first();
    let (parity, load_s) = against_cpu(cfg, &reference, GpuOptions::default())?;
    let cpu_engine =
        BatchEngine::start(Engine::load(&cfg.model, &cpu_device())?, BatchConfig::default());
    let cpu_decode_tokens_per_s = cpu_engine.measure_decode(32)?;
    let short = cfg.prompts.first().cloned().unwrap_or_else(|| vec![1]);
    // Sampled at temperature 1, with a nucleus, with penalties, and with
    // penalties and logprobs: each ask's stream on the CPU engine first.
    let asks = [
        Ask::sampled(sampled(1.0)),
        Ask::sampled(sampled(NUCLEUS_TOP_P)),
        Ask::sampled(penalized()),
        Ask { logprobs: Some(LOGPROBS), ..Ask::sampled(penalized()) },
    ];
    let cpu_streams = asks
        .iter()
        .map(|a| cpu_stream(&cpu_engine, &short, cfg.greedy_tokens, a))
        .collect::<Result<Vec<_>>>()?;
    drop(cpu_engine);

    let greedy = Stream { ids: cpu_ref.to_vec(), logprobs: vec![] };
    let (engine, decode) = decode_figures(cfg, &short, &greedy, GpuOptions::default())?;
    let mut sampled_figures: [Vec<DecodeFigure>; 4] = Default::default();
    for &b in &cfg.batches {
        for ((ask, cpu), figures) in asks.iter().zip(&cpu_streams).zip(&mut sampled_figures) {
            figures.push(measure(&engine, &short, b.max(1), cfg.decode_tokens, cpu, ask)?);
        }
    }
    let [decode_sampled, decode_nucleus, decode_penalized, decode_logprobs] = sampled_figures;
    let long: Vec<u32> = short.iter().copied().cycle().take(cfg.prefill_tokens.max(1)).collect();
    let ttft = first_token(&engine, &long)?;
    drop(engine);
    // The same figures with every step launched eagerly, side by side.
    let graphs = gpu.as_ref().is_some_and(|g| backend::graphs_default(g.kind));
    let eager = GpuOptions { graphs: Some(false), ..Default::default() };
    let decode_eager = if graphs { decode_figures(cfg, &short, &greedy, eager)?.1 } else { vec![] };
    let (name, backend, memory_bytes) = match &gpu {
        Some(g) => (g.name.clone(), g.kind.name().to_string(), g.memory_bytes),
        None => ("cpu".to_string(), backend::BackendKind::Cpu.name().to_string(), 0),
    };
    let mut report = CheckReport {
        device: name,
        backend,
        memory_bytes,
        load_s,
        parity,
        decode,
        decode_sampled,
        decode_nucleus,
        decode_penalized,
        decode_logprobs,
        exact: None,
        graphs,
        decode_eager,
        anatomy: vec![],
        dense: vec![],
        dense_decoder: None,
        naive: vec![],
        embed: None,
        cpu_decode_tokens_per_s,
        prefill_tokens: long.len(),
        ttft_ms: ttft.as_secs_f64() * 1e3,
        prefill_tokens_per_s: long.len() as f64 / ttft.as_secs_f64().max(1e-9),
    };
    progress(&report);
    if gpu.is_some() {
        let exact = GpuOptions { exact: Some(true), ..Default::default() };
        let (parity, _) = against_cpu(cfg, &reference, exact)?;
        let (engine, decode) = decode_figures(cfg, &short, &greedy, exact)?;
        // The last ask: penalties and a bias, with logprobs.
        let (ask, cpu) = (&asks[3], &cpu_streams[3]);
        let sampled = (cfg.batches.iter().take(2))
            .map(|&b| measure(&engine, &short, b.max(1), cfg.decode_tokens, cpu, ask))
            .collect::<Result<Vec<_>>>()?;
        report.exact = Some(ExactFigures { parity, decode, sampled });
        progress(&report);
    }
    report.anatomy =
        anatomy::run(&Engine::load(&cfg.model, &cpu_device())?, cfg.device, &cfg.batches);
    progress(&report);
    // burn has no wgpu backend in this build: the naive loop runs on
    // burn-cuda or the CPU only.
    if cfg.naive_steps > 0 && !matches!(cfg.device, ComputeDevice::Wgpu(_)) {
        let d = backend::burn_device(cfg.device);
        report.naive = naive::run(naive::NaiveShape::SMOLLM2, &d, &cfg.batches, cfg.naive_steps);
        progress(&report);
    }
    if let Some(dir) = &cfg.embed_dir {
        report.embed = Some(embed::run(dir, cfg.device, &cfg.embed_batches)?);
        progress(&report);
    }
    if gpu.is_some() {
        report.dense =
            dense::run(&Engine::load(&cfg.model, &cpu_device())?, cfg.device, &cfg.batches);
        progress(&report);
        // Last: a routine that panics ends only this part.
        let opts = GpuOptions { dense: Some(1), ..Default::default() };
        let run = std::panic::AssertUnwindSafe(|| -> Result<ExactFigures> {
            let (parity, _) = against_cpu(cfg, &reference, opts)?;
            let decode = decode_figures(cfg, &short, &greedy, opts)?.1;
            Ok(ExactFigures { parity, decode, sampled: vec![] })
        });
        let (figures, error) = match std::panic::catch_unwind(run) {
            Ok(Ok(f)) => (Some(f), None),
            Ok(Err(e)) => (None, Some(e.to_string())),
            Err(_) => (None, Some("panicked (the log has its message)".into())),
        };
        report.dense_decoder = Some(DenseDecoder { figures, error });
        progress(&report);
    }
    Ok(report)
}

/// The CPU decoder's run of the check's prompts, each step teacher-forced
/// by its own greedy token: every step's token, and the whole logits of
/// the first `logit_prompts` prompts. Computed once; each device decoder
/// is compared against it ([`against_cpu`]).
struct CpuReference {
    table: Vec<u32>,
    /// Per prompt, the token of each step.
    tokens: Vec<Vec<u32>>,
    /// Per prompt of the first `logit_prompts`, each step's logits.
    logits: Vec<Vec<Vec<f32>>>,
}

impl CpuReference {
    fn run(cfg: &CheckConfig) -> Result<Self> {
        let longest = cfg.prompts.iter().map(Vec::len).max().unwrap_or(0) + cfg.greedy_tokens + 1;
        let table: Vec<u32> = (0..blocks(longest) as u32).collect();
        let mut cpu = CpuDecoder::new(Engine::load(&cfg.model, &cpu_device())?.model, table.len());
        let (mut tokens, mut logits) = (vec![], vec![]);
        for (i, prompt) in cfg.prompts.iter().enumerate() {
            let (mut toks, mut steps) = (vec![], vec![]);
            let mut feed = prompt.clone();
            let mut past = 0;
            for _ in 0..cfg.greedy_tokens {
                let s =
                    [PagedSeq { tokens: &feed, past, table: &table, decode_from: prompt.len() }];
                let a = cpu.forward_paged(&s)?;
                let tok = argmax(&a);
                toks.push(tok);
                if i < cfg.logit_prompts {
                    steps.push(a);
                }
                past += feed.len();
                feed = vec![tok];
            }
            tokens.push(toks);
            if i < cfg.logit_prompts {
                logits.push(steps);
            }
        }
        Ok(Self { table, tokens, logits })
    }

    /// The CPU's greedy continuation of the first prompt, which the decode
    /// measurements (that prompt, greedy) must reproduce on every stream.
    fn first(&self) -> &[u32] {
        self.tokens.first().map_or(&[], Vec::as_slice)
    }
}

/// The decoder on the checked device (as `opts` says) against the CPU's
/// run `r`, fed the CPU's tokens; and the seconds it took to load. Logits
/// are compared (max |Δ|, bit-equality) over the prompts `r` kept them of.
fn against_cpu(cfg: &CheckConfig, r: &CpuReference, opts: GpuOptions) -> Result<(Parity, f64)> {
    let backend_err = |e: backend::BackendError| EngineError::Backend(e.to_string());
    let t = Instant::now();
    let model = Engine::load(&cfg.model, &cpu_device())?.model;
    let mut dev = paged_decoder(cfg.device, model, r.table.len(), opts).map_err(backend_err)?;
    let load_s = t.elapsed().as_secs_f64();
    let mut p = Parity { prompts: cfg.prompts.len(), logits_bit_equal: true, ..Default::default() };
    for (i, (prompt, want)) in cfg.prompts.iter().zip(&r.tokens).enumerate() {
        let mut feed = prompt.clone();
        let mut past = 0;
        let mut all = true;
        for (step, &tok) in want.iter().enumerate() {
            let s = [PagedSeq { tokens: &feed, past, table: &r.table, decode_from: prompt.len() }];
            let b = dev.forward_paged(&s)?;
            if let Some(a) = r.logits.get(i).map(|l| &l[step]) {
                let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                p.max_abs_logit_delta = p.max_abs_logit_delta.max(d);
                p.logits_bit_equal &= a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            }
            let same = argmax(&b) == tok;
            p.top1_agree += usize::from(same);
            all &= same;
            p.top1_total += 1;
            past += feed.len();
            feed = vec![tok]; // teacher-forced by the CPU
        }
        p.greedy_identical += usize::from(all);
    }
    Ok((p, load_s))
}

/// A batch engine on the checked device (as `opts` says) and its decode
/// figure at each batch size.
fn decode_figures(
    cfg: &CheckConfig,
    short: &[u32],
    cpu_ref: &Stream,
    opts: GpuOptions,
) -> Result<(BatchEngine, Vec<DecodeFigure>)> {
    let backend_err = |e: backend::BackendError| EngineError::Backend(e.to_string());
    let most = cfg.batches.iter().copied().max().unwrap_or(1).max(1);
    let per_seq = blocks(short.len() + cfg.decode_tokens + 2) + 1;
    let kv_blocks = (most * per_seq).max(blocks(cfg.prefill_tokens + 2) + 1);
    let bcfg = BatchConfig {
        max_running: most,
        max_waiting: most,
        kv_blocks,
        gpu: opts,
        ..Default::default()
    };
    let engine = BatchEngine::start_on(Engine::load(&cfg.model, &cpu_device())?, bcfg, cfg.device)
        .map_err(backend_err)?;
    // Warm-up: every kernel compiled before anything is timed.
    engine.measure_decode(4)?;
    let (mut decode, greedy) = (vec![], Ask::default());
    for &b in &cfg.batches {
        decode.push(measure(&engine, short, b.max(1), cfg.decode_tokens, cpu_ref, &greedy)?);
    }
    Ok((engine, decode))
}

/// The seed of every sampled stream of the check.
pub const SAMPLED_SEED: u64 = 7;

/// The nucleus of the check's top-p streams (`decode_nucleus`).
pub const NUCLEUS_TOP_P: f32 = 0.9;

/// The alternatives each token of the check's streams with logprobs
/// lists (`decode_logprobs`).
pub const LOGPROBS: usize = 5;

/// The check's sampled streams: temperature 1 (OpenAI's default), with
/// [`SAMPLED_SEED`], keeping the nucleus `top_p`.
fn sampled(top_p: f32) -> SamplingOptions {
    SamplingOptions { temperature: 1.0, top_p, seed: SAMPLED_SEED, ..Default::default() }
}

/// The check's penalised streams: [`sampled`] without a nucleus, with
/// OpenAI's frequency and presence penalties (0.5, 0.3) and a bias on a
/// few ids.
fn penalized() -> SamplingOptions {
    let logit_bias = vec![(13, -2.0), (28, 1.5), (330, -1.0)];
    SamplingOptions { frequency_penalty: 0.5, presence_penalty: 0.3, logit_bias, ..sampled(1.0) }
}

/// What a stream of the check asks for: greedy (`sampling` none) or
/// sampled, with or without logprobs.
#[derive(Debug, Clone, Default)]
struct Ask {
    sampling: Option<SamplingOptions>,
    logprobs: Option<usize>,
}

impl Ask {
    fn sampled(o: SamplingOptions) -> Self {
        Self { sampling: Some(o), logprobs: None }
    }

    /// A stream of `prompt`, `max_tokens` long, with a prefix-cache salt
    /// of its own.
    fn request(&self, prompt: &[u32], max_tokens: usize, salt: usize) -> SeqRequest {
        let mut r = SeqRequest::new(Prompt::Tokens(prompt.to_vec()), max_tokens);
        r.ignore_eos = true;
        // A salt of its own per stream: no stream reuses another's prefix.
        r.tenant = format!("gcs-engine/check/{salt}");
        if let Some(o) = &self.sampling {
            r.sampling = o.clone();
        }
        r.logprobs = self.logprobs;
        r
    }
}

/// A stream's tokens and, where it asked, their logprobs.
#[derive(Debug, Clone, Default)]
struct Stream {
    ids: Vec<u32>,
    logprobs: Vec<Logprobs>,
}

/// The first `tokens` tokens (and logprobs) `engine` gives `prompt` as
/// `ask` says.
fn cpu_stream(engine: &BatchEngine, prompt: &[u32], tokens: usize, ask: &Ask) -> Result<Stream> {
    let s = engine.submit(ask.request(prompt, tokens, usize::MAX))?;
    let mut out = Stream::default();
    loop {
        match s.recv() {
            Some(SeqEvent::Delta { token_ids, logprobs, .. }) => {
                out.ids.extend(token_ids);
                out.logprobs.extend(logprobs);
            }
            Some(SeqEvent::Done(_)) => return Ok(out),
            Some(SeqEvent::Error(e)) => return Err(EngineError::InvalidRequest(e)),
            None => return Err(EngineError::Stopped),
        }
    }
}

/// `batch` streams of `tokens` tokens after the first, at once, as `ask`
/// says; `reference` is what each stream's first tokens (and logprobs)
/// should be.
fn measure(
    engine: &BatchEngine,
    prompt: &[u32],
    batch: usize,
    tokens: usize,
    reference: &Stream,
    ask: &Ask,
) -> Result<DecodeFigure> {
    let read_before = engine.rows_read_after_step();
    let streams = (0..batch)
        .map(|i| engine.submit(ask.request(prompt, tokens + 1, i)))
        .collect::<Result<Vec<_>>>()?;
    let mut got = vec![0usize; batch];
    let mut ids: Vec<Vec<u32>> = vec![vec![]; batch];
    let mut lps: Vec<Vec<Logprobs>> = vec![vec![]; batch];
    let mut done = vec![false; batch];
    let (mut start, mut counted) = (None::<Instant>, 0usize);
    while done.iter().any(|d| !d) {
        let mut idle = true;
        for (i, s) in streams.iter().enumerate() {
            if done[i] {
                continue;
            }
            let ev = match s.try_recv() {
                Ok(ev) => ev,
                Err(TryRecvError::Empty) => continue,
                Err(TryRecvError::Disconnected) => return Err(EngineError::Stopped),
            };
            idle = false;
            match ev {
                SeqEvent::Delta { token_ids, logprobs, .. } => {
                    got[i] += token_ids.len();
                    ids[i].extend_from_slice(&token_ids);
                    lps[i].extend(logprobs);
                    if start.is_some() {
                        counted += token_ids.len();
                    } else if got.iter().all(|&g| g > 0) {
                        // Every stream has its first token: steady state.
                        start = Some(Instant::now());
                    }
                }
                SeqEvent::Done(_) => done[i] = true,
                SeqEvent::Error(e) => return Err(EngineError::InvalidRequest(e)),
            }
        }
        if idle {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let seconds = start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let tokens_per_s = if seconds > 0.0 { counted as f64 / seconds } else { 0.0 };
    let streams_equal = ids.iter().filter(|t| **t == ids[0]).count();
    let want = &reference.ids;
    let k = want.len().min(tokens);
    let streams_match_cpu = ids.iter().filter(|t| t.len() >= k && t[..k] == want[..k]).count();
    let logprobs = ask.logprobs.map(|_| LogprobAgreement::of(&ids, &lps, reference));
    Ok(DecodeFigure {
        batch,
        tokens: counted,
        seconds,
        tokens_per_s,
        streams_equal,
        streams_match_cpu,
        rows_read_after: engine.rows_read_after_step() - read_before,
        logprobs,
    })
}

/// Time from submitting `prompt` to its first token.
fn first_token(engine: &BatchEngine, prompt: &[u32]) -> Result<Duration> {
    let t = Instant::now();
    let s = engine.submit(Ask::default().request(prompt, 1, usize::MAX))?;
    loop {
        match s.recv() {
            Some(SeqEvent::Delta { token_ids, .. }) if !token_ids.is_empty() => {
                return Ok(t.elapsed())
            }
            Some(SeqEvent::Delta { .. }) => {}
            Some(SeqEvent::Done(_)) => return Ok(t.elapsed()),
            Some(SeqEvent::Error(e)) => return Err(EngineError::InvalidRequest(e)),
            None => return Err(EngineError::Stopped),
        }
    }
}

#[cfg(test)]
mod tests;
