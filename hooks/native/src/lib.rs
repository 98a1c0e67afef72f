//! `kvtrail_guard`: the guard the engine hooks (kvtrail_sglang,
//! kvtrail_vllm) run in the engine process, a Python module built from
//! kvtrail (PyO3 + maturin). It mirrors the pool events the hook queues for
//! the sidecar into the lineage slot rule (`kvtrail::lineage::rule`, the one
//! home of the rule), and answers, before a request's first forward over KV
//! it did not compute, whether every slot it will read is its own, granted,
//! foreign (whose) or unknown. docs/guard.md.
//!
//! It also builds the vLLM hook's per-step events (`schedule_step`, the
//! `step` module): the hook's hot path, one native call per scheduler step.

mod guard;
mod sglang;
mod step;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyRange, PyRangeMethods, PyTuple};

use kvtrail::schema::Op;

use guard::runs_of;

/// Items `push` holds before it applies them (the hooks' queue items are
/// immutable once queued: the sender thread formats them later too).
const PENDING: usize = 1024;

// Event kinds and ops in the hooks' queue (kvtrail_hook_client).
const KV: i64 = 0;
const SEND: i64 = 2;
const COMMIT: i64 = 3;
const LOST: i64 = 4;
const PULL: i64 = 5;
const COPY: i64 = 6;
const REQ: i64 = 1;

/// The item kinds above by the client's names: the module exports them
/// (`KINDS`, and the ops in code order as `OPS`) so that a hook refuses a
/// module that numbers them otherwise than its client does
/// (`kvtrail_hook_client.native_mismatch`), instead of misreading items.
const KINDS: [(&str, i64); 7] = [
    ("KV", KV),
    ("REQ", REQ),
    ("SEND", SEND),
    ("COMMIT", COMMIT),
    ("LOST", LOST),
    ("PULL", PULL),
    ("COPY", COPY),
];

/// The op of the hooks' op index `i` (kvtrail_hook_client's `OPS`, in
/// the order of the op's code, `Op::ALL`).
pub(crate) fn op_at(i: usize) -> PyResult<Op> {
    Op::ALL.get(i).copied().ok_or_else(|| err("unknown op"))
}

/// Whether the rule takes `op` as an event: a read is a check, a free
/// changes no content.
pub(crate) fn mirrored(op: Op) -> bool {
    !matches!(op, Op::Read | Op::Free)
}

/// The run of a step-1 range of at least one index (None: another kind
/// of index, or a range `runs` handles).
fn one_run(idx: &Bound<'_, PyAny>) -> PyResult<Option<(u64, u64)>> {
    let Ok(r) = idx.cast::<PyRange>() else {
        return Ok(None);
    };
    let (a, b) = (r.start()?, r.stop()?);
    if a < 0 || b <= a || r.step()? != 1 {
        return Ok(None);
    }
    Ok(Some((a as u64, (b - a) as u64)))
}

/// Slot runs (start, count) of an index list, range, array or tensor.
fn runs(idx: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64)>> {
    if let Ok(r) = idx.cast::<PyRange>() {
        let (a, b, step) = (r.start()?, r.stop()?, r.step()?);
        if step == 1 {
            return Ok(if b > a && a >= 0 {
                vec![(a as u64, (b - a) as u64)]
            } else {
                vec![]
            });
        }
    }
    let v: Vec<i64> = if idx.cast::<PyList>().is_ok() || idx.cast::<PyTuple>().is_ok() {
        idx.extract()?
    } else if idx.hasattr("tolist")? {
        idx.call_method0("tolist")?.extract()?
    } else {
        idx.extract()?
    };
    Ok(runs_of(&v))
}

fn pool_id(p: i64) -> Option<u16> {
    u16::try_from(p).ok()
}

fn err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("kvtrail guard: {e}"))
}

/// The guard of one engine process.
#[pyclass(module = "kvtrail_guard")]
struct Guard {
    g: guard::Guard,
    /// Items `push` took and has not applied yet, in the hook's order.
    pending: Vec<Py<PyTuple>>,
}

#[pymethods]
impl Guard {
    #[new]
    fn new() -> Self {
        Guard {
            g: guard::Guard::default(),
            pending: Vec::new(),
        }
    }

    /// One item of the hook's queue (the SGLang hook's every item, the vLLM
    /// hook's items other than its step's writes): held, and applied in
    /// order with the others before anything reads the state (a check,
    /// stats, `sees`, a page size) or once [`PENDING`] are held. Items the
    /// rule need not see (requests, reads, frees) are dropped here. An
    /// item that cannot be applied is counted in `errors` and leaves a hole
    /// in its pool, as `feed` does, but raises nothing.
    fn push(&mut self, py: Python<'_>, item: &Bound<'_, PyAny>) {
        let Ok(t) = item.cast::<PyTuple>() else {
            self.g.counts.errors += 1;
            return;
        };
        if !wanted(t) {
            return;
        }
        self.pending.push(t.clone().unbind());
        if self.pending.len() >= PENDING {
            self.drain(py);
        }
    }

    /// Many items of the hook's queue (a list or any iterable), in order:
    /// `push` for each, in one call.
    fn feed_many(&mut self, py: Python<'_>, items: &Bound<'_, PyAny>) -> PyResult<()> {
        if let Ok(l) = items.cast::<PyList>() {
            for it in l.iter() {
                self.push(py, &it);
            }
        } else {
            for it in items.try_iter()? {
                self.push(py, &it?);
            }
        }
        Ok(())
    }

    /// Applies what `push` holds (the hooks need not call it: every read
    /// of the state does).
    fn flush(&mut self, py: Python<'_>) {
        self.drain(py);
    }

    /// The page size of `pool` (slots per page of its transfer pages).
    fn page_size(&mut self, py: Python<'_>, pool: i64, page_size: u64) {
        self.drain(py);
        if let Some(p) = pool_id(pool) {
            self.g.set_page_size(p, page_size);
        }
    }

    /// Whether this process reports events of `pool`.
    fn sees(&mut self, py: Python<'_>, pool: i64) -> bool {
        self.drain(py);
        pool_id(pool).is_some_and(|p| self.g.sees(p))
    }

    /// One item of the hook's queue, as the hook queues it for the sidecar.
    /// A malformed item raises ValueError and leaves a hole in its pool
    /// (later checks of what it may have changed answer unknown).
    fn feed(&mut self, py: Python<'_>, item: &Bound<'_, PyTuple>) -> PyResult<()> {
        self.drain(py);
        let kind: i64 = item.get_item(0)?.extract()?;
        let Some(pool) = pool_id(item.get_item(1)?.extract()?) else {
            return Ok(());
        };
        let out = self.feed_kind(kind, pool, item);
        if out.is_err() {
            self.g.counts.errors += 1;
            self.g.lost(pool);
        }
        out
    }

    /// Classifies the read of `slots` (indices) of `pool` by `request_id`:
    /// (verdict, source request ids, slots foreign, slots unknown, slots
    /// read), verdict one of "ok", "foreign", "unknown".
    fn check(
        &mut self,
        pool: i64,
        request_id: u64,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<(&'static str, Vec<u64>, u64, u64, u64)> {
        let r = runs(slots)?;
        self.check_runs(slots.py(), pool, request_id, r)
    }

    /// `check` over slot runs (start, count).
    fn check_runs(
        &mut self,
        py: Python<'_>,
        pool: i64,
        request_id: u64,
        runs: Vec<(u64, u64)>,
    ) -> PyResult<(&'static str, Vec<u64>, u64, u64, u64)> {
        self.drain(py);
        let t = match pool_id(pool) {
            Some(p) => self.g.check(p, request_id, &runs).map_err(err)?,
            None => guard::Tally {
                unknown: runs.iter().map(|r| r.1).sum(),
                ..Default::default()
            },
        };
        Ok((
            t.verdict(),
            t.sources.clone(),
            t.foreign,
            t.unknown,
            t.slots(),
        ))
    }

    /// Counters: events mirrored, copies (local: from a pool this process
    /// sees; remote: content of unknown owner), holes, checks, errors, and
    /// the slots its tables hold (memory: about 24 bytes per slot).
    fn stats<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.drain(py);
        let c = &self.g.counts;
        let d = PyDict::new(py);
        d.set_item("events", c.events)?;
        d.set_item("copies_local", c.copies_local)?;
        d.set_item("copies_remote", c.copies_remote)?;
        d.set_item("holes", c.holes)?;
        d.set_item("checks", c.checks)?;
        d.set_item("errors", c.errors)?;
        d.set_item("slots_allocated", self.g.slots_allocated())?;
        Ok(d)
    }
}

impl Guard {
    /// Applies the held items in order; one that cannot be applied is
    /// counted and leaves a hole in its pool.
    fn drain(&mut self, py: Python<'_>) {
        if self.pending.is_empty() {
            return;
        }
        let items = std::mem::take(&mut self.pending);
        for it in &items {
            let t = it.bind(py);
            let pool = match t.get_item(1).and_then(|p| p.extract::<i64>()) {
                Ok(p) => pool_id(p),
                Err(_) => {
                    self.g.counts.errors += 1;
                    continue;
                }
            };
            let Some(pool) = pool else { continue };
            let kind = t.get_item(0).and_then(|k| k.extract::<i64>());
            if kind.and_then(|k| self.feed_kind(k, pool, t)).is_err() {
                self.g.counts.errors += 1;
                self.g.lost(pool);
            }
        }
        // Reuse the buffer (the references drop here).
        self.pending = items;
        self.pending.clear();
    }

    fn feed_kind(&mut self, kind: i64, pool: u16, item: &Bound<'_, PyTuple>) -> PyResult<()> {
        let at = |i: usize| item.get_item(i);
        match kind {
            KV => {
                // (KV, pool, ts, rid, op, idx, tpos, page_size)
                let op = op_at(at(4)?.extract()?)?;
                if !mirrored(op) {
                    return Ok(());
                }
                let rid: u64 = at(3)?.extract()?;
                let idx = at(5)?;
                // The hooks' usual index: one range (no run list to build).
                if let Some(run) = one_run(&idx)? {
                    return self.g.kv(pool, rid, op, &[run]).map_err(err);
                }
                let r = runs(&idx)?;
                self.g.kv(pool, rid, op, &r).map_err(err)
            }
            SEND => {
                // (SEND, pool, ts, room, dst_index, pages, last)
                let room: u64 = at(3)?.extract()?;
                let dst_index: u64 = at(4)?.extract()?;
                let pages = flat(&at(5)?)?;
                self.g.send(room, pool, dst_index, &pages);
                Ok(())
            }
            COMMIT => {
                // (COMMIT, pool, ts, room, rid, prefix_len, pages)
                let room: u64 = at(3)?.extract()?;
                let rid: u64 = at(4)?.extract()?;
                let pages = flat(&at(6)?)?;
                self.g.commit(room, pool, rid, &pages).map_err(err)
            }
            LOST => {
                self.g.lost(pool);
                Ok(())
            }
            PULL => {
                // (PULL, pool, ts, rid, src_pool, runs (dst, src, n, tp),
                // outcome, policy[, src_blocks, tail]): the block form when
                // src_blocks is given (runs then (dst, src_tok, n, tp)).
                let rid: u64 = at(3)?.extract()?;
                let Some(src) = pool_id(at(4)?.extract()?) else {
                    self.g.lost(pool);
                    return Ok(());
                };
                let rs: Vec<(u32, u32, u32, Option<u32>)> = at(5)?.extract()?;
                let rs: Vec<(u32, u32, u32, u32)> = rs
                    .into_iter()
                    .map(|(d, s, n, tp)| (d, s, n, tp.unwrap_or(0)))
                    .collect();
                let (blocks, tail): (Option<Vec<u32>>, Option<u32>) = if item.len() > 8 {
                    (at(8)?.extract()?, at(9)?.extract()?)
                } else {
                    (None, None)
                };
                self.g
                    .pull(pool, rid, src, &rs, blocks.as_deref(), tail)
                    .map_err(err)
            }
            COPY => {
                // (COPY, pool, ts, rid, src_pool, runs (dst, src, n))
                let rid: u64 = at(3)?.extract()?;
                let Some(src) = pool_id(at(4)?.extract()?) else {
                    self.g.lost(pool);
                    return Ok(());
                };
                let rs: Vec<(u64, u64, u64)> = at(5)?.extract()?;
                self.g.copy(pool, rid, src, &rs).map_err(err)
            }
            _ => Ok(()),
        }
    }
}

/// Whether the rule needs this queue item: not a request row, a read (a
/// check, not an event) or a free (it changes no content).
fn wanted(t: &Bound<'_, PyTuple>) -> bool {
    let Ok(k) = t.get_borrowed_item(0) else {
        return true; // malformed: applied, so counted
    };
    match k.extract::<i64>() {
        // An op that is not one is applied, so counted as an error.
        Ok(KV) => t
            .get_borrowed_item(4)
            .and_then(|o| o.extract::<usize>())
            .and_then(op_at)
            .map_or(true, mirrored),
        Ok(REQ) => false,
        _ => true,
    }
}

/// Every index of a list, range, array or tensor, in order.
fn flat(idx: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    Ok(runs(idx)?.into_iter().flat_map(|(a, n)| a..a + n).collect())
}

#[pymodule]
fn kvtrail_guard(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Guard>()?;
    m.add_class::<step::Step>()?;
    m.add_class::<step::StepCache>()?;
    m.add_function(wrap_pyfunction!(step::schedule_step, m)?)?;
    m.add_function(wrap_pyfunction!(step::py_slot_runs, m)?)?;
    m.add_function(wrap_pyfunction!(step::kv_lines, m)?)?;
    m.add_function(wrap_pyfunction!(step::block_lines, m)?)?;
    m.add_function(wrap_pyfunction!(sglang::decode_step, m)?)?;
    let kinds = PyDict::new(m.py());
    for (name, code) in KINDS {
        kinds.set_item(name, code)?;
    }
    m.add("KINDS", kinds)?;
    m.add("OPS", PyTuple::new(m.py(), Op::ALL.map(Op::as_str))?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
