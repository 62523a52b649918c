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
