//! A prefill-to-decode (PD) trace of the shape a PD deployment records:
//! two pools that every request's KV crosses, so the pools form one
//! copy-connected group.
//!
//! Every request allocates, writes and frees a prefill extent of a few
//! hundred slots and copies it to a decode extent, where it is read,
//! extended by a short output and read again, then freed: nine events a
//! request. Requests overlap in decode (`DECODE_WINDOW` of them at once),
//! so the decode pool's stream holds a copy every few events. Now and then
//! a placeholder request copies one slot only and reads its whole extent:
//! it reads the stale KV an earlier request left in the decode slots (the
//! incident).
//!
//! All events go to one kv file (both pools, in the order they happened),
//! as an engine-side exporter writes them; the manifest lists no kv files
//! (`files` is optional).

use std::path::Path;

use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord};
use kvtrail::trace::{Deployment, Pool, Role};

use super::synth::Rng;

/// The seed incident's pools and context window.
pub const PREFILL_SLOTS: u64 = 681_280;
pub const DECODE_SLOTS: u64 = 2_097_152;
pub const CONTEXT: u64 = 1_048_576;
/// Requests in decode at once.
pub const DECODE_WINDOW: usize = 64;
/// One request in this many is a placeholder that reads stale KV.
pub const PLACEHOLDER_EVERY: u64 = 1000;

fn deployment() -> Deployment {
    let pool = |id, role, cap, name: &str| Pool {
        id,
        name: name.into(),
        role,
        capacity_tokens: cap,
        page_size: 1,
        extra: Default::default(),
    };
    Deployment {
        name: "bench / synthetic PD pair".into(),
        engine: "sglang-0.5.19 (synthetic)".into(),
        context_window: CONTEXT,
        pools: vec![
            pool(0, Role::Prefill, PREFILL_SLOTS, "prefill"),
            pool(1, Role::Decode, DECODE_SLOTS, "decode"),
        ],
        prefix_cache_scope: None,
        extra: Default::default(),
    }
}

/// A bump allocator of contiguous extents that wraps to slot 0.
struct Ring {
    next: u32,
    cap: u32,
}

impl Ring {
    fn alloc(&mut self, n: u32) -> u32 {
        if self.next as u64 + n as u64 > self.cap as u64 {
            self.next = 0;
        }
        let s = self.next;
        self.next += n;
        s
    }
}

/// A request in decode: id, decode extent start, prompt and output length.
struct InDecode {
    id: u64,
    start: u32,
    prompt: u32,
    out: u32,
}

/// Writes the PD trace of `requests` requests into `dir`.
pub fn generate(dir: &Path, requests: u64) -> kvtrail::Result<()> {
    let opts = RecorderOptions {
        started_ns: Some(1_700_000_000_000_000_000),
        ..Default::default()
    };
    let mut rec = Recorder::create(dir, deployment(), opts)?;
    let mut rng = Rng(0x7064_7472_6163_6501);
    let mut pre = Ring {
        next: 0,
        cap: PREFILL_SLOTS as u32,
    };
    let mut dec = Ring {
        next: 0,
        cap: DECODE_SLOTS as u32,
    };
    let ts = std::cell::Cell::new(1_700_000_000_000_000_000i64);
    let mut all: Vec<KvEvent> = Vec::with_capacity(requests as usize * 9);
    let mut emit = |rec: &mut Recorder,
                    pool: u16,
                    rid: u64,
                    op: Op,
                    (start, count): (u32, u32),
                    token_pos: Option<u32>,
                    src: Option<CopySrc>|
     -> kvtrail::Result<u64> {
        ts.set(ts.get() + 1_000);
        let mut e = KvEvent {
            pool,
            seq: 0,
            ts_ns: ts.get(),
            request_id: rid,
            op,
            slot_start: start,
            slot_count: count,
            token_pos,
            src,
        };
        e.seq = rec.kv(e)?;
        all.push(e);
        Ok(e.seq)
    };
    let mut active = std::collections::VecDeque::new();
    for id in 1..=requests {
        let prompt = 128 + rng.below(320) as u32;
        let out = 16 + rng.below(48) as u32;
        let placeholder = id % PLACEHOLDER_EVERY == 0;
        let prefilled = if placeholder { 1 } else { prompt };
        let ps = pre.alloc(prefilled);
        emit(&mut rec, 0, id, Op::Alloc, (ps, prefilled), None, None)?;
        let last = emit(&mut rec, 0, id, Op::Write, (ps, prefilled), Some(0), None)?;
        emit(&mut rec, 0, id, Op::Free, (ps, prefilled), None, None)?;
        let ds = dec.alloc(prompt + out);
        emit(&mut rec, 1, id, Op::Alloc, (ds, prompt + out), None, None)?;
        let src = CopySrc {
            pool: 0,
            slot_start: ps,
            seq: last,
        };
        emit(
            &mut rec,
            1,
            id,
            Op::Write,
            (ds, prefilled),
            Some(0),
            Some(src),
        )?;
        emit(&mut rec, 1, id, Op::Read, (ds, prompt), Some(0), None)?;
        rec.request(RequestRecord {
            request_id: id,
            external_id: Some(format!("req-{id:08x}")),
            tenant: format!("tenant-{:02}", rng.below(40)),
            arrival_ns: ts.get(),
            finish_ns: Some(ts.get() + 1_000_000),
            prompt_tokens: prompt,
            prefilled_tokens: Some(prefilled),
            output_tokens: out,
            http_status: 200,
            finish_reason: Some(if placeholder { "length" } else { "stop" }.into()),
            prefill_pool: Some(0),
            decode_pool: Some(1),
            prompt_hash: Some(kvtrail::schema::hash_tokens(&[id as u32, prompt])),
            output_hash: Some(kvtrail::schema::hash_tokens(&[id as u32, out])),
        })?;
        active.push_back(InDecode {
            id,
            start: ds,
            prompt,
            out,
        });
        while active.len() > DECODE_WINDOW || (id == requests && !active.is_empty()) {
            let a = active.pop_front().expect("a request in decode");
            let all_n = a.prompt + a.out;
            emit(
                &mut rec,
                1,
                a.id,
                Op::Write,
                (a.start + a.prompt, a.out),
                Some(a.prompt),
                None,
            )?;
            emit(&mut rec, 1, a.id, Op::Read, (a.start, all_n), Some(0), None)?;
            emit(&mut rec, 1, a.id, Op::Free, (a.start, all_n), None, None)?;
        }
    }
    rec.close()?;
    one_kv_file(dir, &all)
}

/// Replaces the recorder's per-pool kv files with one file of every event
/// in the order they happened, and drops them from the manifest's list.
fn one_kv_file(dir: &Path, events: &[KvEvent]) -> kvtrail::Result<()> {
    let io = |p: &Path, e| kvtrail::Error::io(p, e);
    let kv = dir.join("kv");
    std::fs::remove_dir_all(&kv).map_err(|e| io(&kv, e))?;
    let batches: Vec<_> = events
        .chunks(64 * 1024)
        .map(kvtrail::trace::write::kv_batch)
        .collect();
    kvtrail::trace::write::write_single_file(&kv.join("part-00000.parquet"), &batches)?;
    let manifest = dir.join("trace.json");
    let text = std::fs::read_to_string(&manifest).map_err(|e| io(&manifest, e))?;
    let mut m: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| kvtrail::Error::Other(e.to_string()))?;
    if let Some(files) = m.get_mut("files").and_then(|f| f.as_array_mut()) {
        files.retain(|f| {
            f.get("path")
                .and_then(|p| p.as_str())
                .is_some_and(|p| !p.starts_with("kv/"))
        });
    }
    let text =
        serde_json::to_string_pretty(&m).map_err(|e| kvtrail::Error::Other(e.to_string()))?;
    std::fs::write(&manifest, text).map_err(|e| io(&manifest, e))
}
