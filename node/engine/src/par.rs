//! Data parallelism for one forward pass: a small fork-join pool whose
//! workers spin between parallel regions, and helpers that use it when the
//! calling thread has one installed (rayon otherwise).
//!
//! Why not rayon alone: a decode step is ~100 parallel regions of 10–100 µs
//! each (one per matmul), separated by a few µs of serial work (norms,
//! residuals). A rayon worker that found no work goes to sleep within tens
//! of µs, and waking it is a futex round trip, so a region often ran at the
//! speed of its slowest hand-off (node/engine/README.md, *Where one decode
//! step goes*: "matmul wait"). Here a worker keeps polling for the next
//! region for a bounded time (`GCS_ENGINE_SPIN_US`, yielding its core every
//! few µs so a loaded machine is not starved), and work is handed out by an
//! atomic counter, so the caller takes every chunk a late worker has not
//! claimed: a descheduled worker delays nothing it has not started.
//!
//! Results do not depend on which thread runs which index: every caller
//! writes each index's output from that index alone.
//!
//! `GCS_ENGINE_POOL=rayon` turns the pool off (every region on rayon, as
//! before it existed), for side-by-side runs of one binary.

use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// Bits of [`Shared::state`]: the job's epoch above, then the closed flag,
/// then how many workers are inside the job.
const EPOCH_SHIFT: u32 = 32;
const CLOSED: u64 = 1 << 31;
const COUNT: u64 = CLOSED - 1;

/// How long an idle worker polls for the next region before it parks.
const DEFAULT_SPIN: Duration = Duration::from_micros(1000);
/// Polling gives up the core this often (a no-op on an idle machine).
const YIELD_EVERY: Duration = Duration::from_micros(20);

type Job<'a> = dyn Fn() + Sync + 'a;

struct Shared {
    /// `epoch << 32 | CLOSED? | workers inside`.
    state: AtomicU64,
    /// The current job, valid while its epoch is open or a worker is inside.
    /// Lifetime-erased: the caller waits for every worker that entered
    /// before it returns (see `Pool::run`).
    job: std::cell::UnsafeCell<Option<&'static Job<'static>>>,
    panicked: AtomicBool,
    /// A job is being published or run: a second caller (the pool
    /// installed on two threads at once) runs its job alone instead.
    busy: AtomicBool,
    stop: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    spin: Duration,
}

// SAFETY: `job` is written only by the owner while no worker can enter
// (previous epoch closed and empty, the new one not yet published) and read
// by workers only after entering an open epoch (Acquire on `state`).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// A fork-join pool of `threads - 1` spinning workers plus the thread that
/// calls [`SpinPool::install`].
pub struct SpinPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// `GCS_ENGINE_POOL=rayon`: `install` leaves rayon in charge.
    off: bool,
}

impl std::fmt::Debug for SpinPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinPool").field("threads", &(self.workers.len() + 1)).finish()
    }
}

thread_local! {
    /// The pool installed on this thread, and whether a job is running on it
    /// (nested parallel calls inside a job run serially).
    static CURRENT: Cell<Option<*const SpinPool>> = const { Cell::new(None) };
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

impl SpinPool {
    /// A pool of `threads` threads in all (the caller included); the polling
    /// time comes from `GCS_ENGINE_SPIN_US` (0: park at once).
    pub fn new(threads: usize) -> Self {
        Self::configured(threads, false)
    }

    /// As [`SpinPool::new`], with workers at a low OS priority
    /// ([`lower_thread_priority`]): the pool of steps that carry batch
    /// work only.
    pub fn background(threads: usize) -> Self {
        Self::configured(threads, true)
    }

    fn configured(threads: usize, low: bool) -> Self {
        if std::env::var("GCS_ENGINE_POOL").is_ok_and(|v| v == "rayon") {
            let mut pool = Self::with_spin(1, Duration::ZERO);
            pool.off = true;
            return pool;
        }
        let spin = std::env::var("GCS_ENGINE_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(DEFAULT_SPIN, Duration::from_micros);
        Self::build(threads, spin, low)
    }

    /// As [`SpinPool::new`] with rayon's thread count.
    pub fn for_rayon() -> Self {
        Self::new(rayon::current_num_threads())
    }

    pub fn with_spin(threads: usize, spin: Duration) -> Self {
        Self::build(threads, spin, false)
    }

    fn build(threads: usize, spin: Duration, low: bool) -> Self {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(CLOSED),
            job: std::cell::UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            spin,
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(if low { format!("gcs-low-{i}") } else { format!("gcs-engine-{i}") })
                    .spawn(move || {
                        if low {
                            lower_thread_priority();
                        }
                        worker(&s)
                    })
                    .expect("spawn an engine thread")
            })
            .collect();
        Self { shared, workers, off: false }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f` with this pool serving the parallel helpers of this module
    /// on the calling thread.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.off {
            return f();
        }
        struct Restore(Option<*const SpinPool>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|c| c.replace(Some(self as *const _))));
        f()
    }

    /// Runs `job` on the caller and on every worker that wakes in time, and
    /// returns when all that started it have finished.
    fn run(&self, job: &Job<'_>) {
        let s = &*self.shared;
        if s.busy.swap(true, Acquire) {
            IN_JOB.with(|f| f.set(true));
            let r = catch_unwind(AssertUnwindSafe(job));
            IN_JOB.with(|f| f.set(false));
            return r.unwrap_or_else(|p| resume_unwind(p));
        }
        let epoch = (s.state.load(Acquire) >> EPOCH_SHIFT).wrapping_add(1);
        // SAFETY: the previous epoch is closed and no worker is inside it
        // (the previous `run` waited for that), so nobody reads `job`; the
        // erased lifetime ends only after `Close` below has waited again.
        unsafe {
            *s.job.get() = Some(std::mem::transmute::<&Job<'_>, &'static Job<'static>>(job));
        }
        s.state.store(epoch << EPOCH_SHIFT, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        /// Closes the epoch and waits for the workers inside it, also when
        /// `job` panics on the caller (they still borrow its stack).
        struct Close<'a>(&'a Shared);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                let prev = self.0.state.fetch_or(CLOSED, AcqRel);
                if prev & COUNT != 0 {
                    wait_until(|| self.0.state.load(Acquire) & COUNT == 0);
                }
                // SAFETY: closed and empty: no worker reads `job` any more.
                unsafe { *self.0.job.get() = None };
                self.0.busy.store(false, Release);
            }
        }
        let close = Close(s);
        IN_JOB.with(|f| f.set(true));
        let r = catch_unwind(AssertUnwindSafe(job));
        IN_JOB.with(|f| f.set(false));
        drop(close);
        if let Err(p) = r {
            resume_unwind(p);
        }
        if s.panicked.swap(false, AcqRel) {
            panic!("an engine worker thread panicked in a parallel region");
        }
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.stop.store(true, SeqCst);
        {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Spins on `done`, yielding the core now and then.
fn wait_until(done: impl Fn() -> bool) {
    let mut last = Instant::now();
    while !done() {
        std::hint::spin_loop();
        if last.elapsed() >= YIELD_EVERY {
            std::thread::yield_now();
            last = Instant::now();
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = s.state.load(Acquire) >> EPOCH_SHIFT;
    loop {
        // Wait for a new epoch: poll, then park.
        let started = Instant::now();
        let mut last_yield = started;
        let mut polls = 0u32;
        loop {
            if s.stop.load(Acquire) {
                return;
            }
            if s.state.load(Acquire) >> EPOCH_SHIFT != seen {
                break;
            }
            std::hint::spin_loop();
            polls = polls.wrapping_add(1);
            if polls % 64 != 0 {
                continue;
            }
            let now = Instant::now();
            if now.duration_since(started) >= s.spin {
                let g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, SeqCst);
                let g = s
                    .wake
                    .wait_while(g, |_| {
                        s.state.load(SeqCst) >> EPOCH_SHIFT == seen && !s.stop.load(SeqCst)
                    })
                    .unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_sub(1, SeqCst);
                drop(g);
                break;
            }
            if now.duration_since(last_yield) >= YIELD_EVERY {
                std::thread::yield_now();
                last_yield = now;
            }
        }
        // Enter the newest epoch unless it is already closed.
        let mut cur = s.state.load(Acquire);
        loop {
            seen = cur >> EPOCH_SHIFT;
            if cur & CLOSED != 0 {
                break;
            }
            match s.state.compare_exchange_weak(cur, cur + 1, AcqRel, Acquire) {
                Ok(_) => {
                    // SAFETY: inside an open epoch: `job` stays valid until
                    // our decrement below.
                    if let Some(job) = unsafe { *s.job.get() } {
                        IN_JOB.with(|f| f.set(true));
                        if catch_unwind(AssertUnwindSafe(job)).is_err() {
                            s.panicked.store(true, Release);
                        }
                        IN_JOB.with(|f| f.set(false));
                    }
                    s.state.fetch_sub(1, Release);
                    break;
                }
                Err(now) => cur = now,
            }
        }
    }
}

/// The installed pool of this thread, unless a job of it is running here.
fn current() -> Option<&'static SpinPool> {
    if IN_JOB.with(Cell::get) {
        return None;
    }
    // SAFETY: `install` keeps the pool borrowed while it is set.
    CURRENT.with(Cell::get).map(|p| unsafe { &*p })
}

/// Names rayon's global threads `gcs-rayon-N`. Unnamed, they take the name
/// of the thread that first used rayon (a forward pass showed up in `top`
/// as `tokio-rt-worker`). Call before anything uses rayon; after that it
/// does nothing. The thread count stays rayon's (`RAYON_NUM_THREADS`).
pub fn name_global_threads() {
    let named = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("gcs-rayon-{i}"));
    let _ = named.build_global();
}

/// The nice value of the threads of batch-only steps: `GCS_ENGINE_BATCH_NICE`
/// (0–19), default 19. At 19 a thread weighs ~1/70 of a nice-0 one: an
/// interactive step and the node's network threads take nearly all of a
/// core it contends for, and batch work gets what is left (issue 20:
/// batch fills idle capacity). On a machine shared with other busy work
/// that must not starve the batch, 10 gives it ~1/10 and keeps less of
/// the gain (specs/figures.md, "TTFT beside a batch: batch steps at the
/// lowest OS priority, and yielding mid-step").
pub fn batch_nice() -> i32 {
    std::env::var("GCS_ENGINE_BATCH_NICE")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(19, |n| n.clamp(0, 19))
}

/// Lowers the calling thread's OS priority to [`batch_nice`] (Linux, where
/// niceness is per thread; nothing elsewhere). An unprivileged thread
/// cannot raise it again, so only threads that serve batch work for their
/// whole life call this: while they run, anything else on the machine
/// (the node's network threads, the gateway, another worker's interactive
/// step) takes the core first.
pub fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain syscall on the calling thread (`who` 0), no memory.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, batch_nice()) };
        if rc != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "could not lower a batch thread's priority");
        }
    }
}

/// The threads a parallel helper called here will use.
pub fn threads() -> usize {
    match current() {
        Some(p) => p.threads(),
        None if IN_JOB.with(Cell::get) => 1,
        None => rayon::current_num_threads().max(1),
    }
}

/// Runs `f(i)` for every `i` in `0..n`, in parallel.
pub fn for_each_index(n: usize, f: impl Fn(usize) + Sync) {
    if n == 0 {
        return;
    }
    if n == 1 || IN_JOB.with(Cell::get) {
        return (0..n).for_each(f);
    }
    match current() {
        Some(pool) if pool.threads() > 1 => {
            let next = AtomicUsize::new(0);
            pool.run(&|| loop {
                let i = next.fetch_add(1, Relaxed);
                if i >= n {
                    break;
                }
                f(i);
            });
        }
        Some(_) => (0..n).for_each(f),
        None => (0..n).into_par_iter().for_each(|i| f(i)),
    }
}

/// A raw pointer that may cross threads: the helpers below hand each index
/// a disjoint part of the memory behind it.
struct Ptr<T>(*mut T);
impl<T> Clone for Ptr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Ptr<T> {}
unsafe impl<T: Send> Send for Ptr<T> {}
unsafe impl<T: Send> Sync for Ptr<T> {}

/// `f(i, chunk)` for each `chunk`-long piece of `data` (the last may be
/// shorter), in parallel, like rayon's `par_chunks_mut().enumerate()`.
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    assert!(chunk > 0, "chunk size");
    let len = data.len();
    let base = Ptr(data.as_mut_ptr());
    for_each_index(len.div_ceil(chunk), |i| {
        let base = &base;
        let start = i * chunk;
        let end = (start + chunk).min(len);
        // SAFETY: each index is run once, and its range lies inside `data`
        // and overlaps no other index's range.
        let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
        f(i, part)
    });
}

/// `(0..n).map(f).collect()`, in parallel.
pub fn map_indices<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for_each_chunk_mut(&mut out, 1, |i, o| o[0] = Some(f(i)));
    out.into_iter().map(|o| o.expect("every index ran")).collect()
}

#[cfg(test)]
#[path = "par_tests.rs"]
mod tests;
