//! The operator's side of live detection (docs/live.md): the alert rules
//! under deploy/prometheus checked and unit-tested by promtool; every
//! series the rules and the Grafana dashboard query exists in a live
//! scrape; a real Prometheus scrapes a live `kvtrail record --metrics`
//! and answers the foreign-read count over its HTTP API (and fires the
//! page rule); a real Alertmanager receives `--alertmanager` alerts.
//! Then the faults: Alertmanager down, slow, answering 500 or a huge
//! body; a flood of foreign reads (one alert per response, the storm
//! aggregated) with a metrics client that never reads; the cross-tenant
//! prefix-hit alert; and `kvtrail verify` comparing live-findings.json
//! with a fresh scope. Capture is never blocked nor lost.
//!
//! The servers are the distribution's packages (.ci/setup.d/57-prometheus.sh),
//! started on loopback on free ports with temporary storage, killed on drop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use kvtrail::record::live::{AlertTarget, AlertmanagerOptions, LIVE_FINDINGS, LiveOptions};
use kvtrail::record::{Listen, NoLog, RecordConfig, RecordSummary, Sidecar};
use kvtrail::trace::Trace;
use kvtrail::trace::manifest::{Deployment, PrefixCacheScope};

use crate::support::cli::{kvtrail, s};
use crate::support::record::{connect_to, deployment, kv, spawn_record, wait_bounded};

const SETUP: &str = ".ci/setup.d/57-prometheus.sh";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// A server process, killed and reaped on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tool(name: &str) -> Command {
    let found = Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    assert!(found, "{name} is not installed: run {SETUP}");
    Command::new(name)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One HTTP/1.0 exchange: (status, body).
fn http(addr: &str, method: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut r = String::new();
    s.read_to_string(&mut r).ok()?;
    let status = r.split_whitespace().nth(1)?.parse().ok()?;
    let body = r.split_once("\r\n\r\n").map_or("", |x| x.1).to_string();
    Some((status, body))
}

fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn sigterm(c: &Child) {
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
}

// ---------------------------------------------------------------- rules

#[test]
fn promtool_checks_and_unit_tests_the_alert_rules() {
    let dir = deploy_dir().join("prometheus");
    for args in [
        &["check", "rules", "kvtrail-rules.yml"][..],
        &["check", "config", "prometheus.yml"],
        &["test", "rules", "kvtrail-rules.test.yml"],
    ] {
        let o = tool("promtool")
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        let out =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "promtool {args:?}:\n{out}");
        assert!(out.contains("SUCCESS"), "promtool {args:?}:\n{out}");
    }
}

/// The `kvtrail_…` names in a text (rules, dashboard).
fn names_in(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("kvtrail_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// The sample names of an exposition.
fn sample_names(body: &str) -> std::collections::BTreeSet<String> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(String::from)
        .collect()
}

fn live_cfg(sock: &Path, tune: impl FnOnce(&mut LiveOptions)) -> RecordConfig {
    let mut cfg = RecordConfig::new(Listen::Unix(sock.to_path_buf()));
    cfg.recorder.from_engine_start = true;
    let mut o = LiveOptions::default();
    tune(&mut o);
    cfg.live = Some(o);
    cfg
}

const REQ7: &str = r#"{"type":"request","request_id":7,"external_id":"chatcmpl-7","tenant":"acme","arrival_ns":1,"prompt_tokens":4,"output_tokens":1,"http_status":200}"#;
const REQ8: &str = r#"{"type":"request","request_id":8,"external_id":"chatcmpl-8","tenant":"globex","arrival_ns":2,"prompt_tokens":4,"output_tokens":1,"http_status":200}"#;

/// Request 7 (acme) writes pool 2's slots 0..4; request 8 (globex) reads
/// them twice without a grant.
fn foreign_lines() -> Vec<String> {
    vec![
        REQ7.into(),
        REQ8.into(),
        kv(2, 7, "alloc", 0, 4),
        kv(2, 7, "write", 0, 4),
        kv(2, 8, "alloc", 10, 4),
        kv(2, 8, "read", 0, 4),
        kv(2, 8, "read", 0, 4),
    ]
}

fn scrape(addr: SocketAddr) -> String {
    http(&addr.to_string(), "GET", "/metrics")
        .map(|x| x.1)
        .unwrap_or_default()
}

/// Every series name the rules and the dashboard use is one a live
/// `/metrics` exports (as a sample, not only in HELP), and no series
/// names a tenant.
#[test]
fn every_series_in_the_rules_and_dashboard_is_exported() {
    let rules = std::fs::read_to_string(deploy_dir().join("prometheus/kvtrail-rules.yml")).unwrap();
    let dash = std::fs::read_to_string(deploy_dir().join("grafana/kvtrail-live.json")).unwrap();
    let d: Value = serde_json::from_str(&dash).expect("the dashboard is JSON");
    let panels = d["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8);
    let mut exprs = String::new();
    for p in panels {
        let t = p["targets"].as_array().expect("targets");
        assert!(!t.is_empty(), "{}", p["title"]);
        for q in t {
            exprs.push_str(q["expr"].as_str().expect("expr"));
            exprs.push('\n');
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let am = AlertmanagerOptions::parse(&format!("http://127.0.0.1:{}", free_port())).unwrap();
    let a = dir.path().join("alerts.jsonl");
    let cfg = live_cfg(&sock, |o| {
        o.metrics = Some("127.0.0.1:0".parse().unwrap());
        o.alerts = Some(AlertTarget::File(a));
        o.alertmanager = Some(AlertmanagerOptions {
            attempts: 1,
            close_grace: Duration::from_millis(200),
            ..am
        });
    });
    let sc = Sidecar::start(cfg, deployment(), &dir.path().join("rec"), Arc::new(NoLog)).unwrap();
    let addr = sc.metrics_addr().unwrap();
    let mut c = connect_to(&sock, &[2]);
    for l in foreign_lines() {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
    let body = wait_for("foreign reads in /metrics", Duration::from_secs(10), || {
        let b = scrape(addr);
        b.contains("kvtrail_foreign_reads_total 2").then_some(b)
    });
    let have = sample_names(&body);
    let used: std::collections::BTreeSet<String> = names_in(&rules)
        .into_iter()
        .chain(names_in(&exprs))
        .collect();
    assert!(used.len() >= 15, "{used:?}");
    let missing: Vec<&String> = used.iter().filter(|n| !have.contains(*n)).collect();
    assert!(missing.is_empty(), "not exported: {missing:?}\n{body}");
    // Not vacuous: a near miss is not taken.
    assert!(!have.contains("kvtrail_foreign_read_total"));
    for t in ["acme", "globex", "chatcmpl"] {
        assert!(!body.contains(t), "{t} in /metrics");
    }
    drop(c);
    sc.shutdown().unwrap();
}

// ------------------------------------------------------- real servers

/// Prometheus (the distribution's server) scrapes a live `kvtrail record
/// --metrics` every second with the shipped rules; a PromQL query through
/// its HTTP API returns the foreign-read count, and the page rule fires.
#[test]
fn prometheus_scrapes_a_live_record_and_answers_the_foreign_reads() {
    let dir = tempfile::tempdir().unwrap();
    let mport = free_port();
    let maddr = format!("127.0.0.1:{mport}");
    let (child, sock, _out) = spawn_record(dir.path(), &["--metrics", &maddr]);
    let pport = free_port();
    let paddr = format!("127.0.0.1:{pport}");
    let cfg = dir.path().join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: kvtrail\n    static_configs:\n      - targets: [\"{maddr}\"]\n",
            deploy_dir().join("prometheus/kvtrail-rules.yml").display()
        ),
    )
    .unwrap();
    let _prom = Server(
        tool("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={paddr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let query = |q: &str| -> Option<Vec<Value>> {
        let path = format!("/api/v1/query?query={}", urlencode(q));
        let (st, body) = http(&paddr, "GET", &path)?;
        let v: Value = serde_json::from_str(&body).ok()?;
        (st == 200 && v["status"] == "success").then(|| v["data"]["result"].as_array().cloned())?
    };
    // Scraped once before the reads: the rule sees an increase.
    wait_for("a first scrape", Duration::from_secs(60), || {
        let r = query("kvtrail_foreign_reads_total")?;
        (r.len() == 1).then_some(())
    });
    let mut c = connect_to(&sock, &[2]);
    for l in foreign_lines() {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
    let got = wait_for("the foreign-read count", Duration::from_secs(60), || {
        let r = query("kvtrail_foreign_reads_total")?;
        let v = r.first()?["value"][1].as_str()?.to_string();
        (v == "2").then_some(r)
    });
    assert_eq!(got[0]["metric"]["job"], "kvtrail");
    assert_eq!(got[0]["metric"]["instance"], maddr.as_str());
    wait_for("KvtrailForeignRead firing", Duration::from_secs(60), || {
        let r = query(r#"ALERTS{alertname="KvtrailForeignRead",alertstate="firing"}"#)?;
        (r.len() == 1 && r[0]["metric"]["severity"] == "critical").then_some(())
    });
    drop(c);
    sigterm(&child);
    let o = wait_bounded(child, Duration::from_secs(60));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Alertmanager (the distribution's server) receives the alerts of
/// `kvtrail record --alertmanager`: the foreign read (labels without
/// tenant names, the finding in the annotations) and the loss.
#[test]
fn alertmanager_receives_the_alerts() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let aaddr = format!("127.0.0.1:{port}");
    let cfg = dir.path().join("am.yml");
    std::fs::write(
        &cfg,
        "route:\n  receiver: discard\n  group_wait: 1s\nreceivers:\n  - name: discard\n",
    )
    .unwrap();
    let _am = Server(
        tool("prometheus-alertmanager")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.path={}",
                dir.path().join("am").display()
            ))
            .arg(format!("--web.listen-address={aaddr}"))
            .arg("--cluster.listen-address=")
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("Alertmanager ready", Duration::from_secs(60), || {
        http(&aaddr, "GET", "/-/ready").and_then(|(st, _)| (st == 200).then_some(()))
    });
    let alerts = dir.path().join("alerts.jsonl");
    let url = format!("http://{aaddr}");
    let (child, sock, _out) = spawn_record(
        dir.path(),
        &[
            "--alertmanager",
            &url,
            "--alerts",
            s(&alerts),
            "--from-engine-start",
        ],
    );
    let mut c = connect_to(&sock, &[2]);
    for l in foreign_lines() {
        writeln!(c, "{l}").unwrap();
    }
    writeln!(c, r#"{{"type":"lost","pool":2,"n":3}}"#).unwrap();
    c.flush().unwrap();
    let got = wait_for(
        "both alerts in Alertmanager",
        Duration::from_secs(30),
        || {
            let (st, body) = http(&aaddr, "GET", "/api/v2/alerts")?;
            let v: Vec<Value> = serde_json::from_str(&body).ok()?;
            (st == 200 && v.len() == 2).then_some(v)
        },
    );
    let by = |n: &str| {
        got.iter()
            .find(|a| a["labels"]["alertname"] == n)
            .unwrap_or_else(|| panic!("{n}: {got:?}"))
            .clone()
    };
    let f = by("KvtrailForeignRead");
    let l = &f["labels"];
    assert_eq!(l["severity"], "critical");
    assert_eq!(l["pool"], "2");
    assert_eq!(l["deployment"], "t");
    assert_eq!(l["request_id"], "8");
    assert_eq!(l["confidence"], "confirmed");
    let labels = l.to_string();
    for t in ["acme", "globex", "chatcmpl"] {
        assert!(!labels.contains(t), "{t} in labels: {labels}");
    }
    let finding: Value =
        serde_json::from_str(f["annotations"]["finding"].as_str().unwrap()).unwrap();
    assert_eq!(finding["class_uid"], 2006);
    assert_eq!(finding["unmapped"]["request_id"], 8);
    assert_eq!(finding["resources"][0]["owner"]["name"], "globex");
    assert_eq!(f["annotations"]["summary"], finding["message"]);
    assert_eq!(f["annotations"]["trigger"], "first_foreign_read");
    let loss = by("KvtrailCaptureLoss");
    assert_eq!(loss["labels"]["severity"], "warning");
    assert_eq!(loss["labels"]["pool"], "2");
    drop(c);
    sigterm(&child);
    let o = wait_bounded(child, Duration::from_secs(60));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("2 alerts (2 written, 0 dropped; Alertmanager: 2 sent, 0 dropped)"),
        "{out}"
    );
}

// -------------------------------------------------------------- faults

#[derive(Clone, Copy, Debug)]
enum Fake {
    /// Nothing listens.
    Down,
    /// Reads the request, never answers.
    Slow,
    /// Answers this status with a body that never ends.
    Huge(u16),
    /// Answers this status.
    Status(u16),
}

/// A fake Alertmanager: counts the POSTs and the bytes it wrote.
struct FakeAm {
    addr: SocketAddr,
    posts: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Drop for FakeAm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn fake_am(kind: Fake) -> FakeAm {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (posts, written, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    if matches!(kind, Fake::Down) {
        drop(l);
    } else {
        let (p, w, st) = (posts.clone(), written.clone(), stop.clone());
        l.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let Ok((s, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let (p, w, st) = (p.clone(), w.clone(), st.clone());
                std::thread::spawn(move || answer(s, kind, &p, &w, &st));
            }
        });
    }
    FakeAm {
        addr,
        posts,
        written,
        stop,
    }
}

/// Reads one request (head and Content-Length body) and answers as told.
fn answer(s: TcpStream, kind: Fake, posts: &AtomicU64, written: &AtomicU64, stop: &AtomicBool) {
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0u8; len];
    if r.read_exact(&mut body).is_err() {
        return;
    }
    posts.fetch_add(1, Ordering::Relaxed);
    let mut s = s;
    match kind {
        Fake::Down => {}
        Fake::Slow => {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Fake::Status(st) => {
            let _ = write!(
                s,
                "HTTP/1.1 {st} X\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno"
            );
        }
        Fake::Huge(st) => {
            let _ = write!(
                s,
                "HTTP/1.1 {st} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                1u64 << 40
            );
            let chunk = vec![b'x'; 64 << 10];
            s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
            while !stop.load(Ordering::Relaxed) && s.write_all(&chunk).is_ok() {
                written.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        }
    }
}

/// Streams `responses` foreign reads (each a distinct response reading
/// request 7's KV) and `filler` own writes through a sidecar; returns the
/// summary, the seconds sending took and the seconds shutdown took.
fn flood(
    dir: &Path,
    responses: u64,
    filler: u64,
    tune: impl FnOnce(&mut LiveOptions),
    during: impl FnOnce(&Sidecar),
) -> (RecordSummary, f64, f64, PathBuf) {
    let sock = dir.join("s.sock");
    let out = dir.join("rec");
    let cfg = live_cfg(&sock, tune);
    let sc = Sidecar::start(cfg, deployment(), &out, Arc::new(NoLog)).unwrap();
    let mut c = std::io::BufWriter::new(connect_to(&sock, &[2]));
    let t = Instant::now();
    writeln!(c, "{}", kv(2, 7, "alloc", 0, 4)).unwrap();
    writeln!(c, "{}", kv(2, 7, "write", 0, 4)).unwrap();
    writeln!(c, "{}", kv(2, 9, "alloc", 100, 1000)).unwrap();
    for r in 0..responses {
        writeln!(c, "{}", kv(2, 1000 + r, "read", 0, 4)).unwrap();
    }
    for i in 0..filler {
        let slot = 100 + (i % 1000) as u32;
        writeln!(c, "{}", kv(2, 9, "write", slot, 1)).unwrap();
    }
    c.flush().unwrap();
    let sending = t.elapsed().as_secs_f64();
    during(&sc);
    drop(c);
    let t = Instant::now();
    let sum = sc.shutdown().unwrap();
    (sum, sending, t.elapsed().as_secs_f64(), out)
}

fn tight(url: &str) -> AlertmanagerOptions {
    AlertmanagerOptions {
        queue: 8,
        connect_timeout: Duration::from_millis(500),
        read_timeout: Duration::from_millis(300),
        timeout: Duration::from_secs(1),
        attempts: 3,
        backoff: Duration::from_millis(50),
        backoff_max: Duration::from_millis(100),
        close_grace: Duration::from_secs(1),
        ..AlertmanagerOptions::parse(url).unwrap()
    }
}

/// Alertmanager down, slow, answering 500, answering a huge body: capture
/// is never held nor lost, every event is in the trace and every finding
/// in live-findings.json, delivery is bounded (retries, queue, close
/// grace), and each alert is either sent or counted dropped.
#[test]
fn alertmanager_faults_never_hold_or_lose_capture() {
    const RESPONSES: u64 = 40;
    const FILLER: u64 = 50_000;
    // (the fake, the queue): with a queue of 8 the burst of 40 alerts
    // overflows it (dropped at once, counted); with 64 it does not.
    for (kind, queue) in [
        (Fake::Down, 64),
        (Fake::Status(500), 64),
        (Fake::Slow, 64),
        (Fake::Slow, 8),
        (Fake::Huge(200), 64),
        (Fake::Huge(500), 64),
    ] {
        let fake = fake_am(kind);
        let dir = tempfile::tempdir().unwrap();
        let url = format!("http://{}", fake.addr);
        let (sum, sending, closing, out) = flood(
            dir.path(),
            RESPONSES,
            FILLER,
            |o| {
                o.alertmanager = Some(AlertmanagerOptions {
                    queue,
                    ..tight(&url)
                })
            },
            // Shut down while the retries may still run.
            |_| std::thread::sleep(Duration::from_millis(300)),
        );
        let l = sum.live.clone().unwrap();
        let sent_events = 3 + RESPONSES + FILLER;
        assert_eq!(
            sum.stats.kv_written, sent_events,
            "{kind:?}: capture lost events"
        );
        assert_eq!(sum.stats.lost_events(), 0, "{kind:?}");
        assert!(sum.complete, "{kind:?}");
        assert_eq!(l.affected_responses, RESPONSES, "{kind:?}: {l:?}");
        assert_eq!(l.alerts, RESPONSES, "{kind:?}: one alert per response");
        assert_eq!(
            l.alertmanager_sent + l.alertmanager_dropped,
            RESPONSES,
            "{kind:?}: every alert sent or counted dropped: {l:?}"
        );
        // Close: the grace (1 s) and one POST's timeout (1 s) at most.
        assert!(closing < 6.0, "{kind:?}: shutdown took {closing:.1} s");
        let f: Value =
            serde_json::from_slice(&std::fs::read(out.join(LIVE_FINDINGS)).unwrap()).unwrap();
        assert_eq!(
            f["affected_responses"].as_array().unwrap().len() as u64,
            RESPONSES
        );
        let posts = fake.posts.load(Ordering::Relaxed);
        match kind {
            Fake::Huge(200) => {
                assert_eq!(l.alertmanager_sent, RESPONSES, "{l:?}");
                // The answer is read to 64 KiB, then the connection closed.
                let w = fake.written.load(Ordering::Relaxed);
                assert!(w < 64 << 20, "the fake wrote {w} bytes");
            }
            Fake::Down => {
                assert_eq!(posts, 0);
                assert_eq!(l.alertmanager_dropped, RESPONSES, "{l:?}");
            }
            _ => {
                assert_eq!(l.alertmanager_dropped, RESPONSES, "{kind:?}: {l:?}");
                assert!(posts >= 1, "{kind:?}: the fake saw no POST");
                // Each batch at most `attempts` times.
                assert!(
                    posts <= 3 * RESPONSES.div_ceil(8),
                    "{kind:?}: {posts} POSTs"
                );
            }
        }
        eprintln!(
            "{kind:?} queue {queue}: sent {sent_events} events in {sending:.2} s, shutdown {closing:.2} s, {posts} POSTs, alerts sent {} dropped {}",
            l.alertmanager_sent, l.alertmanager_dropped
        );
    }
}

/// A flood of foreign reads by 3000 responses: one alert per response,
/// at most `storm_limit` sent one by one per window and the rest counted
/// in storm summaries (to the alerts file and to Alertmanager alike);
/// every response is in live-findings.json; a metrics client that sends
/// its request and never reads holds nothing; capture is whole.
#[test]
fn a_flood_of_foreign_reads_is_aggregated_and_blocks_nothing() {
    const RESPONSES: u64 = 3000;
    let fake = fake_am(Fake::Status(200));
    let dir = tempfile::tempdir().unwrap();
    let alerts = dir.path().join("alerts.jsonl");
    let a = alerts.clone();
    let url = format!("http://{}", fake.addr);
    let (sum, _, closing, out) = flood(
        dir.path(),
        RESPONSES,
        10_000,
        |o| {
            o.alerts = Some(AlertTarget::File(a));
            o.alertmanager = Some(AlertmanagerOptions {
                queue: 4096,
                ..tight(&url)
            });
            o.metrics = Some("127.0.0.1:0".parse().unwrap());
            o.storm_limit = 20;
            o.storm_window = Duration::from_millis(500);
        },
        |sc| {
            let addr = sc.metrics_addr().unwrap();
            // Sends its request, never reads the answer.
            let mut stuck = TcpStream::connect(addr).unwrap();
            write!(stuck, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let body = wait_for("the flood in /metrics", Duration::from_secs(20), || {
                let b = scrape(addr);
                b.contains(&format!("kvtrail_foreign_reads_total {RESPONSES}"))
                    .then_some(b)
            });
            assert!(body.contains("kvtrail_alerts_aggregated_total"), "{body}");
            std::thread::sleep(Duration::from_millis(700));
            drop(stuck);
        },
    );
    let l = sum.live.unwrap();
    assert_eq!(sum.stats.kv_written, 3 + RESPONSES + 10_000);
    assert_eq!(l.affected_responses, RESPONSES);
    let lines: Vec<Value> = std::fs::read_to_string(&alerts)
        .unwrap()
        .lines()
        .map(|x| serde_json::from_str(x).unwrap())
        .collect();
    let single = lines
        .iter()
        .filter(|v| v["unmapped"]["trigger"] == "first_foreign_read")
        .count() as u64;
    let storms: Vec<&Value> = lines
        .iter()
        .filter(|v| v["unmapped"]["kind"] == "alert_storm")
        .collect();
    let folded: u64 = storms
        .iter()
        .map(|v| {
            v["unmapped"]["folded"]["first_foreign_read"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert!(!storms.is_empty(), "a storm summary");
    assert!(
        (20..RESPONSES / 10).contains(&single),
        "{single} sent one by one"
    );
    assert_eq!(single + folded, RESPONSES, "each response counted once");
    assert_eq!(l.alerts_aggregated, folded);
    assert_eq!(l.alerts, RESPONSES + storms.len() as u64);
    assert_eq!(l.alerts_written, lines.len() as u64);
    assert!(
        storms[0]["message"]
            .as_str()
            .unwrap()
            .starts_with("alert storm: ")
    );
    assert_eq!(storms[0]["severity_id"], 4);
    assert_eq!(l.alertmanager_sent, lines.len() as u64, "{l:?}");
    assert!(closing < 6.0, "shutdown {closing:.1} s");
    let f: Value =
        serde_json::from_slice(&std::fs::read(out.join(LIVE_FINDINGS)).unwrap()).unwrap();
    assert_eq!(
        f["affected_responses"].as_array().unwrap().len() as u64,
        RESPONSES
    );
}

// ------------------------------------------- prefix hits and verify

fn tenant_deployment() -> Deployment {
    let mut d = deployment();
    d.prefix_cache_scope = Some(PrefixCacheScope::Tenant);
    d
}

/// Under `prefix_cache_scope: tenant`: request 8 (globex) served from
/// request 7's (acme) cached prefix raises one cross-tenant prefix-hit
/// alert (however many reads), request 9 (acme, the same tenant) none;
/// request 10 (initech) reads 7's KV without a grant: a foreign read.
/// The live findings equal a fresh scope, and `kvtrail verify` says so;
/// it fails when live-findings.json says less than scope.
#[test]
fn cross_tenant_prefix_hit_alert_and_verify_compares_live_with_scope() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = dir.path().join("rec");
    let alerts = dir.path().join("alerts.jsonl");
    let a = alerts.clone();
    let cfg = live_cfg(&sock, |o| o.alerts = Some(AlertTarget::File(a)));
    let sc = Sidecar::start(cfg, tenant_deployment(), &out, Arc::new(NoLog)).unwrap();
    let mut c = connect_to(&sock, &[2]);
    let req = |id: u64, t: &str| {
        format!(
            r#"{{"type":"request","request_id":{id},"external_id":"chatcmpl-{id}","tenant":"{t}","arrival_ns":{id},"prompt_tokens":4,"output_tokens":1,"http_status":200}}"#
        )
    };
    for l in [
        req(7, "acme"),
        req(8, "globex"),
        req(9, "acme"),
        req(10, "initech"),
        kv(2, 7, "alloc", 0, 4),
        kv(2, 7, "write", 0, 4),
        kv(2, 8, "share", 0, 4),
        kv(2, 8, "read", 0, 4),
        kv(2, 8, "read", 0, 4),
        kv(2, 9, "share", 0, 4),
        kv(2, 9, "read", 0, 4),
        kv(2, 10, "read", 0, 2),
    ] {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
    drop(c);
    let sum = sc.shutdown().unwrap();
    let lines: Vec<Value> = std::fs::read_to_string(&alerts)
        .unwrap()
        .lines()
        .map(|x| serde_json::from_str(x).unwrap())
        .collect();
    let trig = |t: &str| -> Vec<&Value> {
        lines
            .iter()
            .filter(|v| v["unmapped"]["trigger"] == t)
            .collect()
    };
    let p = trig("cross_tenant_prefix_hit");
    assert_eq!(p.len(), 1, "{lines:?}");
    assert_eq!(p[0]["class_uid"], 2006);
    assert_eq!(p[0]["unmapped"]["request_id"], 8);
    assert_eq!(p[0]["unmapped"]["pool"], 2);
    let text = p[0].to_string();
    assert!(text.contains("acme") && text.contains("globex"), "{text}");
    let f = trig("first_foreign_read");
    assert_eq!(f.len(), 1, "{lines:?}");
    assert_eq!(f[0]["unmapped"]["request_id"], 10);
    assert_eq!(sum.live.unwrap().alerts, 2);

    let t = Trace::open(&out).unwrap();
    let scope =
        kvtrail::scope::scope(&t, &Default::default(), &kvtrail::progress::NoReporter).unwrap();
    assert_eq!(scope.cross_tenant_shared.len(), 1);
    assert_eq!(scope.affected_responses.len(), 1);

    // verify: equal.
    let r = kvtrail(["verify", s(&out)]).run();
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("live findings equal a fresh scope: 1 affected responses and 1 cross-tenant prefix hits live, 1 and 1 in scope"),
        "{}",
        r.stdout
    );
    let j = kvtrail(["verify", s(&out), "--json"]).run();
    let v: Value = serde_json::from_str(&j.stdout).unwrap();
    assert_eq!(v["live"]["equal"], true);

    let path = out.join(LIVE_FINDINGS);
    let orig: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let edit = |f: &dyn Fn(&mut Value)| {
        let mut v = orig.clone();
        f(&mut v);
        std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
        kvtrail(["verify", s(&out)]).run()
    };
    // Live missed the affected response: fails.
    let r = edit(&|v| v["affected_responses"] = Value::Array(vec![]));
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(
        r.stdout.contains(
            "FAIL live         affected response 10 finding: live none, scope 2 exposed tokens"
        ),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("FAILED: live findings said less than a fresh scope"),
        "{}",
        r.stdout
    );
    // Fewer tokens, a weaker confidence: fail.
    let r = edit(&|v| v["affected_responses"][0]["foreign_tokens"] = 1.into());
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(
        r.stdout.contains("foreign_tokens: live 1, scope 2"),
        "{}",
        r.stdout
    );
    let r = edit(&|v| v["affected_responses"][0]["confidence"] = "possible".into());
    assert_eq!(r.code, 1, "{}", r.stdout);
    // The prefix hit missed: fails.
    let r = edit(&|v| v["cross_tenant_shared"] = Value::Array(vec![]));
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(
        r.stdout
            .contains("prefix hit 8 finding: live none, scope 4 tokens"),
        "{}",
        r.stdout
    );
    // Live said more: noted, not failed.
    let r = edit(&|v| v["affected_responses"][0]["exposed_tokens"] = 3.into());
    assert_eq!(r.code, 0, "{}", r.stdout);
    assert!(r.stdout.contains("NOTE live"), "{}", r.stdout);
    assert!(
        r.stdout
            .contains("said more than a fresh scope, never less"),
        "{}",
        r.stdout
    );
    // Not live findings: exit 2 naming the file.
    std::fs::write(&path, b"{\"kind\": 1}").unwrap();
    let r = kvtrail(["verify", s(&out)]).run();
    assert_eq!(r.code, 2, "{}", r.stdout);
    assert!(r.stderr.contains(LIVE_FINDINGS), "{}", r.stderr);
}

// ------------------------------------------------------------ sealing

/// With `--signing-key`, live-findings.json is written before the final
/// seal and covered by it: `verify --allowed-signers` passes, and a
/// changed live-findings.json fails the seal check, named.
#[test]
fn live_findings_are_sealed_with_the_trace() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "test", "-f"])
        .arg(&key)
        .status()
        .expect("ssh-keygen (OpenSSH) is installed: run .ci/setup.d/20-openssh.sh");
    assert!(st.success());
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    let two: Vec<&str> = public.split_whitespace().take(2).collect();
    let allowed = dir.path().join("allowed");
    std::fs::write(&allowed, format!("capture@example {}\n", two.join(" "))).unwrap();
    let (child, sock, out) = spawn_record(
        dir.path(),
        &["--live", "--signing-key", s(&key), "--from-engine-start"],
    );
    let mut c = connect_to(&sock, &[2]);
    for l in foreign_lines() {
        writeln!(c, "{l}").unwrap();
    }
    c.flush().unwrap();
    drop(c);
    sigterm(&child);
    let o = wait_bounded(child, Duration::from_secs(60));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let seals: Vec<String> = std::fs::read_dir(out.join("seals"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap_or_default())
        .collect();
    assert!(
        seals
            .iter()
            .any(|t| t.contains(&format!("\"{LIVE_FINDINGS}\""))),
        "no seal names {LIVE_FINDINGS}"
    );
    let r = kvtrail(["verify", s(&out), "--allowed-signers", s(&allowed)]).run();
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("SEALED"), "{}", r.stdout);
    assert!(
        r.stdout.contains("live findings equal a fresh scope"),
        "{}",
        r.stdout
    );
    // One byte more: the seal check names the file.
    let p = out.join(LIVE_FINDINGS);
    let mut b = std::fs::read(&p).unwrap();
    b.push(b'\n');
    std::fs::write(&p, b).unwrap();
    let r = kvtrail(["verify", s(&out), "--allowed-signers", s(&allowed)]).run();
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stdout
            .contains(&format!("FAIL seal         {LIVE_FINDINGS}")),
        "{}",
        r.stdout
    );
}
