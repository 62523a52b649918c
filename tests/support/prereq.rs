//! What a test does when something it needs is missing (a model, an SDK, a
//! system tool, a kernel feature): under `CI=true` that is a failure naming
//! the missing thing, elsewhere (a bare `cargo test` on a laptop) the test
//! says SKIP and returns. The README's test command (scripts/test.sh)
//! installs every prerequisite, so in CI nothing may be skipped.
//!
//! Included by path (`#[path = ".../tests/support/prereq.rs"] mod prereq;`)
//! from the integration tests and benches of every crate that has some.

#![allow(dead_code, clippy::panic)]

use std::io::Write;

/// Whether this is a CI run (`CI=true`, as CI services set it, or `CI=1`).
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// `what` is missing; `fix` says how to get it. Panics under CI; otherwise
/// prints SKIP straight to the process's stderr (not the test harness's
/// captured output, so a skip shows in a passing run) and returns.
#[track_caller]
pub fn missing(what: &str, fix: &str) {
    if ci() {
        panic!("missing prerequisite under CI=true: {what} ({fix})");
    }
    let _ = writeln!(std::io::stderr(), "SKIP: {what} missing; {fix}");
}

/// `Some(v)` passes through; `None` is [`missing`] (a panic under CI).
#[track_caller]
pub fn require<T>(v: Option<T>, what: &str, fix: &str) -> Option<T> {
    if v.is_none() {
        missing(what, fix);
    }
    v
}

/// An environment variable the test command exports.
#[track_caller]
pub fn env(name: &str, fix: &str) -> Option<String> {
    require(std::env::var(name).ok().filter(|v| !v.is_empty()), name, fix)
}

/// A program: a path to an executable file, or a name found on PATH.
#[track_caller]
pub fn program(prog: &str, fix: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let runnable = |p: &std::path::Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let ok = if prog.contains('/') {
        runnable(std::path::Path::new(prog))
    } else {
        std::env::var_os("PATH")
            .is_some_and(|path| std::env::split_paths(&path).any(|d| runnable(&d.join(prog))))
    };
    if !ok {
        missing(prog, fix);
    }
    ok
}
