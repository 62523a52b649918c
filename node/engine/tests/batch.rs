//! Continuous batching against single-sequence generation (needs the model;
//! skips otherwise).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use gcs_engine::{
    cpu_device, BatchConfig, BatchEngine, ChatMessage, Engine, EngineError, FinishReason, Prompt,
    SamplingOptions, SamplingParams, SeqEvent, SeqRequest, SeqResult, SeqStream,
};

struct Collected {
    tokens: Vec<u32>,
    deltas: Vec<String>,
    logprobs: Vec<gcs_engine::sampling::Logprobs>,
    result: SeqResult,
}

fn collect(s: SeqStream) -> Collected {
    let (mut tokens, mut deltas, mut lps) = (Vec::new(), Vec::new(), Vec::new());
    loop {
        match s.recv_timeout(Duration::from_secs(120)).expect("event in time") {
            SeqEvent::Delta { text, token_ids, logprobs } => {
                tokens.extend(token_ids);
                deltas.push(text);
                lps.extend(logprobs);
            }
            SeqEvent::Done(result) => {
                assert_eq!(deltas.concat(), result.text, "deltas add up to the text");
                assert_eq!(tokens.len(), result.completion_tokens);
                return Collected { tokens, deltas, logprobs: lps, result };
            }
            SeqEvent::Error(e) => panic!("sequence failed: {e}"),
        }
    }
}

fn load() -> Option<(Engine, BatchEngine)> {
    load_with(BatchConfig { prefill_chunk: 32, ..BatchConfig::default() })
}

fn load_with(cfg: BatchConfig) -> Option<(Engine, BatchEngine)> {
    let path = common::smollm_path()?;
    let reference = Engine::load(&path, &cpu_device()).unwrap();
    let batch = BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg);
    Some((reference, batch))
}

const QUESTIONS: [&str; 8] = [
    "Name a colour.",
    "What is two plus two? Answer briefly please.",
    "Write a haiku about the sea.",
    "List three fruits.",
    "Why is the sky blue? Explain it to a child in a few sentences, with an example.",
    "Translate 'good morning' into French.",
    "Give me a fun fact about octopuses.",
    "What is the capital of Japan?",
];

fn chat(q: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::new("user", q)]
}

fn greedy_alone(e: &Engine, prompt: &[u32], max: usize) -> Vec<u32> {
    e.generate_from_tokens(prompt, max, &SamplingParams::greedy(), &[], |_| true).unwrap().token_ids
}

/// 8 sequences decoded together (with chunked prefill interleaved) give
/// exactly the greedy tokens of each sequence generated alone.
#[test]
fn batched_greedy_matches_generate_alone() {
    let Some((reference, batch)) = load() else { return };
    let streams: Vec<SeqStream> = QUESTIONS
        .iter()
        .map(|q| batch.submit(SeqRequest::new(Prompt::Chat(chat(q)), 24)).unwrap())
        .collect();
    for (q, s) in QUESTIONS.iter().zip(streams) {
        let prompt = reference.prompt_tokens(&chat(q)).unwrap();
        assert_eq!(s.prompt_tokens(), prompt.len());
        let got = collect(s);
        assert_eq!(got.tokens, greedy_alone(&reference, &prompt, 24), "{q}");
        assert_eq!(got.result.prompt_tokens, prompt.len());
    }
}

/// A prompt sharing a 64-token prefix with an earlier one reuses its
/// blocks, and the text is the same as without the cache. Other tenants
/// never share.
#[test]
fn prefix_cache_reuses_shared_prefix() {
    let Some((reference, batch)) = load() else { return };
    let sys = "You are a helpful assistant for a library. Answer questions about opening hours, \
               membership, borrowing rules and events. Be concise, friendly and accurate, and \
               never invent facts you were not given. The library is open from nine in the \
               morning to six in the evening on weekdays, and from ten to four on Saturdays.";
    let msgs = |q: &str| vec![ChatMessage::new("system", sys), ChatMessage::new("user", q)];
    let a = reference.prompt_tokens(&msgs("When do you open?")).unwrap();
    let b = reference.prompt_tokens(&msgs("Can I borrow ten books at once?")).unwrap();
    let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(shared >= 64, "prompts share {shared} tokens");
    let first = collect(batch.submit(SeqRequest::new(Prompt::Tokens(a), 8)).unwrap());
    assert_eq!(first.result.cached_tokens, 0);
    let second = collect(batch.submit(SeqRequest::new(Prompt::Tokens(b.clone()), 24)).unwrap());
    assert!(second.result.cached_tokens >= 48, "cached {}", second.result.cached_tokens);
    assert_eq!(second.tokens, greedy_alone(&reference, &b, 24));
    let other =
        SeqRequest { tenant: "someone-else".into(), ..SeqRequest::new(Prompt::Tokens(b), 4) };
    assert_eq!(collect(batch.submit(other).unwrap()).result.cached_tokens, 0);
}

/// A seed gives the same sampled text whatever runs next to it.
#[test]
fn seeded_sampling_is_independent_of_batch_neighbours() {
    let Some((_, batch)) = load() else { return };
    let sampled = |q: &str, seed| SeqRequest {
        sampling: SamplingOptions {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 50,
            min_p: 0.02,
            seed,
            frequency_penalty: 0.3,
            presence_penalty: 0.2,
            logit_bias: vec![],
        },
        ..SeqRequest::new(Prompt::Chat(chat(q)), 20)
    };
    let alone = collect(batch.submit(sampled("Tell me a short fact about the moon.", 7)).unwrap());
    let mut others: Vec<SeqStream> = QUESTIONS[..4]
        .iter()
        .enumerate()
        .map(|(i, q)| batch.submit(sampled(q, 100 + i as u64)).unwrap())
        .collect();
    let again = collect(batch.submit(sampled("Tell me a short fact about the moon.", 7)).unwrap());
    others.push(batch.submit(sampled(QUESTIONS[5], 3)).unwrap());
    assert_eq!(alone.tokens, again.tokens);
    assert_eq!(alone.result.text, again.result.text);
    for s in others {
        collect(s);
    }
}

/// A stop string spanning a token boundary ends generation; nothing of it
/// is ever emitted, and the text before it is.
#[test]
fn stop_string_split_across_tokens_is_never_emitted() {
    let Some((reference, batch)) = load() else { return };
    let q = "Write a detailed story about a lighthouse keeper.";
    let prompt = reference.prompt_tokens(&chat(q)).unwrap();
    let toks = greedy_alone(&reference, &prompt, 40);
    let tk = batch.tokenizer();
    // A boundary between two alphabetic tokens, well into the text.
    let i = (5..toks.len() - 1)
        .find(|&i| {
            let (x, y) = (tk.decode(&toks[i..=i]), tk.decode(&toks[i + 1..=i + 1]));
            x.trim().len() >= 2 && y.len() >= 2 && x.is_ascii() && y.is_ascii()
        })
        .expect("two ascii tokens");
    let (x, y) = (tk.decode(&toks[i..=i]), tk.decode(&toks[i + 1..=i + 1]));
    let stop = format!("{}{}", &x[x.len() - 2..], &y[..2]);
    let full = tk.decode(&toks);
    let want = &full[..full.find(&stop).unwrap()];
    let req =
        SeqRequest { stop: vec![stop.clone()], ..SeqRequest::new(Prompt::Tokens(prompt), 40) };
    let got = collect(batch.submit(req).unwrap());
    assert_eq!(got.result.finish_reason, FinishReason::Stop);
    assert_eq!(got.result.text, want, "stop {stop:?}");
    assert!(got.deltas.iter().all(|d| !d.contains(&stop[..2]) || want.contains(d.as_str())));
    assert!(!got.result.text.contains(&stop));
}

/// Cancelling (explicitly or by dropping the stream) frees the blocks and
/// reports the tokens generated so far.
#[test]
fn cancel_frees_blocks() {
    let cfg = BatchConfig { kv_blocks: 64, ..BatchConfig::default() };
    let Some((_, batch)) = load_with(cfg) else { return };
    let total = 64 * 16;
    assert_eq!(batch.free_kv_tokens(), total);
    let req = SeqRequest {
        ignore_eos: true,
        ..SeqRequest::new(Prompt::Chat(chat("Count from one to one thousand.")), 500)
    };
    let s = batch.submit(req.clone()).unwrap();
    let mut n = 0;
    while n < 3 {
        if let SeqEvent::Delta { token_ids, .. } = s.recv().unwrap() {
            n += token_ids.len();
        }
    }
    assert!(batch.free_kv_tokens() < total);
    s.cancel();
    let r = loop {
        match s.recv().unwrap() {
            SeqEvent::Done(r) => break r,
            SeqEvent::Delta { .. } => {}
            SeqEvent::Error(e) => panic!("{e}"),
        }
    };
    assert_eq!(r.finish_reason, FinishReason::Cancelled);
    assert!(r.completion_tokens >= 3 && r.completion_tokens < 500);
    let dropped = batch.submit(req).unwrap();
    let _ = dropped.recv();
    drop(dropped);
    let t = Instant::now();
    while (batch.free_kv_tokens() != total || batch.running() != 0) && t.elapsed().as_secs() < 10 {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(batch.free_kv_tokens(), total, "all blocks back (cached ones count as free)");
}

/// A full waiting queue refuses at once with Busy.
#[test]
fn full_queue_is_busy() {
    let cfg = BatchConfig { max_running: 1, max_waiting: 2, ..BatchConfig::default() };
    let Some((_, batch)) = load_with(cfg) else { return };
    let req = SeqRequest::new(Prompt::Chat(chat("Write a long poem.")), 64);
    let results: Vec<_> = (0..10).map(|_| batch.submit(req.clone())).collect();
    let busy = results.iter().filter(|r| matches!(r, Err(EngineError::Busy { .. }))).count();
    assert!(busy >= 7, "{busy} busy");
    let bad = SeqRequest::new(Prompt::Tokens(vec![]), 4);
    assert!(matches!(batch.submit(bad), Err(EngineError::InvalidRequest(_))));
    // Shutdown: accepted streams end (with an error event) and new
    // submissions are refused.
    batch.shutdown();
    assert!(matches!(batch.submit(req), Err(EngineError::Stopped)));
    for s in results.into_iter().flatten() {
        let mut last = None;
        while let Some(ev) = s.recv() {
            last = Some(ev);
        }
        assert!(matches!(last, Some(SeqEvent::Error(_) | SeqEvent::Done(_))), "{last:?}");
    }
}

/// Too few KV blocks for all sequences: the newest are preempted and
/// recomputed later, and every sequence still gets its greedy tokens.
#[test]
fn preemption_recomputes_to_the_same_tokens() {
    let cfg = BatchConfig { kv_blocks: 14, prefill_chunk: 64, ..BatchConfig::default() };
    let Some((reference, batch)) = load_with(cfg) else { return };
    let qs = &QUESTIONS[2..6];
    let streams: Vec<SeqStream> = qs
        .iter()
        .map(|q| batch.submit(SeqRequest::new(Prompt::Chat(chat(q)), 48)).unwrap())
        .collect();
    for (q, s) in qs.iter().zip(streams) {
        let prompt = reference.prompt_tokens(&chat(q)).unwrap();
        assert_eq!(collect(s).tokens, greedy_alone(&reference, &prompt, 48), "{q}");
    }
}

/// Logprobs come with each token when asked for.
#[test]
fn logprobs_are_reported() {
    let Some((_, batch)) = load() else { return };
    let req =
        SeqRequest { logprobs: Some(3), ..SeqRequest::new(Prompt::Chat(chat(QUESTIONS[0])), 6) };
    let s = batch.submit(req).unwrap();
    let mut n = 0;
    while let Some(ev) = s.recv() {
        match ev {
            SeqEvent::Delta { token_ids, logprobs, .. } => {
                assert_eq!(token_ids.len(), logprobs.len());
                for (t, lp) in token_ids.iter().zip(&logprobs) {
                    assert_eq!(lp.chosen.token, *t);
                    assert_eq!(lp.top.len(), 3);
                    // Greedy: the chosen token is the most likely one.
                    assert_eq!(lp.top[0].token, *t);
                    assert!(lp.chosen.logprob <= 0.0);
                }
                n += token_ids.len();
            }
            SeqEvent::Done(_) => break,
            SeqEvent::Error(e) => panic!("{e}"),
        }
    }
    assert!(n > 0);
}

/// n > 1 samples share the prompt's blocks (copy-on-write) and each equals
/// the same request submitted alone with seed + i; prefill in 7-token
/// chunks (not block aligned) changes nothing.
#[test]
fn n_samples_share_prompt_and_match_single_runs() {
    let cfg = BatchConfig { prefill_chunk: 7, ..BatchConfig::default() };
    let Some((reference, batch)) = load_with(cfg) else { return };
    let q = "Tell me a short fact about the moon.";
    let req = |seed| SeqRequest {
        sampling: SamplingOptions {
            temperature: 0.8,
            top_p: 0.95,
            seed,
            ..SamplingOptions::default()
        },
        ..SeqRequest::new(Prompt::Chat(chat(q)), 16)
    };
    let streams = batch.submit_n(req(5), 3).unwrap();
    assert_eq!(streams.len(), 3);
    let got: Vec<Collected> = streams.into_iter().map(collect).collect();
    for (i, g) in got.iter().enumerate() {
        let alone = collect(batch.submit(req(5 + i as u64)).unwrap());
        assert_eq!(g.tokens, alone.tokens, "sample {i}");
    }
    assert_ne!(got[0].tokens, got[1].tokens, "different seeds, different samples");
    // Greedy with 7-token prefill chunks equals generate.
    let prompt = reference.prompt_tokens(&chat(q)).unwrap();
    let g = collect(batch.submit(SeqRequest::new(Prompt::Tokens(prompt.clone()), 16)).unwrap());
    assert_eq!(g.tokens, greedy_alone(&reference, &prompt, 16));
    assert!(batch.submit_n(req(1), 0).is_err());
}

/// Many requests with shared prefixes, a small pool (preemption), random
/// cancels and dropped streams: every kept stream ends with Done, and all
/// blocks come back.
#[test]
fn stress_cancel_and_preempt_leaks_nothing() {
    let cfg =
        BatchConfig { kv_blocks: 24, max_running: 6, prefill_chunk: 48, ..BatchConfig::default() };
    let Some((_, batch)) = load_with(cfg) else { return };
    let sys = "You are a terse assistant. Always answer in one or two sentences. ".repeat(3);
    let mut kept = Vec::new();
    for i in 0..14usize {
        let msgs = vec![
            ChatMessage::new("system", sys.clone()),
            ChatMessage::new("user", QUESTIONS[i % QUESTIONS.len()]),
        ];
        let req = SeqRequest {
            tenant: format!("t{}", i % 2),
            ignore_eos: i % 3 == 0,
            ..SeqRequest::new(Prompt::Chat(msgs), 8 + 5 * (i % 4))
        };
        let s = batch.submit(req).unwrap();
        match i % 4 {
            0 => drop(s),
            1 => {
                s.cancel();
                kept.push(s);
            }
            _ => kept.push(s),
        }
    }
    for s in kept {
        let mut done = false;
        while let Ok(ev) = s.recv_timeout(Duration::from_secs(120)) {
            match ev {
                SeqEvent::Done(r) => {
                    assert!(r.completion_tokens <= 23);
                    done = true;
                    break;
                }
                SeqEvent::Error(e) => panic!("{e}"),
                SeqEvent::Delta { .. } => {}
            }
        }
        assert!(done, "stream {} ended without Done", s.id());
    }
    let t = Instant::now();
    while (batch.free_kv_tokens() != 24 * 16 || batch.running() != 0) && t.elapsed().as_secs() < 10
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(batch.free_kv_tokens(), 24 * 16);
    assert_eq!(batch.waiting(), 0);
}

use gcs_engine::backend::{Adjust, CpuDecoder, PagedDecoder, Pick, StepLogits};

/// The CPU decoder answering as a GPU does: each sequence's argmax or
/// its plain temperature draw (`draw_temperature` at the uniform the
/// step was given) after its bias and penalty additions, and the logits
/// of only the sequences that asked for them (raw). Counts the steps that
/// copied none, the draws and the rows it added to.
#[derive(Debug)]
struct PickOnly {
    inner: CpuDecoder,
    counts: std::sync::Arc<PickCounts>,
    /// The last step's logits, for `last_logits`.
    last: Vec<f32>,
}

/// What a [`PickOnly`] decoder was asked for.
#[derive(Debug, Default)]
struct PickCounts {
    /// Steps that returned no logits.
    bare_steps: std::sync::atomic::AtomicUsize,
    draws: std::sync::atomic::AtomicUsize,
    tops: std::sync::atomic::AtomicUsize,
    /// Rows read back after their step (candidates that missed the cut).
    misses: std::sync::atomic::AtomicUsize,
    /// Rows it masked or added a bias or penalties to.
    adjusted: std::sync::atomic::AtomicUsize,
    /// Rows it masked.
    masked: std::sync::atomic::AtomicUsize,
    /// Rows it scored before their additions (logprobs beside them).
    scored: std::sync::atomic::AtomicUsize,
}

impl PagedDecoder for PickOnly {
    common::delegate_decoder!();
    fn picks_on_device(&self) -> bool {
        true
    }
    fn forward_paged(
        &mut self,
        seqs: &[gcs_engine::llama::PagedSeq<'_>],
    ) -> gcs_engine::Result<Vec<f32>> {
        self.inner.forward_paged(seqs)
    }
    fn forward_select(
        &mut self,
        seqs: &[gcs_engine::llama::PagedSeq<'_>],
        picks: &[Pick],
        adjust: &Adjust,
    ) -> gcs_engine::Result<StepLogits> {
        use gcs_engine::sampling::{argmax, draw_temperature, top_candidates};
        use std::sync::atomic::Ordering;
        let mut logits = self.inner.forward_paged(seqs)?;
        let v = self.vocab();
        let n = &self.counts;
        let mut scored = vec![];
        // Each row picked here masked, scored (its candidates, and its
        // added tokens' logits, before the additions), then its additions
        // in order.
        for (i, p) in picks.iter().enumerate() {
            if *p == Pick::Logits || !adjust.touches(i) {
                continue;
            }
            n.adjusted.fetch_add(1, Ordering::Relaxed);
            let row = &mut logits[i * v..(i + 1) * v];
            let words = &adjust.mask_words()[adjust.mask_range(i)];
            if !words.is_empty() {
                n.masked.fetch_add(1, Ordering::Relaxed);
                for (t, l) in row.iter_mut().enumerate() {
                    if !gcs_engine::constraint::word_allows(words, t as u32) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            let r = adjust.range(i);
            if let Pick::Scored { .. } = p {
                n.scored.fetch_add(1, Ordering::Relaxed);
                let mut c = top_candidates(row, 0.0);
                c.known =
                    adjust.ids()[r.clone()].iter().map(|&id| (id, row[id as usize])).collect();
                c.known.dedup_by_key(|k| k.0);
                scored.push((i, c));
            }
            for (&id, &a) in adjust.ids()[r.clone()].iter().zip(&adjust.adds()[r]) {
                row[id as usize] += a;
            }
        }
        let picked: Vec<u32> = logits
            .chunks(v)
            .zip(picks)
            .map(|(l, p)| match *p {
                Pick::Draw { temperature, u }
                | Pick::Top { temperature, u }
                | Pick::Scored { temperature, u }
                    if temperature > 0.0 && u >= 0.0 =>
                {
                    n.draws.fetch_add(1, Ordering::Relaxed);
                    draw_temperature(l, temperature, u)
                }
                _ => argmax(l),
            })
            .collect();
        // The picked token's logit beside the candidates, as a GPU's; a
        // scored row's unless an addition touched it.
        let pick_of = |i: usize| (picked[i], logits[i * v + picked[i] as usize]);
        for (i, c) in &mut scored {
            if c.known.iter().all(|k| k.0 != picked[*i]) {
                c.known.push(pick_of(*i));
            }
        }
        let tops = picks
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let t = match *p {
                    Pick::Top { temperature, .. } => temperature,
                    Pick::Scored { temperature, u } if u < 0.0 => temperature,
                    _ => return None,
                };
                n.tops.fetch_add(1, Ordering::Relaxed);
                let mut c = top_candidates(&logits[i * v..(i + 1) * v], t);
                if c.logit(picked[i]).is_none() {
                    c.known.push(pick_of(i));
                }
                Some((i, c))
            })
            .collect();
        let rows: Vec<usize> = (0..picks.len()).filter(|&i| picks[i] == Pick::Logits).collect();
        if rows.is_empty() {
            n.bare_steps.fetch_add(1, Ordering::Relaxed);
        }
        let kept = rows.iter().flat_map(|&i| logits[i * v..(i + 1) * v].iter().copied()).collect();
        self.last = logits;
        let (picked, adjusted) = (Some(picked), true);
        Ok(StepLogits { logits: kept, rows: Some(rows), picked, tops, scored, adjusted })
    }
    fn last_logits(&mut self, seqs: &[usize]) -> gcs_engine::Result<Vec<f32>> {
        let v = self.vocab();
        self.counts.misses.fetch_add(seqs.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(seqs.iter().flat_map(|&i| self.last[i * v..(i + 1) * v].iter().copied()).collect())
    }
}

/// The plain CPU engine, and the same model's scheduler over a
/// [`PickOnly`] decoder with its counts (`None` without the model).
fn pick_only() -> Option<(BatchEngine, BatchEngine, std::sync::Arc<PickCounts>)> {
    let (_, plain) = load()?;
    let path = common::smollm_path()?;
    let counts = std::sync::Arc::new(PickCounts::default());
    let n = counts.clone();
    let cfg = BatchConfig { prefill_chunk: 32, ..BatchConfig::default() };
    let select =
        BatchEngine::start_with(Engine::load(&path, &cpu_device()).unwrap(), cfg, |m, k| {
            Box::new(PickOnly { inner: CpuDecoder::new(m, k), counts: n, last: vec![] })
        });
    Some((plain, select, counts))
}

/// `requests` submitted to `select` and to `plain` at once: the same
/// tokens, text, finish and logprobs from each; `select`'s.
fn side_by_side(
    select: &BatchEngine,
    plain: &BatchEngine,
    requests: Vec<SeqRequest>,
) -> Vec<Collected> {
    let got: Vec<SeqStream> = requests.iter().map(|r| select.submit(r.clone()).unwrap()).collect();
    let want: Vec<SeqStream> = requests.into_iter().map(|r| plain.submit(r).unwrap()).collect();
    let mut out = vec![];
    for (i, (g, w)) in got.into_iter().zip(want).enumerate() {
        let (g, w) = (collect(g), collect(w));
        assert_eq!(g.tokens, w.tokens, "request {i}");
        assert_eq!(g.result.text, w.result.text, "request {i}");
        assert_eq!(g.result.finish_reason, w.result.finish_reason, "request {i}");
        assert_eq!(g.logprobs, w.logprobs, "request {i}");
        out.push(g);
    }
    out
}

/// The scheduler over a decoder that picks tokens without returning
/// logits (as the GPU decoder does: argmax ids for greedy sequences,
/// draws for plain temperature sampling, the best candidates for top-k /
/// top-p / min-p draws and for logprobs) gives the same tokens as the
/// plain CPU engine: greedy and seeded plain-temperature ones from the
/// picks, top-k / top-p / min-p ones from the candidates (and, where a
/// wide nucleus misses them, from the row read after the step), and the
/// same logprobs from the candidates (greedy, drawn, cut), where the
/// token lies outside them from the row read after the step; steps
/// without any such sequence copy no logits.
#[test]
fn tokens_picked_by_the_decoder_equal_the_cpu_engines() {
    let Some((plain, select, counts)) = pick_only() else { return };
    let sampled = |q: &str, o: SamplingOptions| SeqRequest {
        sampling: o,
        ..SeqRequest::new(Prompt::Chat(chat(q)), 12)
    };
    let requests = || {
        let greedy = |q: &str| SeqRequest::new(Prompt::Chat(chat(q)), 12);
        let o =
            |temperature, seed| SamplingOptions { temperature, seed, ..SamplingOptions::default() };
        let seeded = sampled(QUESTIONS[2], o(0.8, 7));
        let nucleus = sampled(QUESTIONS[0], SamplingOptions { top_p: 0.9, ..o(1.2, 3) });
        let lp = SeqRequest { logprobs: Some(2), ..greedy(QUESTIONS[3]) };
        vec![greedy(QUESTIONS[0]), greedy(QUESTIONS[1]), seeded, nucleus, lp]
    };
    // Greedy and plain-temperature streams alone first: those steps need
    // no logits at all.
    let alone: Vec<Collected> =
        requests().into_iter().take(3).map(|r| collect(select.submit(r).unwrap())).collect();
    assert!(n_of(&counts.bare_steps) > 0, "greedy steps copied no logits");
    // Every token of the seeded stream was drawn by the decoder (and a
    // prompt chunk before its last may be asked for a draw it ignores).
    let (drawn_alone, seeded) = (n_of(&counts.draws), alone[2].tokens.len());
    assert!(seeded > 0 && drawn_alone >= seeded, "{drawn_alone} draws, {seeded} tokens");
    for (i, g) in side_by_side(&select, &plain, requests()).iter().enumerate().take(3) {
        assert_eq!(alone[i].tokens, g.tokens, "request {i} alone");
    }
    let drawn = n_of(&counts.draws) - drawn_alone;
    assert!(drawn >= seeded, "drawn beside the others too: {drawn}");
    // Top-k, top-p and min-p draws from the candidates, side by side;
    // a hot, wide nucleus misses them on some steps.
    let o = |seed| SamplingOptions { seed, ..SamplingOptions::default() };
    // With logprobs: a cut draw's, a hot plain draw's (some tokens
    // outside the candidates) and a greedy one's from the candidates.
    let scored = |r: SeqRequest| SeqRequest { logprobs: Some(3), ..r };
    let cut = || {
        vec![
            sampled(QUESTIONS[1], SamplingOptions { temperature: 0.9, top_k: 40, ..o(5) }),
            sampled(QUESTIONS[2], SamplingOptions { temperature: 1.0, min_p: 0.05, ..o(6) }),
            sampled(QUESTIONS[3], SamplingOptions { temperature: 2.0, top_p: 0.999, ..o(8) }),
            scored(sampled(QUESTIONS[0], SamplingOptions { temperature: 0.8, top_p: 0.9, ..o(9) })),
            scored(sampled(QUESTIONS[1], SamplingOptions { temperature: 3.0, ..o(10) })),
            scored(sampled(QUESTIONS[2], SamplingOptions::default())),
        ]
    };
    let (tops_before, misses_before) = (n_of(&counts.tops), n_of(&counts.misses));
    let mut tokens = 0;
    for (i, g) in side_by_side(&select, &plain, cut()).iter().enumerate() {
        assert_eq!(g.logprobs.len(), if i < 3 { 0 } else { g.tokens.len() }, "cut request {i}");
        tokens += g.tokens.len();
    }
    let (tops, misses) = (n_of(&counts.tops) - tops_before, n_of(&counts.misses) - misses_before);
    eprintln!("{tokens} tokens: {tops} candidate rows, {misses} read after their step");
    assert_eq!(select.rows_read_after_step(), n_of(&counts.misses) as u64, "counted as read");
    assert!(tops >= tokens, "every cut token asked for candidates: {tops} of {tokens}");
    assert!(misses > 0 && misses < tops, "{misses} misses of {tops}");
}

/// A bias and penalties added by the decoder before it picks (greedy, a
/// plain draw, top-k / top-p / min-p from candidates of the adjusted row,
/// a wide nucleus from the adjusted row read after its step) give the
/// tokens the plain CPU engine gives, which adds them on the host; and
/// such greedy steps copy no logits. With logprobs (of the raw logits:
/// greedy, drawn, cut, and a token the bias forces from far outside the
/// raw candidates) the same logprobs from the candidates of the row
/// before the additions and the added tokens' logits beside them.
#[test]
fn a_bias_and_penalties_added_by_the_decoder_equal_the_cpu_engines() {
    let Some((plain, select, counts)) = pick_only() else { return };
    // A bias that changes the answer (its first greedy token banned, a
    // few ids pushed and pulled), penalties that change it as it grows.
    let raw = SeqRequest::new(Prompt::Chat(chat(QUESTIONS[0])), 14);
    let raw = collect(plain.submit(raw).unwrap()).tokens;
    let adjusted = |t, seed, top_k, top_p, min_p| SamplingOptions {
        temperature: t,
        seed,
        top_k,
        top_p,
        min_p,
        frequency_penalty: 0.8,
        presence_penalty: 0.6,
        logit_bias: vec![(raw[0], -100.0), (1848, 5.0), (330, 3.5), (28, -2.0)],
    };
    // A token the bias forces every step (greedy), its raw logit far
    // below the row's best: its logprob needs that logit.
    let forced =
        SamplingOptions { logit_bias: vec![(12345, 60.0)], ..adjusted(0.0, 10, 0, 1.0, 0.0) };
    let requests = || {
        let r = |q: &str, o: SamplingOptions| SeqRequest {
            sampling: o,
            ..SeqRequest::new(Prompt::Chat(chat(q)), 14)
        };
        vec![
            r(QUESTIONS[0], adjusted(0.0, 1, 0, 1.0, 0.0)),
            r(QUESTIONS[1], adjusted(0.9, 2, 0, 1.0, 0.0)),
            r(QUESTIONS[2], adjusted(1.0, 3, 40, 1.0, 0.0)),
            r(QUESTIONS[3], adjusted(1.0, 4, 0, 0.9, 0.0)),
            r(QUESTIONS[0], adjusted(0.8, 5, 0, 1.0, 0.05)),
            r(QUESTIONS[1], adjusted(2.0, 6, 0, 0.999, 0.0)),
            SeqRequest { logprobs: Some(2), ..r(QUESTIONS[2], adjusted(0.0, 7, 0, 1.0, 0.0)) },
            SeqRequest { logprobs: Some(3), ..r(QUESTIONS[3], adjusted(0.9, 8, 0, 1.0, 0.0)) },
            SeqRequest { logprobs: Some(1), ..r(QUESTIONS[0], adjusted(1.0, 9, 0, 0.9, 0.0)) },
            SeqRequest { logprobs: Some(2), ..r(QUESTIONS[1], forced.clone()) },
        ]
    };
    // The greedy one alone: its steps copy nothing back.
    let bare = n_of(&counts.bare_steps);
    let alone = collect(select.submit(requests().remove(0)).unwrap());
    assert!(n_of(&counts.bare_steps) - bare >= alone.tokens.len() - 1, "greedy, adjusted, bare");
    let got = side_by_side(&select, &plain, requests());
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.logprobs.len(), if i >= 6 { g.tokens.len() } else { 0 }, "request {i}");
    }
    assert_eq!(got[0].tokens, alone.tokens, "alone and beside others");
    assert!(alone.tokens[0] != raw[0] && !alone.tokens.is_empty(), "the bias changed it");
    // The forced token's logprob is its raw one: far below the best's.
    let forced = &got[9];
    assert!(forced.tokens.iter().all(|&t| t == 12345), "{:?}", forced.tokens);
    let first = &forced.logprobs[0];
    assert!(first.chosen.logprob < first.top[0].logprob - 5.0, "{first:?}");
    let (rows, misses, scored) =
        (n_of(&counts.adjusted), n_of(&counts.misses), n_of(&counts.scored));
    eprintln!("{rows} rows adjusted by the decoder ({scored} scored), {misses} read after");
    assert!(rows > 6 * 10 && misses > 0, "{rows} rows, {misses} misses");
    let scored_tokens: usize = got[6..].iter().map(|g| g.tokens.len()).sum();
    assert!(scored >= scored_tokens, "every token with logprobs scored: {scored}");
}

/// Grammar rows masked by the decoder before it picks (a JSON schema
/// and a JSON object: greedy, drawn, top-p from candidates of the masked
/// row or from the row read after its step, with a bias and penalties)
/// give the tokens, text and finish of
/// the plain CPU engine, which masks them on the host; with logprobs (of
/// the masked distribution: greedy, a top-p draw, a penalised draw) the
/// same logprobs from the masked row's candidates, a penalised row's
/// before its additions.
#[test]
fn grammar_masks_applied_by_the_decoder_equal_the_cpu_engines() {
    use gcs_engine::Grammar;
    let Some((plain, select, counts)) = pick_only() else { return };
    let schema = r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"],"additionalProperties":false}"#;
    let o = |temperature, seed| SamplingOptions { temperature, seed, ..SamplingOptions::default() };
    let requests = || {
        let r = |q: &str, g: Grammar, o: SamplingOptions| SeqRequest {
            sampling: o,
            grammar: Some(g),
            ..SeqRequest::new(Prompt::Chat(chat(q)), 40)
        };
        let person = || Grammar::JsonSchema(schema.into());
        let penalised =
            SamplingOptions { frequency_penalty: 0.7, logit_bias: vec![(28, 2.0)], ..o(0.9, 4) };
        vec![
            r("Describe a person as JSON.", person(), o(0.0, 1)),
            r("Describe a person as JSON.", person(), o(1.0, 2)),
            r(
                "Describe a cat as JSON.",
                Grammar::JsonObject,
                SamplingOptions { top_p: 0.999, presence_penalty: 0.5, ..o(2.0, 3) },
            ),
            r("Describe a dog as JSON.", Grammar::JsonObject, penalised.clone()),
            SeqRequest { logprobs: Some(2), ..r("A person?", person(), o(0.0, 5)) },
            SeqRequest {
                logprobs: Some(3),
                ..r("A cat?", Grammar::JsonObject, SamplingOptions { top_p: 0.9, ..o(1.0, 6) })
            },
            SeqRequest { logprobs: Some(2), ..r("A dog?", person(), penalised) },
        ]
    };
    for (i, g) in side_by_side(&select, &plain, requests()).iter().enumerate() {
        eprintln!("request {i}: {:?} {}", g.result.finish_reason, g.result.text);
        assert_eq!(g.logprobs.len(), if i >= 4 { g.tokens.len() } else { 0 }, "request {i}");
        // Only allowed tokens among the alternatives.
        assert!(g.logprobs.iter().all(|l| l.top.iter().all(|t| t.logprob.is_finite())));
    }
    assert!(n_of(&counts.scored) > 0, "the penalised row with logprobs was scored");
    let (masked, misses) = (n_of(&counts.masked), n_of(&counts.misses));
    eprintln!("{masked} rows masked by the decoder, {misses} read after their step");
    // The hot nucleus missed its candidates: its masked, penalised row
    // was read after the step and sampled without adding them again.
    assert!(masked > 4 * 10 && misses > 0, "{masked} rows masked, {misses} misses");
}

fn n_of(c: &std::sync::atomic::AtomicUsize) -> usize {
    c.load(std::sync::atomic::Ordering::Relaxed)
}
