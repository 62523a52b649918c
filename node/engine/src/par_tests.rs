use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use super::*;

/// A small LCG so the sizes vary; the seed is printed.
fn lcg(s: &mut u64) -> u64 {
    *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    *s >> 33
}

/// Every index runs exactly once, over many regions of random sizes, for
/// each polling policy (0 parks at once: the wake-up path).
#[test]
fn every_index_runs_once() {
    let seed = 0x5eed_u64 ^ std::process::id() as u64;
    println!("seed {seed}");
    for spin_us in [0, 50, 1000] {
        let pool = SpinPool::with_spin(3, Duration::from_micros(spin_us));
        let mut s = seed;
        pool.install(|| {
            assert_eq!(threads(), 3);
            for _ in 0..3000 {
                let n = (lcg(&mut s) % 40) as usize;
                let chunk = 1 + (lcg(&mut s) % 5) as usize;
                let mut data = vec![0u32; n];
                for_each_chunk_mut(&mut data, chunk, |i, c| {
                    for (k, v) in c.iter_mut().enumerate() {
                        *v += (i * chunk + k) as u32 + 1;
                    }
                });
                let want: Vec<u32> = (1..=n as u32).collect();
                assert_eq!(data, want, "seed {seed}, spin {spin_us} µs");
            }
        });
    }
}

#[test]
fn map_keeps_order_and_nested_calls_run_serially() {
    let pool = SpinPool::with_spin(2, Duration::from_micros(100));
    let inner = AtomicUsize::new(0);
    let out = pool.install(|| {
        map_indices(50, |i| {
            assert_eq!(threads(), 1, "inside a job");
            for_each_index(4, |_| {
                inner.fetch_add(1, Relaxed);
            });
            i * i
        })
    });
    assert_eq!(out, (0..50).map(|i| i * i).collect::<Vec<_>>());
    assert_eq!(inner.load(Relaxed), 200);
    // Not installed any more: rayon's count.
    assert_eq!(threads(), rayon::current_num_threads().max(1));
}

/// A panic in a region reaches the caller after every worker has left it,
/// and the pool keeps working.
#[test]
fn a_panic_reaches_the_caller_and_the_pool_survives() {
    let pool = SpinPool::with_spin(2, Duration::from_micros(200));
    for bad in [0usize, 7, 63] {
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
            pool.install(|| {
                for_each_index(64, |i| {
                    if i == bad {
                        panic!("index {i}");
                    }
                    std::hint::black_box(i);
                })
            })
        }));
        assert!(r.is_err(), "index {bad} panicked");
        let sum = AtomicUsize::new(0);
        pool.install(|| {
            for_each_index(100, |i| {
                sum.fetch_add(i, Relaxed);
            })
        });
        assert_eq!(sum.load(Relaxed), 4950);
    }
}

#[test]
fn one_thread_and_the_rayon_fallback_give_the_same_results() {
    let run = || {
        let mut v = vec![0u64; 1000];
        for_each_chunk_mut(&mut v, 7, |i, c| c.iter_mut().for_each(|x| *x = i as u64 * 3));
        v
    };
    let want = run();
    assert_eq!(SpinPool::with_spin(1, Duration::ZERO).install(run), want);
    assert_eq!(SpinPool::with_spin(4, Duration::ZERO).install(run), want);
}

/// The pool installed on two threads at once: each region still runs every
/// index once (the second caller runs its own alone).
#[test]
fn two_callers_at_once_stay_correct() {
    let pool = SpinPool::with_spin(2, Duration::from_micros(100));
    std::thread::scope(|sc| {
        for _ in 0..2 {
            sc.spawn(|| {
                pool.install(|| {
                    for _ in 0..2000 {
                        let mut v = vec![0u32; 37];
                        for_each_chunk_mut(&mut v, 3, |i, c| {
                            c.iter_mut().enumerate().for_each(|(k, x)| *x = (3 * i + k) as u32)
                        });
                        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
                    }
                })
            });
        }
    });
}
