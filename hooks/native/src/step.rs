//! The vLLM hook's per-step events, built in one native call per scheduler
//! step (`schedule_step`): for every request scheduled, the `write` of the
//! tokens it computes this step and the `read` of its whole context, per KV
//! cache group, as the canonical KV lines the sidecar reads
//! (`kvtrail::record::wire::KvLineHead`); the writes mirrored into
//! the guard; and the guard's check of a request's first step over KV it
//! did not compute, made in the stream's order. The Python hook only queues
//! the lines (one queue item a step) and acts on the checks.
//!
//! Two passes: the first reads vLLM's objects (Python calls, during which
//! another thread may run) and writes the lines; the second, with no
//! Python call, applies the step to the guard in the stream's order. So the
//! guard is never held while Python code runs.
//!
//! `slot_runs` is the one home of the block-table walk: token positions to
//! slot runs.

use std::ops::Range;

use pyo3::PyTraverseError;
use pyo3::exceptions::PyValueError;
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString};

use kvtrail::lineage::backend::AddrMap;
use kvtrail::record::wire::{KvLineHead, write_lost};
use kvtrail::schema::Op;

use crate::Guard;

/// Slot runs `(start, count, token_pos)` of token positions `[a, b)` in a
/// block table (block ids; id 0, vLLM's null block, holds nothing and is
/// skipped). A run continues the previous one only when both its slots and
/// its positions do. A table shorter than `b` ends the runs where it ends.
pub fn slot_runs(table: &[u64], bs: u64, a: u64, b: u64, out: &mut Vec<(u64, u64, u64)>) {
    out.clear();
    if b <= a || bs == 0 {
        return;
    }
    for i in a / bs..=(b - 1) / bs {
        let Some(&blk) = usize::try_from(i).ok().and_then(|i| table.get(i)) else {
            break;
        };
        if blk == 0 {
            continue;
        }
        let lo = a.max(i * bs);
        let hi = b.min(i.saturating_add(1).saturating_mul(bs));
        let Some(start) = blk.checked_mul(bs).and_then(|s| s.checked_add(lo - i * bs)) else {
            continue;
        };
        match out.last_mut() {
            Some((s, n, tp))
                if s.checked_add(*n) == Some(start) && tp.checked_add(*n) == Some(lo) =>
            {
                *n += hi - lo
            }
            _ => out.push((start, hi - lo, lo)),
        }
    }
}

/// `slot_runs` for Python: the runs of positions `[a, b)` of `table`.
#[pyfunction(name = "slot_runs")]
pub fn py_slot_runs(table: Vec<u64>, bs: u64, a: u64, b: u64) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    slot_runs(&table, bs, a, b, &mut out);
    out
}

/// What the native step keeps between steps, one per engine (the hook
/// keeps it beside the engine's state), to touch fewer of vLLM's objects
/// each step:
/// - block ids by block object. vLLM's block objects (`KVCacheBlock`)
///   live as long as their pool and never change their `block_id`;
///   reading it from the object each step touches one more cold object
///   per block of every request's table;
/// - per request (by its id object, as the scheduler hands it over): the
///   trace request id, the hook's row, and whether the row's `covered`
///   has reached the prompt (then it no longer moves). The hook forgets a
///   request when it is added and when it is freed.
///
/// Each object is held (a strong reference), so its address names it while
/// it is cached; the cache takes part in Python's garbage collection, so
/// an engine that goes away takes its cache with it. Bounded: each map is
/// cleared when full.
#[pyclass(module = "kvtrail_guard")]
#[derive(Default)]
pub struct StepCache {
    blocks: AddrMap<(u64, Py<PyAny>)>,
    reqs: AddrMap<Known>,
    /// The last step's line buffer, emptied: the next step writes into it
    /// rather than growing a fresh one.
    buf: Vec<u8>,
}

/// A request the step has seen.
struct Known {
    name: Py<PyAny>,
    rid: u64,
    row: Option<Py<PyDict>>,
    /// `covered` reached the prompt: the row needs no more updates.
    done: bool,
}

/// Most block objects (about 50 bytes each, the table's own included) and
/// requests one cache holds.
const BLOCKS_MAX: usize = 1 << 22;
const REQS_MAX: usize = 1 << 20;

#[pymethods]
impl StepCache {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// (block objects, requests) held.
    fn sizes(&self) -> (usize, usize) {
        (self.blocks.len(), self.reqs.len())
    }

    /// Forgets the request whose id object is `name` (added or freed).
    fn forget(&mut self, name: &Bound<'_, PyAny>) {
        self.reqs.remove(&(name.as_ptr() as usize));
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for (_, o) in self.blocks.values() {
            visit.call(o)?;
        }
        for k in self.reqs.values() {
            visit.call(&k.name)?;
            visit.call(&k.row)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.blocks.clear();
        self.reqs.clear();
    }
}

/// The id of block object `b`, from `blocks` (the cache's block ids)
/// when there, else read from the object and kept.
fn block_id(blocks: &mut AddrMap<(u64, Py<PyAny>)>, b: &Bound<'_, PyAny>) -> PyResult<u64> {
    let key = b.as_ptr() as usize;
    if let Some((id, _)) = blocks.get(&key) {
        return Ok(*id);
    }
    let id: u64 = b.getattr(intern!(b.py(), "block_id"))?.extract()?;
    if blocks.len() >= BLOCKS_MAX {
        blocks.clear();
    }
    blocks.insert(key, (id, b.clone().unbind()));
    Ok(id)
}

/// A guard check's answer: (pool, verdict, source request ids, slots
/// foreign, slots unknown, slots read).
type Answer = (i64, &'static str, Vec<u64>, u64, u64, u64);
/// Read runs of one group: (pool, runs (start, count, token_pos)).
type Reads = (i64, Vec<(u64, u64, u64)>);

/// What one step leaves to the hook.
#[pyclass(module = "kvtrail_guard", frozen, get_all)]
pub struct Step {
    /// The step's lines, newline-separated (None: no line).
    text: Option<Py<PyString>>,
    /// Events per pool: (pool, events), a line of several runs counting
    /// one per run and a `lost` line its n.
    counts: Vec<(u16, u64)>,
    /// The events in all (what the client's queue bound counts).
    events: u64,
    /// Requests checked this step: (request id as the engine names it,
    /// trace request id, the answer per group read).
    checks: Vec<(Py<PyAny>, u64, Vec<Answer>)>,
    /// Requests whose reads wait for a load (LMCache): (engine request id,
    /// trace request id, whether a check is due, their reads per group).
    waits: Vec<(Py<PyAny>, u64, bool, Vec<Reads>)>,
    /// Requests whose state could not be read: each left a `lost` line in
    /// every pool of the engine's groups (a hole) instead of events.
    holes: u64,
    /// The guard was busy in another thread for the whole step: it did
    /// not see this step (the hook feeds it a hole per pool) and the
    /// checks due answered `unknown`.
    guard_missed: bool,
}

impl Step {
    /// A step of lines only (no checks, no waits): `out`'s lines, with
    /// `holes` requests unreadable and whether the guard missed it.
    pub(crate) fn of_lines(
        py: Python<'_>,
        out: Out,
        holes: u64,
        guard_missed: bool,
    ) -> PyResult<Step> {
        let text = if out.buf.is_empty() {
            None
        } else {
            // The lines are ASCII (the canonical writer writes nothing else).
            let text = std::str::from_utf8(&out.buf).map_err(crate::err)?;
            Some(PyString::new(py, text).unbind())
        };
        Ok(Step {
            text,
            counts: out.counts,
            events: out.events,
            checks: Vec::new(),
            waits: Vec::new(),
            holes,
            guard_missed,
        })
    }
}

/// One KV cache group of the engine: its pool (None: not recorded), block
/// size, and whether it holds attention KV (a Mamba state group does not).
type Group = (Option<i64>, u64, bool);

/// The head of `pool`'s lines stamped `ts` (a step's lines share it),
/// kept in `head` for the next line.
fn head(head: &mut Option<KvLineHead>, pool: u16, ts: i64) -> &KvLineHead {
    if !head.as_ref().is_some_and(|h| h.is(pool, ts)) {
        *head = Some(KvLineHead::new(pool, ts));
    }
    head.get_or_insert_with(|| KvLineHead::new(pool, ts))
}

/// The step's lines, with their events per pool and in all.
pub(crate) struct Out {
    pub(crate) buf: Vec<u8>,
    pub(crate) counts: Vec<(u16, u64)>,
    pub(crate) events: u64,
    /// The last lines' common head (pool and stamp), kept for the next.
    head: Option<KvLineHead>,
}

impl Out {
    pub(crate) fn with_capacity(bytes: usize) -> Self {
        Self::with_buf(Vec::with_capacity(bytes))
    }

    /// Lines written into `buf` (emptied first), reusing its capacity.
    fn with_buf(mut buf: Vec<u8>) -> Self {
        buf.clear();
        Out {
            buf,
            counts: Vec::new(),
            events: 0,
            head: None,
        }
    }

    fn line(&mut self, pool: u16) {
        self.line_of(pool, 1);
    }

    /// A line that stands for `events` events of `pool` (the hook's
    /// positions and queue bound count events).
    fn line_of(&mut self, pool: u16, events: u64) {
        if !self.buf.is_empty() {
            self.buf.push(b'\n');
        }
        self.events += events;
        match self.counts.iter_mut().find(|c| c.0 == pool) {
            Some(c) => c.1 += events,
            None => self.counts.push((pool, events)),
        }
    }

    /// The lines of `runs` `(start, count, token_pos)`, one line per run
    /// (the lines the shared client writes for the same events); a slot or
    /// position past what a KV line holds (u32) makes the request
    /// unreadable (a hole), never a line the sidecar refuses.
    pub(crate) fn kv(
        &mut self,
        pool: u16,
        ts: i64,
        rid: u64,
        op: Op,
        runs: &[(u64, u64, u64)],
    ) -> PyResult<()> {
        self.per_run(pool, ts, rid, op, runs, |&(a, n, t)| (a, n, Some(t)))
    }

    /// The events of `runs` `(start, count, token_pos)` as one KV line of
    /// several runs (docs/jsonl.md; a third of the bytes of a line per
    /// run), or the canonical line when there is one run; past u32 as in
    /// `kv`.
    pub(crate) fn kv_runs(
        &mut self,
        pool: u16,
        ts: i64,
        rid: u64,
        op: Op,
        runs: &[(u64, u64, u64)],
    ) -> PyResult<()> {
        self.several(pool, ts, rid, op, runs, |&(a, n, t)| (a, n, Some(t)))
    }

    /// Lines of slot runs `(start, count)` with no token position (an
    /// `alloc`), one per run, as in `kv`.
    pub(crate) fn kv_unplaced(
        &mut self,
        pool: u16,
        ts: i64,
        rid: u64,
        op: Op,
        runs: &[(u64, u64)],
    ) -> PyResult<()> {
        self.per_run(pool, ts, rid, op, runs, |&(a, n)| (a, n, None))
    }

    /// One line per run, each run `f(r)`: (start, count, position if
    /// any). A value past u32 is an error; the runs before it are written
    /// (the callers drop the request's lines).
    fn per_run<R>(
        &mut self,
        pool: u16,
        ts: i64,
        rid: u64,
        op: Op,
        runs: &[R],
        f: impl Fn(&R) -> (u64, u64, Option<u64>),
    ) -> PyResult<()> {
        for r in runs {
            let (a, n, t) = narrow(f(r))?;
            self.line(pool);
            head(&mut self.head, pool, ts).kv(&mut self.buf, rid, op, a, n, t);
        }
        Ok(())
    }

    /// Lines of several runs (at most [`RUNS_PER_LINE`] a line), or the
    /// canonical line of one run. A value past u32 is an error, and then
    /// nothing is written.
    fn several<R>(
        &mut self,
        pool: u16,
        ts: i64,
        rid: u64,
        op: Op,
        runs: &[R],
        f: impl Fn(&R) -> (u64, u64, Option<u64>),
    ) -> PyResult<()> {
        if runs.len() < 2 {
            return self.per_run(pool, ts, rid, op, runs, f);
        }
        for r in runs {
            narrow(f(r))?;
        }
        for chunk in runs.chunks(RUNS_PER_LINE) {
            self.line_of(pool, chunk.len() as u64);
            head(&mut self.head, pool, ts).kv_runs(
                &mut self.buf,
                rid,
                op,
                // Checked above: the casts keep every value.
                chunk.iter().map(|r| {
                    let (a, n, t) = f(r);
                    (a as u32, n as u32, t.map(|t| t as u32))
                }),
            );
        }
        Ok(())
    }

    pub(crate) fn lost(&mut self, pool: u16) {
        self.lost_n(pool, 1);
    }

    /// A `lost` line of `n` events of `pool` (a hole of that many).
    fn lost_n(&mut self, pool: u16, n: u64) {
        self.line_of(pool, n);
        write_lost(&mut self.buf, pool, n);
    }
}

/// One event of the hooks' queue as lines (the vLLM hook's `_kv_runs`):
/// `op` (the hooks' op index) by request `rid` over slot runs `(start,
/// count, token_pos)` of `pool` stamped `ts`, the positions dropped unless
/// `placed`; and mirrored into `guard` (unless a read or a free: the rule
/// needs neither) after the items it holds, as the hook's queue orders
/// them. Runs that cannot be written (a value that is not an int from 0
/// to u32, a run that is not three values) are a `lost` line of as many
/// events (a hole the sidecar and the guard both see, counted in `holes`),
/// never a line the sidecar refuses nor an exception. None when there is
/// no run. A guard busy in another thread for the whole call did not see
/// it: `guard_missed`, and the hook feeds it a hole.
#[pyfunction]
#[pyo3(signature = (pool, ts, rid, op, runs, placed, guard=None))]
#[allow(clippy::too_many_arguments)]
pub fn kv_lines<'py>(
    py: Python<'py>,
    pool: u16,
    ts: i64,
    rid: u64,
    op: usize,
    runs: &Bound<'py, PyAny>,
    placed: bool,
    guard: Option<Bound<'py, Guard>>,
) -> PyResult<Option<Step>> {
    let op = crate::op_at(op)?;
    let parsed: PyResult<Vec<(u64, u64, Option<u64>)>> = runs.try_iter().and_then(|it| {
        it.map(|r| r?.extract::<(u64, u64, Option<u64>)>())
            .map(|r| r.map(|(a, n, t)| (a, n, t.filter(|_| placed))))
            .collect()
    });
    match parsed {
        Ok(runs) => event_lines(py, pool, ts, rid, op, runs, guard),
        Err(_) => {
            let n = runs.len().unwrap_or(1).max(1);
            Ok(Some(hole_lines(py, pool, n as u64, op, guard)?))
        }
    }
}

/// [`kv_lines`] of the blocks `blocks` (vLLM's block objects: an
/// allocation, a free, an eviction) of block size `bs`: their slots by
/// ascending block id, runs of consecutive blocks, no position; the null
/// block (id 0) holds nothing. Block ids come from `cache` when given.
/// Blocks that cannot be read are a hole of as many events as blocks were
/// read (at least one).
#[pyfunction]
#[pyo3(signature = (pool, bs, ts, rid, op, blocks, guard=None, cache=None))]
#[allow(clippy::too_many_arguments)]
pub fn block_lines<'py>(
    py: Python<'py>,
    pool: u16,
    bs: u64,
    ts: i64,
    rid: u64,
    op: usize,
    blocks: &Bound<'py, PyAny>,
    guard: Option<Bound<'py, Guard>>,
    cache: Option<Bound<'py, StepCache>>,
) -> PyResult<Option<Step>> {
    let op = crate::op_at(op)?;
    let mut cache = cache.as_ref().and_then(|c| c.try_borrow_mut().ok());
    let mut ids = Vec::new();
    let mut read = || -> PyResult<()> {
        for b in blocks.try_iter()? {
            let b = b?;
            let id = match cache.as_deref_mut() {
                Some(c) => block_id(&mut c.blocks, &b)?,
                None => b.getattr(intern!(py, "block_id"))?.extract()?,
            };
            if id != 0 {
                ids.push(id);
            }
        }
        Ok(())
    };
    if read().is_err() {
        drop(cache);
        return Ok(Some(hole_lines(
            py,
            pool,
            ids.len().max(1) as u64,
            op,
            guard,
        )?));
    }
    drop(cache);
    ids.sort_unstable();
    let mut runs: Vec<(u64, u64, Option<u64>)> = Vec::new();
    for i in ids {
        // A slot past u64 saturates, past u32: a hole (event_lines).
        let s = i.saturating_mul(bs);
        match runs.last_mut() {
            Some((a, n, _)) if a.checked_add(*n) == Some(s) => *n += bs,
            _ => runs.push((s, bs, None)),
        }
    }
    event_lines(py, pool, ts, rid, op, runs, guard)
}

/// Applies `f` to `guard` after the items it holds, unless the rule does
/// not take `op` (a read, a free). False when the guard stayed busy in
/// another thread: it missed the event (the hook feeds it a hole).
fn mirror<'py>(
    py: Python<'py>,
    guard: Option<Bound<'py, Guard>>,
    op: Op,
    f: impl FnOnce(&mut Guard),
) -> bool {
    let Some(g) = guard.filter(|_| crate::mirrored(op)) else {
        return true;
    };
    match borrow(py, &g) {
        Some(mut g) => {
            g.drain(py);
            f(&mut g);
            true
        }
        None => false,
    }
}

/// A `lost` line of `n` events of `pool` for an event of `op` that could
/// not be written, and a hole in the guard where the event would have
/// reached it.
fn hole_lines<'py>(
    py: Python<'py>,
    pool: u16,
    n: u64,
    op: Op,
    guard: Option<Bound<'py, Guard>>,
) -> PyResult<Step> {
    let mut out = Out::with_capacity(64);
    out.lost_n(pool, n);
    let seen = mirror(py, guard, op, |g| {
        g.g.counts.errors += 1;
        g.g.lost(pool);
    });
    Step::of_lines(py, out, 1, !seen)
}

/// The lines of one event's runs and its mirror into the guard (see
/// [`kv_lines`]); runs of no slot are no event.
fn event_lines<'py>(
    py: Python<'py>,
    pool: u16,
    ts: i64,
    rid: u64,
    op: Op,
    mut runs: Vec<(u64, u64, Option<u64>)>,
    guard: Option<Bound<'py, Guard>>,
) -> PyResult<Option<Step>> {
    runs.retain(|r| r.1 > 0);
    if runs.is_empty() {
        return Ok(None);
    }
    let mut out = Out::with_capacity(64 + 36 * runs.len());
    if out.several(pool, ts, rid, op, &runs, |&r| r).is_err() {
        return Ok(Some(hole_lines(py, pool, runs.len() as u64, op, guard)?));
    }
    let seen = mirror(py, guard, op, |g| {
        let rs: Vec<(u64, u64)> = runs.iter().map(|r| (r.0, r.1)).collect();
        if g.g.kv(pool, rid, op, &rs).is_err() {
            g.g.counts.errors += 1;
            g.g.lost(pool);
        }
    });
    Step::of_lines(py, out, 0, !seen).map(Some)
}

/// Most runs on one line the step writes: at most 35 bytes a run, so a
/// line stays under 4.6 KiB, far below the sidecar's 1 MiB line bound
/// (`--max-line-bytes`) and any sensible lower one.
const RUNS_PER_LINE: usize = 128;

fn u32_of(v: u64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| PyValueError::new_err("a slot or position past u32"))
}

/// A run `(start, count, position)` as a KV line holds it (u32s).
fn narrow((a, n, t): (u64, u64, Option<u64>)) -> PyResult<(u32, u32, Option<u32>)> {
    Ok((u32_of(a)?, u32_of(n)?, t.map(u32_of).transpose()?))
}

/// Buffers the first pass reuses from request to request (the step runs
/// on the engine's scheduler thread: no allocation per request).
#[derive(Default)]
struct Scratch {
    ids: Vec<u64>,
    runs: Vec<(u64, u64, u64)>,
    read: Vec<(u64, u64, u64)>,
    /// The step's line counts before the current request.
    counts: Vec<(u16, u64)>,
}

/// What the first pass leaves the second, per request in the step's
/// order.
enum Did {
    /// Its writes (`writes[range]`: pool, start, count), and the index of
    /// its check in `due` when one is due.
    Events {
        rid: u64,
        writes: Range<usize>,
        check: Option<usize>,
    },
    /// Unreadable: a hole in every pool of the engine's groups.
    Hole,
}

/// The schedule step's events, after `Scheduler.schedule` (docs/guard.md):
/// `scheduled` is the step's request id -> tokens scheduled,
/// `requests` the scheduler's requests, `reqs` the hook's rows (`"id"`:
/// the trace request id, `"covered"`: raised to the context computed, up
/// to `"prompt"`),
/// `groups` per KV cache group (pool or None, block size, attention),
/// `tables` per group the manager's `req_to_blocks`, `ts` the stamp,
/// `guard` the native guard (None: unguarded), `guarded` the requests
/// already checked, `waits` the LMCache loads pending (request id -> dict
/// whose `"reads"` is None until the load is seen), `rid_of` the trace
/// request id of a request the hook has no row for, `cache` the engine's
/// [`StepCache`].
///
/// A request whose state cannot be read (a `num_computed_tokens` or id
/// that is not an int, a row or table that is not a dict or list, a group
/// without its table, a slot past u32) gets a `lost` line in every pool of
/// the engine's groups instead of its lines: a hole, never a silent gap.
/// (A scheduled count that is not a positive int schedules nothing, as in
/// vLLM.)
#[pyfunction]
#[pyo3(signature = (scheduled, requests, reqs, groups, tables, ts, guard, guarded, waits, rid_of, cache=None))]
#[allow(clippy::too_many_arguments)]
pub fn schedule_step<'py>(
    py: Python<'py>,
    scheduled: &Bound<'py, PyDict>,
    requests: &Bound<'py, PyDict>,
    reqs: &Bound<'py, PyDict>,
    groups: Vec<Group>,
    tables: &Bound<'py, PyList>,
    ts: i64,
    guard: Option<Bound<'py, Guard>>,
    guarded: Option<Bound<'py, PySet>>,
    waits: &Bound<'py, PyDict>,
    rid_of: &Bound<'py, PyAny>,
    cache: Option<Bound<'py, StepCache>>,
) -> PyResult<Step> {
    let pools: Vec<Option<u16>> = groups
        .iter()
        .map(|&(p, bs, att)| {
            p.and_then(|p| u16::try_from(p).ok())
                .filter(|_| att && bs > 0)
        })
        .collect();
    // A group's table that is missing or not a dict: its requests are holes.
    let tables: Vec<Option<Bound<'py, PyDict>>> = (0..groups.len())
        .map(|g| {
            tables
                .get_item(g)
                .ok()
                .and_then(|t| t.cast_into::<PyDict>().ok())
        })
        .collect();
    let mut holed: Vec<u16> = Vec::new();
    for p in pools.iter().flatten() {
        if !holed.contains(p) {
            holed.push(*p);
        }
    }
    let mut step = Step {
        text: None,
        counts: Vec::new(),
        events: 0,
        checks: Vec::new(),
        waits: Vec::new(),
        holes: 0,
        guard_missed: false,
    };
    // Another thread in this engine's step (never: the scheduler has one)
    // only means this step reads the ids from the objects.
    let mut cache = cache.as_ref().and_then(|c| c.try_borrow_mut().ok());
    let mut out = match cache.as_deref_mut() {
        Some(c) => Out::with_buf(std::mem::take(&mut c.buf)),
        None => Out::with_capacity(scheduled.len() * 2 * 140),
    };
    let mut did: Vec<Did> = Vec::with_capacity(scheduled.len());
    let mut writes: Vec<(u16, u64, u64)> = Vec::new();
    // Checks due: (engine request id, trace request id, reads per group).
    let mut due: Vec<(Py<PyAny>, u64, Vec<Reads>)> = Vec::new();
    let mut scratch = Scratch::default();
    let mut reads: Vec<Reads> = Vec::new();
    let waits = (!waits.is_empty()).then_some(waits);
    let checking = guard.is_some();
    for (name, n) in scheduled.iter() {
        let n: i64 = n.extract().unwrap_or(0);
        if n <= 0 {
            continue;
        }
        let Some(req) = requests.get_item(&name)? else {
            continue;
        };
        reads.clear();
        // Where this request's lines begin (restored if it is a hole).
        scratch.counts.clear();
        scratch.counts.extend_from_slice(&out.counts);
        let mark = (out.buf.len(), out.events, writes.len());
        let cx = Cx {
            py,
            reqs,
            groups: &groups,
            pools: &pools,
            tables: &tables,
            ts,
            checking,
            guarded: guarded.as_ref(),
            waits,
            rid_of,
        };
        let r = request(
            &cx,
            &name,
            &req,
            n,
            cache.as_deref_mut(),
            &mut out,
            &mut scratch,
            &mut writes,
            &mut reads,
        );
        match r {
            Ok((rid, due_now)) => {
                let check = match due_now {
                    Some(Due::Check) => {
                        due.push((name.unbind(), rid, std::mem::take(&mut reads)));
                        Some(due.len() - 1)
                    }
                    Some(Due::Wait(check)) => {
                        step.waits
                            .push((name.unbind(), rid, check, std::mem::take(&mut reads)));
                        None
                    }
                    None => None,
                };
                did.push(Did::Events {
                    rid,
                    writes: mark.2..writes.len(),
                    check,
                });
            }
            Err(_) => {
                // What this request's step did cannot be told: its partial
                // lines go, and a hole goes in each pool, never a guess.
                out.buf.truncate(mark.0);
                std::mem::swap(&mut out.counts, &mut scratch.counts);
                out.events = mark.1;
                writes.truncate(mark.2);
                step.holes += 1;
                for &p in &holed {
                    out.lost(p);
                }
                did.push(Did::Hole);
            }
        }
    }
    // The second pass: the guard, with no Python call while it is held.
    if let Some(g) = &guard {
        match borrow(py, g) {
            Some(mut g) => {
                g.drain(py);
                let mut answers: Vec<Vec<Answer>> = vec![Vec::new(); due.len()];
                for d in &did {
                    match d {
                        Did::Events {
                            rid,
                            writes: w,
                            check,
                        } => {
                            for &(pool, a, k) in &writes[w.clone()] {
                                if g.g.kv(pool, *rid, Op::Write, &[(a, k)]).is_err() {
                                    g.g.counts.errors += 1;
                                    g.g.lost(pool);
                                }
                            }
                            if let Some(i) = check {
                                answers[*i] =
                                    due[*i].2.iter().map(|r| answer(&mut g, *rid, r)).collect();
                            }
                        }
                        Did::Hole => {
                            for &p in &holed {
                                g.g.lost(p);
                            }
                        }
                    }
                }
                for ((name, rid, _), a) in due.into_iter().zip(answers) {
                    step.checks.push((name, rid, a));
                }
            }
            None => {
                step.guard_missed = true;
                for (name, rid, rs) in due {
                    let a = rs.iter().map(|(pool, r)| unknown(*pool, r)).collect();
                    step.checks.push((name, rid, a));
                }
            }
        }
    }
    if !out.buf.is_empty() {
        // The lines are ASCII (the canonical writer writes nothing else).
        let text = std::str::from_utf8(&out.buf).map_err(crate::err)?;
        step.text = Some(PyString::new(py, text).unbind());
    }
    step.counts = out.counts;
    step.events = out.events;
    if let Some(c) = cache.as_deref_mut() {
        // Kept for the next step, unless one step's burst made it large.
        if out.buf.capacity() <= BUF_KEEP {
            c.buf = out.buf;
        }
    }
    Ok(step)
}

/// The largest line buffer a cache keeps between steps (a decode step at
/// batch 256 writes about 100 KiB).
const BUF_KEEP: usize = 4 << 20;

/// The guard, waiting (with the GIL released) while another thread's call
/// into it ends; None when it stays busy.
pub(crate) fn borrow<'py>(py: Python<'py>, g: &Bound<'py, Guard>) -> Option<PyRefMut<'py, Guard>> {
    for _ in 0..10_000 {
        if let Ok(r) = g.try_borrow_mut() {
            return Some(r);
        }
        py.detach(std::thread::yield_now);
    }
    None
}

/// The guard's answer to a request's read of one group; a check that
/// fails is a read it cannot vouch for: unknown.
fn answer(g: &mut Guard, rid: u64, (pool, runs): &Reads) -> Answer {
    let Ok(p) = u16::try_from(*pool) else {
        return unknown(*pool, runs);
    };
    let rs: Vec<(u64, u64)> = runs.iter().map(|r| (r.0, r.1)).collect();
    match g.g.check(p, rid, &rs) {
        Ok(t) => (
            *pool,
            t.verdict(),
            t.sources.clone(),
            t.foreign,
            t.unknown,
            t.slots(),
        ),
        Err(_) => {
            g.g.counts.errors += 1;
            unknown(*pool, runs)
        }
    }
}

fn unknown(pool: i64, runs: &[(u64, u64, u64)]) -> Answer {
    let n = runs.iter().map(|r| r.1).sum();
    (pool, "unknown", Vec::new(), 0, n, n)
}

/// What a request leaves for after its lines: a guard check (its reads
/// are in `reads`), or a wait for its load (whether a check is due).
enum Due {
    Check,
    Wait(bool),
}

/// The step's inputs every request reads.
struct Cx<'a, 'py> {
    py: Python<'py>,
    reqs: &'a Bound<'py, PyDict>,
    groups: &'a [Group],
    pools: &'a [Option<u16>],
    tables: &'a [Option<Bound<'py, PyDict>>],
    ts: i64,
    checking: bool,
    guarded: Option<&'a Bound<'py, PySet>>,
    waits: Option<&'a Bound<'py, PyDict>>,
    rid_of: &'a Bound<'py, PyAny>,
}

/// One request's lines and writes (see `schedule_step`): its trace id and
/// what is due after.
#[allow(clippy::too_many_arguments)]
fn request<'py>(
    cx: &Cx<'_, 'py>,
    name: &Bound<'py, PyAny>,
    req: &Bound<'py, PyAny>,
    n: i64,
    mut cache: Option<&mut StepCache>,
    out: &mut Out,
    scratch: &mut Scratch,
    writes: &mut Vec<(u16, u64, u64)>,
    reads: &mut Vec<Reads>,
) -> PyResult<(u64, Option<Due>)> {
    let py = cx.py;
    let Scratch {
        ids, runs, read, ..
    } = scratch;
    let end: i64 = req.getattr(intern!(py, "num_computed_tokens"))?.extract()?;
    let c = end - n;
    let key = name.as_ptr() as usize;
    let known = cache
        .as_deref()
        .and_then(|k| k.reqs.get(&key))
        .map(|k| (k.rid, k.row.as_ref().map(|r| r.bind(py).clone()), k.done));
    let (rid, row, done) = match known {
        Some(k) => k,
        None => {
            let row = match cx.reqs.get_item(name)? {
                Some(r) => Some(r.cast_into::<PyDict>()?),
                None => None,
            };
            let rid: u64 = match &row {
                Some(r) => r
                    .get_item(intern!(py, "id"))?
                    .ok_or_else(|| PyValueError::new_err("no id"))?
                    .extract()?,
                None => cx.rid_of.call1((req,))?.extract()?,
            };
            if let Some(k) = cache.as_deref_mut() {
                if k.reqs.len() >= REQS_MAX {
                    k.reqs.clear();
                }
                k.reqs.insert(
                    key,
                    Known {
                        name: name.clone().unbind(),
                        rid,
                        row: row.as_ref().map(|r| r.clone().unbind()),
                        done: false,
                    },
                );
            }
            (rid, row, false)
        }
    };
    let check = c > 0
        && cx.checking
        && !cx
            .guarded
            .is_some_and(|s| s.contains(name).unwrap_or(false));
    let wait = match cx.waits {
        Some(w) => match w.get_item(name)? {
            Some(d) => d.get_item(intern!(py, "reads"))?.is_none(),
            None => false,
        },
        None => false,
    };
    let (c, end) = (
        u64::try_from(c.max(0)).unwrap_or(0),
        u64::try_from(end).unwrap_or(0),
    );
    for (g, (&(pool_id, bs, _), &pool)) in cx.groups.iter().zip(cx.pools).enumerate() {
        let Some(pool) = pool else { continue };
        let Some(table) = &cx.tables[g] else {
            return Err(PyValueError::new_err("no block table for the group"));
        };
        ids.clear();
        if let Some(blocks) = table.get_item(name)? {
            let blocks = blocks.cast_into::<PyList>()?;
            // Only the blocks the context reaches.
            let want = usize::try_from(end.div_ceil(bs)).unwrap_or(usize::MAX);
            for b in blocks.iter().take(want) {
                ids.push(match cache.as_deref_mut() {
                    Some(c) => block_id(&mut c.blocks, &b)?,
                    None => b.getattr(intern!(py, "block_id"))?.extract()?,
                });
            }
        }
        slot_runs(ids, bs, c, end, runs);
        out.kv_runs(pool, cx.ts, rid, Op::Write, runs)?;
        writes.extend(runs.iter().map(|&(a, k, _)| (pool, a, k)));
        slot_runs(ids, bs, 0, end, read);
        if !wait {
            out.kv_runs(pool, cx.ts, rid, Op::Read, read)?;
        }
        if check || wait {
            reads.push((pool_id.unwrap_or(-1), read.clone()));
        }
    }
    if let Some(r) = row.as_ref().filter(|_| !done) {
        // `covered`: how much of the prompt the engine computed (the row's
        // prefilled tokens); past the prompt it no longer moves.
        let int = |k: &Bound<'py, PyString>| -> PyResult<Option<u64>> {
            Ok(match r.get_item(k)? {
                Some(v) => v.extract().ok(),
                None => None,
            })
        };
        let covered = int(intern!(py, "covered"))?.unwrap_or(0);
        if end > covered {
            let prompt = int(intern!(py, "prompt"))?.unwrap_or(u64::MAX);
            if covered < prompt {
                r.set_item(intern!(py, "covered"), end.min(prompt))?;
            }
            if end >= prompt
                && let Some(k) = cache.and_then(|k| k.reqs.get_mut(&key))
            {
                k.done = true;
            }
        }
    }
    Ok((
        rid,
        if wait {
            Some(Due::Wait(check))
        } else if check {
            Some(Due::Check)
        } else {
            None
        },
    ))
}
