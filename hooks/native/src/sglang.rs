//! The SGLang hook's decode step in one native call (`decode_step`), after
//! `alloc_for_decode`: for every request of the batch, the `alloc`, `write`
//! and `read` of the slots allocated for its new token(s), as the
//! canonical KV lines the sidecar reads
//! (`kvtrail::record::wire::write_canonical_kv`), and the `alloc` and
//! `write` mirrored into the guard. The lines are the ones the shared
//! client writes for the hook's per-event items, byte for byte, in the same
//! order; the Python hook queues them as one item.
//!
//! Two passes, as the vLLM step: the first reads SGLang's objects (Python
//! calls) and writes the lines; the second, with no Python call, applies
//! them to the guard.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyList;

use kvtrail::schema::Op;

use crate::Guard;
use crate::step::{Out, Step, borrow};

/// Contiguous runs `(start, count)` of slots `xs` (in order), into `out`;
/// an error for a negative slot.
fn runs_into(xs: &[i64], out: &mut Vec<(u64, u64)>) -> PyResult<()> {
    out.clear();
    for &x in xs {
        let x = u64::try_from(x).map_err(|_| PyValueError::new_err("a negative slot"))?;
        match out.last_mut() {
            Some((s, n)) if s.checked_add(*n) == Some(x) => *n += 1,
            _ => out.push((x, 1)),
        }
    }
    Ok(())
}

/// One request of the batch: its trace request id and slot runs, or an
/// error when they cannot be read (it becomes a hole).
#[allow(clippy::too_many_arguments)]
fn request(
    py: Python<'_>,
    req: &Bound<'_, PyAny>,
    rid_of: &Bound<'_, PyAny>,
    slots: &[i64],
    pos: &Bound<'_, PyAny>,
    out: &mut Out,
    pool: u16,
    ts: i64,
    runs: &mut Vec<(u64, u64)>,
) -> PyResult<u64> {
    let cached = req
        .getattr(intern!(py, "_kvtrail_id"))
        .ok()
        .filter(|v| !v.is_none());
    let rid: u64 = match cached {
        Some(v) => v.extract()?,
        None => rid_of.call1((req,))?.extract()?,
    };
    let pos: i64 = pos.extract()?;
    let pos = u64::try_from(pos).map_err(|_| PyValueError::new_err("a negative position"))?;
    runs_into(slots, runs)?;
    out.kv_unplaced(pool, ts, rid, Op::Alloc, runs)?;
    let mut placed = Vec::with_capacity(runs.len());
    let mut tp = pos;
    for &(a, n) in runs.iter() {
        placed.push((a, n, tp));
        tp += n;
    }
    out.kv(pool, ts, rid, Op::Write, &placed)?;
    out.kv(pool, ts, rid, Op::Read, &placed)?;
    Ok(rid)
}

/// The decode step's events (docs/guard.md, "Cost"): `reqs` the batch's
/// requests, `locs` the slots `alloc_for_decode` allocated
/// (`token_per_req` per request, in the batch's order), `seqs` each
/// request's sequence length before the step (its new token's position),
/// `pool` and `ts` the lines' pool and stamp, `guard` the native guard
/// (None: unguarded), `rid_of` the hook's `request_id` (for a request the
/// hook has not named yet: `_kvtrail_id` unset).
///
/// Per request, the lines the hook's `alloc`, `write` and `read` items
/// make (one per contiguous run of its slots; the write and the read
/// placed at its position). A request whose values cannot be read (its
/// slots missing or negative, a position or id that is not an int, a slot
/// past u32) gets a `lost` line in the pool instead: a hole, never a
/// silent gap; the guard is fed the same hole.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn decode_step<'py>(
    py: Python<'py>,
    pool: u16,
    ts: i64,
    reqs: &Bound<'py, PyList>,
    locs: Vec<i64>,
    seqs: &Bound<'py, PyList>,
    token_per_req: usize,
    guard: Option<Bound<'py, Guard>>,
    rid_of: &Bound<'py, PyAny>,
) -> PyResult<Step> {
    let t = token_per_req.max(1);
    let mut out = Out::with_capacity(reqs.len() * 3 * 140);
    let mut runs: Vec<(u64, u64)> = Vec::new();
    // Per request: Some((rid, start of its runs in `all`, end)) or a hole.
    let mut did: Vec<Option<(u64, usize, usize)>> = Vec::with_capacity(reqs.len());
    let mut all: Vec<(u64, u64)> = Vec::new();
    let mut holes = 0u64;
    for (i, req) in reqs.iter().enumerate() {
        let mark = (out.buf.len(), out.events, out.counts.clone());
        let slots = i
            .checked_mul(t)
            .and_then(|a| locs.get(a..a.checked_add(t)?))
            .ok_or_else(|| PyValueError::new_err("fewer slots than requests"));
        let r = slots.and_then(|slots| {
            let pos = seqs.get_item(i)?;
            request(py, &req, rid_of, slots, &pos, &mut out, pool, ts, &mut runs)
        });
        match r {
            Ok(rid) => {
                let from = all.len();
                all.extend_from_slice(&runs);
                did.push(Some((rid, from, all.len())));
            }
            Err(_) => {
                out.buf.truncate(mark.0);
                out.events = mark.1;
                out.counts = mark.2;
                out.lost(pool);
                holes += 1;
                did.push(None);
            }
        }
    }
    let mut missed = false;
    if let Some(g) = &guard {
        match borrow(py, g) {
            Some(mut g) => {
                g.drain(py);
                for d in &did {
                    let ok = match *d {
                        Some((rid, a, b)) => {
                            let rs = &all[a..b];
                            g.g.kv(pool, rid, Op::Alloc, rs).is_ok()
                                && g.g.kv(pool, rid, Op::Write, rs).is_ok()
                        }
                        None => false,
                    };
                    if !ok {
                        if d.is_some() {
                            g.g.counts.errors += 1;
                        }
                        g.g.lost(pool);
                    }
                }
            }
            None => missed = true,
        }
    }
    Step::of_lines(py, out, holes, missed)
}

#[cfg(test)]
mod tests {
    use super::runs_into;

    #[test]
    fn runs_merge_only_where_slots_continue() {
        let mut out = Vec::new();
        runs_into(&[5, 6, 7, 9, 10, 3], &mut out).unwrap();
        assert_eq!(out, vec![(5, 3), (9, 2), (3, 1)]);
        runs_into(&[], &mut out).unwrap();
        assert!(out.is_empty());
        assert!(runs_into(&[1, -1], &mut out).is_err());
    }
}
