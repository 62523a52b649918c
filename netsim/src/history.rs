//! The recorded history of a run and the checks over it, Jepsen-style: the
//! client's view of every request plus the gateway's usage records, judged
//! after the fact against invariants that hold whatever the faults were.

use serde::Serialize;
use serde_json::Value;

use crate::client::{Record, Terminal};
use crate::scenario::{Expect, RequestSpec};

/// One request of the history.
#[derive(Clone, Debug, Serialize)]
pub struct Entry {
    /// Request group.
    pub group: String,
    /// Index within the group.
    pub index: u32,
    /// What the client saw.
    pub record: Record,
    /// The gateway's usage record for the job, when found.
    pub usage: Option<Value>,
    /// The gateway serving it was killed while it ran.
    pub gateway_died: bool,
    /// Check results.
    pub checks: Vec<Check>,
    /// Findings that do not fail the run (known limitations).
    pub notes: Vec<String>,
}

/// A named check and its verdict.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// Name (the table's column).
    pub name: &'static str,
    /// Passed.
    pub ok: bool,
    /// Why not, or what was seen.
    pub detail: String,
}

fn check(name: &'static str, ok: bool, detail: impl Into<String>) -> Check {
    Check { name, ok, detail: detail.into() }
}

/// The check names in table order.
pub const COLUMNS: [&str; 5] = ["terminal", "wire", "usage", "expect", "reference"];

impl Entry {
    /// Whether every check passed.
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.ok)
    }

    /// Runs every check; `reference` is the unfaulted text when the group
    /// asked for one.
    pub fn judge(&mut self, spec: &RequestSpec, reference: Option<&str>) {
        let usage = self.usage_check();
        let r = &self.record;
        let mut checks = vec![self.terminal(spec), wire(r, spec), usage];
        checks.push(self.expectation(spec));
        let alt = spec.adversary_output_ok.then(|| crate::adversary::output_text(spec.max_tokens));
        checks.push(match (reference, alt) {
            (None, None) => check("reference", true, "not asked"),
            (Some(text), None) => reference_check(r, text),
            (None, Some(adv)) => reference_check(r, &adv),
            // One worker's output, whichever won the job: never a mix.
            (Some(text), Some(adv)) => {
                let honest = reference_check(r, text);
                let rogue = reference_check(r, &adv);
                match (honest.ok, rogue.ok) {
                    (true, _) => honest,
                    (false, true) => check(
                        "reference",
                        true,
                        format!("the adversary's output: {}", rogue.detail),
                    ),
                    (false, false) => check(
                        "reference",
                        false,
                        format!(
                            "neither the reference ({}) nor the adversary's output ({})",
                            honest.detail, rogue.detail
                        ),
                    ),
                }
            }
        });
        self.checks = checks;
    }

    /// Exactly one terminal outcome: complete, an HTTP error, or an SSE
    /// error event. A closed connection or failed connect counts only when
    /// the serving gateway was killed; a timeout never counts.
    fn terminal(&self, spec: &RequestSpec) -> Check {
        let r = &self.record;
        let both = r.dones > 0 && r.error.is_some();
        let ok = !both
            && match r.terminal {
                Terminal::Complete | Terminal::Error => true,
                Terminal::ClientGaveUp => {
                    spec.read_bytes_per_s.is_some() || spec.vanish_after_frames.is_some()
                }
                Terminal::Closed | Terminal::ConnectFailed => self.gateway_died,
                Terminal::Timeout => false,
            };
        let detail = format!("{:?} status {}", r.terminal, r.status);
        check(
            "terminal",
            ok,
            if both { format!("{detail}: both [DONE] and an error") } else { detail },
        )
    }

    /// Every accepted job has a usage record whose
    /// `output_tokens_sent_to_client` equals what the client received when
    /// it read to the terminal frame, and is at least that when the stream
    /// stopped early — a slow client, or a gateway killed mid-stream and
    /// recovered from its keyspace (bytes still queued were never read, but
    /// what was read must never be unbilled).
    fn usage_check(&self) -> Check {
        let r = &self.record;
        if r.status != 200 {
            return check("usage", true, "not accepted");
        }
        let Some(job) = &r.job_id else { return check("usage", false, "no x-request-id") };
        let Some(u) = &self.usage else {
            return check("usage", false, format!("no record for {job}"));
        };
        let sent = u["output_tokens_sent_to_client"].as_u64().unwrap_or(0);
        let got = r.received_tokens();
        let read_all = matches!(r.terminal, Terminal::Complete | Terminal::Error);
        let detail = format!("sent {sent}, received {got}");
        let ok = if read_all { sent == got } else { sent >= got };
        check("usage", ok, detail)
    }

    fn expectation(&self, spec: &RequestSpec) -> Check {
        let r = &self.record;
        let partial = r.error.is_some() && r.content_frames > 0;
        let shape_ok = match spec.expect {
            Expect::Any => true,
            Expect::Complete => r.terminal == Terminal::Complete,
            Expect::ErrorAfterPartial => partial,
            Expect::ErrorOrClosed => {
                matches!(r.terminal, Terminal::Error | Terminal::Closed | Terminal::ConnectFailed)
            }
            Expect::CompleteOrErrorAfterPartial => r.terminal == Terminal::Complete || partial,
        };
        let mut why = vec![format!("{:?}", spec.expect)];
        let mut ok = shape_ok;
        let u = self.usage.as_ref();
        if let Some(want) = &spec.expect_cancellation {
            let got = u.and_then(|u| u["cancellation_reason"].as_str()).unwrap_or("none");
            ok &= got == want;
            why.push(format!("cancellation {got} (want {want})"));
        }
        if let Some(min) = spec.expect_requeues_min {
            let got = u.and_then(|u| u["requeue_count"].as_u64()).unwrap_or(0);
            ok &= got >= u64::from(min);
            why.push(format!("requeues {got} (want >= {min})"));
        }
        if spec.expect_late_metering {
            let generated = u.and_then(|u| u["output_tokens_generated"].as_u64()).unwrap_or(0);
            let sent = u.and_then(|u| u["output_tokens_sent_to_client"].as_u64()).unwrap_or(0);
            ok &= generated > sent;
            why.push(format!("late metering: generated {generated} > sent {sent}"));
        }
        if partial && !self.gateway_died {
            // A failure after tokens reached the client is billed as such.
            let flag = u.and_then(|u| u["failed_after_partial_output"].as_bool()).unwrap_or(false);
            ok &= flag;
            why.push(format!("failed_after_partial_output {flag}"));
        }
        check("expect", ok, why.join(", "))
    }
}

/// Wire-level invariants: no frame after `[DONE]` or after an error event,
/// at most one finish chunk and `[DONE]`, a complete stream has exactly one
/// of each, content never follows the finish, one response id throughout.
fn wire(r: &Record, spec: &RequestSpec) -> Check {
    let mut bad = r.violations.clone();
    if spec.stream && r.status == 200 {
        if r.finishes > 1 {
            bad.push(format!("{} finish chunks", r.finishes));
        }
        if r.dones > 1 {
            bad.push(format!("{} [DONE] frames", r.dones));
        }
        if r.terminal == Terminal::Complete && (r.finishes != 1 || r.dones != 1) {
            bad.push(format!("complete with {} finishes, {} [DONE]", r.finishes, r.dones));
        }
    }
    let detail = if bad.is_empty() {
        format!("{} content frames", r.content_frames)
    } else {
        bad.join("; ")
    };
    check("wire", bad.is_empty(), detail)
}

/// Temperature 0 makes the answer a function of the request: what the
/// client got must be a prefix of the unfaulted answer (equal when
/// complete). A duplicated or skipped token, or a silent switch to a
/// worker that restarted the answer mid-stream, breaks the prefix.
fn reference_check(r: &Record, text: &str) -> Check {
    if r.status != 200 {
        return check("reference", true, "not accepted");
    }
    let ok = if r.terminal == Terminal::Complete {
        r.content == text
    } else {
        text.starts_with(&r.content)
    };
    let at = r.content.chars().zip(text.chars()).take_while(|(a, b)| a == b).count();
    let detail = if ok {
        format!("{} of {} chars match", r.content.chars().count(), text.chars().count())
    } else {
        format!(
            "diverges at char {at}: got {:?}",
            r.content.chars().skip(at).take(40).collect::<String>()
        )
    };
    check("reference", ok, detail)
}


#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(expect: Expect) -> RequestSpec {
        let mut s: RequestSpec =
            toml::from_str("name = \"g\"\ngateway = \"gw\"").expect("minimal request spec");
        s.expect = expect;
        s
    }

    fn entry(content: &str, frames: u64, terminal: Terminal, sent: u64) -> Entry {
        let mut r = Record::lost("");
        r.violations.clear();
        r.status = 200;
        r.job_id = Some("job".into());
        r.terminal = terminal;
        r.content = content.into();
        r.content_frames = frames;
        if terminal == Terminal::Complete {
            r.finishes = 1;
            r.dones = 1;
        } else {
            r.error = Some(json!({"code": "gnus_worker_lost"}));
        }
        let usage =
            json!({"output_tokens_sent_to_client": sent, "failed_after_partial_output": true});
        Entry {
            group: "g".into(),
            index: 0,
            record: r,
            usage: Some(usage),
            gateway_died: false,
            checks: vec![],
            notes: vec![],
        }
    }

    fn failed(e: &Entry) -> Vec<&'static str> {
        e.checks.iter().filter(|c| !c.ok).map(|c| c.name).collect()
    }

    #[test]
    fn a_clean_complete_stream_passes() {
        let mut e = entry("a b c", 3, Terminal::Complete, 3);
        e.judge(&spec(Expect::Complete), Some("a b c"));
        assert!(e.ok(), "{:?}", e.checks);
    }

    #[test]
    fn duplicated_text_breaks_the_reference_prefix() {
        let mut e = entry("a b b", 3, Terminal::Error, 3);
        e.judge(&spec(Expect::ErrorAfterPartial), Some("a b c d"));
        assert_eq!(failed(&e), ["reference"]);
    }

    #[test]
    fn a_silent_switch_is_not_an_error_after_partial_output() {
        let mut e = entry("a b c d", 4, Terminal::Complete, 4);
        e.judge(&spec(Expect::ErrorAfterPartial), None);
        assert_eq!(failed(&e), ["expect"]);
    }

    #[test]
    fn unbilled_or_overbilled_tokens_fail_usage() {
        for sent in [2, 4] {
            let mut e = entry("a b c", 3, Terminal::Error, sent);
            e.judge(&spec(Expect::Any), None);
            assert_eq!(failed(&e), ["usage"], "sent {sent}");
        }
        let mut e = entry("a b c", 3, Terminal::Error, 3);
        e.usage = None;
        e.judge(&spec(Expect::Any), None);
        assert!(failed(&e).contains(&"usage"));
    }

    #[test]
    fn wire_violations_and_double_endings_fail() {
        let mut e = entry("a", 1, Terminal::Complete, 1);
        e.record.finishes = 2;
        e.record.violations.push("frame after the error event".into());
        e.judge(&spec(Expect::Any), None);
        assert_eq!(failed(&e), ["wire"]);
        let mut e = entry("a", 1, Terminal::Complete, 1);
        e.record.error = Some(json!({}));
        e.judge(&spec(Expect::Any), None);
        assert!(failed(&e).contains(&"terminal"));
    }

    #[test]
    fn either_workers_output_passes_but_never_a_mix() {
        let adv = crate::adversary::output_text(16);
        let mut s = spec(Expect::Complete);
        s.adversary_output_ok = true;
        let mut e = entry(&adv, 12, Terminal::Complete, 12);
        e.judge(&s, Some("a b c"));
        assert!(e.ok(), "{:?}", e.checks);
        let mut e = entry("a b c", 3, Terminal::Complete, 3);
        e.judge(&s, Some("a b c"));
        assert!(e.ok(), "{:?}", e.checks);
        // The adversary's first chunks, then the honest worker's text.
        let mixed = format!("adv0 adv1 {}", "a b c");
        let mut e = entry(&mixed, 5, Terminal::Complete, 5);
        e.judge(&s, Some("a b c"));
        assert_eq!(failed(&e), ["reference"]);
    }

    #[test]
    fn late_metering_is_required_when_asked() {
        let mut s = spec(Expect::ErrorAfterPartial);
        s.expect_late_metering = true;
        let mut e = entry("a b", 2, Terminal::Error, 2);
        e.judge(&s, None);
        assert_eq!(failed(&e), ["expect"]);
        e.usage.as_mut().unwrap()["output_tokens_generated"] = json!(9);
        e.judge(&s, None);
        assert!(e.ok(), "{:?}", e.checks);
    }

    #[test]
    fn a_closed_connection_passes_only_when_the_gateway_died() {
        let mut e = entry("a", 1, Terminal::Closed, 1);
        e.record.error = None;
        e.judge(&spec(Expect::ErrorOrClosed), None);
        assert_eq!(failed(&e), ["terminal"]);
        e.gateway_died = true;
        e.judge(&spec(Expect::ErrorOrClosed), None);
        assert!(e.ok(), "{:?}", e.checks);
    }
}
