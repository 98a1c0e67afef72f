//! The vLLM hook's per-step events, built in one native call per scheduler
//! step (`schedule_step`): for every request scheduled, the `write` of the
//! tokens it computes this step and the `read` of its whole context, per KV
//! cache group, as the canonical KV lines the sidecar reads
//! (`kvtrail::record::wire::write_canonical_kv`); the writes mirrored into
//! the guard; and the guard's check of a request's first step over KV it
//! did not compute, made in the stream's order. The Python hook only queues
//! the lines (one queue item a step) and acts on the checks.
//!
//! `slot_runs` is the one home of the block-table walk: token positions to
//! slot runs.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString};

use kvtrail::record::wire::write_canonical_kv;
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
            Some((s, n, tp)) if *s + *n == start && *tp + *n == lo => *n += hi - lo,
            _ => out.push((start, hi - lo, lo)),
        }
    }
}

/// Block ids by block object. vLLM's block objects (`KVCacheBlock`) live
/// as long as their pool and never change their `block_id`; reading it
/// from the object each step touches one more cold object per block of
/// every request's table. Each object is held (a strong reference), so its
/// address names it while it is cached. Bounded: cleared when full.
struct BlockIds {
    map: HashMap<usize, (u64, Py<PyAny>), BuildHasherDefault<AddrHasher>>,
}

/// Most block objects cached (about 40 bytes each).
const BLOCK_IDS_MAX: usize = 1 << 22;

static BLOCK_IDS: Mutex<BlockIds> = Mutex::new(BlockIds {
    map: HashMap::with_hasher(BuildHasherDefault::new()),
});

impl BlockIds {
    fn id(&mut self, b: &Bound<'_, PyAny>) -> PyResult<u64> {
        let key = b.as_ptr() as usize;
        if let Some((id, _)) = self.map.get(&key) {
            return Ok(*id);
        }
        let id: u64 = b.getattr(intern!(b.py(), "block_id"))?.extract()?;
        if self.map.len() >= BLOCK_IDS_MAX {
            self.map.clear();
        }
        self.map.insert(key, (id, b.clone().unbind()));
        Ok(id)
    }
}

/// A hasher for object addresses (aligned: the low bits carry nothing).
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = ((n as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// `slot_runs` for Python: the runs of positions `[a, b)` of `table`.
#[pyfunction(name = "slot_runs")]
pub fn py_slot_runs(table: Vec<u64>, bs: u64, a: u64, b: u64) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    slot_runs(&table, bs, a, b, &mut out);
    out
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
    /// Lines per pool: (pool, lines), a `lost` line counting its n.
    counts: Vec<(u16, u64)>,
    /// The lines in all.
    lines: u64,
    /// Requests checked this step: (request id as the engine names it,
    /// trace request id, the answer per group read).
    checks: Vec<(Py<PyAny>, u64, Vec<Answer>)>,
    /// Requests whose reads wait for a load (LMCache): (engine request id,
    /// trace request id, whether a check is due, their reads per group).
    waits: Vec<(Py<PyAny>, u64, bool, Vec<Reads>)>,
    /// Requests whose state could not be read: each left a `lost` line in
    /// its pools (a hole) instead of events.
    holes: u64,
}

/// One KV cache group of the engine: its pool (None: not recorded), block
/// size, and whether it holds attention KV (a Mamba state group does not).
type Group = (Option<i64>, u64, bool);

/// Per step scratch, reused.
struct Out {
    buf: Vec<u8>,
    counts: Vec<(u16, u64)>,
    lines: u64,
}

impl Out {
    fn line(&mut self, pool: u16) {
        if !self.buf.is_empty() {
            self.buf.push(b'\n');
        }
        self.lines += 1;
        match self.counts.iter_mut().find(|c| c.0 == pool) {
            Some(c) => c.1 += 1,
            None => self.counts.push((pool, 1)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn kv(&mut self, pool: u16, ts: i64, rid: u64, op: Op, runs: &[(u64, u64, u64)]) {
        for &(start, n, tp) in runs {
            self.line(pool);
            write_canonical_kv(&mut self.buf, pool, ts, rid, op, start, n, Some(tp));
        }
    }

    fn lost(&mut self, pool: u16) {
        self.line(pool);
        self.buf.extend_from_slice(br#"{"type":"lost","pool":"#);
        self.buf.extend_from_slice(pool.to_string().as_bytes());
        self.buf.extend_from_slice(br#","n":1}"#);
    }
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
/// request id of a request the hook has no row for.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn schedule_step<'py>(
    py: Python<'py>,
    scheduled: &Bound<'py, PyDict>,
    requests: &Bound<'py, PyDict>,
    reqs: &Bound<'py, PyDict>,
    groups: Vec<Group>,
    tables: &Bound<'py, PyList>,
    ts: i64,
    mut guard: Option<PyRefMut<'py, Guard>>,
    guarded: Option<Bound<'py, PySet>>,
    waits: &Bound<'py, PyDict>,
    rid_of: &Bound<'py, PyAny>,
) -> PyResult<Step> {
    if tables.len() < groups.len() {
        return Err(PyValueError::new_err(
            "kvtrail schedule_step: fewer block tables than groups",
        ));
    }
    if let Some(g) = guard.as_mut() {
        g.drain(py);
    }
    let pools: Vec<Option<u16>> = groups
        .iter()
        .map(|&(p, bs, att)| {
            p.and_then(|p| u16::try_from(p).ok())
                .filter(|_| att && bs > 0)
        })
        .collect();
    let tables: Vec<Bound<'py, PyDict>> = tables
        .iter()
        .take(groups.len())
        .map(|t| t.cast_into::<PyDict>().map_err(PyErr::from))
        .collect::<PyResult<_>>()?;
    let mut out = Out {
        buf: Vec::with_capacity(scheduled.len() * 2 * 140),
        counts: Vec::new(),
        lines: 0,
    };
    let mut step = Step {
        text: None,
        counts: Vec::new(),
        lines: 0,
        checks: Vec::new(),
        waits: Vec::new(),
        holes: 0,
    };
    let mut ids: Vec<u64> = Vec::new();
    let mut writes = Vec::new();
    let mut reads: Vec<Reads> = Vec::new();
    let some_waits = !waits.is_empty();
    // Never waited for: another thread holding it (it calls into Python
    // while it does) only means this step reads the ids from the objects.
    let mut cache = BLOCK_IDS.try_lock().ok();
    for (name, n) in scheduled.iter() {
        let n: i64 = n.extract().unwrap_or(0);
        if n <= 0 {
            continue;
        }
        let Some(req) = requests.get_item(&name)? else {
            continue;
        };
        reads.clear();
        let r = request(
            py,
            &name,
            &req,
            n,
            reqs,
            &groups,
            &pools,
            &tables,
            ts,
            guard.as_deref_mut(),
            guarded.as_ref(),
            some_waits.then_some(waits),
            rid_of,
            cache.as_deref_mut(),
            &mut out,
            &mut ids,
            &mut writes,
            &mut reads,
        );
        match r {
            Ok(Some(Due::Check(rid))) => {
                let g = guard
                    .as_deref_mut()
                    .expect("a check is due only when guarded");
                let mut answers = Vec::with_capacity(reads.len());
                for (pool, runs) in &reads {
                    let t = match u16::try_from(*pool) {
                        Ok(p) => {
                            let rs: Vec<(u64, u64)> = runs.iter().map(|r| (r.0, r.1)).collect();
                            g.g.check(p, rid, &rs).map_err(crate::err)?
                        }
                        Err(_) => continue,
                    };
                    answers.push((
                        *pool,
                        t.verdict(),
                        t.sources.clone(),
                        t.foreign,
                        t.unknown,
                        t.slots(),
                    ));
                }
                step.checks.push((name.unbind(), rid, answers));
            }
            Ok(Some(Due::Wait(rid, check))) => {
                step.waits
                    .push((name.unbind(), rid, check, std::mem::take(&mut reads)));
            }
            Ok(None) => {}
            Err(_) => {
                // What this request's step did cannot be told: a hole in
                // each of its pools, never a guess.
                step.holes += 1;
                let mut seen: Vec<u16> = Vec::new();
                for p in pools.iter().flatten() {
                    if !seen.contains(p) {
                        seen.push(*p);
                        out.lost(*p);
                        if let Some(g) = guard.as_deref_mut() {
                            g.g.lost(*p);
                        }
                    }
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
    step.lines = out.lines;
    Ok(step)
}

/// What a request leaves for after its lines: a guard check (its reads
/// are in `reads`), or a wait for its load.
enum Due {
    Check(u64),
    Wait(u64, bool),
}

/// One request's lines (see `schedule_step`).
#[allow(clippy::too_many_arguments)]
fn request<'py>(
    py: Python<'py>,
    name: &Bound<'py, PyAny>,
    req: &Bound<'py, PyAny>,
    n: i64,
    reqs: &Bound<'py, PyDict>,
    groups: &[Group],
    pools: &[Option<u16>],
    tables: &[Bound<'py, PyDict>],
    ts: i64,
    mut guard: Option<&mut Guard>,
    guarded: Option<&Bound<'py, PySet>>,
    waits: Option<&Bound<'py, PyDict>>,
    rid_of: &Bound<'py, PyAny>,
    mut cache: Option<&mut BlockIds>,
    out: &mut Out,
    ids: &mut Vec<u64>,
    writes: &mut Vec<(u64, u64, u64)>,
    reads: &mut Vec<Reads>,
) -> PyResult<Option<Due>> {
    let end: i64 = req.getattr(intern!(py, "num_computed_tokens"))?.extract()?;
    let c = end - n;
    let row = match reqs.get_item(name)? {
        Some(r) => Some(r.cast_into::<PyDict>()?),
        None => None,
    };
    let rid: u64 = match &row {
        Some(r) => r
            .get_item(intern!(py, "id"))?
            .ok_or_else(|| PyValueError::new_err("no id"))?
            .extract()?,
        None => rid_of.call1((req,))?.extract()?,
    };
    let check =
        c > 0 && guard.is_some() && !guarded.is_some_and(|s| s.contains(name).unwrap_or(false));
    let wait = match waits {
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
    for (g, (&(pool_id, bs, _), &pool)) in groups.iter().zip(pools).enumerate() {
        let Some(pool) = pool else { continue };
        ids.clear();
        if let Some(blocks) = tables[g].get_item(name)? {
            let blocks = blocks.cast_into::<PyList>()?;
            // Only the blocks the context reaches.
            let want = usize::try_from(end.div_ceil(bs)).unwrap_or(usize::MAX);
            for b in blocks.iter().take(want) {
                ids.push(match cache.as_deref_mut() {
                    Some(c) => c.id(&b)?,
                    None => b.getattr(intern!(py, "block_id"))?.extract()?,
                });
            }
        }
        slot_runs(ids, bs, c, end, writes);
        out.kv(pool, ts, rid, Op::Write, writes);
        if let Some(g) = guard.as_deref_mut() {
            for &(a, k, _) in writes.iter() {
                g.g.kv(pool, rid, Op::Write, &[(a, k)])
                    .map_err(crate::err)?;
            }
        }
        let mut read = Vec::new();
        slot_runs(ids, bs, 0, end, &mut read);
        if !wait {
            out.kv(pool, ts, rid, Op::Read, &read);
        }
        if check || wait {
            reads.push((pool_id.unwrap_or(-1), read));
        }
    }
    if let Some(r) = &row {
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
        }
    }
    Ok(if wait {
        Some(Due::Wait(rid, check))
    } else if check {
        Some(Due::Check(rid))
    } else {
        None
    })
}
