//! `engine-bench --model PATH [--model PATH ...] [--llama-bench PATH]`:
//! each model side by side with llama.cpp in the same run. Rounds alternate
//! ours and theirs (who goes first alternates too), each a fresh process
//! loading the file, so a machine busy with other work slows both alike;
//! the table shows the medians, the range and the ratio.

use std::process::Command;

use serde::Serialize;

use super::{ours, theirs};

/// What the compare mode was asked for.
#[derive(Debug)]
pub struct Args {
    pub models: Vec<String>,
    pub llama_bench: Option<String>,
    pub rounds: usize,
    pub tokens: usize,
    /// Context of the long-context decode (0: not measured).
    pub ctx: usize,
    pub threads: usize,
    pub json: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: Machine,
    llama_bench: Option<String>,
    rounds: usize,
    tokens: usize,
    models: Vec<ModelReport>,
}

#[derive(Debug, Serialize)]
struct Machine {
    cpu: String,
    /// The SIMD flags the kernels dispatch on that this CPU has.
    flags: Vec<String>,
    threads: usize,
    /// /proc/loadavg before the first round and after the last model.
    loadavg_start: String,
    loadavg_end: String,
}

#[derive(Debug, Serialize)]
struct ModelReport {
    file: String,
    name: String,
    arch: String,
    quantization: String,
    weights_mb: f64,
    ours: Vec<ours::Round>,
    theirs: Vec<theirs::Round>,
    /// metric → [ours median, theirs median, ours / theirs] (for TTFT
    /// theirs / ours, so above 1 is ours better everywhere).
    medians: Vec<(String, [f64; 3])>,
}

pub fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn machine(threads: usize) -> Machine {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let have = field("flags");
    let have: Vec<&str> = have.split_whitespace().collect();
    let wanted = ["avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl"];
    let wanted = wanted.iter().chain(&["avx512_vnni", "avx512_bf16", "amx_int8", "amx_tile"]);
    Machine {
        cpu: field("model name"),
        flags: wanted.filter(|f| have.contains(f)).map(|f| f.to_string()).collect(),
        threads,
        loadavg_start: loadavg(),
        loadavg_end: String::new(),
    }
}

/// One of our rounds, in a child process (`--measure-one`).
fn ours_round(file: &str, a: &Args) -> Result<ours::Round, Box<dyn std::error::Error>> {
    let out = Command::new(std::env::current_exe()?)
        .args(["--measure-one", file, "--tokens", &a.tokens.to_string()])
        .args(["--ctx", &a.ctx.to_string()])
        .env("RAYON_NUM_THREADS", a.threads.to_string())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find_map(|l| l.strip_prefix(ours::MARK));
    match (out.status.success(), line) {
        (true, Some(l)) => Ok(serde_json::from_str(l)?),
        _ => Err(format!(
            "gcs-engine round on {file} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        )
        .into()),
    }
}

pub fn run(a: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let mut report = Report {
        machine: machine(a.threads),
        llama_bench: a.llama_bench.clone(),
        rounds: a.rounds,
        tokens: a.tokens,
        models: vec![],
    };
    println!(
        "engine-bench --model: {} round(s) per model, {} threads, {} decode tokens per stream; \
         CPU {} [{}]; load {}",
        a.rounds,
        a.threads,
        a.tokens,
        report.machine.cpu,
        report.machine.flags.join(" "),
        report.machine.loadavg_start
    );
    for file in &a.models {
        let (mut us, mut them) = (vec![], vec![]);
        for r in 0..a.rounds {
            // Alternate who goes first, so neither always runs on a
            // machine the other has just warmed (or heated).
            for theirs_turn in [r % 2 == 1, r % 2 == 0] {
                match (&a.llama_bench, theirs_turn) {
                    (Some(lb), true) => {
                        let t = theirs::measure(lb, file, a.threads, a.tokens, a.ctx)?;
                        eprintln!(
                            "  round {} llama.cpp: pp64 {:.1} pp512 {:.1} tg{} {:.1}, at depth {} {:.1} tok/s (load {})",
                            r + 1,
                            t.pp64,
                            t.pp512,
                            a.tokens,
                            t.tg,
                            a.ctx,
                            t.tg_ctx,
                            loadavg()
                        );
                        them.push(t);
                    }
                    (_, false) => {
                        let o = ours_round(file, a)?;
                        eprintln!(
                            "  round {} gcs-engine: pp64 {:.1} pp512 {:.1} decode {:.1} / {:.1} / {:.1}, at {} context {:.1} tok/s (load {})",
                            r + 1,
                            o.prefill_64,
                            o.prefill_512,
                            o.decode_1,
                            o.decode_8,
                            o.decode_16,
                            o.ctx,
                            o.decode_ctx,
                            loadavg()
                        );
                        us.push(o);
                    }
                    (None, true) => {}
                }
            }
        }
        let m = model_report(file, us, them, a.tokens, a.ctx);
        print_table(&m, a);
        report.models.push(m);
        // After every model, so a run cut short keeps what it measured.
        report.machine.loadavg_end = loadavg();
        if let Some(path) = &a.json {
            std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
            println!("wrote {path}");
        }
    }
    Ok(())
}

fn model_report(
    file: &str,
    us: Vec<ours::Round>,
    them: Vec<theirs::Round>,
    tokens: usize,
    ctx: usize,
) -> ModelReport {
    let o = |f: fn(&ours::Round) -> f64| median(&us.iter().map(f).collect::<Vec<_>>());
    let t = |f: fn(&theirs::Round) -> f64| median(&them.iter().map(f).collect::<Vec<_>>());
    let tg = t(|x| x.tg);
    let ttft_theirs = 64e3 / t(|x| x.pp64);
    let rows: Vec<(String, f64, f64, bool)> = vec![
        ("prefill 64 tok/s".into(), o(|x| x.prefill_64), t(|x| x.pp64), true),
        ("prefill 512 tok/s".into(), o(|x| x.prefill_512), t(|x| x.pp512), true),
        ("TTFT 64-token prompt ms".into(), o(|x| x.ttft_64_ms), ttft_theirs, false),
        (format!("decode 1 stream tok/s (tg{tokens})"), o(|x| x.decode_1), tg, true),
        ("decode 8 streams tok/s, vs 1 stream".into(), o(|x| x.decode_8), tg, true),
        ("decode 16 streams tok/s, vs 1 stream".into(), o(|x| x.decode_16), tg, true),
        (
            format!("decode 1 stream at {ctx} context tok/s"),
            o(|x| x.decode_ctx),
            t(|x| x.tg_ctx),
            true,
        ),
        // Ours at long context over ours at short context, and theirs.
        (
            format!("decode at {ctx} / short context"),
            o(|x| x.decode_ctx / x.decode_1),
            t(|x| x.tg_ctx / x.tg),
            true,
        ),
        ("peak RSS MiB".into(), o(|x| x.peak_rss_mib), t(|x| x.peak_rss_mib), false),
    ];
    let medians = rows
        .into_iter()
        .map(|(k, a, b, higher_better)| {
            let ratio = if higher_better { a / b } else { b / a };
            (k, [a, b, ratio])
        })
        .collect();
    let first = us.first().cloned().unwrap_or_default();
    ModelReport {
        file: file.to_string(),
        name: first.name,
        arch: first.arch,
        quantization: first.quantization,
        weights_mb: first.weights_mb,
        ours: us,
        theirs: them,
        medians,
    }
}

fn print_table(m: &ModelReport, a: &Args) {
    println!(
        "\n{} ({}, {}, {:.1} MB of weights) — {}\n  medians of {} rounds, {} threads",
        if m.name.is_empty() { "?" } else { &m.name },
        m.arch,
        m.quantization,
        m.weights_mb,
        m.file,
        a.rounds,
        a.threads
    );
    let theirs = a.llama_bench.is_some();
    if theirs {
        println!("  {:<40} {:>12} {:>12} {:>8}", "metric", "gcs-engine", "llama.cpp", "ratio");
    } else {
        println!("  {:<40} {:>12}", "metric", "gcs-engine");
    }
    let spread = |i: usize| -> String {
        let v: Vec<f64> = m.ours.iter().map(|r| ours_metric(r, i)).collect();
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.1}–{hi:.1}")
    };
    for (i, (k, [o, t, r])) in m.medians.iter().enumerate() {
        // `--ctx 0`: the long-context rows were not measured.
        if a.ctx == 0 && k.contains(" context") {
            continue;
        }
        if theirs {
            println!("  {k:<40} {o:>12.1} {t:>12.1} {r:>7.2}x   (ours {})", spread(i));
        } else {
            println!("  {k:<40} {o:>12.1}   ({})", spread(i));
        }
    }
    if theirs {
        println!("  (TTFT and RSS ratios are llama.cpp / ours; llama.cpp's TTFT is 64 / pp64.)");
    }
}

fn ours_metric(r: &ours::Round, i: usize) -> f64 {
    [
        r.prefill_64,
        r.prefill_512,
        r.ttft_64_ms,
        r.decode_1,
        r.decode_8,
        r.decode_16,
        r.decode_ctx,
        r.decode_ctx / r.decode_1,
        r.peak_rss_mib,
    ]
    .get(i)
    .copied()
    .unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_nan() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[f64::NAN, 5.0]), 5.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn ratios_are_ours_over_theirs_and_theirs_over_ours_for_ttft() {
        let us = ours::Round {
            prefill_64: 200.0,
            ttft_64_ms: 400.0,
            decode_1: 60.0,
            decode_8: 300.0,
            ..Default::default()
        };
        let them = theirs::Round { pp64: 320.0, tg: 120.0, ..Default::default() };
        let m = model_report("f", vec![us], vec![them], 128, 0);
        let get = |k: &str| m.medians.iter().find(|(n, _)| n.starts_with(k)).unwrap().1;
        assert_eq!(get("prefill 64"), [200.0, 320.0, 0.625]);
        assert_eq!(get("TTFT"), [400.0, 200.0, 0.5]);
        assert_eq!(get("decode 1"), [60.0, 120.0, 0.5]);
        assert_eq!(get("decode 8"), [300.0, 120.0, 2.5]);
    }
}
