//! Sidecar throughput: 4 concurrent senders stream JSONL KV events over a
//! Unix socket into `kvtrail record` (in-process `Sidecar`) until every
//! event is in closed Parquet files; baseline: the same events handed to a
//! `Recorder` directly (no socket, no parsing), in the same process.
//!
//! cargo run --release --example bench_record -- [EVENTS_PER_SENDER] [SENDERS]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::record::{Listen, NoLog, RecordConfig, Sidecar};
use kvtrail::schema::{KvEvent, Op};
use kvtrail::trace::manifest::Deployment;

fn deployment(senders: usize) -> Deployment {
    let pools: Vec<serde_json::Value> = (0..senders)
        .map(|i| serde_json::json!({"id": i, "role": "mixed", "capacity_tokens": 1 << 20, "page_size": 1}))
        .collect();
    serde_json::from_value(serde_json::json!({"context_window": 1 << 20, "pools": pools})).unwrap()
}

fn event(pool: u16, i: u64) -> KvEvent {
    let op = Op::ALL[(i % 4) as usize];
    KvEvent {
        pool,
        seq: 0,
        ts_ns: 1_700_000_000_000_000_000 + i as i64 * 1000,
        request_id: 1 + i / 64,
        op,
        slot_start: ((i * 37) % 1_000_000) as u32,
        slot_count: 1 + (i % 16) as u32,
        token_pos: (op != Op::Alloc && op != Op::Free).then_some((i % 4096) as u32),
        src: None,
    }
}

fn line(e: &KvEvent) -> String {
    let tp = e.token_pos.map_or("null".to_string(), |t| t.to_string());
    format!(
        r#"{{"type":"kv","pool":{},"ts_ns":{},"request_id":{},"op":"{}","slot_start":{},"slot_count":{},"token_pos":{}}}"#,
        e.pool, e.ts_ns, e.request_id, e.op, e.slot_start, e.slot_count, tp
    )
}

/// One sidecar run over `payloads`: (wall seconds, senders' seconds, the
/// summary).
fn sidecar(
    dir: &std::path::Path,
    name: &str,
    dep: Deployment,
    payloads: &[Vec<u8>],
    live: bool,
) -> (f64, f64, kvtrail::record::RecordSummary) {
    let sock = dir.join(format!("{name}.sock"));
    let mut cfg = RecordConfig::new(Listen::Unix(sock.clone()));
    cfg.queue_batches = 4096;
    if live {
        cfg.live = Some(kvtrail::record::live::LiveOptions::default());
    }
    let out = dir.join(name);
    let sc = Sidecar::start(cfg, dep, &out, Arc::new(NoLog)).unwrap();
    let t = Instant::now();
    std::thread::scope(|s| {
        for p in payloads {
            let sock = &sock;
            s.spawn(move || {
                let mut c = UnixStream::connect(sock).unwrap();
                for chunk in p.chunks(1 << 20) {
                    c.write_all(chunk).unwrap();
                }
            });
        }
    });
    let sent = t.elapsed().as_secs_f64();
    let sum = sc.shutdown().unwrap();
    (t.elapsed().as_secs_f64(), sent, sum)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let per: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(500_000);
    let senders: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(4);
    let total = per * senders as u64;
    let dep = deployment(senders);
    let dir = tempfile::tempdir().unwrap();

    // Pre-generate every sender's bytes (the engine side is not measured).
    let payloads: Vec<Vec<u8>> = (0..senders)
        .map(|p| {
            let mut b = format!("{{\"type\":\"hello\",\"pools\":[{p}],\"worker\":\"bench\"}}\n")
                .into_bytes();
            for i in 0..per {
                b.extend_from_slice(line(&event(p as u16, i)).as_bytes());
                b.push(b'\n');
            }
            b
        })
        .collect();
    let bytes: usize = payloads.iter().map(Vec::len).sum();

    // Baseline: the Recorder alone.
    let t = Instant::now();
    let mut rec = Recorder::create(
        &dir.path().join("direct"),
        dep.clone(),
        RecorderOptions::default(),
    )
    .unwrap();
    for i in 0..per {
        for p in 0..senders {
            rec.kv(event(p as u16, i)).unwrap();
        }
    }
    rec.close().unwrap();
    let direct = t.elapsed().as_secs_f64();

    // The sidecar with `senders` concurrent connections, without and with
    // live detection (the lineage rule applied while recording).
    let (wall, sent, sum) = sidecar(dir.path(), "sidecar", dep.clone(), &payloads, false);
    let (lwall, lsent, lsum) = sidecar(dir.path(), "live", dep, &payloads, true);
    let st = &sum.stats;
    assert_eq!(st.kv_written + st.lost_queue, total, "{st:?}");
    let live = lsum.live.clone().expect("live stats");
    println!(
        "bench_record: {senders} senders x {per} events ({:.0} MB of JSONL), {} cores",
        bytes as f64 / 1e6,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "  direct Recorder (baseline): {:>8.3} s  {:>10.0} events/s",
        direct,
        total as f64 / direct
    );
    println!(
        "  sidecar, sockets -> Parquet: {:>8.3} s  {:>10.0} events/s written ({} dropped as holes), senders done after {:.3} s",
        wall,
        st.kv_written as f64 / wall,
        st.lost_queue,
        sent
    );
    println!(
        "  sidecar + live detection:    {:>8.3} s  {:>10.0} events/s written, {} classified live ({} dropped from the live view, {} affected responses), senders done after {:.3} s",
        lwall,
        lsum.stats.kv_written as f64 / lwall,
        live.events_applied,
        live.events_dropped,
        live.affected_responses,
        lsent
    );
    println!("  ratio sidecar / direct time: {:.2}x", wall / direct);
    println!(
        "  ratio sidecar+live / sidecar events/s: {:.2}x",
        (lsum.stats.kv_written as f64 / lwall) / (st.kv_written as f64 / wall)
    );
}
