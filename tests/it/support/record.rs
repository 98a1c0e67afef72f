//! The sidecar tests' rig (record_protocol, record_hostile, record_soak): a
//! four-pool deployment, a sidecar started on a Unix socket in a temporary
//! directory, acknowledged connections, the binary started as `kvtrail
//! record`, and small line builders.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cli::kvtrail;
use kvtrail::record::{Listen, NoLog, RecordConfig, RecordSummary, Sidecar};
use kvtrail::schema::{KvEvent, RequestRecord, hex32};
use kvtrail::trace::Trace;
use kvtrail::trace::manifest::Deployment;

/// Pools 0 (prefill) and 1 (decode), page size 4; pools 2 and 3 (mixed),
/// page size 1; 4096 slots each.
pub fn deployment() -> Deployment {
    serde_json::from_value(serde_json::json!({
        "name": "t", "engine": "test", "context_window": 4096,
        "pools": [
            {"id": 0, "role": "prefill", "capacity_tokens": 4096, "page_size": 4},
            {"id": 1, "role": "decode", "capacity_tokens": 4096, "page_size": 4},
            {"id": 2, "role": "mixed", "capacity_tokens": 4096, "page_size": 1},
            {"id": 3, "role": "mixed", "capacity_tokens": 4096, "page_size": 1}
        ]
    }))
    .unwrap()
}

pub struct Rig {
    pub _dir: tempfile::TempDir,
    pub sock: PathBuf,
    pub out: PathBuf,
    pub sidecar: Sidecar,
}

pub fn start(tune: impl FnOnce(&mut RecordConfig)) -> Rig {
    start_in(deployment(), tune)
}

/// As [`start`], with another deployment.
pub fn start_in(dep: Deployment, tune: impl FnOnce(&mut RecordConfig)) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = dir.path().join("trace");
    let mut cfg = RecordConfig::new(Listen::Unix(sock.clone()));
    tune(&mut cfg);
    let sidecar = Sidecar::start(cfg, dep, &out, Arc::new(NoLog)).unwrap();
    Rig {
        _dir: dir,
        sock,
        out,
        sidecar,
    }
}

/// A test client's connection: says `bye` (with counts that add up) when
/// dropped, as the hooks do on a clean close; [`Hook::crash`] drops it
/// without one.
pub struct Hook(Option<UnixStream>);

impl Hook {
    pub fn new(s: UnixStream) -> Hook {
        Hook(Some(s))
    }
    /// Ends the connection without the closing line (an engine that died).
    pub fn crash(mut self) {
        self.0.take();
    }
}

impl Write for Hook {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.as_mut().expect("open").write(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.as_mut().expect("open").flush()
    }
}

impl Drop for Hook {
    fn drop(&mut self) {
        if let Some(s) = &mut self.0 {
            let _ = writeln!(s, r#"{{"type":"bye","enqueued":0,"sent":0,"dropped":0}}"#);
        }
    }
}

impl Rig {
    /// A connection whose hello the sidecar has acknowledged (its claim
    /// on `pools` holds when this returns).
    pub fn connect(&self, pools: &[u16]) -> Hook {
        connect_to(&self.sock, pools)
    }
}

/// Connects to a sidecar's socket and waits for the welcome.
pub fn connect_to(sock: &Path, pools: &[u16]) -> Hook {
    let mut c = UnixStream::connect(sock).unwrap();
    writeln!(
        c,
        "{}",
        serde_json::json!({"type": "hello", "pools": pools, "worker": "test"})
    )
    .unwrap();
    // A missing reply fails the test instead of hanging it.
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut reply = String::new();
    BufReader::new(&c).read_line(&mut reply).unwrap();
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(v["type"], "welcome", "{reply}");
    assert_eq!(v["pools"], serde_json::json!(pools), "{reply}");
    Hook::new(c)
}

impl Rig {
    pub fn stop(self) -> (RecordSummary, Trace, tempfile::TempDir, PathBuf) {
        let sum = self.sidecar.shutdown().unwrap();
        let t = Trace::open(&self.out).unwrap();
        (sum, t, self._dir, self.out)
    }
}

pub fn kv(pool: u16, rid: u64, op: &str, start: u32, count: u32) -> String {
    format!(
        r#"{{"type":"kv","pool":{pool},"ts_ns":1,"request_id":{rid},"op":"{op}","slot_start":{start},"slot_count":{count}}}"#
    )
}

/// Events per pool, in seq order.
pub fn events(t: &Trace) -> BTreeMap<u16, Vec<KvEvent>> {
    let mut m: BTreeMap<u16, Vec<KvEvent>> = BTreeMap::new();
    for c in t.kv_chunks() {
        for e in c.unwrap().events {
            m.entry(e.pool).or_default().push(e);
        }
    }
    for v in m.values_mut() {
        v.sort_by_key(|e| e.seq);
    }
    m
}

pub fn seqs(t: &Trace, pool: u16) -> Vec<u64> {
    events(t)
        .get(&pool)
        .map(|v| v.iter().map(|e| e.seq).collect())
        .unwrap_or_default()
}

// ---------------------------------------------------------------- the binary

pub fn write_deployment(dir: &Path) -> PathBuf {
    let p = dir.join("deploy.json");
    std::fs::write(&p, serde_json::to_string(&deployment()).unwrap()).unwrap();
    p
}

/// `kvtrail record` on `dir/s.sock` writing `dir/trace`, once its socket
/// exists.
pub fn spawn_record(dir: &Path, extra: &[&str]) -> (Child, PathBuf, PathBuf) {
    let sock = dir.join("s.sock");
    let out = dir.join("trace");
    let dep = write_deployment(dir);
    let mut args = vec![
        "record".to_string(),
        "--listen".into(),
        sock.to_str().unwrap().into(),
        "--deployment".into(),
        dep.to_str().unwrap().into(),
        "--out".into(),
        out.to_str().unwrap().into(),
        "--health-secs".into(),
        "1".into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let child = kvtrail(&args).spawn();
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    (child, sock, out)
}

/// Connects and sends a hello without waiting for the answer.
pub fn hello(sock: &Path, pool: u16) -> UnixStream {
    let mut c = UnixStream::connect(sock).unwrap();
    writeln!(c, r#"{{"type":"hello","pools":[{pool}]}}"#).unwrap();
    c
}

/// Reads a child's pipe to its end on a thread of its own (so a chatty
/// child never blocks on a full pipe).
pub fn drain<R: std::io::Read + Send + 'static>(r: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut v);
        }
        v
    })
}

/// Waits for a child at most `limit` (draining the pipes it still has);
/// kills it and fails when it is still running then.
pub fn wait_bounded(mut child: Child, limit: Duration) -> std::process::Output {
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let e = err.join().unwrap();
            panic!(
                "still running after {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&e)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// A `kv` wire line for an event (what a hook sends).
pub fn kv_line(e: &KvEvent) -> String {
    let mut v = serde_json::json!({
        "type": "kv", "pool": e.pool, "seq": e.seq, "ts_ns": e.ts_ns,
        "request_id": e.request_id, "op": e.op.as_str(),
        "slot_start": e.slot_start, "slot_count": e.slot_count,
        "token_pos": e.token_pos,
    });
    if let Some(s) = e.src {
        v["src_pool"] = s.pool.into();
        v["src_slot_start"] = s.slot_start.into();
        v["src_seq"] = s.seq.into();
    }
    v.to_string()
}

/// A `request` wire line for a request row.
pub fn request_line(r: &RequestRecord) -> String {
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

// ------------------------------------------------ live against scope

/// For a trace recorded with `--live`: its live findings
/// (live-findings.json) against a fresh scope. `kvtrail verify` compares
/// them on a trace that passes its own checks and prints the verdict; a
/// trace that fails them (an incomplete capture) verify does not compare,
/// so it is compared through the same library call verify makes. Returns
/// the comparison and verify's stdout.
pub fn live_vs_scope(trace: &Path) -> (kvtrail::record::live::compare::Comparison, String) {
    let v = kvtrail(["verify", trace.to_str().unwrap()]).run();
    let c = kvtrail::record::live::compare::compare_trace(trace)
        .unwrap()
        .expect("live-findings.json written at close");
    if v.code == 0 {
        // verify ran the comparison and said so.
        let want = if c.equal {
            "live findings equal a fresh scope"
        } else if c.live_said_less {
            "FAILED: live findings said less"
        } else {
            "live findings said more than a fresh scope, never less"
        };
        assert!(v.stdout.contains(want), "{}\n{}", v.stdout, v.stderr);
    }
    (c, v.stdout)
}

/// Live findings equal a fresh scope, field by field; where the trace
/// verifies, `kvtrail verify` prints "live findings equal a fresh scope".
pub fn assert_live_equals_scope(trace: &Path) {
    let (c, out) = live_vs_scope(trace);
    assert!(
        c.equal && c.live_exact,
        "live against scope on {}: {:#?}\n{out}",
        trace.display(),
        c
    );
}
