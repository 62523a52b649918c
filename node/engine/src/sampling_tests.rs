use super::*;

fn opts(temperature: f32, seed: u64) -> SamplingOptions {
    SamplingOptions { temperature, seed, ..SamplingOptions::default() }
}

fn draws(o: &SamplingOptions, logits: &[f32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(o.clone());
    (0..n).map(|_| s.sample(logits)).collect()
}

#[test]
fn greedy_picks_max_and_seed_is_reproducible() {
    let logits = vec![0.1, 2.0, 1.9, -1.0];
    assert_eq!(Sampler::new(SamplingParams::greedy()).sample(&logits), 1);
    let p = SamplingParams { temperature: 1.0, top_p: 0.9, top_k: 3, seed: 42 };
    let a = draws(&p.clone().into(), &logits, 20);
    let b = draws(&p.into(), &logits, 20);
    assert_eq!(a, b);
    assert!(a.iter().all(|&t| t == 1 || t == 2), "top-p/top-k keep only the two best: {a:?}");
}

#[test]
fn greedy_ties_go_to_lowest_id() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
    assert_eq!(Sampler::new(opts(0.0, 1)).sample(&[5.0, 5.0]), 0);
}

#[test]
fn different_seeds_differ_and_temperature_spreads() {
    let logits = vec![0.0f32; 100];
    let a = draws(&opts(1.0, 1), &logits, 50);
    let b = draws(&opts(1.0, 2), &logits, 50);
    assert_ne!(a, b);
    let distinct: std::collections::HashSet<_> = a.iter().collect();
    assert!(distinct.len() > 20, "uniform logits should spread: {distinct:?}");
}

#[test]
fn top_k_limits_candidates() {
    let logits: Vec<f32> = (0..50).map(|i| i as f32 * 0.01).collect();
    let o = SamplingOptions { top_k: 3, ..opts(1.0, 3) };
    assert!(draws(&o, &logits, 200).iter().all(|&t| t >= 47));
}

#[test]
fn top_p_keeps_the_nucleus_even_in_a_large_vocab() {
    // Three tokens hold ~all mass in a 50k vocabulary.
    let mut logits = vec![-20.0f32; 50_000];
    logits[10] = 5.0;
    logits[20] = 4.5;
    logits[30] = 4.0;
    let o = SamplingOptions { top_p: 0.7, ..opts(1.0, 4) };
    let d = draws(&o, &logits, 300);
    assert!(d.iter().all(|&t| t == 10 || t == 20), "{d:?}");
    assert!(d.contains(&10) && d.contains(&20));
    // A flat tail: the nucleus needs more than the first 64 candidates.
    let flat: Vec<f32> = (0..1000).map(|i| -(i as f32) * 1e-4).collect();
    let o = SamplingOptions { top_p: 0.5, ..opts(1.0, 5) };
    let d = draws(&o, &flat, 300);
    assert!(d.iter().all(|&t| t < 510), "{:?}", d.iter().max());
    assert!(d.iter().any(|&t| t > 64), "the nucleus reaches past 64 tokens");
}

#[test]
fn min_p_drops_unlikely_tokens() {
    let mut logits = vec![0.0f32; 1000];
    logits[0] = 3.0; // p0 / p_rest = e^3 ≈ 20
    logits[1] = 2.5;
    let o = SamplingOptions { min_p: 0.1, ..opts(1.0, 6) };
    let d = draws(&o, &logits, 300);
    assert!(d.iter().all(|&t| t <= 1), "{d:?}");
    assert!(d.contains(&1));
}

#[test]
fn logit_bias_forces_and_bans_tokens() {
    let logits = vec![1.0, 2.0, 3.0];
    let o = SamplingOptions { logit_bias: vec![(0, 100.0)], ..opts(0.0, 0) };
    assert_eq!(draws(&o, &logits, 3), vec![0, 0, 0]);
    let o = SamplingOptions { logit_bias: vec![(2, -100.0)], ..opts(1.0, 7) };
    assert!(!draws(&o, &logits, 200).contains(&2));
    assert!(SamplingOptions { logit_bias: vec![(3, 1.0)], ..opts(0.0, 0) }.validate(3).is_err());
    assert!(SamplingOptions { logit_bias: vec![(1, 101.0)], ..opts(0.0, 0) }.validate(3).is_err());
}

#[test]
fn frequency_penalty_counts_repeats() {
    // Greedy with a frequency penalty: token 0 leads by 1.0, so after two
    // uses (penalty 2 * 0.6 = 1.2) token 1 wins, then they alternate.
    let logits = vec![2.0, 1.0, -5.0];
    let o = SamplingOptions { frequency_penalty: 0.6, ..opts(0.0, 0) };
    assert_eq!(draws(&o, &logits, 4), vec![0, 0, 1, 0]);
    // Without the penalty greedy repeats forever.
    assert_eq!(draws(&opts(0.0, 0), &logits, 4), vec![0; 4]);
}

#[test]
fn presence_penalty_is_applied_once() {
    let logits = vec![2.0, 1.0, -5.0];
    // Presence 1.5: after one use token 0 is at 0.5 < 1.0; then both used.
    let o = SamplingOptions { presence_penalty: 1.5, ..opts(0.0, 0) };
    assert_eq!(draws(&o, &logits, 3), vec![0, 1, 0]);
    // Negative penalties encourage repetition.
    let o = SamplingOptions { presence_penalty: -2.0, ..opts(0.0, 0) };
    assert_eq!(draws(&o, &[1.0, 2.0], 3), vec![1, 1, 1]);
}

/// The bias and penalties as a device applies them (`adjustments`, each
/// id's run of additions in order, the runs in any order), then the pick
/// made from those logits (an argmax, a plain draw, candidates, or the
/// adjusted row itself) and replayed: the tokens, logits and draws of
/// `sample` from the raw row, bit for bit, over every kind of pick, a
/// duplicated bias id and penalties that grow with the stream.
#[test]
fn a_pick_from_device_adjusted_logits_equals_sampling() {
    let raw: Vec<f32> = (0..3000).map(|i| ((i * 7919 % 997) as f32 / 997.0 - 0.5) * 9.0).collect();
    let v = raw.len();
    let adj = |o: SamplingOptions| SamplingOptions {
        logit_bias: vec![(7, 3.25), (1200, -1.5), (7, 0.1), (42, 2.0)],
        frequency_penalty: 0.37,
        presence_penalty: 0.21,
        ..o
    };
    let cases = [
        adj(opts(0.0, 1)),
        adj(opts(0.9, 2)),
        adj(SamplingOptions { top_p: 0.8, ..opts(1.0, 3) }),
        adj(SamplingOptions { top_k: 20, ..opts(0.7, 4) }),
        adj(SamplingOptions { min_p: 0.3, ..opts(1.1, 5) }),
        // A wide nucleus: candidates miss, the adjusted row is sampled.
        adj(SamplingOptions { top_p: 0.999, ..opts(2.0, 6) }),
        SamplingOptions { presence_penalty: -0.5, ..opts(0.0, 7) },
    ];
    let (mut kinds, mut misses) = ([0usize; 3], 0);
    for (i, o) in cases.iter().enumerate() {
        let (mut host, mut dev) = (Sampler::new(o.clone()), Sampler::new(o.clone()));
        for step in 0..25 {
            let adds = dev.adjustments();
            assert!(adds.windows(2).all(|w| w[0].0 <= w[1].0), "grouped by id");
            // The device: each id's run from its last to its first run.
            let mut row = raw.clone();
            let runs: Vec<&[(u32, f32)]> = adds.chunk_by(|a, b| a.0 == b.0).collect();
            for run in runs.iter().rev() {
                run.iter().for_each(|&(id, a)| row[id as usize] += a);
            }
            let want_row = host.adjusted(&raw).unwrap_or_else(|| raw.clone());
            assert!(row.iter().zip(&want_row).all(|(a, b)| a.to_bits() == b.to_bits()));
            let want = host.sample(&raw);
            let got = if !dev.draws_rng(v) {
                kinds[0] += 1;
                dev.replay(argmax(&row), v);
                argmax(&row)
            } else if let Some((t, u)) = dev.next_draw(v, true) {
                kinds[1] += 1;
                let tok = draw_temperature(&row, t, u);
                dev.replay(tok, v);
                tok
            } else {
                kinds[2] += 1;
                let t = dev.next_top(v, true).unwrap_or_else(|| panic!("case {i}: no top"));
                assert_eq!(dev.next_top(v, false), None, "raw logits cannot be cut");
                dev.sample_top(&top_candidates(&row, t), v, true).unwrap_or_else(|| {
                    misses += 1;
                    dev.sample_adjusted(&row)
                })
            };
            assert_eq!(got, want, "case {i} step {step}");
            assert_eq!(dev.draws(), host.draws(), "case {i} step {step}");
        }
    }
    assert!(kinds.iter().all(|&k| k > 0) && misses > 0, "{kinds:?}, {misses} misses");
    // On one id, its biases in order, then its penalty.
    let mut s = Sampler::new(adj(opts(0.0, 1)));
    assert_eq!(s.adjustments(), vec![(7, 3.25), (7, 0.1), (42, 2.0), (1200, -1.5)]);
    s.replay(7, v);
    s.replay(7, v);
    let pen = -(0.37 * 2.0 + 0.21);
    assert_eq!(s.adjustments(), vec![(7, 3.25), (7, 0.1), (7, pen), (42, 2.0), (1200, -1.5)]);
    assert!(Sampler::new(opts(1.0, 1)).adjustments().is_empty());
}

#[test]
fn validate_rejects_bad_values() {
    assert!(opts(-1.0, 0).validate(10).is_err());
    assert!(SamplingOptions { top_p: 0.0, ..opts(1.0, 0) }.validate(10).is_err());
    assert!(SamplingOptions { min_p: 1.5, ..opts(1.0, 0) }.validate(10).is_err());
    assert!(SamplingOptions { frequency_penalty: 2.5, ..opts(1.0, 0) }.validate(10).is_err());
    assert!(opts(0.7, 0).validate(10).is_ok());
}

#[test]
fn logprobs_are_log_softmax_of_raw_logits() {
    let logits = vec![1.0f32, 2.0, 3.0, 0.5];
    let mut s = Sampler::new(SamplingOptions { logit_bias: vec![(0, 50.0)], ..opts(0.0, 0) });
    let (tok, lp) = s.sample_with_logprobs(&logits, 2);
    assert_eq!(tok, 0, "bias changes the choice");
    let z: f32 = logits.iter().map(|l| l.exp()).sum();
    assert!((lp.chosen.logprob - (1.0 - z.ln())).abs() < 1e-5);
    assert_eq!(lp.top.iter().map(|t| t.token).collect::<Vec<_>>(), vec![2, 1]);
    assert!((lp.top[0].logprob - (3f32.exp() / z).ln()).abs() < 1e-5);
    // n is capped at MAX_TOP_LOGPROBS.
    let big: Vec<f32> = (0..100).map(|i| i as f32).collect();
    assert_eq!(logprobs(&big, 0, 50).top.len(), MAX_TOP_LOGPROBS);
    assert_eq!(logprobs(&big, 0, 0).top.len(), 0);
}

/// A sampler that replays the first `k` tokens of a run samples the rest
/// exactly as the uninterrupted one, on every path (greedy, plain
/// temperature, top-k, top-p, min-p, penalties, a grammar mask): each
/// draws once per stochastic token, and the counts are rebuilt.
#[test]
fn replayed_sampler_continues_like_the_original() {
    let vocab = 300;
    let logits = |step: usize| -> Vec<f32> {
        (0..vocab).map(|i| (((i * 31 + step * 17) % 97) as f32 / 19.0) - 2.0).collect()
    };
    let base = |temperature| SamplingOptions { temperature, seed: 9, ..SamplingOptions::default() };
    let cases = [
        ("greedy", base(0.0)),
        ("temperature", base(0.8)),
        ("top_k", SamplingOptions { top_k: 40, ..base(0.8) }),
        ("top_k_1", SamplingOptions { top_k: 1, ..base(0.8) }),
        ("top_p", SamplingOptions { top_p: 0.9, ..base(0.8) }),
        ("min_p", SamplingOptions { min_p: 0.2, ..base(1.1) }),
        (
            "penalties",
            SamplingOptions { frequency_penalty: 1.5, presence_penalty: 0.7, ..base(0.8) },
        ),
    ];
    for masked in [false, true] {
        for (name, o) in &cases {
            let allowed = |id: u32| id % 3 != 0;
            let step = |s: &mut Sampler, i: usize| -> u32 {
                if masked {
                    s.sample_masked(&logits(i), allowed, None, false).unwrap().0
                } else {
                    s.sample(&logits(i))
                }
            };
            let mut a = Sampler::new(o.clone());
            let run: Vec<u32> = (0..40).map(|i| step(&mut a, i)).collect();
            for k in [0, 1, 13, 39] {
                let mut b = Sampler::new(o.clone());
                for &t in &run[..k] {
                    b.replay(t, vocab);
                }
                let expect_draws = if b.draws_rng(vocab) { k as u64 } else { 0 };
                assert_eq!(b.draws(), expect_draws, "{name} masked={masked} k={k}");
                let rest: Vec<u32> = (k..40).map(|i| step(&mut b, i)).collect();
                assert_eq!(rest, run[k..], "{name} masked={masked} seam {k}");
            }
            assert_eq!(a.draws(), if a.draws_rng(vocab) { 40 } else { 0 }, "{name}");
        }
    }
    // The cases differ: the penalties and the mask change the picks.
    let plain: Vec<u32> = {
        let mut s = Sampler::new(base(0.8));
        (0..40).map(|i| s.sample(&logits(i))).collect()
    };
    let pen: Vec<u32> = {
        let mut s = Sampler::new(cases[6].1.clone());
        (0..40).map(|i| s.sample(&logits(i))).collect()
    };
    assert_ne!(plain, pen);
}

/// A plain temperature sampler's next draw, peeked and drawn elsewhere
/// with `draw_temperature`, then replayed, gives the tokens `sample`
/// gives, and leaves the sampler where `sample` would; every other kind
/// of pick (greedy, top-k, top-p, min-p, a bias, a penalty once a token
/// is counted) is not a plain draw.
#[test]
fn a_peeked_draw_replayed_equals_sampling() {
    let logits: Vec<f32> = (0..500).map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0).collect();
    let v = logits.len();
    let o = opts(0.8, 11);
    let mut peeked = Sampler::new(o.clone());
    let mut plain = Sampler::new(o);
    for _ in 0..40 {
        let (t, u) = peeked.next_draw(v, false).unwrap();
        assert_eq!(peeked.next_draw(v, false), Some((t, u)), "peeking draws nothing");
        let tok = draw_temperature(&logits, t, u);
        peeked.replay(tok, v);
        assert_eq!(tok, plain.sample(&logits));
    }
    assert_eq!(peeked.draws(), plain.draws());
    // Ids drawn spread (the uniform moves between tokens).
    let spread: std::collections::HashSet<u32> = (0..40)
        .map(|_| {
            let (t, u) = peeked.next_draw(v, false).unwrap();
            let tok = draw_temperature(&logits, t, u);
            peeked.replay(tok, v);
            tok
        })
        .collect();
    assert!(spread.len() > 5, "{spread:?}");
    let none = |o: SamplingOptions| Sampler::new(o).next_draw(v, false);
    assert_eq!(none(opts(0.0, 1)), None, "greedy");
    assert_eq!(none(SamplingOptions { top_k: 5, ..opts(1.0, 1) }), None);
    assert_eq!(none(SamplingOptions { top_p: 0.9, ..opts(1.0, 1) }), None);
    assert_eq!(none(SamplingOptions { min_p: 0.1, ..opts(1.0, 1) }), None);
    assert_eq!(none(SamplingOptions { logit_bias: vec![(3, 1.0)], ..opts(1.0, 1) }), None);
    assert!(none(SamplingOptions { top_k: v, ..opts(1.0, 1) }).is_some(), "top-k of all");
    let mut pen = Sampler::new(SamplingOptions { presence_penalty: 0.5, ..opts(1.0, 1) });
    assert!(pen.next_draw(v, false).is_some(), "nothing counted yet: no penalty");
    pen.sample(&logits);
    assert_eq!(pen.next_draw(v, false), None, "a counted token is penalised");
}

/// `draw_temperature` follows the running sum in id order: a uniform
/// just below a token's share of the mass picks it, just above the next.
#[test]
fn draw_temperature_follows_the_cumulative_mass() {
    // Probabilities 1/4, 1/2, 1/4 at temperature 1.
    let ln2 = std::f32::consts::LN_2;
    let logits = [0.0, ln2, 0.0];
    assert_eq!(draw_temperature(&logits, 1.0, 0.0), 0);
    assert_eq!(draw_temperature(&logits, 1.0, 0.2), 0);
    assert_eq!(draw_temperature(&logits, 1.0, 0.3), 1);
    assert_eq!(draw_temperature(&logits, 1.0, 0.7), 1);
    assert_eq!(draw_temperature(&logits, 1.0, 0.8), 2);
    // A low temperature sharpens towards the best.
    assert_eq!(draw_temperature(&logits, 0.05, 0.2), 1);
    assert_eq!(draw_temperature(&logits, 0.05, 0.99), 1);
}

/// A draw that lands in a long tail of small weights after a few large
/// ones: one f32 running sum stops growing there (each weight is below
/// half its ulp), so its total left the tail out and it drew inside the
/// ten best; the grouped sums' crossing lies within a few dozen ulps of
/// the exact (f64) one (each range's sum rounds once as it is added).
#[test]
fn a_draw_in_a_long_tail_finds_its_token() {
    let vocab = 49_152;
    let mut logits = vec![-18.0f32; vocab];
    logits[..10].fill(0.0);
    let w: Vec<f64> = logits.iter().map(|&l| (l as f64).exp()).collect();
    let total: f64 = w.iter().sum();
    // The ten best hold all but 7.5e-5 of the mass.
    for u in [0.99994f32, 0.99996, 0.99999] {
        let tok = draw_temperature(&logits, 1.0, u) as usize;
        let r = u as f64 * total;
        let before: f64 = w[..tok].iter().sum();
        let ulp = 10f32.next_up() as f64 - 10.0;
        assert!(tok > 10 && tok < vocab - 1, "u {u}: {tok}");
        assert!((before - r).abs() < 32.0 * ulp, "u {u}: token {tok}, {before} against {r}");
    }
    // Ties in a grouped sum: the ranges split the vocabulary evenly.
    assert_eq!(draw_temperature(&[0.0; 5], 1.0, 0.5), 2);
    assert_eq!(draw_temperature(&[], 1.0, 0.5), 0);
}

/// A temperature too small for `l / t` (a subnormal one overflowed every
/// probability to NaN and drew the last id) samples greedily, draws
/// nothing from the RNG, and is picked as an argmax; from
/// `MIN_TEMPERATURE` on it draws.
#[test]
fn a_vanishing_temperature_is_greedy() {
    let logits = vec![0.5, 3.0, -1.0, 2.9];
    for t in [1e-40, 1e-20, MIN_TEMPERATURE / 2.0] {
        let mut s = Sampler::new(opts(t, 9));
        assert!(s.plain_greedy(logits.len()) && s.next_draw(logits.len(), false).is_none(), "{t}");
        assert_eq!(s.sample(&logits), 1, "{t}");
        assert_eq!(s.draws(), 0, "{t}");
    }
    assert!(Sampler::new(opts(MIN_TEMPERATURE, 9)).next_draw(logits.len(), false).is_some());
}

/// A top-k / top-p / min-p draw finished from a row's best candidates and
/// its mass (what a GPU returns instead of the logits) is the draw
/// `sample` makes from the logits, RNG and counts included; where the
/// candidates do not reach the cut nothing is drawn, and sampling the
/// logits then continues the same stream.
#[test]
fn a_draw_from_the_top_candidates_equals_sampling() {
    // A flat row (a wide nucleus) and a peaked one, over a vocabulary
    // larger and smaller than the candidates.
    let row = |v: usize, spread: f32| -> Vec<f32> {
        (0..v).map(|i| ((i * 7919 % 997) as f32 / 997.0 - 0.5) * spread).collect()
    };
    let cases = [
        (row(5000, 30.0), SamplingOptions { top_p: 0.9, ..opts(1.0, 1) }),
        (row(5000, 30.0), SamplingOptions { top_k: 40, ..opts(0.7, 2) }),
        (row(5000, 30.0), SamplingOptions { top_k: 200, top_p: 0.5, ..opts(1.0, 3) }),
        (row(5000, 2.0), SamplingOptions { top_p: 0.95, ..opts(1.2, 4) }),
        (row(5000, 4.0), SamplingOptions { min_p: 0.5, ..opts(1.0, 5) }),
        (row(100, 3.0), SamplingOptions { top_p: 0.99, ..opts(1.0, 6) }),
        (row(100, 3.0), SamplingOptions { top_k: 150, min_p: 0.05, ..opts(0.9, 7) }),
    ];
    let (mut hits, mut misses) = (0, 0);
    for (i, (logits, o)) in cases.iter().enumerate() {
        let v = logits.len();
        let mut from_top = Sampler::new(o.clone());
        let mut plain = Sampler::new(o.clone());
        for step in 0..30 {
            // The counts change nothing here (no penalty), the RNG does.
            let want = plain.sample(logits);
            let t =
                from_top.next_top(v, false).unwrap_or_else(|| panic!("case {i}: not a top draw"));
            let top = top_candidates(logits, t);
            assert_eq!(top.cand.len(), v.min(TOP_CANDIDATES));
            let got = match from_top.sample_top(&top, v, false) {
                Some(tok) => {
                    hits += 1;
                    tok
                }
                None => {
                    misses += 1;
                    from_top.sample(logits)
                }
            };
            assert_eq!(got, want, "case {i} step {step}");
            assert_eq!(from_top.draws(), plain.draws(), "case {i} step {step}");
        }
    }
    assert!(hits > 0 && misses > 0, "{hits} hits, {misses} misses");
    let top = |o: SamplingOptions| Sampler::new(o).next_top(5000, false);
    assert_eq!(top(opts(0.0, 1)), None, "greedy");
    assert_eq!(top(opts(1.0, 1)), None, "a plain draw needs no candidates");
    assert_eq!(top(SamplingOptions { top_k: 1000, ..opts(1.0, 1) }), None, "top-k past them");
    assert_eq!(
        top(SamplingOptions { top_p: 0.9, logit_bias: vec![(3, 1.0)], ..opts(1.0, 1) }),
        None
    );
    assert_eq!(top(SamplingOptions { top_k: 256, ..opts(0.5, 1) }), Some(0.5));
}

/// Logprobs from a row's candidates equal those of its logits (the same
/// normaliser, in f64) for any token among them, with at most 20
/// alternatives; a token outside them has none, unless its logit came
/// back beside them.
#[test]
fn logprobs_from_the_candidates_equal_the_logits() {
    let logprobs_from_top =
        |top: &TopCandidates, tok: u32, n: usize| logprobs_with(top, tok, top.logit(tok)?, n);
    let logits: Vec<f32> =
        (0..3000).map(|i| ((i * 7919 % 997) as f32 / 997.0 - 0.5) * 12.0).collect();
    let top = top_candidates(&logits, 0.8);
    for (rank, n) in [(0, 5), (17, 20), (255, 40), (3, 0)] {
        let tok = top.cand[rank].0;
        let want = logprobs(&logits, tok, n);
        assert_eq!(logprobs_from_top(&top, tok, n), Some(want), "rank {rank}, n {n}");
    }
    let outside = (0..3000u32).find(|i| top.cand.iter().all(|c| c.0 != *i)).unwrap();
    assert_eq!(logprobs_from_top(&top, outside, 5), None);
    // Its logit known beside them (a device's picked token).
    let known = TopCandidates { known: vec![(outside, logits[outside as usize])], ..top.clone() };
    assert_eq!(logprobs_from_top(&known, outside, 5), Some(logprobs(&logits, outside, 5)));
    // A vocabulary smaller than the alternatives asked.
    let small = [0.5f32, -1.0, 2.0];
    let top = top_candidates(&small, 1.0);
    assert_eq!(logprobs_from_top(&top, 1, 20), Some(logprobs(&small, 1, 20)));
}
