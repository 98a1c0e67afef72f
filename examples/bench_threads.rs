//! Benchmark of `scope` on every core, in one run over one trace:
//!
//! - scope on 1 thread pinned to one core (`taskset -c 0`), on 1 thread
//!   unpinned, and on 2 threads (`LineageOptions::threads`, as
//!   `kvtrail scope --threads N`), each in a child process of its own (its
//!   own peak RSS), alternated, the median of 5 by wall time; the reports must be
//!   byte-identical (blake3 of the JSON report);
//! - the floor: a bare single-thread flat-array sweep over the same kv
//!   files (Parquet decoded on the same thread, one owner array per pool,
//!   a write sets the owner, a read counts the slots another request owns:
//!   no shares, copies, stale content or holes);
//! - the DuckDB lineage query a responder writes (`bench/duckdb_lineage.py`:
//!   unnest the extents, ASOF JOIN reads to the last write), when the SQL
//!   venv of `.ci/setup.d/50-sql.sh` is there (`KVTRAIL_SQL_VENV`, else
//!   `~/.cache/kvtrail/venv-sql`); `BENCH_NO_DUCKDB=1` skips it.
//!
//! The trace is synthetic, written with the Recorder: `GROUPS` PD pairs
//! (prefill pool 2g copies to decode pool 2g+1), requests dealt to the
//! pairs in turn, long-tailed prompts, decode steps that append one token
//! and read the whole context in extents of up to 8 pages of 64 slots
//! (long extents), and a placeholder request now and then whose decode
//! reads stale KV of earlier requests (the incident).
//!
//! With `pd [REQUESTS]` the trace is the PD shape instead (`support/pd.rs`):
//! one prefill and one decode pool, every request's KV copied across, so
//! the two pools are one copy-connected group; one kv file.
//!
//! Every kind runs 5 times, alternated, and the median by wall time is
//! reported, with its user and system CPU time. Every figure is printed
//! with the load average (`/proc/loadavg`) at the time it was taken: on a
//! shared machine the ratios are what to read.
//!
//! Run: `cargo run --release --example bench_threads -- [EVENTS] [GROUPS]`
//! (defaults 900000 and 2), or `-- pd [REQUESTS]` (default 100000).
//! Traces are cached under target/bench/.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord};
use kvtrail::trace::{Deployment, Pool, Role, Trace};

#[path = "support/pd.rs"]
mod pd;
#[path = "support/synth.rs"]
mod synth;
use synth::{PAGE, Pages, Rng, runs, slot};

const PREFILL_SLOTS: u64 = 262_144;
const DECODE_SLOTS: u64 = 1_048_576;
/// Longest read extent (8 pages).
const READ_MAX: u32 = 8 * PAGE;
/// Requests in decode at once, per PD pair.
const ACTIVE: usize = 16;
/// Runs of each kind (the median is reported).
const ROUNDS: usize = 5;

fn deployment(groups: u16) -> Deployment {
    let mut pools = Vec::new();
    for g in 0..groups {
        for (id, role, cap, name) in [
            (2 * g, Role::Prefill, PREFILL_SLOTS, "prefill"),
            (2 * g + 1, Role::Decode, DECODE_SLOTS, "decode"),
        ] {
            pools.push(Pool {
                id,
                name: format!("{name}-{g}"),
                role,
                capacity_tokens: cap,
                page_size: PAGE,
                extra: Default::default(),
            });
        }
    }
    Deployment {
        name: "bench / synthetic PD pairs".into(),
        engine: "sglang-0.5.19 (synthetic)".into(),
        context_window: 262_144,
        pools,
        prefix_cache_scope: None,
        extra: Default::default(),
    }
}

struct Active {
    id: u64,
    prompt: u32,
    out: u32,
    step: u32,
    pages: Vec<u32>,
}

/// One PD pair's allocators and requests in decode.
struct Group {
    pre: Pages,
    dec: Pages,
    active: Vec<Active>,
}

/// Writes a trace of about `target` kv events over `groups` PD pairs.
fn generate(dir: &Path, target: u64, groups: u16) -> kvtrail::Result<()> {
    let opts = RecorderOptions {
        started_ns: Some(1_700_000_000_000_000_000),
        ..Default::default()
    };
    let mut rec = Recorder::create(dir, deployment(groups), opts)?;
    let mut rng = Rng(0x7472_6561_6473_0001);
    let mut gs: Vec<Group> = (0..groups)
        .map(|_| Group {
            pre: Pages::new((PREFILL_SLOTS / PAGE as u64) as u32),
            dec: Pages::new((DECODE_SLOTS / PAGE as u64) as u32),
            active: Vec::new(),
        })
        .collect();
    let ts = std::cell::Cell::new(1_700_000_000_000_000_000i64);
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
    let emit = |rec: &mut Recorder, mut e: KvEvent, n: &mut u64| {
        ts.set(ts.get() + 1_000);
        e.ts_ns = ts.get();
        *n += 1;
        rec.kv(e)
    };
    while events < target || gs.iter().any(|g| !g.active.is_empty()) {
        for (gi, g) in gs.iter_mut().enumerate() {
            let (pp, dp) = (2 * gi as u16, 2 * gi as u16 + 1);
            while events < target && g.active.len() < ACTIVE {
                let id = next_id;
                let bogus = id % 1500 == 0;
                let prompt = if bogus {
                    60_000 + rng.below(20_000) as u32
                } else {
                    let k = 7 + rng.below(7);
                    128 + rng.below(1 << k) as u32
                };
                let out = if bogus { 4 } else { 8 + rng.below(40) as u32 };
                let prefilled = if bogus { 1 } else { prompt };
                let Some(dpages) = g.dec.alloc((prompt + out).div_ceil(PAGE)) else {
                    break;
                };
                let Some(ppages) = g.pre.alloc(prefilled.div_ceil(PAGE)) else {
                    g.dec.release(&dpages);
                    break;
                };
                next_id += 1;
                let tenant = format!("tenant-{:02}", rng.below(40));
                let mut last = 0;
                for (t, s, n) in runs(&ppages, 0, prefilled, u32::MAX) {
                    emit(
                        &mut rec,
                        ev(pp, id, Op::Alloc, s, n, None, None),
                        &mut events,
                    )?;
                    last = emit(
                        &mut rec,
                        ev(pp, id, Op::Write, s, n, Some(t), None),
                        &mut events,
                    )?;
                }
                for (_, s, n) in runs(&dpages, 0, prompt + out, u32::MAX) {
                    emit(
                        &mut rec,
                        ev(dp, id, Op::Alloc, s, n, None, None),
                        &mut events,
                    )?;
                }
                // The transfer: one copy per contiguous run of both sides.
                let mut t = 0;
                while t < prefilled {
                    let (ss, ds) = (slot(&ppages, t), slot(&dpages, t));
                    let n = (PAGE - t % PAGE).min(prefilled - t);
                    let src = Some(CopySrc {
                        pool: pp,
                        slot_start: ss,
                        seq: last,
                    });
                    emit(
                        &mut rec,
                        ev(dp, id, Op::Write, ds, n, Some(t), src),
                        &mut events,
                    )?;
                    t += n;
                }
                for (_, s, n) in runs(&ppages, 0, prefilled, u32::MAX) {
                    emit(
                        &mut rec,
                        ev(pp, id, Op::Free, s, n, None, None),
                        &mut events,
                    )?;
                }
                g.pre.release(&ppages);
                rec.request(RequestRecord {
                    request_id: id,
                    external_id: Some(format!("req-{id:08x}")),
                    tenant,
                    arrival_ns: ts.get(),
                    finish_ns: Some(ts.get() + 1_000_000),
                    prompt_tokens: prompt,
                    prefilled_tokens: Some(prefilled),
                    output_tokens: out,
                    http_status: 200,
                    finish_reason: Some(if bogus { "length" } else { "stop" }.into()),
                    prefill_pool: Some(pp),
                    decode_pool: Some(dp),
                    prompt_hash: Some(kvtrail::schema::hash_tokens(&[id as u32, prompt])),
                    output_hash: Some(kvtrail::schema::hash_tokens(&[id as u32, out])),
                })?;
                g.active.push(Active {
                    id,
                    prompt,
                    out,
                    step: 0,
                    pages: dpages,
                });
            }
            // One decode step of every request of this pair.
            let mut i = 0;
            while i < g.active.len() {
                let a = &mut g.active[i];
                let pos = a.prompt + a.step;
                let s = slot(&a.pages, pos);
                emit(
                    &mut rec,
                    ev(dp, a.id, Op::Write, s, 1, Some(pos), None),
                    &mut events,
                )?;
                for (t, s, n) in runs(&a.pages, 0, pos + 1, READ_MAX) {
                    emit(
                        &mut rec,
                        ev(dp, a.id, Op::Read, s, n, Some(t), None),
                        &mut events,
                    )?;
                }
                a.step += 1;
                if a.step == a.out {
                    let a = g.active.swap_remove(i);
                    for (_, s, n) in runs(&a.pages, 0, a.prompt + a.out, u32::MAX) {
                        emit(
                            &mut rec,
                            ev(dp, a.id, Op::Free, s, n, None, None),
                            &mut events,
                        )?;
                    }
                    g.dec.release(&a.pages);
                } else {
                    i += 1;
                }
            }
        }
    }
    rec.close()?;
    Ok(())
}

/// The trace of `events` events over `groups` PD pairs, or with `pd` of
/// the PD shape with `events` requests; generated once.
fn trace_for(events: u64, groups: u16, pd: bool) -> PathBuf {
    let name = if pd {
        format!("pd-{events}")
    } else {
        format!("threads-{events}-{groups}")
    };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/bench")
        .join(name);
    let complete = Trace::open(&dir)
        .map(|t| t.manifest.capture.complete)
        .unwrap_or(false);
    if !complete {
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!("generating {} ({events} events)...", dir.display());
        let t = Instant::now();
        if pd {
            pd::generate(&dir, events).expect("generate");
        } else {
            generate(&dir, events, groups).expect("generate");
        }
        eprintln!("  done in {:.1}s", t.elapsed().as_secs_f64());
    }
    dir
}

/// CPU seconds (user, system; all threads) this process has used so far.
fn cpu_secs() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) / 100.0, ticks(12) / 100.0)
}

/// The 1-minute load average now.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

fn vmhwm_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// One measured run.
#[derive(Clone)]
struct Run {
    secs: f64,
    cpu: f64,
    sys: f64,
    vmhwm_kb: u64,
    load: String,
    /// What the run found: scope's report digest, or the floor's count.
    answer: String,
    touches: u64,
    foreign: u64,
}

/// The floor: one pass over every kv file on this thread, flat owner
/// arrays per pool; returns (rows, slot touches, foreign read slots).
fn floor_sweep(dir: &Path) -> (u64, u64, u64) {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{UInt16Type, UInt32Type, UInt64Type};
    use parquet::arrow::ProjectionMask;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let trace = Trace::open(dir).expect("trace");
    let mut owners: HashMap<u16, Vec<u64>> = trace
        .deployment()
        .pools
        .iter()
        .map(|p| (p.id, vec![u64::MAX; p.capacity_tokens as usize]))
        .collect();
    let (mut rows, mut touches, mut foreign) = (0u64, 0u64, 0u64);
    for f in &trace.kv_files {
        let file = std::fs::File::open(f).expect("open");
        let b = ParquetRecordBatchReaderBuilder::try_new(file).expect("parquet");
        let cols = ["pool", "op", "request_id", "slot_start", "slot_count"];
        let schema = b.parquet_schema();
        let idx: Vec<usize> = (0..schema.num_columns())
            .filter(|&i| cols.contains(&schema.column(i).name()))
            .collect();
        let mask = ProjectionMask::leaves(schema, idx);
        let r = b
            .with_projection(mask)
            .with_batch_size(64 * 1024)
            .build()
            .expect("reader");
        for batch in r {
            let batch = batch.expect("batch");
            let col = |n: &str| batch.column_by_name(n).expect(n).clone();
            let pool = col("pool");
            let pool = pool.as_primitive::<UInt16Type>().values();
            let rid = col("request_id");
            let rid = rid.as_primitive::<UInt64Type>().values();
            let start = col("slot_start");
            let start = start.as_primitive::<UInt32Type>().values();
            let count = col("slot_count");
            let count = count.as_primitive::<UInt32Type>().values();
            let op = col("op");
            let op = op.as_string::<i32>();
            let mut cur = (u16::MAX, None::<&mut Vec<u64>>);
            for i in 0..batch.num_rows() {
                rows += 1;
                let n = count[i] as usize;
                touches += n as u64;
                if cur.0 != pool[i] {
                    cur = (pool[i], owners.get_mut(&pool[i]));
                }
                let Some(o) = cur.1.as_deref_mut() else {
                    continue;
                };
                let a = start[i] as usize;
                // The contract's op names: only `write` starts with w and
                // only `read` with r.
                match op.value(i).as_bytes().first() {
                    Some(b'w') => o[a..a + n].fill(rid[i]),
                    Some(b'r') => {
                        let r = rid[i];
                        foreign += o[a..a + n]
                            .iter()
                            .map(|&w| (w != r && w != u64::MAX) as u64)
                            .sum::<u64>();
                    }
                    _ => {}
                }
            }
        }
    }
    (rows, touches, foreign)
}

/// Runs one measurement in a child process: `floor`, or scope on
/// `threads` threads, pinned to CPU 0 with `pin`.
fn child(dir: &Path, what: &str, pin: bool) -> Run {
    let exe = std::env::current_exe().expect("exe");
    let mut cmd = if pin {
        let mut c = Command::new("taskset");
        c.arg("-c").arg("0").arg(exe);
        c
    } else {
        Command::new(exe)
    };
    let load = load();
    let out = cmd
        .arg("--child")
        .arg(what)
        .arg(dir)
        .output()
        .expect("child");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let get = |k: &str| -> String {
        text.split_whitespace()
            .skip_while(|w| *w != k)
            .nth(1)
            .map(str::to_string)
            .unwrap_or_else(|| {
                panic!(
                    "child {what} output lacks {k}: {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
    };
    let num = |k: &str| get(k).parse::<f64>().expect("number");
    Run {
        secs: num("SECS"),
        cpu: num("CPU"),
        sys: num("SYS"),
        vmhwm_kb: num("VMHWM_KB") as u64,
        load,
        answer: get("ANSWER"),
        touches: num("TOUCHES") as u64,
        foreign: num("FOREIGN") as u64,
    }
}

fn child_main(what: &str, dir: &Path) {
    let t = Instant::now();
    let (u0, s0) = cpu_secs();
    let (answer, touches, foreign) = if what == "floor" {
        let (rows, touches, foreign) = floor_sweep(dir);
        (format!("rows={rows}"), touches, foreign)
    } else {
        let threads: usize = what.parse().expect("threads");
        let trace = Trace::open(dir).expect("trace");
        let opts = kvtrail::lineage::LineageOptions {
            backend: kvtrail::lineage::BackendChoice::Cpu,
            threads,
            ..Default::default()
        };
        let r =
            kvtrail::scope::scope(&trace, &opts, &kvtrail::progress::NoReporter).expect("scope");
        let digest = blake3::hash(kvtrail::report::to_json(&r).as_bytes()).to_hex();
        (
            digest[..16].to_string(),
            r.counts.slot_touches,
            r.counts.foreign_tokens,
        )
    };
    let (u1, s1) = cpu_secs();
    println!(
        "SECS {} CPU {} SYS {} VMHWM_KB {} ANSWER {answer} TOUCHES {touches} FOREIGN {foreign}",
        t.elapsed().as_secs_f64(),
        (u1 - u0) + (s1 - s0),
        s1 - s0,
        vmhwm_kb()
    );
}

/// The DuckDB lineage query on the trace: (seconds, foreign reader-slots),
/// or None without the SQL venv.
fn duckdb(dir: &Path) -> Option<(f64, u64, String)> {
    if std::env::var_os("BENCH_NO_DUCKDB").is_some() {
        return None;
    }
    let venv = std::env::var_os("KVTRAIL_SQL_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvtrail/venv-sql"))
        })?;
    let py = venv.join("bin/python");
    if !py.is_file() {
        println!(
            "DuckDB: skipped, {} missing (.ci/setup.d/50-sql.sh builds it)",
            py.display()
        );
        return None;
    }
    let load = load();
    let out = Command::new(py)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/duckdb_lineage.py"))
        .arg(dir)
        .output()
        .expect("python");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() {
        println!(
            "DuckDB: failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    let field = |k: &str| {
        text.split_whitespace()
            .skip_while(|w| *w != k)
            .nth(1)
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((field("SECS")?, field("FOREIGN")? as u64, load))
}

fn line(name: &str, r: &Run) {
    println!(
        "  {name:<28} {:>7.3} s wall {:>7.3} s CPU ({:.3} s sys)  peak RSS {:>5} MB  load {:>5}  [{}]",
        r.secs,
        r.cpu,
        r.sys,
        r.vmhwm_kb / 1024,
        r.load,
        r.answer
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        child_main(&args[2], Path::new(&args[3]));
        return;
    }
    let pd = args.get(1).map(String::as_str) == Some("pd");
    let args = &args[pd as usize..];
    let default = if pd { 100_000 } else { 900_000 };
    let events: u64 = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(default);
    let groups: u16 = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(2);
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let dir = trace_for(events, groups, pd);
    let _ = child(&dir, "floor", false); // warm the page cache
    // Alternated rounds; the median by wall time of each kind.
    let kinds: [(&str, &str, bool); 4] = [
        ("floor (1 thread, 1 core)", "floor", true),
        ("scope --threads 1, 1 core", "1", true),
        ("scope --threads 1", "1", false),
        ("scope --threads 2", "2", false),
    ];
    let mut all: Vec<Vec<Run>> = vec![Vec::new(); kinds.len()];
    for _ in 0..ROUNDS {
        for (i, &(_, what, pin)) in kinds.iter().enumerate() {
            all[i].push(child(&dir, what, pin));
        }
    }
    let best: Vec<Run> = all
        .into_iter()
        .map(|mut v| {
            v.sort_by(|a, b| a.secs.total_cmp(&b.secs));
            v.swap_remove(v.len() / 2)
        })
        .collect();
    let (floor, s1p, s1, s2) = (&best[0], &best[1], &best[2], &best[3]);
    let trace = Trace::open(&dir).expect("trace");
    println!(
        "bench_threads: {cores} cores; trace {}: {} pools, {} kv files, {} slot touches, {} foreign read slots",
        dir.display(),
        trace.deployment().pools.len(),
        trace.kv_files.len(),
        s1.touches,
        s1.foreign
    );
    for (i, r) in best.iter().enumerate() {
        line(kinds[i].0, r);
    }
    assert_eq!(
        s1.answer, s2.answer,
        "scope's report differs between 1 and 2 threads"
    );
    assert_eq!(s1.answer, s1p.answer);
    assert_eq!(
        floor.touches, s1.touches,
        "the floor saw the same slot touches"
    );
    println!("  reports byte-identical at 1 and 2 threads: yes");
    println!(
        "  speed-up 1 -> 2 threads    : {:.2}x wall from 1 pinned core (load {} / {}), {:.2}x from 1 thread unpinned (target >= 1.7x)",
        s1p.secs / s2.secs,
        s1p.load,
        s2.load,
        s1.secs / s2.secs
    );
    println!(
        "  scope / floor              : {:.2}x wall on 1 core, {:.2}x wall on 2 threads; per core (wall x threads / floor): {:.2}x (target <= 2x); CPU {:.2}x",
        s1p.secs / floor.secs,
        s2.secs / floor.secs,
        s2.secs * 2.0 / floor.secs,
        s2.cpu / floor.cpu.max(0.001)
    );
    if let Some((secs, foreign, load)) = duckdb(&dir) {
        println!(
            "  DuckDB lineage query       : {secs:>7.3} s wall (load {load}; {foreign} foreign reader-slots, scope {} foreign tokens)",
            s2.foreign
        );
        println!(
            "  DuckDB / scope             : {:.1}x scope on 2 threads, {:.1}x on 1 core (target >= 100x)",
            secs / s2.secs,
            secs / s1p.secs
        );
    }
}
