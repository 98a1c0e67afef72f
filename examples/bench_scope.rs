//! Benchmark of `scope` against two baselines on the same files, in one run:
//!
//! - floor: a plain Parquet scan of every kv file (all columns decoded);
//! - DuckDB: the lineage SQL a responder would write (unnest + ASOF JOIN,
//!   `bench/duckdb_lineage.py`), run on a 1M-event slice generated the same
//!   way (at 10M events it does not fit this machine) and extrapolated
//!   linearly, which flatters DuckDB.
//!
//! The traces are synthetic, written with the Recorder: a PD deployment,
//! requests with long-tailed prompts, page-granular allocation with
//! SGLang's PD free list (lowest pages first), prefill→decode copies,
//! decode steps that append one token and read the whole context in
//! extents of up to 4 pages, and a few placeholder requests whose decode
//! reads stale KV of earlier requests (the incident).
//!
//! Run: `cargo run --release --example bench_scope -- [EVENTS] [SLICE_EVENTS]`
//! (defaults 10000000 and 1000000). Traces are cached under target/bench/.
//! Peak RSS (VmHWM) of scope is measured in a child process per trace size.
//!
//! A third comparison prices the paged slot table: the replay alone with
//! the CPU backend (pages allocated on first write) and with the flat
//! per-slot arrays it replaced (`support/flat_cpu.rs`), alternated in the
//! same process on the same trace, best of 3 each, as a ratio.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::lineage::Backend;
use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord};
use kvtrail::trace::{Deployment, Pool, Role, Trace};

#[path = "support/synth.rs"]
mod synth;
use synth::{PAGE, Pages, Rng, runs, slot};

#[path = "support/flat_cpu.rs"]
mod flat_cpu;

struct Active {
    id: u64,
    prompt: u32,
    out: u32,
    step: u32,
    pages: Vec<u32>,
}

fn deployment() -> Deployment {
    let pool = |id, role, cap| Pool {
        id,
        name: format!("{}-0", if id == 0 { "prefill" } else { "decode" }),
        role,
        capacity_tokens: cap,
        page_size: PAGE,
        extra: Default::default(),
    };
    Deployment {
        name: "bench / synthetic PD".into(),
        engine: "sglang-0.5.19 (synthetic)".into(),
        context_window: 262_144,
        pools: vec![
            pool(0, Role::Prefill, 131_072),
            pool(1, Role::Decode, 524_288),
        ],
        prefix_cache_scope: None,
        extra: Default::default(),
    }
}

/// Generates a trace of about `target` kv events.
fn generate(dir: &Path, target: u64) -> kvtrail::Result<()> {
    let opts = RecorderOptions {
        started_ns: Some(1_700_000_000_000_000_000),
        ..Default::default()
    };
    let mut rec = Recorder::create(dir, deployment(), opts)?;
    let mut rng = Rng(0x5eed_cafe_f00d_d00d);
    let mut pre = Pages::new(131_072 / PAGE);
    let mut dec = Pages::new(524_288 / PAGE);
    let mut ts: i64 = 1_700_000_000_000_000_000;
    let mut active: Vec<Active> = Vec::new();
    let mut next_id = 1u64;
    let mut events = 0u64;
    let ev = |pool, rid, op, start, count, tpos: Option<u32>, src| KvEvent {
        pool,
        seq: 0,
        ts_ns: 0,
        request_id: rid,
        op,
        slot_start: start,
        slot_count: count,
        token_pos: tpos,
        src,
    };
    let emit = |rec: &mut Recorder, mut e: KvEvent, ts: &mut i64, n: &mut u64| {
        *ts += 1_000;
        e.ts_ns = *ts;
        *n += 1;
        rec.kv(e)
    };
    while events < target || !active.is_empty() {
        // admit new requests while there is room
        while events < target && active.len() < 24 {
            let id = next_id;
            let bogus = id % 2000 == 0;
            let prompt = if bogus {
                140_000 + rng.below(20_000) as u32
            } else {
                let k = 6 + rng.below(7);
                64 + rng.below(1 << k) as u32
            };
            let out = if bogus { 4 } else { 8 + rng.below(56) as u32 };
            let prefilled = if bogus { 1 } else { prompt };
            let Some(dpages) = dec.alloc((prompt + out).div_ceil(PAGE)) else {
                break;
            };
            let Some(ppages) = pre.alloc(prefilled.div_ceil(PAGE)) else {
                dec.release(&dpages);
                break;
            };
            next_id += 1;
            let u = (rng.below(1000) as f64 / 1000.0).powi(3);
            let tenant = format!("tenant-{:02}", (u * 50.0) as u32);
            // prefill: alloc + write the prompt (or the 1-token placeholder)
            let mut last = 0;
            for (t, s, n) in runs(&ppages, 0, prefilled, u32::MAX) {
                emit(
                    &mut rec,
                    ev(0, id, Op::Alloc, s, n, None, None),
                    &mut ts,
                    &mut events,
                )?;
                last = emit(
                    &mut rec,
                    ev(0, id, Op::Write, s, n, Some(t), None),
                    &mut ts,
                    &mut events,
                )?;
            }
            // decode preallocates the full prompt + output, then the copy
            for (_, s, n) in runs(&dpages, 0, prompt + out, u32::MAX) {
                emit(
                    &mut rec,
                    ev(1, id, Op::Alloc, s, n, None, None),
                    &mut ts,
                    &mut events,
                )?;
            }
            let mut t = 0;
            while t < prefilled {
                let ss = slot(&ppages, t);
                let ds = slot(&dpages, t);
                let n = (PAGE - t % PAGE).min(prefilled - t);
                let src = Some(CopySrc {
                    pool: 0,
                    slot_start: ss,
                    seq: last,
                });
                emit(
                    &mut rec,
                    ev(1, id, Op::Write, ds, n, Some(t), src),
                    &mut ts,
                    &mut events,
                )?;
                t += n;
            }
            for (_, s, n) in runs(&ppages, 0, prefilled, u32::MAX) {
                emit(
                    &mut rec,
                    ev(0, id, Op::Free, s, n, None, None),
                    &mut ts,
                    &mut events,
                )?;
            }
            pre.release(&ppages);
            rec.request(RequestRecord {
                request_id: id,
                external_id: Some(format!("req-{id:08x}")),
                tenant,
                arrival_ns: ts,
                finish_ns: Some(ts + 1_000_000),
                prompt_tokens: prompt,
                prefilled_tokens: Some(prefilled),
                output_tokens: out,
                http_status: 200,
                finish_reason: Some(if bogus { "length" } else { "stop" }.into()),
                prefill_pool: Some(0),
                decode_pool: Some(1),
                prompt_hash: Some(kvtrail::schema::hash_tokens(&[id as u32, prompt])),
                output_hash: Some(kvtrail::schema::hash_tokens(&[id as u32, out])),
            })?;
            active.push(Active {
                id,
                prompt,
                out,
                step: 0,
                pages: dpages,
            });
        }
        // one decode step for every active request
        let mut i = 0;
        while i < active.len() {
            let a = &mut active[i];
            let pos = a.prompt + a.step;
            let s = slot(&a.pages, pos);
            emit(
                &mut rec,
                ev(1, a.id, Op::Write, s, 1, Some(pos), None),
                &mut ts,
                &mut events,
            )?;
            for (t, s, n) in runs(&a.pages, 0, pos + 1, 4 * PAGE) {
                emit(
                    &mut rec,
                    ev(1, a.id, Op::Read, s, n, Some(t), None),
                    &mut ts,
                    &mut events,
                )?;
            }
            a.step += 1;
            if a.step == a.out {
                let a = active.swap_remove(i);
                for (_, s, n) in runs(&a.pages, 0, a.prompt + a.out, u32::MAX) {
                    emit(
                        &mut rec,
                        ev(1, a.id, Op::Free, s, n, None, None),
                        &mut ts,
                        &mut events,
                    )?;
                }
                dec.release(&a.pages);
            } else {
                i += 1;
            }
        }
    }
    rec.close()?;
    Ok(())
}

fn trace_for(events: u64) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/bench")
        .join(format!("scope-{events}"));
    if !dir.join("trace.json").is_file()
        || !Trace::open(&dir)
            .map(|t| t.manifest.capture.complete)
            .unwrap_or(false)
    {
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!("generating {} ({events} events)...", dir.display());
        let t = Instant::now();
        generate(&dir, events).expect("generate");
        eprintln!("  done in {:.1}s", t.elapsed().as_secs_f64());
    }
    dir
}

/// CPU seconds (user + system, all threads) this process has used so far.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // fields after the command name: state is field 3; utime 14, stime 15
    let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The floor: decode every column of every kv file. Returns (wall s, CPU s, rows, slots).
fn plain_scan(dir: &Path) -> (f64, f64, u64, u64) {
    use arrow_array::cast::AsArray;
    use arrow_array::types::UInt32Type;
    let trace = Trace::open(dir).expect("trace");
    let t = Instant::now();
    let c0 = cpu_secs();
    let (mut rows, mut slots) = (0u64, 0u64);
    for f in &trace.kv_files {
        let file = std::fs::File::open(f).expect("open");
        let r = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .expect("parquet")
            .with_batch_size(64 * 1024)
            .build()
            .expect("reader");
        for b in r {
            let b = b.expect("batch");
            rows += b.num_rows() as u64;
            let c = b.column_by_name("slot_count").expect("slot_count");
            slots += c
                .as_primitive::<UInt32Type>()
                .values()
                .iter()
                .map(|&x| x as u64)
                .sum::<u64>();
        }
    }
    (t.elapsed().as_secs_f64(), cpu_secs() - c0, rows, slots)
}

struct ScopeRun {
    secs: f64,
    cpu: f64,
    events: u64,
    touches: u64,
    affected: u64,
    foreign: u64,
    vmhwm_kb: u64,
}

/// Runs scope in a child process (own VmHWM).
fn scope_child(dir: &Path) -> ScopeRun {
    let out = Command::new(std::env::current_exe().expect("exe"))
        .arg("--child-scope")
        .arg(dir)
        .output()
        .expect("child");
    let text = String::from_utf8_lossy(&out.stdout);
    let get = |k: &str| -> f64 {
        text.split_whitespace()
            .skip_while(|w| *w != k)
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "child output lacks {k}: {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
    };
    ScopeRun {
        secs: get("SECS"),
        cpu: get("CPU"),
        events: get("EVENTS") as u64,
        touches: get("TOUCHES") as u64,
        affected: get("AFFECTED") as u64,
        foreign: get("FOREIGN") as u64,
        vmhwm_kb: get("VMHWM_KB") as u64,
    }
}

/// Prints how long each phase of scope took (stderr of the child).
struct PhaseTimer(std::sync::Mutex<Option<(String, Instant)>>);

impl kvtrail::progress::Reporter for PhaseTimer {
    fn start(&self, name: &str, _total: u64) {
        *self.0.lock().expect("lock") = Some((name.to_string(), Instant::now()));
    }
    fn advance(&self, _: u64) {}
    fn finish(&self) {
        if let Some((n, t)) = self.0.lock().expect("lock").take() {
            let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
            let hwm = status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .unwrap_or("");
            eprintln!("  phase {n}: {:.3} s, {hwm}", t.elapsed().as_secs_f64());
        }
    }
}

fn child(dir: &Path) {
    let trace = Trace::open(dir).expect("trace");
    let t = Instant::now();
    let c0 = cpu_secs();
    let r = kvtrail::scope::scope(
        &trace,
        &kvtrail::lineage::LineageOptions::default(),
        &PhaseTimer(std::sync::Mutex::new(None)),
    )
    .expect("scope");
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_secs() - c0;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("0");
    println!(
        "SECS {secs} CPU {cpu} EVENTS {} TOUCHES {} AFFECTED {} FOREIGN {} VMHWM_KB {hwm}",
        r.counts.kv_events,
        r.counts.slot_touches,
        r.counts.affected_responses,
        r.counts.foreign_tokens
    );
}

/// Replay alone (no scope aggregation) with `backend`: (wall s, CPU s,
/// slot touches).
fn replay_only(dir: &Path, backend: &mut dyn Backend) -> (f64, f64, u64) {
    let trace = Trace::open(dir).expect("trace");
    let t = Instant::now();
    let c0 = cpu_secs();
    let out = kvtrail::lineage::run_with(
        &trace,
        backend,
        &kvtrail::lineage::LineageOptions::default(),
        &kvtrail::progress::NoReporter,
    )
    .expect("replay");
    (
        t.elapsed().as_secs_f64(),
        cpu_secs() - c0,
        out.counters.slot_touches,
    )
}

/// The paged CPU backend against the flat arrays it replaced, alternated,
/// best of 3 each: (paged wall, flat wall, paged CPU, flat CPU).
fn paged_vs_flat(dir: &Path) -> (f64, f64, f64, f64) {
    let (mut pw, mut fw, mut pc, mut fc) = (f64::MAX, f64::MAX, f64::MAX, f64::MAX);
    for _ in 0..3 {
        let p = replay_only(dir, &mut kvtrail::lineage::cpu::CpuBackend::new());
        let f = replay_only(dir, &mut flat_cpu::FlatCpuBackend::new());
        assert_eq!(p.2, f.2, "both backends replayed the same slot touches");
        pw = pw.min(p.0);
        fw = fw.min(f.0);
        pc = pc.min(p.1);
        fc = fc.min(f.1);
    }
    (pw, fw, pc, fc)
}

/// Runs the DuckDB lineage query; None when DuckDB is not installed.
fn duckdb(dir: &Path) -> Option<(f64, u64, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let py = root.join("target/venv-bench/bin/python");
    if !py.is_file() {
        eprintln!(
            "DuckDB baseline skipped: {} missing (python3 -m venv target/venv-bench && target/venv-bench/bin/pip install duckdb)",
            py.display()
        );
        return None;
    }
    let out = Command::new(py)
        .arg(root.join("bench/duckdb_lineage.py"))
        .arg(dir)
        .output()
        .expect("python");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let secs = text
        .split_whitespace()
        .skip_while(|w| *w != "SECS")
        .nth(1)?
        .parse()
        .ok()?;
    let foreign = text
        .split_whitespace()
        .skip_while(|w| *w != "FOREIGN")
        .nth(1)?
        .parse()
        .ok()?;
    if !out.status.success() {
        eprintln!("duckdb failed: {}", String::from_utf8_lossy(&out.stderr));
        return None;
    }
    Some((secs, foreign, text))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child-scope") {
        child(Path::new(&args[2]));
        return;
    }
    let big: u64 = args
        .get(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000_000);
    let small: u64 = args
        .get(2)
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!("bench_scope: {cores} cores");
    let mut rows = Vec::new();
    for n in [small, big] {
        let dir = trace_for(n);
        let _ = plain_scan(&dir); // warm the page cache
        // best of 3 (the machine is shared): lowest wall time
        let (scan_s, scan_cpu, scan_rows, scan_slots) = (0..3)
            .map(|_| plain_scan(&dir))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .expect("runs");
        let sc = (0..3)
            .map(|_| scope_child(&dir))
            .min_by(|a, b| a.secs.total_cmp(&b.secs))
            .expect("runs");
        assert_eq!(sc.events, scan_rows, "scope and the scan saw the same rows");
        assert_eq!(sc.touches, scan_slots);
        println!(
            "\ntrace {} : {} kv events, {} slot touches",
            dir.display(),
            sc.events,
            sc.touches
        );
        println!(
            "  plain parquet scan : {:>8.2} s wall {:>7.2} s CPU  {:>12.0} events/s",
            scan_s,
            scan_cpu,
            scan_rows as f64 / scan_s
        );
        println!(
            "  kvtrail scope      : {:>8.2} s wall {:>7.2} s CPU  {:>12.0} events/s  {:>14.0} slot touches/s  peak RSS {} MB  ({} affected responses, {} foreign tokens)",
            sc.secs,
            sc.cpu,
            sc.events as f64 / sc.secs,
            sc.touches as f64 / sc.secs,
            sc.vmhwm_kb / 1024,
            sc.affected,
            sc.foreign
        );
        println!(
            "  scope / scan       : {:>8.2}x wall, {:.2}x CPU (target <= 3x)",
            sc.secs / scan_s,
            sc.cpu / scan_cpu.max(0.01)
        );
        let (pw, fw, pc, fc) = paged_vs_flat(&dir);
        println!(
            "  replay, paged slots: {pw:>8.2} s wall {pc:>7.2} s CPU; flat arrays {fw:.2} s wall {fc:.2} s CPU"
        );
        println!(
            "  paged / flat       : {:>8.3}x wall, {:.3}x CPU (target <= 1.10x)",
            pw / fw,
            pc / fc.max(0.01)
        );
        rows.push((n, sc));
    }
    let (small_n, small_sc) = &rows[0];
    let (big_n, big_sc) = &rows[1];
    println!(
        "\npeak RSS: {} MB at {} events, {} MB at {} events (x{:.2} for x{:.1} events)",
        small_sc.vmhwm_kb / 1024,
        small_n,
        big_sc.vmhwm_kb / 1024,
        big_n,
        big_sc.vmhwm_kb as f64 / small_sc.vmhwm_kb.max(1) as f64,
        big_sc.events as f64 / small_sc.events.max(1) as f64
    );
    if std::env::var_os("BENCH_NO_DUCKDB").is_some() {
        return;
    }
    if let Some((duck_s, duck_foreign, _)) = duckdb(&trace_for(*small_n)) {
        let ratio = duck_s / small_sc.secs;
        let extrapolated = duck_s * big_sc.events as f64 / small_sc.events as f64;
        println!(
            "\nDuckDB lineage SQL on the {} -event slice: {:.2} s ({} foreign reader-slots; scope found {})",
            small_sc.events, duck_s, duck_foreign, small_sc.foreign
        );
        println!("  DuckDB / scope on the slice : {ratio:.1}x (target >= 50x)");
        println!(
            "  DuckDB at {} events, extrapolated linearly: {:.0} s -> {:.1}x scope's {:.2} s",
            big_sc.events,
            extrapolated,
            extrapolated / big_sc.secs,
            big_sc.secs
        );
    }
}
