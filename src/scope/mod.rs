//! Scope: turns replay's per-reader exposure into the responder's answer:
//! which responses read foreign KV, whose it was, which tenants are on each
//! side, how sure we are, and how complete the evidence is.
//!
//! Findings are data, not errors. Every list is sorted (request id, tenant)
//! so the same trace always gives the same report. The report never claims
//! "no exposure" without its coverage: gaps, unclean capture, skipped
//! import lines, unverifiable, unlisted, missing, unread or modified files,
//! row counts other than trace.json's and requests missing from the
//! requests table all show up in `coverage` and lower `complete`
//! ([`trace_evidence`] gathers the trace's part, [`finish_coverage`] is the
//! one rule every command uses).

pub mod anomalies;
pub mod merge;
pub mod model;
pub mod run;
pub mod shard;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use rayon::prelude::*;

pub use model::*;

use crate::error::{Error, Result};
use crate::lineage::exposure::{PoolSets, TenantKeys, TenantKeysSource, count};
use crate::lineage::{LineageOptions, LineageOutcome, run};
use crate::progress::Reporter;
use crate::schema::{ENGINE_REQUEST, RequestRecord, hex32};
use crate::trace::manifest::{FileEntry, Manifest};
use crate::trace::read::{Trace, rel_path};
use crate::words::{count as count_of, noun};

/// Replays a trace and scopes the result.
pub fn scope(trace: &Trace, opts: &LineageOptions, reporter: &dyn Reporter) -> Result<ScopeReport> {
    let opts = LineageOptions {
        tenants: Some(tenant_source(trace)),
        ..opts.clone()
    };
    replay_and_scope(trace, opts.threads, reporter, || {
        run(trace, &opts, reporter)
    })
    .map(|(_, report)| report)
}

/// The requests' tenants, read when the replay meets its first shared read
/// of another request's KV (a replay without prefix hits never reads
/// them). A requests table that cannot be read gives no keys here (every
/// shared read is kept); `scope_outcome` reads it again and reports why.
pub fn tenant_source(trace: &Trace) -> TenantKeysSource {
    let trace = trace.clone();
    TenantKeysSource::new(move || {
        crate::trace::request_keys::scan_request_rows(&trace, |_, _| {})
            .map(TenantKeys::new)
            .unwrap_or_default()
    })
}

fn tenant_of(id: u64, reqs: &HashMap<u64, RequestRecord>) -> Tenant {
    if id == ENGINE_REQUEST {
        return Tenant::Engine;
    }
    reqs.get(&id)
        .map(|r| Tenant::Customer(r.tenant.clone()))
        .unwrap_or(Tenant::Unknown)
}

fn union(sets: &[&PoolSets]) -> u64 {
    let mut u = PoolSets::new();
    for s in sets {
        for (p, iv) in s.iter() {
            u.entry(*p).or_default().union(iv);
        }
    }
    count(&u)
}

/// Builds the report from a replay outcome: one pass over the requests
/// table checks every row, finds the anomalies and keeps the rows of the
/// requests in findings (and nothing else of the others but their keys).
pub fn scope_outcome(
    trace: &Trace,
    outcome: &LineageOutcome,
    reporter: &dyn Reporter,
) -> Result<ScopeReport> {
    let involved = involved(outcome);
    reporter.start("requests", trace.request_files.len() as u64);
    let pass = RequestsPass::read(trace, |id| involved.contains(&id))?;
    reporter.advance(trace.request_files.len() as u64);
    reporter.finish();
    report(trace, outcome, &involved, pass, reporter)
}

/// Requests involved in any finding, as readers or sources (the engine,
/// request 0, is none).
fn involved(outcome: &LineageOutcome) -> BTreeSet<u64> {
    let mut involved: BTreeSet<u64> = BTreeSet::new();
    for (&r, ra) in &outcome.exposures.readers {
        if r == ENGINE_REQUEST {
            continue; // the engine's reads are no response (see below)
        }
        involved.insert(r);
        involved.extend(ra.sources.keys().copied());
    }
    for (&r, by_source) in &outcome.exposures.shared {
        involved.insert(r);
        involved.extend(by_source.keys().copied());
    }
    involved.remove(&ENGINE_REQUEST);
    involved
}

/// What one pass over the requests table finds: every row checked, the
/// anomalies (sorted), the number of requests, and the rows kept.
pub(crate) struct RequestsPass {
    anomalies: Vec<Anomaly>,
    requests: u64,
    rows: HashMap<u64, RequestRecord>,
    /// [`trace_evidence`], when it was gathered beside the replay too,
    /// with the files' [`stamps`] taken before it.
    evidence: Option<(Coverage, Stamps)>,
}

impl RequestsPass {
    /// Reads the requests table, keeping the rows whose id `keep` takes.
    fn read(trace: &Trace, keep: impl Fn(u64) -> bool) -> Result<RequestsPass> {
        let mut rows: HashMap<u64, RequestRecord> = HashMap::new();
        let mut anomalies = Vec::new();
        let checker = anomalies::Checker::new(trace.deployment());
        // A row's record is built only for an anomaly or a row kept.
        let keys = crate::trace::request_keys::scan_request_rows(trace, |batch, i| {
            let id = batch.request_id(i);
            if let Some(r) = checker.check_row(batch, i, keep(id), &mut anomalies) {
                rows.insert(id, r);
            }
        })?;
        anomalies.sort_by(|a: &Anomaly, b: &Anomaly| {
            (a.request_id, &a.kind).cmp(&(b.request_id, &b.kind))
        });
        Ok(RequestsPass {
            anomalies,
            requests: keys.len() as u64,
            rows,
            evidence: None,
        })
    }

    /// Reads the rows of `ids` again, after a pass that kept none: only
    /// their rows are decoded past the request_id column
    /// (`RequestFileReader::open_rows`).
    fn keep_rows(&mut self, trace: &Trace, ids: &BTreeSet<u64>) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let sorted: std::sync::Arc<[u64]> = ids.iter().copied().collect();
        for path in &trace.request_files {
            let reader = crate::trace::read::RequestFileReader::open_rows(
                &trace.root,
                path,
                sorted.clone(),
            )?;
            for batch in reader {
                for r in batch? {
                    if ids.contains(&r.request_id) {
                        self.rows.insert(r.request_id, r);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Replays `trace` (`replay`) and scopes the outcome, reading the requests
/// table beside the replay on a thread of its own when `threads` (0: the
/// default) is more than one, and after it otherwise. Either way the
/// report is the same: the pass beside the replay checks every row,
/// counts the anomalies and checks the files' digests ([`trace_evidence`]),
/// and the rows of the requests in findings are read once the replay
/// names them. A replay that fails reports its own error
/// first, as when the requests are read after it.
pub fn replay_and_scope(
    trace: &Trace,
    threads: usize,
    reporter: &dyn Reporter,
    replay: impl FnOnce() -> Result<LineageOutcome>,
) -> Result<(LineageOutcome, ScopeReport)> {
    if crate::lineage::threads_or_default(threads) < 2 || trace.request_files.is_empty() {
        let mut outcome = replay()?;
        // The replay's tenant keys are done with: the report reads the
        // requests table again, and holding both would double them.
        outcome.exposures.tenants = None;
        let report =
            crate::lineage::on_threads(threads, || scope_outcome(trace, &outcome, reporter))??;
        return Ok((outcome, report));
    }
    let (outcome, beside) = std::thread::scope(|s| {
        let beside = std::thread::Builder::new()
            .name("kvtrail-requests".into())
            .spawn_scoped(s, || {
                background_thread();
                // The files' sizes and times before anything is read
                // here: a file changed since is hashed again after the
                // replay.
                let stamps = stamps(trace);
                let mut pass = RequestsPass::read(trace, |_| false)?;
                // The file digests too: they need no replay either. On
                // the run's threads, started from this one (so at its
                // priority too).
                let evidence = || trace_evidence(trace, &crate::progress::NoReporter);
                let evidence = match rayon::ThreadPoolBuilder::new()
                    .num_threads(crate::lineage::threads_or_default(threads))
                    .build()
                {
                    Ok(pool) => pool.install(evidence),
                    Err(_) => evidence(),
                }?;
                pass.evidence = Some((evidence, stamps));
                Ok(pass)
            })
            .ok();
        let outcome = replay();
        let beside = beside.map(|h| {
            h.join().unwrap_or_else(|_| {
                Err(Error::Other(
                    "scope: the requests table's reader stopped unexpectedly".into(),
                ))
            })
        });
        (outcome, beside)
    });
    let mut outcome = outcome?;
    outcome.exposures.tenants = None;
    let involved = involved(&outcome);
    reporter.start("requests", trace.request_files.len() as u64);
    let pass = match beside {
        Some(pass) => {
            let mut pass = pass?;
            pass.keep_rows(trace, &involved)?;
            if pass
                .evidence
                .as_ref()
                .is_some_and(|(_, before)| *before != stamps(trace))
            {
                pass.evidence = None;
            }
            pass
        }
        // No thread to spare: read after the replay, as on one thread.
        None => RequestsPass::read(trace, |id| involved.contains(&id))?,
    };
    reporter.advance(trace.request_files.len() as u64);
    reporter.finish();
    let report = crate::lineage::on_threads(threads, || {
        report(trace, &outcome, &involved, pass, reporter)
    })??;
    Ok((outcome, report))
}

/// The size and modification time of each data file of a local trace
/// (an object store's files are read through hashed copies of their own).
type Stamps = Vec<Option<(u64, std::time::SystemTime)>>;

fn stamps(trace: &Trace) -> Stamps {
    if !matches!(trace.root, crate::trace::root::TraceRoot::Local(_)) {
        return Vec::new();
    }
    trace
        .request_files
        .iter()
        .chain(&trace.kv_files)
        .map(|p| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.len(), m.modified().ok()?))
        })
        .collect()
}

/// Lowers the calling thread's priority to the least (nice 19): work that
/// should take only the time the replay leaves its cores (the replay's
/// index pass and its streams come first). Once the replay is done it
/// runs at full speed on the idle cores. Best effort: where the
/// priority cannot be changed, the thread runs as any other.
fn background_thread() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid and setpriority only read and set this thread's
    // scheduling priority.
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}

/// The report of a replay outcome and the requests pass that kept the
/// rows of `involved`.
fn report(
    trace: &Trace,
    outcome: &LineageOutcome,
    involved: &BTreeSet<u64>,
    pass: RequestsPass,
    reporter: &dyn Reporter,
) -> Result<ScopeReport> {
    let m = &trace.manifest;
    let clean_capture = m.capture.complete;
    let RequestsPass {
        anomalies,
        requests: n_requests,
        rows: reqs,
        evidence,
    } = pass;

    // Responses.
    let mut affected = Vec::new();
    let mut blank_responses = Vec::new();
    let mut readers: Vec<u64> = outcome.exposures.readers.keys().copied().collect();
    readers.sort_unstable();
    let mut window = TimeWindow::default();
    let mut engine_reads = 0;
    for r in readers {
        let ra = &outcome.exposures.readers[&r];
        if r == ENGINE_REQUEST {
            // The engine's own reads (request 0) are no customer response
            // (trace format v1: "A response is affected when its request has
            // at least one foreign read"; request 0 is the engine itself).
            engine_reads = union(&[&ra.foreign, &ra.unknown, &ra.uncertain]);
            continue;
        }
        let rec = reqs.get(&r);
        let tenant = tenant_of(r, &reqs);
        let blank = count(&ra.blank);
        if blank > 0 {
            blank_responses.push(BlankReads {
                request_id: r,
                external_id: rec.and_then(|x| x.external_id.clone()),
                tenant: tenant.clone(),
                tokens: blank,
            });
        }
        let foreign = count(&ra.foreign);
        let unknown = count(&ra.unknown);
        let uncertain = count(&ra.uncertain);
        if foreign == 0 && unknown == 0 && uncertain == 0 {
            continue;
        }
        let mut srcs: Vec<u64> = ra.sources.keys().copied().collect();
        srcs.sort_unstable();
        let mut sources = Vec::new();
        let mut any_certain = false;
        let mut cross = false;
        for s in srcs {
            let sa = &ra.sources[&s];
            let st = tenant_of(s, &reqs);
            let certain = !sa.certain.is_empty() && clean_capture;
            any_certain |= certain;
            let s_cross = Crossing::between(&tenant, s, &st).counted();
            cross |= s_cross;
            sources.push(Source {
                request_id: s,
                external_id: reqs.get(&s).and_then(|x| x.external_id.clone()),
                tenant: st,
                tokens: count(&sa.slots),
                first_seq: sa.first_seq,
                last_seq: sa.last_seq,
                first_ts_ns: sa.first_ts_ns,
                last_ts_ns: sa.last_ts_ns,
                pools: sa.slots.keys().copied().collect(),
                cross_tenant: s_cross,
                confidence: if certain {
                    Confidence::Confirmed
                } else {
                    Confidence::Possible
                },
            });
        }
        let mut reasons = Vec::new();
        if foreign > 0 {
            reasons.push("foreign".to_string());
        }
        if unknown > 0 {
            reasons.push("unknown_predates_capture".to_string());
        }
        if uncertain > 0 {
            reasons.push("after_gap".to_string());
        }
        let confidence = if any_certain {
            Confidence::Confirmed
        } else {
            Confidence::Possible
        };
        window.include(ra.first_ts_ns, ra.last_ts_ns, rec.map(|x| x.arrival_ns));
        affected.push(Response {
            request_id: r,
            external_id: rec.and_then(|x| x.external_id.clone()),
            tenant,
            in_requests_table: rec.is_some(),
            arrival_ns: rec.map(|x| x.arrival_ns),
            finish_ns: rec.and_then(|x| x.finish_ns),
            http_status: rec.map(|x| x.http_status),
            finish_reason: rec.and_then(|x| x.finish_reason.clone()),
            prompt_tokens: rec.map(|x| x.prompt_tokens),
            prefilled_tokens: rec.and_then(|x| x.prefilled_tokens),
            output_tokens: rec.map(|x| x.output_tokens),
            output_hash: rec.and_then(|x| x.output_hash.as_ref().map(hex32)),
            foreign_tokens: foreign,
            unknown_tokens: unknown,
            uncertain_tokens: uncertain,
            exposed_tokens: union(&[&ra.foreign, &ra.unknown, &ra.uncertain]),
            cross_tenant: cross,
            confidence,
            reasons,
            first_read_ns: ra.first_ts_ns,
            last_read_ns: ra.last_ts_ns,
            sources,
        });
    }

    let shared_hits = cross_tenant_shared(&outcome.exposures, &reqs);

    // Tenants on both sides.
    let (recipients, sources) = tenants(&affected);

    // Coverage: the trace's files and capture, the replay's holes, and
    // the requests of findings missing from the requests table.
    let mut cov = match evidence {
        Some((e, _)) => with_replay(e, outcome),
        None => replay_coverage(trace, outcome, reporter)?,
    };
    cov.engine_reads = engine_reads;
    cov.requests_missing = involved
        .iter()
        .filter(|id| !reqs.contains_key(id))
        .copied()
        .collect();
    finish_coverage(&mut cov);

    let counts = Counts {
        requests: n_requests,
        kv_files: outcome.kv_files as u64,
        kv_events: outcome.counters.events,
        slot_touches: outcome.counters.slot_touches,
        read_events: outcome.counters.read_events,
        read_slots: outcome.counters.read_slots,
        anomalies: anomalies.len() as u64,
        spilled_events: outcome.spilled_events,
        cross_tenant_shared_responses: shared_hits.len() as u64,
        ..Counts::of_findings(&affected, &recipients, &sources)
    };
    let blank_reads = blank_responses
        .iter()
        .fold(0u64, |n, b| n.saturating_add(b.tokens));
    let deployment = DeploymentInfo::from(m);
    let verdict = verdict(&counts, &cov, deployment.tenant_prefix_cache());
    Ok(ScopeReport {
        format: "kvtrail-scope".into(),
        version: 1,
        verdict,
        deployment,
        time_window: window,
        counts,
        affected_responses: affected,
        recipients,
        sources,
        blank_reads,
        blank_read_responses: blank_responses,
        cross_tenant_shared: shared_hits,
        anomalies,
        coverage: cov,
    })
}

/// The responses that read another tenant's KV through a prefix-cache hit,
/// by request id; a source counts when its tenant differs from the
/// reader's or either is unknown (as for foreign reads).
fn cross_tenant_shared(
    ex: &crate::lineage::Exposures,
    reqs: &HashMap<u64, RequestRecord>,
) -> Vec<SharedHit> {
    let mut readers: Vec<u64> = ex.shared.keys().copied().collect();
    readers.sort_unstable();
    let mut hits = Vec::new();
    for r in readers {
        if r == ENGINE_REQUEST {
            continue;
        }
        let tenant = tenant_of(r, reqs);
        let by_source = &ex.shared[&r];
        let mut srcs: Vec<u64> = by_source.keys().copied().collect();
        srcs.sort_unstable();
        let mut sources = Vec::new();
        let mut all: Vec<&PoolSets> = Vec::new();
        for s in srcs {
            let st = tenant_of(s, reqs);
            let cross = Crossing::between(&tenant, s, &st).counted();
            if !cross {
                continue;
            }
            all.push(&by_source[&s]);
            sources.push(SharedSource {
                request_id: s,
                tenant: st,
                tokens: count(&by_source[&s]),
            });
        }
        if sources.is_empty() {
            continue;
        }
        hits.push(SharedHit {
            request_id: r,
            external_id: reqs.get(&r).and_then(|x| x.external_id.clone()),
            tenant,
            tokens: union(&all),
            sources,
        });
    }
    hits
}

/// What trace.json and the files on disk say about the evidence, before
/// any replay: the capture state, input lines skipped at import, and every
/// data file: listed in trace.json or not, on disk or not, still holding
/// the bytes (blake3) and the rows trace.json lists, or skipped by the
/// readers (part files left open, hidden names). The replay adds its holes
/// and copies past the end ([`replay_coverage`]); [`finish_coverage`] then
/// decides. Every command that says whether the evidence is complete
/// (scope, inspect, audit; lookup and notify through scope's summary) reads
/// these facts from here.
///
/// Cost: each listed file on disk is hashed once (blake3 of the
/// memory-mapped file, files in parallel) and the footer of each file whose
/// digest matches is read for its row count; no data page is read. Only
/// files the reader lists on disk are opened, never a path as trace.json
/// spells it, so a listed path outside the trace is only "missing".
pub fn trace_evidence(trace: &Trace, reporter: &dyn Reporter) -> Result<Coverage> {
    let m = &trace.manifest;
    let mut cov = Coverage {
        capture_complete: m.capture.complete,
        from_engine_start: m.capture.from_engine_start,
        unverifiable: m.files.is_none(),
        skipped_lines: skipped_lines(m),
        ..Default::default()
    };
    if let Some(files) = &m.files {
        let on_disk: BTreeMap<String, &Path> = trace
            .request_files
            .iter()
            .chain(&trace.kv_files)
            .map(|p| (rel_path(&trace.dir, p), p.as_path()))
            .collect();
        // A path listed twice is checked once against every distinct entry.
        let mut listed: BTreeMap<&str, Vec<&FileEntry>> = BTreeMap::new();
        let mut seen = BTreeSet::new();
        for f in files {
            if seen.insert((&f.path, f.rows, &f.blake3)) {
                listed.entry(f.path.as_str()).or_default().push(f);
            }
        }
        cov.files_not_in_manifest = on_disk
            .keys()
            .filter(|p| !listed.contains_key(p.as_str()))
            .cloned()
            .collect();
        // A listed file the readers skip (`x.PARQUET`, outside requests/
        // and kv/) is unread, not missing: it may be on disk, holding the
        // rows trace.json counts, and no analysis sees them.
        for p in listed.keys().filter(|p| !on_disk.contains_key(**p)) {
            if crate::trace::files::reader_skips(p).is_some() {
                cov.files_unread.push(p.to_string());
            } else {
                cov.files_missing.push(p.to_string());
            }
        }
        let present: Vec<(&str, &Path, &[&FileEntry])> = listed
            .iter()
            .filter_map(|(rel, entries)| on_disk.get(*rel).map(|p| (*rel, *p, entries.as_slice())))
            .collect();
        reporter.start("digests", present.len() as u64);
        let checked: Vec<Result<FileCheck>> = present
            .par_iter()
            .map(|(rel, path, entries)| check_file(trace, rel, path, entries))
            .collect();
        reporter.advance(present.len() as u64);
        reporter.finish();
        for c in checked {
            match c? {
                FileCheck::Matches => {}
                FileCheck::Modified(p) => cov.files_modified.push(p),
                FileCheck::Rows(r) => cov.files_rows_differ.extend(r),
            }
        }
    }
    for sub in ["requests", "kv"] {
        let unread = trace.unread_files(sub);
        cov.files_unread
            .extend(unread.iter().map(|(p, _)| rel_path(&trace.dir, p)));
    }
    cov.files_unread.sort();
    cov.files_unread.dedup();
    finish_coverage(&mut cov);
    Ok(cov)
}

/// The coverage of a replayed trace: [`trace_evidence`] plus the replay's
/// seq holes and copies that read past the end of their source, finished.
/// Scope adds the requests of its findings; audit takes it as it is.
pub fn replay_coverage(
    trace: &Trace,
    outcome: &LineageOutcome,
    reporter: &dyn Reporter,
) -> Result<Coverage> {
    Ok(with_replay(trace_evidence(trace, reporter)?, outcome))
}

/// [`trace_evidence`]'s coverage `cov` with the replay's part added.
fn with_replay(mut cov: Coverage, outcome: &LineageOutcome) -> Coverage {
    cov.gaps = outcome.gaps.clone();
    cov.lost_events = lost_events(&outcome.gaps);
    cov.no_kv_events = outcome.counters.events == 0;
    for (&pool, &(lo, hi)) in &outcome.late_sources {
        cov.copies_past_end.push(CopiesPastEnd {
            pool,
            min_src_seq: lo,
            max_src_seq: hi,
        });
    }
    finish_coverage(&mut cov);
    cov
}

/// `capture.skipped_lines` (kvtrail's own key, written by `ingest
/// --skip-bad-lines`); 0 when absent.
fn skipped_lines(m: &Manifest) -> u64 {
    m.capture
        .extra
        .get("skipped_lines")
        .and_then(|v| v.as_u64())
        .unwrap_or(0)
}

/// One listed file against its trace.json entries.
enum FileCheck {
    Matches,
    Modified(String),
    Rows(Vec<RowsDiffer>),
}

fn check_file(trace: &Trace, rel: &str, path: &Path, entries: &[&FileEntry]) -> Result<FileCheck> {
    // A device, FIFO or directory named *.parquet is no captured file (and
    // hashing a device could read forever).
    if !trace.root.is_regular_file(path) {
        return Ok(FileCheck::Modified(rel.to_string()));
    }
    let (digest, _) = trace.root.hash(path)?;
    if entries
        .iter()
        .any(|e| !e.blake3.eq_ignore_ascii_case(&digest))
    {
        return Ok(FileCheck::Modified(rel.to_string()));
    }
    let rows = trace.footer_rows(path)?;
    let differ: Vec<RowsDiffer> = entries
        .iter()
        .filter(|e| e.rows != rows)
        .map(|e| RowsDiffer {
            path: rel.to_string(),
            listed_rows: e.rows,
            file_rows: rows,
        })
        .collect();
    Ok(if differ.is_empty() {
        FileCheck::Matches
    } else {
        FileCheck::Rows(differ)
    })
}

/// Events lost in all holes together, saturating: seqs are UInt64, and a
/// capture that joined a running engine may number from its counter, so
/// two leading holes can exceed u64 together.
pub(crate) fn lost_events(gaps: &[crate::lineage::Gap]) -> u64 {
    gaps.iter().fold(0u64, |n, g| n.saturating_add(g.missing()))
}

/// Sets `complete` (nothing lowers confidence) and the notes from the
/// rest of the coverage: the one rule for a single run and a merge.
/// The note of a merged report whose shards were not authenticated.
pub const SHARDS_NOT_AUTHENTICATED: &str = "shards not authenticated: the shard folders' signed statements were not checked (`kvtrail merge` without --allowed-signers), so anyone who could write a shard folder could have changed its findings and its evidence.json; sign the shards (`scope --signing-key`) and merge with --allowed-signers";

pub(crate) fn finish_coverage(c: &mut Coverage) {
    c.complete = c.capture_complete
        && c.gaps.is_empty()
        && c.copies_past_end.is_empty()
        && !c.unverifiable
        && c.files_not_in_manifest.is_empty()
        && c.files_missing.is_empty()
        && c.files_unread.is_empty()
        && c.files_modified.is_empty()
        && c.files_rows_differ.is_empty()
        && c.skipped_lines == 0
        && c.requests_missing.is_empty()
        && !c.no_kv_events
        && !c.shards_not_authenticated;
    c.notes = coverage_notes(c, true);
}

/// The coverage notes for a customer's notification pack: the same notes
/// as `coverage.notes`, worded without file paths or names (a trace's file
/// names can carry other customers' names, e.g. Hive folders by tenant).
/// Built from the coverage's structure, never from the responder's notes.
pub fn customer_notes(c: &Coverage) -> Vec<String> {
    coverage_notes(c, false)
}

/// `paths`: whether notes may quote file paths (the responder's own
/// report) or only count files (anything that reaches a customer).
fn coverage_notes(c: &Coverage, paths: bool) -> Vec<String> {
    let mut n = Vec::new();
    if c.shards_not_authenticated {
        n.push(SHARDS_NOT_AUTHENTICATED.into());
    }
    if c.no_kv_events {
        n.push(crate::trace::NO_KV_EVENTS.into());
    }
    if !c.capture_complete {
        n.push("capture.complete is false: the recorder did not close cleanly; events may be missing and every finding is at most `possible`".into());
    }
    if c.skipped_lines > 0 {
        n.push(format!(
            "{} skipped at import (capture.skipped_lines): their events are lost",
            count_of(
                c.skipped_lines,
                "malformed input line was",
                "malformed input lines were"
            )
        ));
    }
    digest_notes(c, paths, &mut n);
    if c.from_engine_start != Some(true) {
        n.push("the capture did not begin with the engine (from_engine_start not true): slots never written in the trace may hold KV from before the capture; reads of them are reported as unknown".into());
    }
    for g in &c.gaps {
        n.push(match g.after_seq {
            Some(a) => format!(
                "pool {}: {} lost between seq {a} and seq {}; slot state after the hole is uncertain until rewritten",
                g.pool,
                count_of(g.missing(), "event", "events"),
                g.before_seq
            ),
            None => format!(
                "pool {}: the stream starts at seq {}; {} not in the trace",
                g.pool,
                g.before_seq,
                count_of(g.missing(), "earlier event is", "earlier events are")
            ),
        });
    }
    for cp in &c.copies_past_end {
        n.push(format!(
            "pool {}: copies read source seq {}..={} beyond the last recorded event; their content is uncertain",
            cp.pool, cp.min_src_seq, cp.max_src_seq
        ));
    }
    if c.unverifiable {
        n.push("trace.json has no `files` list: file digests cannot be verified and missing files cannot be detected".into());
    }
    listing_notes(c, paths, &mut n);
    if !c.requests_missing.is_empty() {
        n.push(format!(
            "{} by kv events of findings {} missing from the requests table (tenant unknown)",
            count_of(
                c.requests_missing.len() as u64,
                "request referenced",
                "requests referenced"
            ),
            noun(c.requests_missing.len() as u64, "is", "are")
        ));
    }
    if c.engine_reads > 0 {
        n.push(format!(
            "request 0 (the engine itself) read {} holding KV that was not its own; it has no customer response, so no response is affected by these reads",
            count_of(c.engine_reads, "slot", "slots")
        ));
    }
    n
}

/// Notes on the files of the trace against trace.json's list: unlisted,
/// unread and missing files.
fn listing_notes(c: &Coverage, paths: bool, n: &mut Vec<String>) {
    if !c.files_not_in_manifest.is_empty() {
        n.push(format!(
            "{} on disk {} not listed in trace.json (included in the analysis, but unverified)",
            count_of(
                c.files_not_in_manifest.len() as u64,
                "data file",
                "data files"
            ),
            noun(c.files_not_in_manifest.len() as u64, "is", "are")
        ));
    }
    if !c.files_unread.is_empty() {
        let mut note = format!(
            "{} under requests/ or kv/ may hold rows that were not read (part files left open, *.parquet under a name starting with `_` or `.`, or files trace.json lists, or named like data files, that the readers skip)",
            count_of(c.files_unread.len() as u64, "file", "files")
        );
        if paths {
            note.push_str(": ");
            note.push_str(&c.files_unread.join(", "));
        }
        n.push(note);
    }
    if !c.files_missing.is_empty() {
        n.push(format!(
            "{} in trace.json {} missing on disk",
            count_of(c.files_missing.len() as u64, "file listed", "files listed"),
            noun(c.files_missing.len() as u64, "is", "are")
        ));
    }
}

/// Notes on listed files whose bytes or rows are not what trace.json says.
fn digest_notes(c: &Coverage, paths: bool, n: &mut Vec<String>) {
    if !c.files_modified.is_empty() {
        let mut note = format!(
            "{}: {} not the recorded evidence, and findings from {} cannot be trusted (run `kvtrail verify`)",
            count_of(
                c.files_modified.len() as u64,
                "file listed in trace.json does not match its blake3 digest",
                "files listed in trace.json do not match their blake3 digest"
            ),
            noun(c.files_modified.len() as u64, "it is", "they are"),
            noun(c.files_modified.len() as u64, "it", "them")
        );
        if paths {
            note.push_str(&listed_paths(c.files_modified.iter().cloned()));
        }
        n.push(note);
    }
    if !c.files_rows_differ.is_empty() {
        let mut note = format!(
            "{}: trace.json counts rows the trace does not hold, or holds rows it does not count",
            count_of(
                c.files_rows_differ.len() as u64,
                "file holds another number of rows than trace.json lists although its digest matches",
                "files hold another number of rows than trace.json lists although their digests match"
            )
        );
        if paths {
            note.push_str(&listed_paths(c.files_rows_differ.iter().map(|r| {
                format!(
                    "{} ({} rows, trace.json says {})",
                    r.path, r.file_rows, r.listed_rows
                )
            })));
        }
        n.push(note);
    }
}

/// Paths quoted in one note: the first [`NOTE_PATHS`], then how many more
/// (the coverage lists them all).
fn listed_paths(paths: impl ExactSizeIterator<Item = String>) -> String {
    let more = paths.len().saturating_sub(NOTE_PATHS);
    let mut s = String::from(": ");
    s.push_str(&paths.take(NOTE_PATHS).collect::<Vec<_>>().join(", "));
    if more > 0 {
        s.push_str(&format!(" and {more} more"));
    }
    s
}

/// Paths a note on modified files or row counts quotes.
pub const NOTE_PATHS: usize = 10;

/// The notes on the trace's files alone (digests, rows, unlisted, unread
/// and missing files), with paths: what `inspect` adds to its warnings.
pub fn file_notes(c: &Coverage) -> Vec<String> {
    let mut n = Vec::new();
    digest_notes(c, true, &mut n);
    listing_notes(c, true, &mut n);
    n
}

pub(crate) fn verdict(c: &Counts, cov: &Coverage, tenant_prefix_cache: bool) -> String {
    let evidence = if cov.complete {
        "the evidence is complete".to_string()
    } else {
        format!(
            "the evidence is INCOMPLETE ({})",
            count_of(cov.notes.len() as u64, "coverage note", "coverage notes")
        )
    };
    let hits = c.cross_tenant_shared_responses;
    let hits_note = if hits == 0 {
        String::new()
    } else if tenant_prefix_cache {
        format!(
            "{} ({} another tenant's cached prefix although prefix_cache_scope is \"tenant\")",
            count_of(
                hits,
                "prefix-cache isolation breach",
                "prefix-cache isolation breaches"
            ),
            noun(hits, "a response that hit", "responses that hit")
        )
    } else {
        format!(
            "{} another tenant's cached prefix (cross-tenant shared: \
             information, prefix_cache_scope is global)",
            count_of(hits, "response hit", "responses hit")
        )
    };
    if c.affected_responses == 0 {
        if cov.no_kv_events {
            // Nothing was recorded: "no exposure found" would read as a
            // clean result.
            format!(
                "no KV evidence: the trace holds no KV events, so exposure can be neither found nor ruled out; {evidence}"
            )
        } else if hits > 0 && tenant_prefix_cache {
            format!("{hits_note}; no foreign KV read; {evidence}")
        } else if cov.complete {
            let sep = if hits > 0 { "; " } else { "" };
            format!("no exposure found{sep}{hits_note}; {evidence}")
        } else {
            let sep = if hits > 0 { "; " } else { "" };
            format!(
                "no exposure found in the recorded events{sep}{hits_note}, but {evidence}: exposure cannot be ruled out"
            )
        }
    } else {
        let sep = if hits > 0 { "; " } else { "" };
        let cross = c.cross_tenant_words();
        format!(
            "{} ({} confirmed, {} possible, {cross}){sep}{hits_note}; {evidence}",
            count_of(
                c.affected_responses,
                "response affected",
                "responses affected"
            ),
            c.confirmed_responses,
            c.possible_responses,
        )
    }
}

/// Tenants on both sides (recipients and sources), from the responses;
/// shared by a single run and the merge of shards.
pub(crate) fn tenants(affected: &[Response]) -> (Vec<Recipient>, Vec<SourceTenant>) {
    let mut rec_t: BTreeMap<Tenant, Recipient> = BTreeMap::new();
    type SourceAcc = (BTreeSet<u64>, BTreeSet<Tenant>, u64, u64, BTreeSet<u64>);
    let mut src_t: BTreeMap<Tenant, SourceAcc> = BTreeMap::new();
    for a in affected {
        let e = rec_t.entry(a.tenant.clone()).or_insert_with(|| Recipient {
            tenant: a.tenant.clone(),
            responses: 0,
            foreign_tokens: 0,
            unknown_tokens: 0,
            cross_tenant_responses: 0,
            confirmed: 0,
            possible: 0,
            request_ids: Vec::new(),
        });
        e.responses += 1;
        // Saturating: a merged shard's counts are read from its files.
        e.foreign_tokens = e.foreign_tokens.saturating_add(a.foreign_tokens);
        e.unknown_tokens = e.unknown_tokens.saturating_add(a.unknown_tokens);
        e.cross_tenant_responses += a.cross_tenant as u64;
        match a.confidence {
            Confidence::Confirmed => e.confirmed += 1,
            Confidence::Possible => e.possible += 1,
        }
        e.request_ids.push(a.request_id);
        for s in &a.sources {
            let t = src_t.entry(s.tenant.clone()).or_default();
            t.0.insert(s.request_id);
            t.1.insert(a.tenant.clone());
            t.2 = t.2.saturating_add(s.tokens);
            if s.cross_tenant {
                t.3 = t.3.saturating_add(s.tokens);
            }
            t.4.insert(a.request_id);
        }
    }
    let recipients = rec_t.into_values().collect();
    let sources = src_t
        .into_iter()
        .map(|(tenant, (reqs, rts, tokens, cross, resp))| SourceTenant {
            tenant,
            requests: reqs.len() as u64,
            tokens,
            cross_tenant_tokens: cross,
            recipient_responses: resp.len() as u64,
            recipient_tenants: rts.into_iter().collect(),
            request_ids: reqs.into_iter().collect(),
        })
        .collect();
    (recipients, sources)
}
