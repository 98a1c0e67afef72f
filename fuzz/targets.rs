//! The fuzz targets' entry points, shared by the libFuzzer binaries
//! (`fuzz/fuzz_targets/*.rs`) and by `tests/it/fuzz_regressions.rs`, which
//! replays every kept case through the same functions without the fuzzer.
//!
//! Each entry point takes the raw fuzz input and panics only when kvtrail
//! breaks a rule: a panic escaping the library, or one of the invariants
//! checked below. Errors are the expected answer to bad input.

#![allow(dead_code)] // each includer uses a subset

use std::path::Path;

use kvtrail::capture::jsonl::{JsonlRecord, parse_line};
use kvtrail::lineage::LineageOptions;
use kvtrail::progress::NoReporter;
use kvtrail::record::wire::{Msg, canonical_kv, parse_hello, parse_msg};
use kvtrail::schema::Op;
use kvtrail::trace::Trace;

/// The fuzz targets, by name (folder names under corpus/ and regressions/).
pub const TARGETS: &[&str] = &["trace", "jsonl", "wire"];

/// Runs the entry point of target `name` on `data`.
pub fn run(name: &str, data: &[u8]) {
    match name {
        "trace" => trace(data),
        "jsonl" => jsonl(data),
        "wire" => wire(data),
        other => panic!("unknown fuzz target {other}"),
    }
}

// ------------------------------------------------------------------ trace

/// At most this many files in one input.
const MAX_FILES: usize = 8;

/// Splits a trace input into files: repeated `[name_len: u8][name]
/// [data_len: u32 LE][data]`. A name must be `trace.json` or a relative
/// path under `requests/` or `kv/` made of `[A-Za-z0-9=_.-]` components
/// (no `.`/`..`, at most 4 deep); other entries are skipped. A length past
/// the end takes what is left.
pub fn split_trace(mut data: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    while let Some((&n, rest)) = data.split_first() {
        let n = (n as usize).min(rest.len());
        let (name, rest) = rest.split_at(n);
        let (len, rest) = match rest.get(..4) {
            Some(b) => (
                u32::from_le_bytes(b.try_into().unwrap()) as usize,
                &rest[4..],
            ),
            None => (0, &rest[rest.len()..]),
        };
        let len = len.min(rest.len());
        let (body, rest) = rest.split_at(len);
        data = rest;
        if let Some(name) = std::str::from_utf8(name).ok().filter(|s| name_ok(s)) {
            if files.len() < MAX_FILES && !files.iter().any(|(f, _)| f == name) {
                files.push((name.to_string(), body.to_vec()));
            }
        }
    }
    files
}

/// The inverse of [`split_trace`] (for building seeds).
pub fn join_trace(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, body) in files {
        out.push(name.len() as u8);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(body);
    }
    out
}

fn name_ok(name: &str) -> bool {
    if name == "trace.json" {
        return true;
    }
    let parts: Vec<&str> = name.split('/').collect();
    matches!(parts[0], "requests" | "kv")
        && (2..=5).contains(&parts.len())
        && parts[1..].iter().all(|p| {
            !p.is_empty()
                && *p != "."
                && *p != ".."
                && p.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || b"=_.-".contains(&c))
        })
}

/// Writes the input's files into a fresh trace directory and runs what
/// `verify`, `inspect` and `scope` run: verify, open, stream every batch of
/// both tables, the request index, inspect, and scope's replay (CPU).
pub fn trace(data: &[u8]) {
    let files = split_trace(data);
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("trace");
    for (name, body) in &files {
        let p = dir.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).expect("mkdir");
        std::fs::write(&p, body).expect("write");
    }
    std::fs::create_dir_all(&dir).expect("mkdir");
    analyse(&dir, &tmp.path().join("spill"));
}

/// Every analysis a user can run on a trace directory; errors are fine
/// (their messages are rendered, as the CLI would), panics are not.
pub fn analyse(dir: &Path, spill: &Path) {
    if let Err(e) = kvtrail::trace::verify::verify(dir) {
        let _ = e.to_string();
    }
    let t = match Trace::open(dir) {
        Ok(t) => t,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    for r in t.requests() {
        if let Err(e) = r {
            let _ = e.to_string();
        }
    }
    for c in t.kv_chunks() {
        match c {
            Ok(c) => {
                for e in &c.events {
                    assert!(e.slot_count >= 1, "reader passed slot_count 0");
                    assert!(
                        e.src.is_none() || e.op == Op::Write,
                        "reader passed copy fields on {:?}",
                        e.op
                    );
                }
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
    if let Err(e) = kvtrail::trace::scan_requests(&t, |_| {}) {
        let _ = e.to_string();
    }
    if let Err(e) = kvtrail::inspect::inspect(&t, &NoReporter) {
        let _ = e.to_string();
    }
    let _ = std::fs::create_dir_all(spill);
    let opts = LineageOptions {
        spill_dir: Some(spill.to_path_buf()),
        ..Default::default()
    };
    if let Err(e) = kvtrail::scope::scope(&t, &opts, &NoReporter) {
        let _ = e.to_string();
    }
}

// ------------------------------------------------------------------ jsonl

/// `kvtrail ingest`'s line parser on every line of the input; an accepted
/// KV line must satisfy the contract rules the parser promises.
pub fn jsonl(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for line in text.lines() {
        match parse_line(line) {
            Ok(JsonlRecord::Kv { event, seq }) => {
                assert!(event.slot_count >= 1, "accepted slot_count 0: {line}");
                assert!(
                    event.src.is_none() || event.op == Op::Write,
                    "accepted copy fields on {:?}: {line}",
                    event.op
                );
                assert!(seq.is_none_or(|s| s == event.seq), "seq mismatch: {line}");
            }
            Ok(JsonlRecord::KvRuns(evs)) => {
                assert!(!evs.is_empty(), "accepted a line of no runs: {line}");
                assert!(
                    evs.len() <= kvtrail::capture::jsonl::MAX_LINE_RUNS,
                    "accepted too many runs: {line}"
                );
                for e in &evs {
                    assert!(e.slot_count >= 1, "accepted slot_count 0: {line}");
                    assert!(
                        e.src.is_none() && e.seq == 0,
                        "runs with a seq or copy: {line}"
                    );
                }
            }
            Ok(JsonlRecord::Request(_)) => {}
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
}

// ------------------------------------------------------------------- wire

/// The sidecar's parsers on every line of the input: `parse_hello` (as the
/// first line is read, lossily), then `parse_msg`. A KV event or request
/// that `parse_msg` accepts (possibly through its fast paths) must be
/// exactly what `parse_line` makes of the same line.
pub fn wire(data: &[u8]) {
    for raw in data.split(|&b| b == b'\n') {
        if let Err(e) = parse_hello(&String::from_utf8_lossy(raw)) {
            let _ = e.to_string();
        }
        // The connection reads the canonical KV line from its bytes,
        // before any UTF-8 check: what it accepts must be ASCII and read
        // exactly as parse_line reads it.
        if let Some(Msg::Kv { event, seq }) = canonical_kv(raw) {
            let line = std::str::from_utf8(raw).expect("a canonical KV line is ASCII");
            assert_eq!(
                parse_line(line),
                Ok(JsonlRecord::Kv { event, seq }),
                "canonical_kv and parse_line disagree on {line}"
            );
        }
        if let Some(Msg::KvRuns(evs)) = canonical_kv(raw) {
            let line = std::str::from_utf8(raw).expect("a canonical KV line is ASCII");
            assert_eq!(
                parse_line(line),
                Ok(JsonlRecord::KvRuns(evs)),
                "canonical_kv and parse_line disagree on {line}"
            );
        }
        let Ok(line) = std::str::from_utf8(raw) else {
            continue;
        };
        match parse_msg(line) {
            Ok(Msg::Kv { event, seq }) => {
                let want = parse_line(line);
                assert_eq!(
                    want,
                    Ok(JsonlRecord::Kv { event, seq }),
                    "fast path and parse_line disagree on {line}"
                );
            }
            Ok(Msg::KvRuns(evs)) => {
                assert_eq!(
                    parse_line(line),
                    Ok(JsonlRecord::KvRuns(evs)),
                    "fast path and parse_line disagree on {line}"
                );
            }
            Ok(Msg::Request(r)) => {
                let want = parse_line(line);
                assert_eq!(
                    want,
                    Ok(JsonlRecord::Request(*r)),
                    "parse_msg and parse_line disagree on {line}"
                );
            }
            Ok(_) => {}
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
}
