//! The pass/fail table and the JSON report of scenario runs.

use std::fmt::Write as _;
use std::path::Path;

use crate::history::COLUMNS;
use crate::runner::Outcome;
use crate::Error;

/// A text table: one row per request, one column per check, then the
/// run-level checks and the faults.
pub fn table(o: &Outcome) -> String {
    let mut t = String::new();
    if let Some(why) = &o.skipped {
        let _ = writeln!(t, "scenario {} — SKIPPED: {why}", o.scenario);
        return t;
    }
    let verdict = if o.ok() { "PASS" } else { "FAIL" };
    let _ = writeln!(t, "scenario {} — {verdict} in {:.1}s", o.scenario, o.seconds);
    for f in &o.faults {
        let frames = f
            .frames_at_fault
            .map(|n| format!(", client had {n} content frames"))
            .unwrap_or_default();
        let _ = writeln!(t, "  fault at {:>6} ms: {} {}{frames}", f.at_ms, f.action, f.node);
    }
    let _ = write!(t, "  {:<18} {:<14}", "request", "outcome");
    for c in COLUMNS {
        let _ = write!(t, " {c:<9}");
    }
    let _ = writeln!(t);
    for e in &o.entries {
        let out = format!("{:?}/{}", e.record.terminal, e.record.content_frames);
        let _ = write!(t, "  {:<18} {:<14}", format!("{}#{}", e.group, e.index), out);
        for c in COLUMNS {
            let v =
                e.checks
                    .iter()
                    .find(|x| x.name == c)
                    .map_or("-", |x| if x.ok { "ok" } else { "FAIL" });
            let _ = write!(t, " {v:<9}");
        }
        let _ = writeln!(t);
        for c in e.checks.iter().filter(|c| !c.ok) {
            let _ = writeln!(t, "      {}: {}", c.name, c.detail);
        }
        for n in &e.notes {
            let _ = writeln!(t, "      note: {n}");
        }
    }
    for c in &o.run_checks {
        let _ =
            writeln!(t, "  {:<18} {:<5} {}", c.name, if c.ok { "ok" } else { "FAIL" }, c.detail);
    }
    t
}

/// Writes every outcome as one JSON document.
pub fn write_json(path: &Path, outcomes: &[Outcome]) -> Result<(), Error> {
    let ok = outcomes.iter().all(Outcome::ok);
    let v = serde_json::json!({"ok": ok, "scenarios": outcomes});
    let text = serde_json::to_string_pretty(&v).map_err(|e| Error::Setup(e.to_string()))?;
    std::fs::write(path, text)?;
    Ok(())
}
