//! What sealing costs the sidecar: bench_record's workload (concurrent
//! senders streaming JSONL KV events over a Unix socket into an in-process
//! `Sidecar` until every event is in closed Parquet files), run in pairs,
//! unsealed and sealed (`--signing-key`, a seal every `SEAL_MS`), in the
//! same process, alternating so that a busy machine slows both alike.
//! Prints each pair and the median ratios of sealed to unsealed wall time
//! and CPU time (user + system of the whole process: the senders only
//! write prepared bytes, so nearly all of it is the sidecar's). On a
//! shared machine the CPU ratio is the steadier figure: sealing runs on a
//! thread of its own, so what it costs is CPU, which a wall clock on an
//! idle core does not show and a busy machine drowns.
//!
//! cargo run --release --example bench_seal -- [EVENTS_PER_SENDER] [SENDERS] [PAIRS] [SEAL_MS]

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtrail::custody::keys::SigningKey;
use kvtrail::record::{Listen, NoLog, RecordConfig, SealConfig, Sidecar, WhenBehind};
use kvtrail::trace::manifest::Deployment;

fn deployment(senders: usize) -> Deployment {
    let pools: Vec<serde_json::Value> = (0..senders)
        .map(|i| serde_json::json!({"id": i, "role": "mixed", "capacity_tokens": 1 << 20, "page_size": 1}))
        .collect();
    serde_json::from_value(serde_json::json!({"context_window": 1 << 20, "pools": pools})).unwrap()
}

fn line(pool: usize, i: u64) -> String {
    let op = ["alloc", "write", "read", "free"][(i % 4) as usize];
    let tp = if op == "alloc" || op == "free" {
        "null".to_string()
    } else {
        (i % 4096).to_string()
    };
    format!(
        r#"{{"type":"kv","pool":{pool},"ts_ns":{},"request_id":{},"op":"{op}","slot_start":{},"slot_count":{},"token_pos":{tp}}}"#,
        1_700_000_000_000_000_000 + i as i64 * 1000,
        1 + i / 64,
        (i * 37) % 1_000_000,
        1 + i % 16
    )
}

/// A throwaway ed25519 key from a fixed seed, written owner-only.
fn bench_key(dir: &Path) -> Arc<SigningKey> {
    use ssh_key::private::{Ed25519Keypair, KeypairData};
    let kp = Ed25519Keypair::from_seed(&[7u8; 32]);
    let key = ssh_key::PrivateKey::new(KeypairData::Ed25519(kp), "bench").unwrap();
    let p = dir.join("bench_key");
    std::fs::write(
        &p,
        key.to_openssh(ssh_key::LineEnding::LF).unwrap().as_bytes(),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    Arc::new(SigningKey::load(&p).unwrap())
}

/// CPU seconds (user + system) this process has used so far.
fn cpu_seconds() -> f64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// One capture of `payloads`; its wall time, CPU time and the seals
/// written.
fn run(
    dir: &Path,
    name: &str,
    dep: &Deployment,
    payloads: &[Vec<u8>],
    seal: Option<SealConfig>,
) -> (f64, f64, u64, kvtrail::record::SealCost) {
    let sock = dir.join(format!("{name}.sock"));
    let mut cfg = RecordConfig::new(Listen::Unix(sock.clone()));
    cfg.queue_batches = 4096;
    // Long runs outpace the writer's queue: the senders wait rather than
    // lose events, so both sides capture everything.
    cfg.when_behind = WhenBehind::Wait;
    cfg.seal = seal;
    let out = dir.join(name);
    let sc = Sidecar::start(cfg, dep.clone(), &out, Arc::new(NoLog)).unwrap();
    let cpu = cpu_seconds();
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
    let sum = sc.shutdown().unwrap();
    let wall = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu;
    assert_eq!(sum.stats.lost_queue, 0, "{:?}", sum.stats);
    std::fs::remove_dir_all(&out).unwrap();
    (wall, cpu, sum.seals, sum.seal_cost.unwrap_or_default())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: u64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let per = arg(1, 500_000);
    let senders = arg(2, 4) as usize;
    let pairs = arg(3, 5) as usize;
    let seal_ms = arg(4, 1000);
    let dep = deployment(senders);
    let dir = tempfile::tempdir().unwrap();
    let key = bench_key(dir.path());
    let payloads: Vec<Vec<u8>> = (0..senders)
        .map(|p| {
            let mut b = format!("{{\"type\":\"hello\",\"pools\":[{p}],\"worker\":\"bench\"}}\n")
                .into_bytes();
            for i in 0..per {
                b.extend_from_slice(line(p, i).as_bytes());
                b.push(b'\n');
            }
            b
        })
        .collect();
    let total = per * senders as u64;
    println!(
        "bench_seal: {senders} senders x {per} events, {pairs} pairs, a seal every {seal_ms} ms, {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // One warm-up run each (page cache, allocator).
    run(dir.path(), "warm", &dep, &payloads, None);
    let mut ratios = Vec::new();
    let mut cpu_ratios = Vec::new();
    let mut cpu_shares = Vec::new();
    let mut writer_shares = Vec::new();
    for i in 0..pairs {
        let seal = SealConfig {
            key: key.clone(),
            every: Duration::from_millis(seal_ms),
        };
        // Alternate the order so a drift in load favours neither side.
        let (plain, sealed) = if i % 2 == 0 {
            let a = run(dir.path(), "plain", &dep, &payloads, None);
            (a, run(dir.path(), "sealed", &dep, &payloads, Some(seal)))
        } else {
            let b = run(dir.path(), "sealed", &dep, &payloads, Some(seal));
            (run(dir.path(), "plain", &dep, &payloads, None), b)
        };
        let (pw, pc, _, _) = plain;
        let (sw, sc, seals, cost) = sealed;
        // Direct shares, free of the pairs' scatter: the sealing thread's
        // CPU of the sealed run's CPU, and the writer's sealing work (the
        // hand-over each interval and the wait for the final seal, not the
        // rows it encodes earlier for a seal) of its wall time (the writer
        // is the bottleneck: its time is throughput).
        let cpu_share = cost.sealer_cpu_s / sc;
        let writer_share = (cost.writer_s + cost.final_wait_s) / sw;
        println!(
            "  pair {i}: unsealed {pw:.3} s wall ({:.0} events/s), {pc:.3} CPU-s; sealed {sw:.3} s wall ({:.0} events/s), {sc:.3} CPU-s, {seals} seals: wall ratio {:.4}, CPU ratio {:.4}; sealing thread {:.3} CPU-s ({:.2}% of the CPU), writer {:.3} s + final wait {:.3} s ({:.2}% of the wall; rows encoded early {:.3} s)",
            total as f64 / pw,
            total as f64 / sw,
            sw / pw,
            sc / pc,
            cost.sealer_cpu_s,
            cpu_share * 100.0,
            cost.writer_s,
            cost.final_wait_s,
            writer_share * 100.0,
            cost.flush_s
        );
        ratios.push(sw / pw);
        cpu_ratios.push(sc / pc);
        cpu_shares.push(cpu_share * 100.0);
        writer_shares.push(writer_share * 100.0);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let (m, lo, hi) = median(&mut ratios);
    println!("  median ratio sealed / unsealed wall time: {m:.4} (min {lo:.4}, max {hi:.4})");
    let (m, lo, hi) = median(&mut cpu_ratios);
    println!("  median ratio sealed / unsealed CPU time: {m:.4} (min {lo:.4}, max {hi:.4})");
    let (m, lo, hi) = median(&mut cpu_shares);
    println!("  median sealing thread share of the CPU: {m:.3}% (min {lo:.3}%, max {hi:.3}%)");
    let (m, lo, hi) = median(&mut writer_shares);
    println!(
        "  median writer time on sealing (hand-over + final wait) of the wall: {m:.3}% (min {lo:.3}%, max {hi:.3}%)"
    );
}
