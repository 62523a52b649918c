//! Opt-in wall-clock timing of a forward pass, op by op (the decode profile
//! of node/engine/README.md; `examples/decode_profile.rs` prints it).
//!
//! Off by default: every probe is one relaxed atomic load. When on, the
//! thread that runs a forward pass times each op it waits for; matmuls are
//! split into activation quantization, kernel time (the tasks' busy time
//! over the thread count) and waiting (the rest of the parallel region:
//! wake-ups, the barrier, imbalance, the result transpose). The times are
//! process-wide sums, meant for one forward pass at a time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use super::GgmlType;

static ON: AtomicBool = AtomicBool::new(false);
/// Set while the output projection runs: its matmul is booked as `LmHead`.
static IN_HEAD: AtomicBool = AtomicBool::new(false);

/// What a slot of the profile counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Embed,
    Norm,
    /// gemma3's per-head Q/K norms and Q scale; qwen2's biases.
    QkNorm,
    /// RoPE, K/V store and attention of every sequence in the batch.
    Attention,
    /// SwiGLU / GeGLU.
    Act,
    /// Residual adds and the residual stream's host copies (burn tensors).
    Residual,
    /// Final norm and last-row selection.
    OutputNorm,
    /// The output projection's kernel time (its quantization and wait are
    /// in `QuantActs`/`MatWait`).
    LmHead,
    /// Kernel time of the layers' matmuls of one weight type.
    Mat(GgmlType),
    /// Quantizing activations to Q8_0 / Q8_1 / Q8_K.
    QuantActs,
    /// Matmul wall time not spent in a task: thread wake-ups, the join
    /// barrier, imbalance, the output transpose.
    MatWait,
    /// Soft-capping and output bias.
    Logits,
}

const TYPES: [GgmlType; 10] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];
const FIXED: usize = 11;
const SLOTS: usize = FIXED + TYPES.len();

impl Op {
    fn slot(self) -> usize {
        match self {
            Op::Embed => 0,
            Op::Norm => 1,
            Op::QkNorm => 2,
            Op::Attention => 3,
            Op::Act => 4,
            Op::Residual => 5,
            Op::OutputNorm => 6,
            Op::LmHead => 7,
            Op::QuantActs => 8,
            Op::MatWait => 9,
            Op::Logits => 10,
            Op::Mat(t) => FIXED + TYPES.iter().position(|&x| x == t).unwrap_or(0),
        }
    }

    fn of_slot(i: usize) -> Op {
        const F: [Op; FIXED] = [
            Op::Embed,
            Op::Norm,
            Op::QkNorm,
            Op::Attention,
            Op::Act,
            Op::Residual,
            Op::OutputNorm,
            Op::LmHead,
            Op::QuantActs,
            Op::MatWait,
            Op::Logits,
        ];
        if i < FIXED {
            F[i]
        } else {
            Op::Mat(TYPES[i - FIXED])
        }
    }
}

static NS: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
static CALLS: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];

/// Turn timing on or off (and clear nothing).
pub fn enable(on: bool) {
    ON.store(on, Relaxed);
}

#[inline]
pub fn enabled() -> bool {
    ON.load(Relaxed)
}

/// The start of a timed op, or `None` when timing is off.
#[inline]
pub fn start() -> Option<Instant> {
    enabled().then(Instant::now)
}

/// Book the time since `t0` (from [`start`]) to `op`.
#[inline]
pub fn stop(t0: Option<Instant>, op: Op) {
    if let Some(t0) = t0 {
        add(op, t0.elapsed().as_nanos() as u64);
    }
}

pub fn add(op: Op, ns: u64) {
    NS[op.slot()].fetch_add(ns, Relaxed);
    CALLS[op.slot()].fetch_add(1, Relaxed);
}

/// Run `f` with the output projection's matmul booked as [`Op::LmHead`].
pub fn lm_head<R>(f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    IN_HEAD.store(true, Relaxed);
    let r = f();
    IN_HEAD.store(false, Relaxed);
    r
}

/// The slot a matmul of `ty` books its kernel time to.
pub(crate) fn mat_op(ty: GgmlType) -> Op {
    if IN_HEAD.load(Relaxed) {
        Op::LmHead
    } else {
        Op::Mat(ty)
    }
}

/// Timing of one parallel matmul region: `task` wraps each task, `finish`
/// books busy/threads as kernel time and the rest of the wall as wait.
pub(crate) struct Region {
    t0: Instant,
    busy: AtomicU64,
    op: Op,
}

impl Region {
    pub(crate) fn begin(ty: GgmlType) -> Option<Region> {
        enabled().then(|| Region { t0: Instant::now(), busy: AtomicU64::new(0), op: mat_op(ty) })
    }

    #[inline]
    pub(crate) fn task<R>(r: &Option<Region>, f: impl FnOnce() -> R) -> R {
        let Some(r) = r else { return f() };
        let t = Instant::now();
        let out = f();
        r.busy.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        out
    }

    pub(crate) fn finish(r: Option<Region>, quant_ns: u64) {
        let Some(r) = r else { return };
        let wall = r.t0.elapsed().as_nanos() as u64;
        let threads = crate::par::threads() as u64;
        let kernel = r.busy.load(Relaxed) / threads;
        add(r.op, kernel);
        if quant_ns > 0 {
            add(Op::QuantActs, quant_ns);
        }
        add(Op::MatWait, wall.saturating_sub(kernel + quant_ns));
    }
}

/// Every slot with time booked since the last call: (name, ns, calls);
/// the counters are reset.
pub fn take() -> Vec<(String, u64, u64)> {
    (0..SLOTS)
        .filter_map(|i| {
            let ns = NS[i].swap(0, Relaxed);
            let calls = CALLS[i].swap(0, Relaxed);
            let name = match Op::of_slot(i) {
                Op::Mat(t) => format!("matmul {t:?}"),
                op => format!("{op:?}"),
            };
            (calls > 0).then_some((name, ns, calls))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_only_when_on() {
        // The one test touching the global switch (others may run matmuls).
        assert!(start().is_none());
        enable(true);
        let t = start();
        assert!(t.is_some());
        stop(t, Op::Mat(GgmlType::Q6_K));
        lm_head(|| assert_eq!(mat_op(GgmlType::Q8_0), Op::LmHead));
        assert_eq!(mat_op(GgmlType::Q8_0), Op::Mat(GgmlType::Q8_0));
        enable(false);
        let got = take();
        assert!(got.iter().any(|(n, _, c)| n == "matmul Q6_K" && *c >= 1), "{got:?}");
        assert!(start().is_none());
    }
}
