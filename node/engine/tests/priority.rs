//! Interactive work before batch work in the continuous-batching scheduler
//! (specs/batch.md, "Priority on the worker"), on the real model (skips
//! without it): an interactive request arriving while the step batch or the
//! KV pool is full of batch sequences is stepped at the next engine step,
//! the batch sequences it displaced resume to exactly the tokens of an
//! undisturbed run, and batch work runs in whatever capacity is left.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use gcs_engine::{
    cpu_device, BatchConfig, BatchEngine, Engine, Priority, Prompt, SeqEvent, SeqRequest,
    SeqResult, SeqStream,
};

fn load(cfg: BatchConfig) -> Option<BatchEngine> {
    let path = common::smollm_path()?;
    Some(BatchEngine::start(Engine::load(&path, &cpu_device()).unwrap(), cfg))
}

fn collect(s: SeqStream) -> (Vec<u32>, SeqResult) {
    let mut tokens = Vec::new();
    loop {
        match s.recv_timeout(Duration::from_secs(120)).expect("event in time") {
            SeqEvent::Delta { token_ids, .. } => tokens.extend(token_ids),
            SeqEvent::Done(r) => return (tokens, r),
            SeqEvent::Error(e) => panic!("sequence failed: {e}"),
        }
    }
}

/// `len` prompt tokens of some English text, distinct per `tag`.
fn prompt(engine: &BatchEngine, tag: &str, len: usize) -> Vec<u32> {
    let text = format!(
        "{tag}: the quick brown fox jumps over the lazy dog while the river runs to the \
         sea and the wind turns the mill. "
    )
    .repeat(8);
    let ids = engine.tokenizer().encode(&text).unwrap();
    assert!(ids.len() >= len, "text of {} tokens", ids.len());
    ids[..len].to_vec()
}

/// A greedy request of `max` tokens that runs to its length.
fn req(tokens: Vec<u32>, max: usize, priority: Priority) -> SeqRequest {
    SeqRequest { ignore_eos: true, priority, ..SeqRequest::new(Prompt::Tokens(tokens), max) }
}

/// Waits until `n` sequences run and a few steps have passed.
fn wait_running(engine: &BatchEngine, n: usize) {
    let t = Instant::now();
    while engine.running() < n {
        assert!(t.elapsed() < Duration::from_secs(60), "{} running", engine.running());
        std::thread::sleep(Duration::from_millis(2));
    }
    let s0 = engine.steps();
    while engine.steps() < s0 + 1 {
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The step batch is full of batch sequences: an interactive request is
/// admitted after at most one step (the one in flight when it arrived) by
/// parking the newest batch sequence, which then resumes to the tokens of
/// an undisturbed run. The same arrival as a batch request waits for a
/// sequence to end.
#[test]
fn interactive_takes_a_step_slot_from_batch_work() {
    let cfg = BatchConfig { max_running: 2, prefill_chunk: 64, ..BatchConfig::default() };
    let Some(engine) = load(cfg) else { return };
    let (pa, pb, pi) =
        (prompt(&engine, "alpha", 24), prompt(&engine, "beta", 24), prompt(&engine, "iota", 20));
    let a = engine.submit(req(pa.clone(), 40, Priority::Batch)).unwrap();
    let b = engine.submit(req(pb.clone(), 40, Priority::Batch)).unwrap();
    wait_running(&engine, 2);
    let i = engine.submit(req(pi.clone(), 6, Priority::Interactive)).unwrap();
    let (ti, ri) = collect(i);
    let (ta, ra) = collect(a);
    let (tb, rb) = collect(b);
    assert_eq!(ri.completion_tokens, 6);
    assert!(ri.wait_steps <= 1, "interactive waited {} steps", ri.wait_steps);
    assert_eq!(ri.preemptions, 0);
    assert!(ra.preemptions + rb.preemptions >= 1, "no batch sequence gave way");
    // Undisturbed runs, one at a time, of the same requests.
    for (p, got, r) in [(&pa, &ta, &ra), (&pb, &tb, &rb)] {
        let (alone, ar) = collect(engine.submit(req(p.clone(), 40, Priority::Batch)).unwrap());
        assert_eq!(ar.preemptions, 0);
        assert_eq!(got, &alone, "a batch sequence parked {} times", r.preemptions);
    }
    let (alone, _) = collect(engine.submit(req(pi.clone(), 6, Priority::Interactive)).unwrap());
    assert_eq!(ti, alone);

    // Control: the same arrival in the batch class waits for a slot.
    let a = engine.submit(req(pa, 40, Priority::Batch)).unwrap();
    let b = engine.submit(req(pb, 40, Priority::Batch)).unwrap();
    wait_running(&engine, 2);
    let late = engine.submit(req(pi, 6, Priority::Batch)).unwrap();
    let (_, rl) = collect(late);
    let (_, ra) = collect(a);
    let (_, rb) = collect(b);
    assert!(rl.wait_steps > 10, "a batch request waited only {} steps", rl.wait_steps);
    assert_eq!(ra.preemptions + rb.preemptions, 0);
}

/// The KV pool is full of batch sequences: an interactive request frees
/// the newest one's blocks and is admitted at the next step; the batch
/// sequence is recomputed later (prompt in prefill order, its tokens in
/// decode order) and gives the tokens of an undisturbed run.
#[test]
fn interactive_takes_kv_blocks_from_batch_work() {
    // 6 blocks of 16: two batch sequences of 36 + 12 tokens take 3 each
    // from their admission on, so they never displace each other.
    let cfg =
        BatchConfig { max_running: 8, kv_blocks: 6, prefill_chunk: 128, ..BatchConfig::default() };
    let Some(engine) = load(cfg) else { return };
    let (pa, pb, pi) =
        (prompt(&engine, "gamma", 36), prompt(&engine, "delta", 36), prompt(&engine, "kappa", 20));
    let a = engine.submit(req(pa.clone(), 12, Priority::Batch)).unwrap();
    let b = engine.submit(req(pb.clone(), 12, Priority::Batch)).unwrap();
    wait_running(&engine, 2);
    let i = engine.submit(req(pi, 8, Priority::Interactive)).unwrap();
    let (_, ri) = collect(i);
    let (ta, ra) = collect(a);
    let (tb, rb) = collect(b);
    assert!(ri.wait_steps <= 1, "interactive waited {} steps", ri.wait_steps);
    assert_eq!(ri.preemptions, 0);
    assert!(ra.preemptions + rb.preemptions >= 1, "no batch sequence gave way");
    for (p, got) in [(pa, ta), (pb, tb)] {
        let (alone, ar) = collect(engine.submit(req(p, 12, Priority::Batch)).unwrap());
        assert_eq!(ar.preemptions, 0);
        assert_eq!(got, alone);
    }
    // Every block came back.
    let t = Instant::now();
    while engine.free_kv_tokens() != 6 * 16 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(engine.free_kv_tokens(), 6 * 16);
}

/// Batch work is not starved: it runs beside interactive work while a step
/// slot is free (not displaced), and with every slot taken it runs after
/// the interactive requests (those that arrived later included) finish.
#[test]
fn batch_work_runs_in_idle_capacity() {
    let cfg = BatchConfig { max_running: 2, prefill_chunk: 64, ..BatchConfig::default() };
    let Some(engine) = load(cfg) else { return };
    let long = engine.submit(req(prompt(&engine, "long", 20), 40, Priority::Interactive)).unwrap();
    wait_running(&engine, 1);
    let side = engine.submit(req(prompt(&engine, "side", 20), 6, Priority::Batch)).unwrap();
    let (_, rs) = collect(side);
    assert!(rs.wait_steps <= 1 && rs.preemptions == 0, "{rs:?}");
    assert_eq!(engine.running(), 1, "the interactive one still runs after the batch one");
    collect(long);

    let cfg = BatchConfig { max_running: 1, prefill_chunk: 64, ..BatchConfig::default() };
    let Some(engine) = load(cfg) else { return };
    let first = engine.submit(req(prompt(&engine, "one", 20), 12, Priority::Interactive)).unwrap();
    wait_running(&engine, 1);
    let batch = engine.submit(req(prompt(&engine, "bulk", 20), 6, Priority::Batch)).unwrap();
    let second = engine.submit(req(prompt(&engine, "two", 20), 12, Priority::Interactive)).unwrap();
    collect(first);
    let (_, r2) = collect(second);
    let (tb, rb) = collect(batch);
    assert_eq!(tb.len(), 6, "the batch request completes");
    // The later interactive request went first, all 12 of its steps.
    assert!(r2.wait_steps < rb.wait_steps, "{} vs {}", r2.wait_steps, rb.wait_steps);
    assert!(rb.wait_steps >= 12, "{rb:?}");
}

/// The decoder hears which steps carry batch work only, and records each
/// step's flag.
#[derive(Debug)]
struct Flags {
    inner: gcs_engine::backend::CpuDecoder,
    background: bool,
    steps: std::sync::Arc<std::sync::Mutex<Vec<bool>>>,
}

impl gcs_engine::backend::PagedDecoder for Flags {
    common::delegate_decoder!();
    fn forward_paged(
        &mut self,
        seqs: &[gcs_engine::llama::PagedSeq<'_>],
    ) -> gcs_engine::Result<Vec<f32>> {
        self.steps.lock().unwrap().push(self.background);
        self.inner.forward_paged(seqs)
    }
    fn set_background(&mut self, background: Option<gcs_engine::backend::Interrupt>) {
        self.background = background.is_some();
        self.inner.set_background(background);
    }
}

/// This process's threads whose name starts with `prefix`, with their nice
/// values (`/proc/self/task/*/stat`, field 19).
#[cfg(target_os = "linux")]
fn nice_of_threads(prefix: &str) -> Vec<i64> {
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.trim_end().starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // After the parenthesised name: state is field 3, nice field 19.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        out.push(rest.split(' ').nth(16).unwrap().parse().unwrap());
    }
    out
}

/// Steps with batch sequences only run on the decoder's threads of a low
/// OS priority; a step with an interactive sequence in it does not,
/// and the tokens do not depend on which threads ran a step.
#[test]
fn batch_only_steps_run_on_low_priority_threads() {
    use std::sync::{Arc, Mutex};
    let Some(path) = common::smollm_path() else { return };
    let steps = Arc::new(Mutex::new(Vec::new()));
    let log = steps.clone();
    let cfg = BatchConfig { max_running: 4, prefill_chunk: 64, ..BatchConfig::default() };
    let engine = BatchEngine::start_with(Engine::load(&path, &cpu_device()).unwrap(), cfg, |m, k| {
        Box::new(Flags { inner: gcs_engine::backend::CpuDecoder::new(m, k), background: false, steps: log })
    });
    let taken = || std::mem::take(&mut *steps.lock().unwrap());

    let p = prompt(&engine, "lowly", 20);
    let (batch_tokens, _) = collect(engine.submit(req(p.clone(), 8, Priority::Batch)).unwrap());
    let flags = taken();
    assert!(!flags.is_empty() && flags.iter().all(|&b| b), "batch alone: {flags:?}");
    #[cfg(target_os = "linux")]
    {
        let low = nice_of_threads("gcs-low");
        assert!(!low.is_empty(), "no low-priority threads started");
        let want = i64::from(gcs_engine::par::batch_nice());
        assert!(want > 0 && low.iter().all(|&n| n == want), "batch threads at nice {low:?}");
    }

    let (tokens, _) = collect(engine.submit(req(p.clone(), 8, Priority::Interactive)).unwrap());
    assert_eq!(tokens, batch_tokens, "the same tokens on either set of threads");
    let flags = taken();
    assert!(!flags.is_empty() && flags.iter().all(|&b| !b), "interactive alone: {flags:?}");

    // Side by side: the steps the interactive sequence is in are not
    // batch-only; those after it ends are.
    let b = engine.submit(req(prompt(&engine, "bulk", 20), 30, Priority::Batch)).unwrap();
    wait_running(&engine, 1);
    let i = engine.submit(req(p, 8, Priority::Interactive)).unwrap();
    assert_eq!(collect(i).0, batch_tokens);
    collect(b);
    let flags = taken();
    assert!(flags.contains(&false) && flags.last() == Some(&true), "{flags:?}");
}

/// A batch-only step in flight gives way, at a layer boundary, to an
/// interactive request that arrives while it runs: the request does not
/// wait for that step, and the batch sequences, whose step runs again,
/// give the tokens of an undisturbed run.
#[test]
fn a_batch_step_in_flight_gives_way_to_an_interactive_arrival() {
    let cfg = BatchConfig {
        max_running: 8,
        prefill_chunk: 256,
        batch_prefill_chunk: 256,
        ..BatchConfig::default()
    };
    let Some(engine) = load(cfg) else { return };
    let prompts: Vec<Vec<u32>> =
        ["north", "south", "east", "west"].iter().map(|t| prompt(&engine, t, 60)).collect();
    let batch: Vec<SeqStream> = prompts
        .iter()
        .map(|p| engine.submit(req(p.clone(), 60, Priority::Batch)).unwrap())
        .collect();
    wait_running(&engine, 4);
    // Steps run back to back, so an arrival nearly always finds one in
    // flight; a few tries make "nearly" certain. Each arrival waits a few
    // milliseconds first: right after the previous interactive request's
    // last token the scheduler is between steps (with five tries and no
    // wait, none found a batch step to stop in about one run of six when
    // this binary's tests ran side by side on 2 cores).
    let pi = prompt(&engine, "iota", 20);
    let mut interactive = vec![];
    for _ in 0..10 {
        std::thread::sleep(std::time::Duration::from_millis(3));
        let (t, r) = collect(engine.submit(req(pi.clone(), 4, Priority::Interactive)).unwrap());
        assert!(r.wait_steps <= 1, "interactive waited {} steps", r.wait_steps);
        interactive.push(t);
        if engine.yielded_steps() > 0 {
            break;
        }
    }
    assert!(engine.yielded_steps() > 0, "no batch step gave way");
    let got: Vec<(Vec<u32>, SeqResult)> = batch.into_iter().map(collect).collect();
    assert!(got.iter().all(|(t, _)| t.len() == 60));
    for (p, (tokens, _)) in prompts.into_iter().zip(got) {
        let (alone, _) = collect(engine.submit(req(p, 60, Priority::Batch)).unwrap());
        assert_eq!(tokens, alone, "a batch sequence whose step gave way");
    }
    let (alone, _) = collect(engine.submit(req(pi, 4, Priority::Interactive)).unwrap());
    assert!(interactive.iter().all(|t| *t == alone));
}
