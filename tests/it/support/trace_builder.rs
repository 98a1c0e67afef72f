//! Test support: `TraceBuilder` builds small traces in code, either through
//! the `Recorder` (like an engine hook would) or by hand as Parquet files
//! (random file splits, shuffled rows, dictionary-encoded strings, no
//! `files` list), plus a compact digest of a scope report for data-driven
//! assertions.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, DictionaryArray, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use kvtrail::capture::{Recorder, RecorderOptions};
use kvtrail::schema::{CopySrc, KvEvent, Op, RequestRecord};
use kvtrail::scope::ScopeReport;
use kvtrail::trace::{Capture, Deployment, Manifest, Pool, Role};

/// A tiny deterministic PRNG (xorshift64*), so tests need no extra crates.
#[derive(Clone)]
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// Builds a trace in code. Seqs are assigned per pool in call order.
#[derive(Clone)]
pub struct TraceBuilder {
    pub deployment: Deployment,
    pub events: Vec<KvEvent>,
    pub requests: Vec<RequestRecord>,
    next_seq: Vec<u64>,
    pub from_engine_start: bool,
    pub complete: bool,
    ts: i64,
}

pub fn pool(id: u16, role: Role, cap: u64) -> Pool {
    Pool {
        id,
        name: format!("{}-{id}", role.as_str()),
        role,
        capacity_tokens: cap,
        page_size: 1,
        extra: Default::default(),
    }
}

impl TraceBuilder {
    /// Pool 0 prefill and pool 1 decode, 64 slots each.
    pub fn pd() -> Self {
        Self::with_pools(vec![pool(0, Role::Prefill, 64), pool(1, Role::Decode, 64)])
    }

    pub fn with_pools(pools: Vec<Pool>) -> Self {
        let n = pools.iter().map(|p| p.id as usize + 1).max().unwrap_or(0);
        TraceBuilder {
            deployment: Deployment {
                name: "test".into(),
                engine: "test-engine".into(),
                context_window: 1 << 20,
                pools,
                prefix_cache_scope: None,
                extra: Default::default(),
            },
            events: Vec::new(),
            requests: Vec::new(),
            next_seq: vec![0; n],
            from_engine_start: true,
            complete: true,
            ts: 1_000,
        }
    }

    /// Adds a request row (HTTP 200, prompt 8, decode pool 1).
    pub fn req(&mut self, id: u64, tenant: &str) -> &mut RequestRecord {
        self.requests.push(RequestRecord {
            request_id: id,
            external_id: Some(format!("ext-{id}")),
            tenant: tenant.to_string(),
            arrival_ns: 1_000 + id as i64,
            finish_ns: Some(2_000 + id as i64),
            prompt_tokens: 8,
            prefilled_tokens: Some(8),
            output_tokens: 4,
            http_status: 200,
            finish_reason: Some("stop".into()),
            prefill_pool: None,
            decode_pool: None,
            prompt_hash: Some([id as u8; 32]),
            output_hash: Some([id as u8 ^ 0xff; 32]),
        });
        self.requests.last_mut().unwrap()
    }

    fn push(&mut self, mut e: KvEvent) -> u64 {
        e.seq = self.next_seq[e.pool as usize];
        self.next_seq[e.pool as usize] += 1;
        self.ts += 10;
        e.ts_ns = self.ts;
        self.events.push(e);
        e.seq
    }

    pub fn ev(&mut self, pool: u16, rid: u64, op: Op, start: u32, count: u32) -> u64 {
        self.push(KvEvent {
            pool,
            seq: 0,
            ts_ns: 0,
            request_id: rid,
            op,
            slot_start: start,
            slot_count: count,
            token_pos: matches!(op, Op::Write | Op::Read | Op::Share).then_some(0),
            src: None,
        })
    }
    pub fn alloc(&mut self, pool: u16, rid: u64, start: u32, count: u32) -> u64 {
        self.ev(pool, rid, Op::Alloc, start, count)
    }
    pub fn write(&mut self, pool: u16, rid: u64, start: u32, count: u32) -> u64 {
        self.ev(pool, rid, Op::Write, start, count)
    }
    pub fn read(&mut self, pool: u16, rid: u64, start: u32, count: u32) -> u64 {
        self.ev(pool, rid, Op::Read, start, count)
    }
    pub fn free(&mut self, pool: u16, rid: u64, start: u32, count: u32) -> u64 {
        self.ev(pool, rid, Op::Free, start, count)
    }
    pub fn share(&mut self, pool: u16, rid: u64, start: u32, count: u32) -> u64 {
        self.ev(pool, rid, Op::Share, start, count)
    }
    pub fn scrub(&mut self, pool: u16, start: u32, count: u32) -> u64 {
        self.ev(pool, 0, Op::Scrub, start, count)
    }
    /// A copy into `pool` from `src_pool` as it was just after `src_seq`.
    #[allow(clippy::too_many_arguments)]
    pub fn copy(
        &mut self,
        pool: u16,
        rid: u64,
        start: u32,
        count: u32,
        src_pool: u16,
        src_start: u32,
        src_seq: u64,
    ) -> u64 {
        self.push(KvEvent {
            pool,
            seq: 0,
            ts_ns: 0,
            request_id: rid,
            op: Op::Write,
            slot_start: start,
            slot_count: count,
            token_pos: Some(0),
            src: Some(CopySrc {
                pool: src_pool,
                slot_start: src_start,
                seq: src_seq,
            }),
        })
    }
    /// Loses `n` seqs of `pool` (a hole).
    pub fn lose(&mut self, pool: u16, n: u64) {
        self.next_seq[pool as usize] += n;
    }
    /// The seq the next event of `pool` gets.
    pub fn next_seq(&self, pool: u16) -> u64 {
        self.next_seq[pool as usize]
    }

    /// Writes the trace through the Recorder (one part per few rows).
    pub fn record(&self, dir: &Path) -> PathBuf {
        let opts = RecorderOptions {
            row_group_rows: 3,
            started_ns: Some(0),
            from_engine_start: self.from_engine_start,
            part: kvtrail::trace::write::PartOptions {
                rotate_bytes: 1,
                zstd_level: 1,
            },
            ..Default::default()
        };
        let mut rec = Recorder::create(dir, self.deployment.clone(), opts).unwrap();
        for e in &self.events {
            rec.kv_with_seq(*e).unwrap();
        }
        for r in &self.requests {
            rec.request(r.clone()).unwrap();
        }
        if self.complete {
            rec.close().unwrap();
        } else {
            rec.close_unclean().unwrap();
        }
        dir.to_path_buf()
    }

    /// Writes the trace by hand: rows shuffled (seeded) across `files` kv
    /// files (pools mixed), dictionary-encoded op/tenant columns when
    /// `dict`, an extra unknown column, and no `files` list in trace.json.
    pub fn by_hand(&self, dir: &Path, files: usize, seed: u64, dict: bool) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let mut rng = Rng(seed);
        let mut evs = self.events.clone();
        rng.shuffle(&mut evs);
        let files = files.max(1);
        let mut parts: Vec<Vec<KvEvent>> = vec![Vec::new(); files];
        for e in evs {
            parts[rng.below(files as u64) as usize].push(e);
        }
        // Some files keep their rows sorted (streaming merge), others not
        // (external sort).
        for (i, p) in parts.iter_mut().enumerate() {
            if i % 2 == 0 {
                p.sort_by_key(|e| (e.pool, e.seq));
            }
        }
        for (i, p) in parts.iter().enumerate() {
            if p.is_empty() {
                continue;
            }
            let path = dir.join(format!("kv/batch={}/f-{i:03}.parquet", i % 3));
            kvtrail::trace::write::write_single_file(&path, &[hand_kv_batch(p, dict)]).unwrap();
        }
        let mut reqs = self.requests.clone();
        rng.shuffle(&mut reqs);
        if !reqs.is_empty() {
            let mid = reqs.len() / 2;
            for (i, chunk) in [&reqs[..mid], &reqs[mid..]].iter().enumerate() {
                if chunk.is_empty() {
                    continue;
                }
                let mut b = kvtrail::trace::write::requests_batch(chunk);
                if dict {
                    b = dict_column(&b, "tenant");
                }
                let path = dir.join(format!("requests/r-{i}.parquet"));
                kvtrail::trace::write::write_single_file(&path, &[b]).unwrap();
            }
        }
        let mut m = Manifest::new(
            self.deployment.clone(),
            Capture {
                writer: "hand".into(),
                started_ns: 0,
                ended_ns: 0,
                complete: self.complete,
                from_engine_start: Some(self.from_engine_start),
                extra: Default::default(),
            },
        );
        m.files = None;
        m.store(dir).unwrap();
        dir.to_path_buf()
    }
}

fn hand_kv_batch(evs: &[KvEvent], dict: bool) -> RecordBatch {
    let b = kvtrail::trace::write::kv_batch(evs);
    // An extra column readers must ignore.
    let extra: ArrayRef = Arc::new(Int64Array::from(vec![7i64; evs.len()]));
    let mut fields: Vec<Field> = b.schema().fields().iter().map(|f| (**f).clone()).collect();
    fields.push(Field::new("engine_note", DataType::Int64, false));
    let mut cols = b.columns().to_vec();
    cols.push(extra);
    let b = RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).unwrap();
    if dict { dict_column(&b, "op") } else { b }
}

/// Replaces a Utf8 column by its dictionary-encoded form.
pub fn dict_column(b: &RecordBatch, name: &str) -> RecordBatch {
    let schema = b.schema();
    let mut fields = Vec::new();
    let mut cols = Vec::new();
    for (f, c) in schema.fields().iter().zip(b.columns()) {
        if f.name() == name {
            let s = c.as_any().downcast_ref::<StringArray>().unwrap();
            let d: DictionaryArray<Int32Type> = s.iter().collect();
            fields.push(Field::new(
                name,
                DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
                f.is_nullable(),
            ));
            cols.push(Arc::new(d) as ArrayRef);
        } else {
            fields.push((**f).clone());
            cols.push(c.clone());
        }
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).unwrap()
}

/// Runs scope in-process.
pub fn scope(dir: &Path) -> ScopeReport {
    scope_with(dir, &kvtrail::lineage::LineageOptions::default())
}

/// Runs scope in-process with options (e.g. tiny spill chunks), on the CPU
/// backend (on the default threads, on one thread and on three), and again
/// on the GPU backend over the emulated device (the kernels of
/// kernels/*.cu compiled as C++): all reports must be identical, so every
/// trace of every scope test is a CPU/GPU and a threads parity test.
pub fn scope_with(dir: &Path, opts: &kvtrail::lineage::LineageOptions) -> ScopeReport {
    let trace = kvtrail::trace::Trace::open(dir).unwrap();
    let run = |backend| {
        let o = kvtrail::lineage::LineageOptions {
            backend,
            ..opts.clone()
        };
        kvtrail::scope::scope(&trace, &o, &kvtrail::progress::NoReporter).unwrap()
    };
    let r = run(kvtrail::lineage::BackendChoice::Cpu);
    // The CPU backend on one thread and sharded over three, every batch
    // applied by the threads in parallel: the same bytes.
    let on_threads = |threads: usize| {
        let mut b = kvtrail::lineage::cpu::CpuBackend::with_threads(threads)
            .unwrap()
            .parallel_from(0);
        // On 3 threads the pools of a copy-connected group replay on
        // threads of their own (the exchange), whatever their events.
        let o = kvtrail::lineage::LineageOptions {
            backend: kvtrail::lineage::BackendChoice::Cpu,
            tenants: Some(kvtrail::scope::tenant_source(&trace)),
            pool_threads: (threads > 1).then_some(true),
            ..opts.clone()
        };
        let p = kvtrail::progress::NoReporter;
        let out = kvtrail::lineage::run_with(&trace, &mut b, &o, &p).unwrap();
        kvtrail::scope::scope_outcome(&trace, &out, &p).unwrap()
    };
    for threads in [1, 3] {
        assert_eq!(
            kvtrail::report::to_json(&on_threads(threads)),
            kvtrail::report::to_json(&r),
            "the CPU backend on {threads} threads disagrees with the default on {}",
            dir.display()
        );
    }
    let g = run(kvtrail::lineage::BackendChoice::Emu);
    assert_eq!(
        kvtrail::report::to_json(&g),
        kvtrail::report::to_json(&r),
        "the emulated GPU backend disagrees with the CPU backend on {}",
        dir.display()
    );
    r
}

/// A compact, line-per-fact digest of a report for data-driven tests.
pub fn digest(r: &ScopeReport) -> String {
    let mut out = Vec::new();
    for a in &r.affected_responses {
        let srcs: Vec<String> = a
            .sources
            .iter()
            .map(|s| format!("{}:{}:{}", s.request_id, s.tenant, s.tokens))
            .collect();
        out.push(format!(
            "r{} {} foreign={} unknown={} uncertain={} cross={} {} src=[{}]",
            a.request_id,
            a.tenant,
            a.foreign_tokens,
            a.unknown_tokens,
            a.uncertain_tokens,
            a.cross_tenant,
            a.confidence.as_str(),
            srcs.join(",")
        ));
    }
    out.push(format!("blank={}", r.blank_reads));
    let gaps: Vec<String> = r
        .coverage
        .gaps
        .iter()
        .map(|g| {
            format!(
                "{}:{}..{}",
                g.pool,
                g.after_seq.map(|a| a.to_string()).unwrap_or("-".into()),
                g.before_seq
            )
        })
        .collect();
    out.push(format!(
        "complete={} gaps=[{}]",
        r.coverage.complete,
        gaps.join(",")
    ));
    out.join("\n")
}
