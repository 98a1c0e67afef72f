//! The worst shape for a per-event record table (one record per slot):
//! every request's context is written one token per event, and each decode
//! step writes one slot and reads the request's whole context.
//!
//! One Mixed pool (page size 1). `REQUESTS` requests, each with a context
//! of 2,000-8,000 tokens: the first `context - STEPS` tokens are written
//! one per event (a token-by-token prefill, no reads), the last `STEPS`
//! are decode steps (write one slot, read the whole context so far).
//! `WINDOW` requests run at once, round robin, one token each per turn, so
//! neighbouring slots of a request were written by far-apart events.
//!
//! `cargo run --release --example bench_tokens -- DIR [REQUESTS] [STEPS]`
//! (defaults 2,000 and 64) writes the trace into DIR, a new folder; time
//! scope on it with `bench_threads --child THREADS DIR`. With the
//! defaults: 10.15M events, 667M slot touches (docs/replay-and-scope.md,
//! "Slot state: measured alternatives").

use std::collections::VecDeque;
use std::path::Path;

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{KvEvent, Op, RequestRecord};
use kvtrail::trace::{Deployment, Pool, Role};

const WINDOW: usize = 32;
const CAPACITY: u64 = 1 << 20;

#[path = "support/synth.rs"]
#[allow(dead_code)]
mod synth;
use synth::Rng;

struct Active {
    id: u64,
    start: u32,
    len: u32,
    done: u32,
}

fn generate(dir: &Path, requests: u64, steps: u32) -> kvtrail::Result<u64> {
    let deployment = Deployment {
        name: "bench / token-by-token decode".into(),
        engine: "synthetic".into(),
        context_window: 8192,
        pools: vec![Pool {
            id: 0,
            name: "kv".into(),
            role: Role::Mixed,
            capacity_tokens: CAPACITY,
            page_size: 1,
            extra: Default::default(),
        }],
        prefix_cache_scope: None,
        extra: Default::default(),
    };
    let opts = RecorderOptions {
        started_ns: Some(1_700_000_000_000_000_000),
        ..Default::default()
    };
    let mut rec = Recorder::create(dir, deployment, opts)?;
    let mut rng = Rng(0x746f_6b65_6e73_0001);
    let ts = std::cell::Cell::new(1_700_000_000_000_000_000i64);
    let n_events = std::cell::Cell::new(0u64);
    let emit = |rec: &mut Recorder, rid: u64, op: Op, start: u32, count: u32, pos| {
        ts.set(ts.get() + 1_000);
        n_events.set(n_events.get() + 1);
        rec.kv(KvEvent {
            pool: 0,
            seq: 0,
            ts_ns: ts.get(),
            request_id: rid,
            op,
            slot_start: start,
            slot_count: count,
            token_pos: pos,
            src: None,
        })
        .map(|_| ())
    };
    let mut next_slot = 0u32;
    let mut next_id = 1u64;
    let mut active: VecDeque<Active> = VecDeque::new();
    loop {
        while active.len() < WINDOW && next_id <= requests {
            let len = 2000 + rng.below(6001) as u32;
            if next_slot as u64 + len as u64 > CAPACITY {
                next_slot = 0;
            }
            let a = Active {
                id: next_id,
                start: next_slot,
                len,
                done: 0,
            };
            next_slot += len;
            next_id += 1;
            emit(&mut rec, a.id, Op::Alloc, a.start, a.len, None)?;
            active.push_back(a);
        }
        if active.is_empty() {
            break;
        }
        // One turn: every active request writes its next token.
        let mut i = 0;
        while i < active.len() {
            let a = &mut active[i];
            let p = a.done;
            emit(&mut rec, a.id, Op::Write, a.start + p, 1, Some(p))?;
            a.done += 1;
            if a.done + steps > a.len {
                emit(&mut rec, a.id, Op::Read, a.start, a.done, Some(0))?;
            }
            if a.done == a.len {
                let a = active.remove(i).expect("active");
                emit(&mut rec, a.id, Op::Free, a.start, a.len, None)?;
                rec.request(RequestRecord {
                    request_id: a.id,
                    external_id: Some(format!("req-{:08x}", a.id)),
                    tenant: "tenant-00".into(),
                    arrival_ns: ts.get(),
                    finish_ns: Some(ts.get() + 1_000_000),
                    prompt_tokens: a.len - steps,
                    prefilled_tokens: Some(a.len - steps),
                    output_tokens: steps,
                    http_status: 200,
                    finish_reason: Some("stop".into()),
                    prefill_pool: Some(0),
                    decode_pool: Some(0),
                    prompt_hash: None,
                    output_hash: None,
                })?;
            } else {
                i += 1;
            }
        }
    }
    rec.close()?;
    Ok(n_events.get())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = Path::new(
        args.get(1)
            .expect("usage: bench_tokens DIR [REQUESTS] [STEPS]"),
    );
    let requests = args.get(2).map_or(2000, |s| s.parse().expect("requests"));
    let steps = args.get(3).map_or(64, |s| s.parse().expect("steps"));
    if dir.exists() {
        eprintln!(
            "bench_tokens: {} exists: name a new folder (nothing is overwritten)",
            dir.display()
        );
        std::process::exit(2);
    }
    let t = std::time::Instant::now();
    let n = generate(dir, requests, steps).expect("generate");
    println!(
        "wrote {n} events ({requests} requests, {steps} decode steps) to {} in {:.1}s",
        dir.display(),
        t.elapsed().as_secs_f64()
    );
}
