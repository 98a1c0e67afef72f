//! Costs of live detection in `kvtrail record` (docs/live.md, "What it
//! costs"): the in-process `Sidecar` on a Unix socket, JSONL on the wire.
//!
//! - `throughput [EVENTS]`: the same clean events with live detection off
//!   and on, in the same run: events/s on the wire (wall clock, first
//!   byte to the trace closed) and events per CPU-second of the process.
//! - `lag [EVENTS] [RATE]`: events paced at RATE/s (default 1M/s); the
//!   live lag histogram (`kvtrail_live_lag_seconds`, arrival at the writer
//!   to classification) scraped from `/metrics` before close; p50/p99.
//! - `rss [N...]`: one child process per size (default 1e6 and 1e7
//!   events), live detection off and on, default queue bounds, the sender
//!   waiting when the writer is behind (nothing dropped); each prints its
//!   peak RSS (VmHWM).
//! - `clean [REQUESTS] [CHUNK] [ONLY]`: simulated clean requests (both
//!   engine models, prefix cache, decode radix cache, HiCache, vLLM CPU
//!   offload and LMCache) streamed through the wire in chunks of CHUNK
//!   requests (a fresh sidecar each); counts alerts and live findings
//!   (must be 0). ONLY keeps the configurations whose scenario name
//!   contains it (`steady`, `vllm-cpu-offload`, `vllm-lmcache`).
//!   `BENCH_LIVE_QUEUE=N` sets the live queue to N batches (a small one
//!   makes the live thread drop batches, as when it falls behind);
//!   `BENCH_LIVE_HOLDBACK_MS=0` applies events as they come, so copies
//!   that arrive after their source moved on are rebuilt or taken late.
//! - no argument: all four at small default sizes.
//!
//! cargo run --release --example bench_live -- [MODE] [ARGS]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtrail::progress::NoReporter;
use kvtrail::record::live::LiveOptions;
use kvtrail::record::{Listen, NoLog, RecordConfig, RecordSummary, Sidecar, WhenBehind};
use kvtrail::schema::{KvEvent, RequestRecord, hex32};
use kvtrail::sim::{self, RunLabel, scenario};
use kvtrail::trace::Trace;
use kvtrail::trace::manifest::Deployment;

// ------------------------------------------------------------ measuring

fn proc_status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// CPU seconds (user + system; USER_HZ 100) from a `/proc/.../stat` file.
fn stat_cpu_secs(path: &str) -> f64 {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let after = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

/// Process CPU seconds: the machine may be shared, so wall time alone
/// misleads.
fn cpu_secs() -> f64 {
    stat_cpu_secs("/proc/self/stat")
}

/// CPU seconds of the calling thread alone (the sender's share, taken
/// out of the process's to give the sidecar's own).
fn thread_cpu_secs() -> f64 {
    stat_cpu_secs("/proc/thread-self/stat")
}

/// Pins the calling thread (and the threads it starts from now on) to
/// one core. False where the core is not there or pinning is refused.
fn pin(core: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays in
    // its bounds for core < CPU_SETSIZE (checked).
    unsafe {
        if core >= libc::CPU_SETSIZE as usize {
            return false;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Unpins the calling thread: every core the machine has.
fn unpin() {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: as in `pin`.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for c in 0..n.min(libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, default: T) -> T {
    args.get(i)
        .and_then(|a| a.replace('_', "").parse::<f64>().ok())
        .and_then(|f| (f as u64).to_string().parse().ok())
        .unwrap_or(default)
}

// ------------------------------------------------- clean synthetic events

/// One mixed pool, page size 1, 1 Mi slots.
fn one_pool() -> Deployment {
    serde_json::from_value(serde_json::json!({
        "name": "bench", "context_window": 1 << 20,
        "pools": [{"id": 0, "role": "mixed", "capacity_tokens": 1 << 20, "page_size": 1}]
    }))
    .unwrap()
}

/// Clean lineage: groups of 8 requests in flight, each allocates 64
/// slots, writes them in 4 chunks, reads all 64 eight times (decode
/// steps) and frees them; slots are reused round-robin (14 events per
/// request, every read over the reader's own KV).
struct Clean {
    next_req: u64,
    ts: i64,
}

const GROUP: u64 = 8;
const PER_REQUEST: u64 = 14;

impl Clean {
    fn new() -> Clean {
        Clean {
            next_req: 1,
            ts: 1_700_000_000_000_000_000,
        }
    }

    /// Appends one group's lines (GROUP * PER_REQUEST events).
    fn group(&mut self, out: &mut Vec<u8>) {
        let first = self.next_req;
        self.next_req += GROUP;
        let slots = |r: u64| ((r % (1 << 14)) * 64) as u32;
        let mut ev = |out: &mut Vec<u8>, r: u64, op: &str, start: u32, n: u32, tp: Option<u32>| {
            self.ts += 1000;
            let _ = write!(
                out,
                r#"{{"type":"kv","pool":0,"ts_ns":{},"request_id":{r},"op":"{op}","slot_start":{start},"slot_count":{n}"#,
                self.ts
            );
            match tp {
                Some(t) => {
                    let _ = writeln!(out, r#","token_pos":{t}}}"#);
                }
                // As the hook client writes it.
                None => out.extend_from_slice(b",\"token_pos\":null}\n"),
            }
        };
        for r in first..first + GROUP {
            ev(out, r, "alloc", slots(r), 64, None);
        }
        for c in 0..4u32 {
            for r in first..first + GROUP {
                ev(out, r, "write", slots(r) + 16 * c, 16, Some(16 * c));
            }
        }
        for _ in 0..8 {
            for r in first..first + GROUP {
                ev(out, r, "read", slots(r), 64, Some(0));
            }
        }
        for r in first..first + GROUP {
            ev(out, r, "free", slots(r), 64, None);
        }
    }
}

fn config(sock: &Path, live: bool, metrics: bool) -> RecordConfig {
    let mut cfg = RecordConfig::new(Listen::Unix(sock.to_path_buf()));
    cfg.queue_batches = 4096;
    if live {
        let mut o = LiveOptions::default();
        if metrics {
            o.metrics = Some("127.0.0.1:0".parse().unwrap());
        }
        cfg.live = Some(o);
    }
    cfg
}

fn hello(sock: &Path, pools: &[u16]) -> UnixStream {
    let mut c = UnixStream::connect(sock).unwrap();
    let pools: Vec<String> = pools.iter().map(|p| p.to_string()).collect();
    writeln!(
        c,
        r#"{{"type":"hello","pools":[{}],"worker":"bench"}}"#,
        pools.join(",")
    )
    .unwrap();
    c
}

fn bye(c: &mut impl Write) {
    let _ = writeln!(c, r#"{{"type":"bye","enqueued":0,"sent":0,"dropped":0}}"#);
}

// ----------------------------------------------------------- throughput

struct Run {
    wall: f64,
    cpu: f64,
    /// The sidecar's own CPU: the process's less the sending thread's.
    sidecar_cpu: f64,
    sum: RecordSummary,
}

/// One run. `one_core`: every sidecar thread on core 0 (they are started
/// while this thread is pinned there, and inherit it) and the sender on
/// core 1, so the wall rate is the sidecar's on one core.
fn throughput_run(dir: &Path, name: &str, payload: &[u8], live: bool, one_core: bool) -> Run {
    let sock = dir.join(format!("{name}.sock"));
    if one_core {
        assert!(pin(0), "cannot pin to core 0");
    }
    let sc = Sidecar::start(
        config(&sock, live, false),
        one_pool(),
        &dir.join(name),
        Arc::new(NoLog),
    )
    .unwrap();
    if one_core {
        assert!(pin(1), "cannot pin the sender to core 1");
    }
    let (t, c0, s0) = (Instant::now(), cpu_secs(), thread_cpu_secs());
    let mut c = hello(&sock, &[0]);
    for chunk in payload.chunks(1 << 20) {
        c.write_all(chunk).unwrap();
    }
    bye(&mut c);
    drop(c);
    let sent = thread_cpu_secs() - s0;
    let sum = sc.shutdown().unwrap();
    let (wall, cpu) = (t.elapsed().as_secs_f64(), cpu_secs() - c0);
    if one_core {
        unpin();
    }
    Run {
        wall,
        cpu,
        sidecar_cpu: cpu - sent,
        sum,
    }
}

fn throughput(events: u64) {
    let mut events_gen = Clean::new();
    let mut payload = Vec::new();
    let groups = events.div_ceil(GROUP * PER_REQUEST);
    for _ in 0..groups {
        events_gen.group(&mut payload);
    }
    let n = groups * GROUP * PER_REQUEST;
    let dir = tempfile::tempdir().unwrap();
    println!(
        "throughput: {n} events ({:.0} MB of JSONL), one connection, {} cores",
        payload.len() as f64 / 1e6,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let one_core = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    // Rounds alternate off and on; each figure is the median of 3.
    let mut runs: Vec<(bool, bool, Run)> = Vec::new();
    for round in 0..3 {
        for pinned in [false, true] {
            if pinned && !one_core {
                continue;
            }
            for live in [false, true] {
                let name = format!("r{round}-{}-{}", pinned as u8, live as u8);
                let r = throughput_run(dir.path(), &name, &payload, live, pinned);
                assert_eq!(r.sum.stats.kv_written + r.sum.stats.lost_queue, n);
                runs.push((pinned, live, r));
            }
        }
    }
    let med = |pinned: bool, live: bool, f: &dyn Fn(&Run) -> f64| {
        let mut v: Vec<f64> = runs
            .iter()
            .filter(|(p, l, _)| *p == pinned && *l == live)
            .map(|(_, _, r)| f(r))
            .collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let per_s = |r: &Run| r.sum.stats.kv_written as f64 / r.wall;
    let per_cpu = |r: &Run| r.sum.stats.kv_written as f64 / r.cpu;
    let per_sidecar_cpu = |r: &Run| r.sum.stats.kv_written as f64 / r.sidecar_cpu;
    let dropped = |r: &Run| r.sum.stats.lost_queue as f64;
    for pinned in [false, true] {
        if pinned && !one_core {
            println!("  (one core: needs 2 cores, skipped)");
            continue;
        }
        println!(
            "  {}",
            if pinned {
                "sidecar pinned to core 0, sender to core 1 (the wall rate is the sidecar's on one core):"
            } else {
                "unpinned (medians of 3):"
            }
        );
        for live in [false, true] {
            println!(
                "    live {}: {:>10.0} events/s written; {:>10.0} events/CPU-s (process), {:>10.0} events/CPU-s (sidecar threads); {} dropped as holes",
                if live { "on " } else { "off" },
                med(pinned, live, &per_s),
                med(pinned, live, &per_cpu),
                med(pinned, live, &per_sidecar_cpu),
                med(pinned, live, &dropped),
            );
        }
        println!(
            "    ratio on / off: {:.2}x events/s (wall), {:.2}x events per sidecar CPU-s",
            med(pinned, true, &per_s) / med(pinned, false, &per_s),
            med(pinned, true, &per_sidecar_cpu) / med(pinned, false, &per_sidecar_cpu)
        );
    }
    let live = runs
        .iter()
        .find(|(_, l, _)| *l)
        .and_then(|(_, _, r)| r.sum.live.clone())
        .expect("live stats");
    println!(
        "  live (first run): {} classified, {} dropped from the live view, {} alerts, {} affected responses",
        live.events_applied, live.events_dropped, live.alerts, live.affected_responses
    );
}

// ------------------------------------------------------------------ lag

fn scrape(addr: std::net::SocketAddr) -> String {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body
}

/// (upper bound, cumulative count) of `kvtrail_live_lag_seconds`.
fn lag_buckets(text: &str) -> Vec<(f64, u64)> {
    text.lines()
        .filter(|l| l.starts_with("kvtrail_live_lag_seconds_bucket"))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

fn quantile(b: &[(f64, u64)], q: f64) -> f64 {
    let total = b.last().map_or(0, |x| x.1);
    let want = (total as f64 * q).ceil() as u64;
    b.iter().find(|x| x.1 >= want).map_or(f64::NAN, |x| x.0)
}

fn lag(events: u64, rate: u64) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("lag.sock");
    let sc = Sidecar::start(
        config(&sock, true, true),
        one_pool(),
        &dir.path().join("lag"),
        Arc::new(NoLog),
    )
    .unwrap();
    let addr = sc.metrics_addr().expect("metrics served");
    let mut c = hello(&sock, &[0]);
    let mut events_gen = Clean::new();
    let mut buf = Vec::new();
    let (t, mut sent) = (Instant::now(), 0u64);
    let mut behind = 0f64;
    while sent < events {
        // One group (112 events) per step, each sent at its due time.
        buf.clear();
        events_gen.group(&mut buf);
        c.write_all(&buf).unwrap();
        sent += GROUP * PER_REQUEST;
        let due = Duration::from_secs_f64(sent as f64 / rate as f64);
        let now = t.elapsed();
        if due > now {
            std::thread::sleep(due - now);
        } else {
            behind = behind.max((now - due).as_secs_f64());
        }
    }
    let secs = t.elapsed().as_secs_f64();
    // Let the live thread take the last batches, then read the histogram
    // while the engine is still connected.
    std::thread::sleep(Duration::from_millis(500));
    let b = lag_buckets(&scrape(addr));
    bye(&mut c);
    drop(c);
    let sum = sc.shutdown().unwrap();
    let live = sum.live.expect("live stats");
    println!(
        "lag: {sent} events paced at {rate}/s: sent in {secs:.2} s ({:.0} events/s achieved, at most {:.3} s behind schedule)",
        sent as f64 / secs,
        behind
    );
    println!(
        "  live lag (bucket upper bounds): p50 <= {} s, p99 <= {} s, max <= {} s over {} observations; {} classified, {} dropped from the live view, {} alerts",
        quantile(&b, 0.5),
        quantile(&b, 0.99),
        quantile(&b, 1.0),
        b.last().map_or(0, |x| x.1),
        live.events_applied,
        live.events_dropped,
        live.alerts
    );
}

// ------------------------------------------------------------------ rss

fn rss_one(events: u64, live: bool) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("rss.sock");
    // The default queue bound (not the throughput runs' 4096 batches):
    // a writer that falls behind holds at most that many batches, and the
    // sender waits rather than drop, so every event is captured and the
    // peak is what a deployment with default bounds sees.
    let mut cfg = config(&sock, live, false);
    cfg.queue_batches = RecordConfig::new(Listen::Unix(sock.clone())).queue_batches;
    cfg.when_behind = WhenBehind::Wait;
    let sc = Sidecar::start(cfg, one_pool(), &dir.path().join("rss"), Arc::new(NoLog)).unwrap();
    let t = Instant::now();
    let mut c = std::io::BufWriter::with_capacity(1 << 20, hello(&sock, &[0]));
    let mut events_gen = Clean::new();
    let mut buf = Vec::new();
    let mut sent = 0;
    while sent < events {
        buf.clear();
        events_gen.group(&mut buf);
        c.write_all(&buf).unwrap();
        sent += GROUP * PER_REQUEST;
    }
    bye(&mut c);
    drop(c);
    let sum = sc.shutdown().unwrap();
    let live = sum.live.unwrap_or_default();
    println!(
        "{sent} {} {} {:.2} {}",
        proc_status_kib("VmHWM:"),
        live.events_applied,
        t.elapsed().as_secs_f64(),
        live.events_dropped
    );
}

fn rss(sizes: &[u64]) {
    println!("rss: one process per size and mode, one connection");
    let exe = std::env::current_exe().unwrap();
    for (n, mode) in sizes.iter().flat_map(|&n| [(n, "off"), (n, "on")]) {
        let out = std::process::Command::new(&exe)
            .args(["rss-one", &n.to_string(), mode])
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&out.stdout);
        let f: Vec<&str> = s.split_whitespace().collect();
        if !out.status.success() || f.len() < 5 {
            println!(
                "  {n} {mode}: failed: {s} {}",
                String::from_utf8_lossy(&out.stderr)
            );
            continue;
        }
        println!(
            "  {:>11} events, live {mode:<3}: peak RSS {:>7.1} MB, {} classified live, {} dropped from the live view, {} s",
            f[0],
            f[1].parse::<f64>().unwrap_or(0.0) / 1024.0,
            f[2],
            f[4],
            f[3]
        );
    }
}

// ---------------------------------------------------------------- clean

fn kv_line(out: &mut Vec<u8>, e: &KvEvent) {
    let _ = write!(
        out,
        r#"{{"type":"kv","pool":{},"seq":{},"ts_ns":{},"request_id":{},"op":"{}","slot_start":{},"slot_count":{}"#,
        e.pool, e.seq, e.ts_ns, e.request_id, e.op, e.slot_start, e.slot_count
    );
    if let Some(t) = e.token_pos {
        let _ = write!(out, r#","token_pos":{t}"#);
    }
    if let Some(s) = e.src {
        let _ = write!(
            out,
            r#","src_pool":{},"src_slot_start":{},"src_seq":{}"#,
            s.pool, s.slot_start, s.seq
        );
    }
    out.extend_from_slice(b"}\n");
}

fn request_line(r: &RequestRecord) -> String {
    serde_json::json!({
        "type": "request", "request_id": r.request_id, "external_id": r.external_id,
        "tenant": r.tenant, "arrival_ns": r.arrival_ns, "finish_ns": r.finish_ns,
        "prompt_tokens": r.prompt_tokens, "prefilled_tokens": r.prefilled_tokens,
        "output_tokens": r.output_tokens, "http_status": r.http_status,
        "finish_reason": r.finish_reason, "prefill_pool": r.prefill_pool,
        "decode_pool": r.decode_pool, "prompt_hash": r.prompt_hash.as_ref().map(hex32),
        "output_hash": r.output_hash.as_ref().map(hex32),
    })
    .to_string()
}

#[derive(Default)]
struct Clean0 {
    requests: u64,
    events: u64,
    alerts: u64,
    affected: u64,
    shared: u64,
    inexact: u64,
}

/// One chunk: simulate, then stream the trace through a fresh sidecar
/// (one connection per pool, the events in time order, the request rows
/// last) with live detection on, default bounds.
fn clean_chunk(name: &str, sets: &[&str], requests: u64, seed: u64, acc: &mut Clean0) {
    let dir = tempfile::tempdir().unwrap();
    let mut sc = scenario::scenario(name, Some(requests), seed).unwrap();
    for s in sets {
        sc.config.set(s).unwrap();
    }
    sc.fit_workload();
    let label = RunLabel {
        scenario: name.into(),
        seed,
    };
    let arrivals = sim::workload::Generator::new(sc.workload.clone());
    let src = dir.path().join("sim");
    sim::run(&sc.config, arrivals, &src, &label, &NoReporter).unwrap();
    let t = Trace::open(&src).unwrap();
    let dep = t.deployment().clone();
    let mut all: Vec<KvEvent> = Vec::new();
    for c in t.kv_chunks() {
        all.extend(c.unwrap().events);
    }
    all.sort_by_key(|e| (e.ts_ns, e.pool, e.seq));
    let reqs: Vec<RequestRecord> = t.requests().flat_map(|b| b.unwrap()).collect();
    let sock = dir.path().join("s.sock");
    let out = dir.path().join("rec");
    let mut cfg = config(&sock, true, false);
    cfg.recorder.from_engine_start = t.manifest.from_engine_start();
    if let Some(q) = std::env::var("BENCH_LIVE_QUEUE")
        .ok()
        .and_then(|q| q.parse().ok())
    {
        cfg.live.as_mut().expect("live on").queue_batches = q;
    }
    if let Some(ms) = std::env::var("BENCH_LIVE_HOLDBACK_MS")
        .ok()
        .and_then(|q| q.parse().ok())
    {
        cfg.live.as_mut().expect("live on").bounds.holdback = Duration::from_millis(ms);
    }
    let sidecar = Sidecar::start(cfg, dep.clone(), &out, Arc::new(NoLog)).unwrap();
    let mut conns: std::collections::BTreeMap<u16, std::io::BufWriter<UnixStream>> = dep
        .pools
        .iter()
        .map(|p| {
            let c = hello(&sock, &[p.id]);
            (p.id, std::io::BufWriter::with_capacity(1 << 16, c))
        })
        .collect();
    let mut line = Vec::with_capacity(256);
    for (i, e) in all.iter().enumerate() {
        line.clear();
        kv_line(&mut line, e);
        conns.get_mut(&e.pool).unwrap().write_all(&line).unwrap();
        if i % 4096 == 4095 {
            for c in conns.values_mut() {
                c.flush().unwrap();
            }
        }
    }
    let first = conns.values_mut().next().unwrap();
    for r in &reqs {
        writeln!(first, "{}", request_line(r)).unwrap();
    }
    for (_, mut c) in conns {
        bye(&mut c);
        drop(c.into_inner().ok());
    }
    let sum = sidecar.shutdown().unwrap();
    let live = sum.live.expect("live stats");
    let bytes = std::fs::read(out.join(kvtrail::record::live::LIVE_FINDINGS)).unwrap();
    let f: kvtrail::record::live::LiveFindings = serde_json::from_slice(&bytes).unwrap();
    acc.requests += reqs.len() as u64;
    acc.events += all.len() as u64;
    acc.alerts += live.alerts;
    acc.affected += f.affected_responses.len() as u64;
    acc.shared += f.cross_tenant_shared.len() as u64;
    acc.inexact += u64::from(!f.exact);
    if !f.exact || live.alerts > 0 {
        println!(
            "    chunk seed {seed}: {:?}; writer: {} written, {} dropped as holes",
            f.live, sum.stats.kv_written, sum.stats.lost_queue
        );
    }
}

/// `only`: run the configurations whose simulator scenario contains it
/// (all when empty).
fn clean(requests: u64, chunk: u64, only: &str) {
    println!(
        "clean: simulated clean requests streamed through the wire, live detection on (default bounds{}), chunks of {chunk} requests, a fresh sidecar per chunk",
        ["BENCH_LIVE_QUEUE", "BENCH_LIVE_HOLDBACK_MS"]
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| format!(", {k}={v}")))
            .collect::<String>()
    );
    let configs: [(&str, &str, &[&str]); 3] = [
        (
            "sglang-0.5.19",
            "steady",
            &["decode_radix_cache=true", "hicache=true"],
        ),
        ("vllm-0.33.0", "vllm-cpu-offload", &[]),
        ("vllm-0.33.0", "vllm-lmcache", &[]),
    ];
    for (engine, name, sets) in configs {
        if !name.contains(only) {
            continue;
        }
        let (t, c0) = (Instant::now(), cpu_secs());
        let mut acc = Clean0::default();
        let mut seed = 1;
        while acc.requests < requests {
            let n = chunk.min(requests - acc.requests);
            clean_chunk(name, sets, n, seed, &mut acc);
            seed += 1;
        }
        println!(
            "  {engine} {name} {sets:?}: {} requests, {} events in {:.1} s ({:.1} CPU-s): {} alerts, {} affected responses, {} cross-tenant prefix hits, {} chunks not exact",
            acc.requests,
            acc.events,
            t.elapsed().as_secs_f64(),
            cpu_secs() - c0,
            acc.alerts,
            acc.affected,
            acc.shared,
            acc.inexact
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("throughput") => throughput(arg(&args, 2, 4_000_000)),
        Some("lag") => lag(arg(&args, 2, 10_000_000), arg(&args, 3, 1_000_000)),
        Some("rss") => {
            let sizes: Vec<u64> = (2..args.len()).map(|i| arg(&args, i, 0)).collect();
            rss(if sizes.is_empty() {
                &[1_000_000, 10_000_000]
            } else {
                &sizes
            })
        }
        Some("rss-one") => rss_one(
            arg(&args, 2, 1_000_000),
            args.get(3).is_none_or(|m| m != "off"),
        ),
        Some("clean") => clean(
            arg(&args, 2, 1_000_000),
            arg(&args, 3, 100_000),
            args.get(4).map_or("", String::as_str),
        ),
        Some(m) => eprintln!("unknown mode {m}: throughput, lag, rss, clean"),
        None => {
            throughput(2_000_000);
            lag(3_000_000, 1_000_000);
            rss(&[1_000_000, 10_000_000]);
            clean(40_000, 20_000, "");
        }
    }
}
