//! Soak and fault test of `kvtrail record` (the real binary, Unix socket):
//! rounds of well-behaved and hostile clients (reconnecting, flooding,
//! trickling, silent, over the connection limit, malformed, oversized and
//! out-of-range lines), ended by SIGTERM or SIGKILL at a seeded random
//! point. After every round:
//!
//! - SIGTERM: the sidecar exits 0 within a bound; every event a client
//!   finished sending is in the trace or a counted hole (per pool: events +
//!   holes + trailing loss = what was sent); the sidecar's loss counters
//!   equal the holes; `complete` is true exactly when no counter shows
//!   evidence that is neither written nor a hole, and then only if no
//!   hostile client that must cost evidence ran; `kvtrail verify` exits 0
//!   exactly when the capture is complete.
//! - SIGKILL: the trace is inspectable, incomplete, every listed file
//!   reads back, seqs never repeat, and `verify` reports only the kill's
//!   traces (unclean, in-progress parts, at most one unlisted part).
//!
//! Bounded: `KVTRAIL_SOAK_ROUNDS` rounds (default 6, a few seconds each;
//! every third is SIGKILLed, every third has only well-behaved clients and
//! must end complete), seed `KVTRAIL_SOAK_SEED` (default fixed; each
//! round's seed and plan are printed, and named on failure).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvtrail::trace::{Manifest, Trace};

use crate::support::cli::{kvtrail, s};
use crate::support::record::*;

/// splitmix64: a seeded, dependency-free source of choices.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A connection whose hello was answered; `None` when refused or gone.
fn welcomed(sock: &Path, pool: u16) -> Option<UnixStream> {
    let mut c = UnixStream::connect(sock).ok()?;
    writeln!(c, r#"{{"type":"hello","pools":[{pool}],"worker":"soak"}}"#).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut reply = String::new();
    BufReader::new(&c).read_line(&mut reply).ok()?;
    reply.contains(r#""type":"welcome""#).then_some(c)
}

/// A well-behaved sender on `pool`: `conns` connections one after the
/// other (a hook reconnecting), each with bursts of events, now and then
/// a malformed event of its own pool (a hole), a `lost` line (holes) and
/// a request row. Returns the seqs it spans and the requests it sent, when
/// every write went through (after a kill a failed write may or may not
/// have been read: then `None`).
fn good(sock: &Path, pool: u16, conns: u32, per_conn: u32, seed: u64) -> Option<(u64, u64)> {
    let mut rng = Rng(seed);
    let (mut span, mut requests) = (0u64, 0u64);
    for k in 0..conns {
        let mut c = welcomed(sock, pool)?;
        let mut buf = String::new();
        for i in 0..per_conn {
            let slot = rng.below(4000) as u32;
            match rng.below(50) {
                0 => {
                    buf.push_str(&kv(pool, 1, "wrte", slot, 1));
                    span += 1;
                }
                1 => {
                    let n = 1 + rng.below(5);
                    buf.push_str(&format!(r#"{{"type":"lost","pool":{pool},"n":{n}}}"#));
                    span += n;
                }
                2 => {
                    let rid = ((pool as u64) << 40) + ((k as u64) << 20) + i as u64 + 1;
                    buf.push_str(&format!(
                        r#"{{"type":"request","request_id":{rid},"tenant":"t{pool}","arrival_ns":1,"prompt_tokens":3,"output_tokens":1,"http_status":200,"decode_pool":{pool}}}"#
                    ));
                    requests += 1;
                }
                _ => {
                    buf.push_str(&kv(pool, 1 + i as u64 % 7, "write", slot, 1));
                    span += 1;
                }
            }
            buf.push('\n');
            if rng.chance(10) {
                c.write_all(buf.as_bytes()).ok()?;
                buf.clear();
                if rng.chance(20) {
                    std::thread::sleep(Duration::from_millis(rng.below(30)));
                }
            }
        }
        buf.push_str("{\"type\":\"bye\",\"enqueued\":0,\"sent\":0,\"dropped\":0}\n");
        c.write_all(buf.as_bytes()).ok()?;
        // Say goodbye, close, and wait for the sidecar to close its end (it releases
        // the pool before), so the next connection's claim is not refused
        // as held by this one.
        c.shutdown(std::net::Shutdown::Write).ok()?;
        let _ = std::io::Read::read_to_end(&mut c, &mut Vec::new());
    }
    Some((span, requests))
}

/// A client on `pool` that sends three events, then one byte of a line
/// every 100 ms until the sidecar closes it or `done` is set. Spans 3.
fn trickler(sock: &Path, pool: u16, done: Arc<AtomicBool>) -> Option<u64> {
    let mut c = welcomed(sock, pool)?;
    for i in 0..3 {
        writeln!(c, "{}", kv(pool, 1, "alloc", i, 1)).ok()?;
    }
    c.write_all(br#"{"type":"kv","pool":"#).ok()?;
    while !done.load(Ordering::Relaxed) {
        if c.write_all(b" ").is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Some(3)
}

/// Hostile lines on `pool`, then ten good events. Returns the span.
fn garbage(sock: &Path, pool: u16, max_line: usize) -> Option<u64> {
    let mut c = welcomed(sock, pool)?;
    let other = if pool == 1 { 2 } else { 1 };
    let lines = [
        "x".repeat(max_line + 1), // oversized: unattributed
        "{not json".to_string(),  // unattributed
        format!(r#"{{"type":"lost","pool":{pool},"n":18446744073709551615}}"#), // over the wire limit: unattributed
        format!(
            r#"{{"type":"kv","pool":{pool},"seq":18446744073709551614,"ts_ns":1,"request_id":1,"op":"read","slot_start":0,"slot_count":1}}"#
        ), // malformed: a hole
        kv(other, 1, "write", 0, 1),                                            // forged
        format!(
            r#"{{"type":"request","request_id":77,"tenant":"{}","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}}"#,
            "t".repeat(1000)
        ), // field too long: unattributed
        format!(r#"{{"type":"lost","pool":{pool},"n":281474976710656}}"#),      // 2^48: holes
    ];
    for l in &lines {
        writeln!(c, "{l}").ok()?;
    }
    for i in 0..10 {
        writeln!(c, "{}", kv(pool, 2, "write", i, 1)).ok()?;
    }
    Some(1 + (1 << 48) + 10)
}

/// What the senders finished sending: per pool the seqs spanned, and the
/// request rows (`None` where a write failed).
struct Got {
    spans: BTreeMap<u16, Option<u64>>,
    requests: Option<u64>,
}

impl Got {
    fn take(&mut self, pool: u16, r: Option<(u64, u64)>) {
        self.spans.insert(pool, r.map(|x| x.0));
        self.requests = self.requests.zip(r).map(|(a, (_, b))| a + b);
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Zero {
    Idle,
    Flood,
    Trickle,
    Many,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum One {
    Idle,
    Garbage,
    Many,
}

#[derive(Debug)]
struct Plan {
    kill: bool,
    end_after_ms: u64,
    zero: Zero,
    one: One,
    silent: u32,
    over_limit: bool,
    queue: u64,
    row_group_rows: u64,
    rotate: u64,
    good: [(u32, u32); 2],
}

/// Round `i` of a run: every third is SIGKILLed, every third only has
/// well-behaved clients (so it must end complete), the rest mix in
/// hostile ones and end by SIGTERM.
fn plan(rng: &mut Rng, i: u64) -> Plan {
    let clean = i % 3 == 2;
    Plan {
        kill: i % 3 == 1,
        end_after_ms: 100 + rng.below(1400),
        zero: if clean {
            [Zero::Idle, Zero::Flood, Zero::Many][rng.below(3) as usize]
        } else {
            [Zero::Idle, Zero::Flood, Zero::Trickle, Zero::Many][rng.below(4) as usize]
        },
        one: if clean {
            [One::Idle, One::Many][rng.below(2) as usize]
        } else {
            [One::Idle, One::Garbage, One::Many][rng.below(3) as usize]
        },
        silent: if !clean && rng.chance(30) {
            1 + rng.below(5) as u32
        } else {
            0
        },
        over_limit: !clean && rng.chance(20),
        queue: [1, 4, 256][rng.below(3) as usize],
        row_group_rows: [64, 1000, 65536][rng.below(3) as usize],
        rotate: [4096, 1 << 20][rng.below(2) as usize],
        good: [
            (1 + rng.below(3) as u32, 200 + rng.below(1300) as u32),
            (1 + rng.below(3) as u32, 200 + rng.below(1300) as u32),
        ],
    }
}

const MAX_LINE: usize = 4096;
const MAX_CONNS: u32 = 12;

/// One round; for a SIGTERM round, whether the capture came out complete.
fn round(seed: u64, i: u64) -> Option<bool> {
    let mut rng = Rng(seed);
    let p = plan(&mut rng, i);
    let ctx = format!("seed {seed:#x}: {p:?}");
    eprintln!("round {ctx}");
    let d = tempfile::tempdir().unwrap();
    let args: Vec<String> = [
        "--shutdown-grace",
        "1",
        "--hello-timeout",
        "1",
        "--max-line-bytes",
        &MAX_LINE.to_string(),
        "--max-connections",
        &MAX_CONNS.to_string(),
        "--queue",
        &p.queue.to_string(),
        "--row-group-rows",
        &p.row_group_rows.to_string(),
        "--rotate",
        &p.rotate.to_string(),
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (mut child, sock, out) = spawn_record(d.path(), &argv);
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let done = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();

    let (spans, requests, holders) = std::thread::scope(|sc| {
        let sock = &sock;
        let mut senders = Vec::new();
        for (i, &(conns, per)) in p.good.iter().enumerate() {
            let pool = 2 + i as u16;
            let s = seed ^ (pool as u64 * 0x1234_5678);
            senders.push((pool, sc.spawn(move || good(sock, pool, conns, per, s))));
        }
        let zero = match p.zero {
            Zero::Idle => None,
            Zero::Flood => Some(sc.spawn(move || good(sock, 0, 1, 10_000, seed ^ 7))),
            Zero::Many => Some(sc.spawn(move || good(sock, 0, 20, 30, seed ^ 8))),
            Zero::Trickle => {
                let done = done.clone();
                Some(sc.spawn(move || trickler(sock, 0, done).map(|s| (s, 0))))
            }
        };
        let one = match p.one {
            One::Idle => None,
            One::Garbage => Some(sc.spawn(move || garbage(sock, 1, MAX_LINE).map(|s| (s, 0)))),
            One::Many => Some(sc.spawn(move || good(sock, 1, 20, 30, seed ^ 9))),
        };
        // Silent connections, held to the end of the round.
        let mut holders: Vec<UnixStream> = (0..p.silent)
            .filter_map(|_| UnixStream::connect(sock).ok())
            .collect();

        let mut got = Got {
            spans: BTreeMap::new(),
            requests: Some(0),
        };
        if p.kill {
            std::thread::sleep(Duration::from_millis(p.end_after_ms));
            child.kill().unwrap(); // SIGKILL, mid-stream
            done.store(true, Ordering::Relaxed);
        }
        for (pool, h) in senders {
            got.take(pool, h.join().unwrap());
        }
        if let Some(h) = one {
            got.take(1, h.join().unwrap());
        }
        let trickle = if p.zero == Zero::Trickle {
            zero
        } else {
            if let Some(h) = zero {
                got.take(0, h.join().unwrap());
            }
            None
        };
        if !p.kill {
            if p.over_limit {
                // More than --max-connections at once: some are refused.
                holders.extend((0..MAX_CONNS + 4).filter_map(|_| UnixStream::connect(sock).ok()));
            }
            std::thread::sleep(Duration::from_millis(p.end_after_ms));
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        // The trickler ends when the sidecar cuts it (or the kill).
        if let Some(h) = trickle {
            got.take(0, h.join().unwrap());
        }
        (got.spans, got.requests, holders)
    });
    if p.kill {
        let _ = child.wait();
        drop(holders);
        after_kill(&out, &ctx);
        return None;
    }
    let o = wait_bounded(child, Duration::from_secs(20));
    done.store(true, Ordering::Relaxed);
    drop(holders);
    let err = String::from_utf8(stderr.join().unwrap()).unwrap();
    let summary = String::from_utf8(stdout.join().unwrap()).unwrap();
    assert!(o.status.success(), "{ctx}\n{err}");
    assert!(summary.contains(" kv events, "), "{ctx}\n{summary}");
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "{ctx}: {:?}",
        t0.elapsed()
    );
    after_term(&out, &p, &spans, requests, &ctx);
    Some(Manifest::load(&out).unwrap().capture.complete)
}

fn counter(rec: &serde_json::Value, key: &str) -> u64 {
    rec[key]
        .as_u64()
        .unwrap_or_else(|| panic!("capture.record.{key} missing: {rec}"))
}

fn after_term(
    out: &Path,
    p: &Plan,
    spans: &BTreeMap<u16, Option<u64>>,
    requests: Option<u64>,
    ctx: &str,
) {
    let m = Manifest::load(out).unwrap();
    let rec = &m.capture.extra["record"];
    let trailing = |pool: u16| {
        m.capture
            .extra
            .get("trailing_lost_events")
            .and_then(|t| t[pool.to_string()].as_u64())
            .unwrap_or(0)
    };
    let t = Trace::open(out).unwrap();
    let evs = events(&t);
    let mut holes_total = 0u64;
    let mut trailing_total = 0u64;
    let mut written = 0u64;
    let inspect = kvtrail(["inspect", s(out), "--json"]).run();
    assert_eq!(inspect.code, 0, "{ctx}\n{}", inspect.stderr);
    let ij: serde_json::Value = serde_json::from_str(&inspect.stdout).unwrap();
    for pool in 0..4u16 {
        let seqs: Vec<u64> = evs
            .get(&pool)
            .map(|v| v.iter().map(|e| e.seq).collect())
            .unwrap_or_default();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{ctx}: pool {pool} seqs repeat"
        );
        let top = seqs.last().map_or(0, |s| s + 1);
        let holes = top - seqs.len() as u64;
        let tr = trailing(pool);
        written += seqs.len() as u64;
        holes_total = holes_total.saturating_add(holes);
        trailing_total = trailing_total.saturating_add(tr);
        // Every event sent is written or a hole (inside or after the run).
        if let Some(Some(span)) = spans.get(&pool) {
            assert_eq!(
                top + tr,
                *span,
                "{ctx}: pool {pool}: {} written, {holes} holes, {tr} trailing",
                seqs.len()
            );
        }
        if let Some(ip) = ij["kv"]["pools"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["pool"] == pool)
        {
            assert_eq!(ip["missing_events"], holes, "{ctx}: inspect, pool {pool}");
        }
    }
    assert_eq!(written, counter(rec, "kv_written"), "{ctx}");
    // The sidecar's loss counters are exactly the holes it left.
    let counted = [
        "lost_queue",
        "lost_hook",
        "rejected_malformed",
        "rejected_contract",
        "copies_unresolved",
        "lost_max_bytes",
    ]
    .iter()
    .map(|k| counter(rec, k))
    .fold(0u64, u64::saturating_add);
    assert_eq!(
        holes_total.saturating_add(trailing_total),
        counted,
        "{ctx}: {rec}"
    );
    let rows: u64 = t.requests().map(|b| b.unwrap().len() as u64).sum();
    assert_eq!(rows, counter(rec, "requests_written"), "{ctx}");
    if let Some(r) = requests {
        assert_eq!(rows + counter(rec, "lost_requests"), r, "{ctx}: {rec}");
    }
    // complete exactly when nothing is missing beyond the holes.
    let missing = [
        "rejected_unattributed",
        "refused_claims",
        "refused_connections",
        "dropped_before_hello",
        "connections_cut",
        "lost_unrecorded",
        "lost_requests",
        "lost_max_bytes",
        "connections_unclosed",
        "events_unaccounted",
        "request_conflicts",
    ]
    .iter()
    .any(|k| counter(rec, k) > 0)
        || trailing_total > 0
        || m.capture.extra.get("no_kv_events").is_some();
    assert_eq!(m.capture.complete, !missing, "{ctx}: {rec}");
    if p.zero == Zero::Trickle || p.one == One::Garbage || p.over_limit {
        assert!(!m.capture.complete, "{ctx}: {rec}");
    }
    let clean = p.silent == 0 && !p.over_limit && p.zero != Zero::Trickle && p.one != One::Garbage;
    if clean {
        // Only well-behaved clients, all finished before the stop: holes
        // (dropped by a full queue, reported by the hooks) are the only
        // loss; complete unless some fell after a pool's last event.
        assert!(m.capture.complete || trailing_total > 0, "{ctx}: {rec}");
    }
    if p.zero == Zero::Trickle && spans.get(&0).is_some_and(Option::is_some) {
        assert!(counter(rec, "connections_cut") >= 1, "{ctx}: {rec}");
    }
    if p.over_limit {
        assert!(counter(rec, "refused_connections") >= 1, "{ctx}: {rec}");
    }
    let v = kvtrail(["verify", s(out)]).run();
    assert_eq!(
        v.code,
        if m.capture.complete { 0 } else { 1 },
        "{ctx}\n{}",
        v.stdout
    );
}

fn after_kill(out: &Path, ctx: &str) {
    let m = Manifest::load(out).unwrap();
    assert!(!m.capture.complete, "{ctx}");
    let rep = kvtrail::trace::verify::verify(out).unwrap();
    let kinds: Vec<&str> = rep.problems.iter().map(|p| p.kind.as_str()).collect();
    assert!(
        kinds
            .iter()
            // "empty": killed before any part file was completed, so the
            // readable trace holds no KV event (no evidence, said so).
            .all(|k| ["unclean", "inprogress", "extra", "empty"].contains(k))
            && kinds.iter().filter(|k| **k == "extra").count() <= 1,
        "{ctx}: {:?}",
        rep.problems
    );
    let t = Trace::open(out).unwrap();
    for (pool, v) in events(&t) {
        assert!(
            v.windows(2).all(|w| w[0].seq < w[1].seq),
            "{ctx}: pool {pool}"
        );
    }
    for b in t.requests() {
        b.unwrap();
    }
    let i = kvtrail(["inspect", s(out)]).run();
    assert_eq!(i.code, 0, "{ctx}\n{}", i.stderr);
    assert_eq!(kvtrail(["verify", s(out)]).run().code, 1, "{ctx}");
}

#[test]
fn soak_sidecar_survives_hostile_clients_and_signals() {
    let seed: u64 = std::env::var("KVTRAIL_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x6b_7674_7261_696c);
    let rounds: u64 = std::env::var("KVTRAIL_SOAK_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    let mut rng = Rng(seed);
    let t = Instant::now();
    let ends: Vec<Option<bool>> = (0..rounds).map(|i| round(rng.next(), i)).collect();
    let count = |e: Option<bool>| ends.iter().filter(|x| **x == e).count();
    eprintln!(
        "{rounds} rounds in {:?}: {} killed, {} complete, {} incomplete",
        t.elapsed(),
        count(None),
        count(Some(true)),
        count(Some(false))
    );
    if rounds >= 3 {
        assert!(count(None) > 0 && count(Some(true)) > 0, "{ends:?}");
    }
}
