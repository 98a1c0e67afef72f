"""The SGLang hook's decode step built natively (kvtrail_guard.decode_step,
used by on_alloc_for_decode) against the hook's own per-event path (the
module without the native function), without SGLang: a batch in the shape
ScheduleBatch has (reqs, seq_lens_cpu) and alloc_for_decode's out_cache_loc.

Checks, and prints one JSON line of facts at the end:
- the native step queues one item whose lines are byte-identical to the
  lines the shared client's writer makes of the per-event items, in the
  same order (alloc, write, read per request; one line per contiguous run,
  the write and read placed at the request's position);
- requests the hook has not named yet are named as request_id names them
  (bootstrap_room, else rid), and keep that name;
- the guard fed by the native step and the guard fed the per-event items
  answer a later read of those slots the same way (foreign, naming the
  same requests) with the same counts;
- a request whose values cannot be read leaves a `lost` line (a hole) in
  the pool and the guard, and the others still get their lines; the
  per-event path loses the rest of the batch instead (the reason the
  native step is the path taken).

Run with PYTHONPATH=hooks/sglang/src:hooks/client/src:target/kvtrail-guard-native.
"""

import json
import sys

import kvtrail_guard
import kvtrail_hook_client as c
from kvtrail_hook_client import guard as guard_mod

import kvtrail_sglang as kh

failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)


TS = 1_700_000_000_000_000_321
POOL = 2
kh._time_ns = lambda: TS


class Vals:
    def __init__(self, v):
        self.v = v

    def tolist(self):
        return list(self.v)


class Req:
    def __init__(self, rid, room=None, named=None):
        self.rid = rid
        self.bootstrap_room = room
        if named is not None:
            self._kvtrail_id = named


class Batch:
    def __init__(self, reqs, seqs):
        self.reqs = reqs
        self.seq_lens_cpu = Vals(seqs)
        self._kvtrail_pool = POOL


class Sink:
    """A client that keeps what the hook queues."""

    def __init__(self):
        self.items = []

    def put(self, pool, item):
        self.items.append(item)

    def put_lines(self, ts, text, counts, n):
        self.items.append((c.LINES, POOL, ts, text, counts, n))


def lines_of(items):
    cl = c.Client.__new__(c.Client)
    cl._tmp = {}
    out = []
    for it in items:
        cl._format(it, out)
    return "\n".join(out).split("\n") if out else []


def hook(native):
    """A hook state with a guard (native module) and a sink for the pool."""
    h = kh._Hook.__new__(kh._Hook)
    h.guard = guard_mod.Guard.__new__(guard_mod.Guard)
    h.guard.native = kvtrail_guard.Guard()
    h.guard.push = h.guard.native.push
    h.guard.page_sizes = {}
    h.clients = {POOL: Sink()}
    h.default_pool = POOL
    h.disabled = False
    h.guard_holes = set()
    h.counts = {"hook_errors": 0}
    h.ungranted = {}
    kh._H = h
    kh._native = kvtrail_guard if native else None
    return h


def batch():
    # a: named already; b: named by its bootstrap_room; d: by its rid.
    # Two tokens a request (speculative decoding's token_per_req): b's two
    # slots are apart (two runs).
    reqs = [Req("a", named=41), Req("b", room=9001), Req("d")]
    return Batch(reqs, [17, 5, 300]), Vals([100, 101, 7, 30, 64, 65])


def run(native):
    h = hook(native)
    b, locs = batch()
    kh.on_alloc_for_decode(b, locs, token_per_req=2)
    return h, b


ref, ref_batch = run(False)
nat, nat_batch = run(True)
ref_lines = lines_of(ref.clients[POOL].items)
nat_items = nat.clients[POOL].items
expect(len(nat_items) == 1 and nat_items[0][0] == c.LINES, f"one LINES item: {nat_items}")
nat_lines = lines_of(nat_items)
expect(nat_lines == ref_lines, f"lines differ:\n{nat_lines}\n{ref_lines}")
expect(len(ref_lines) == 12, f"a: 3 lines, b: 2 runs x 3, d: 3; got {len(ref_lines)}")
expect(nat_items[0][5] == len(ref_lines) and nat_items[0][4] == [(POOL, len(ref_lines))],
       f"counts: {nat_items[0][4:]}")
names = [getattr(r, "_kvtrail_id", None) for r in nat_batch.reqs]
expect(names == [getattr(r, "_kvtrail_id", None) for r in ref_batch.reqs], f"names {names}")
expect(names[0] == 41 and names[1] == 9001 and names[2] == c.id_of("d"), f"names {names}")
for run in ('"op":"write","slot_start":7,"slot_count":1,"token_pos":5',
            '"op":"write","slot_start":30,"slot_count":1,"token_pos":6',
            '"op":"read","slot_start":100,"slot_count":2,"token_pos":17'):
    expect(any(run in ln for ln in ref_lines), f"{run} in {ref_lines}")

# The guards: a later request (5) reading every slot the batch wrote.
slots = [100, 101, 7, 30, 64, 65]
answers = [h.guard.native.check(POOL, 5, slots) for h in (ref, nat)]
expect(answers[0] == answers[1], f"guards differ: {answers}")
expect(answers[1][0] == "foreign" and sorted(answers[1][1]) == sorted(names),
       f"foreign naming the batch: {answers[1]}")
st = [h.guard.native.stats() for h in (ref, nat)]
expect(st[0] == st[1], f"guard stats differ: {st}")
# Request a reading its own slots: own.
own = nat.guard.native.check(POOL, 41, [100, 101])
expect(own[0] == "ok", f"own read: {own}")

# A request whose position is not a number, and one whose slots are
# missing (fewer slots than requests): holes; the others' lines stand.
h = hook(True)
reqs = [Req("a", named=41), Req("x", named=42), Req("b", named=43), Req("y", named=44)]
kh.on_alloc_for_decode(Batch(reqs, [3, "?", 4, 9]), Vals([10, 11, 12]), token_per_req=1)
got = lines_of(h.clients[POOL].items)
lost = [ln for ln in got if '"type":"lost"' in ln]
expect(len(lost) == 2 and len(got) == 2 + 2 * 3, f"holes: {got}")
expect(all('"request_id":42' not in ln and '"request_id":44' not in ln for ln in got), got)
expect(h.counts["hook_errors"] == 1, f"one error counted: {h.counts}")
st = h.guard.native.stats()
expect(st["holes"] == 2, f"the guard's holes: {st}")
# The per-event path stops at the bad request: b's events are lost.
h = hook(False)
try:
    kh.on_alloc_for_decode(Batch(reqs, [3, "?", 4, 9]), Vals([10, 11, 12]), token_per_req=1)
except Exception:
    pass
got_py = lines_of(h.clients[POOL].items)
expect(not any('"request_id":43' in ln for ln in got_py), f"per-event path: {got_py}")

# A native module that numbers the queue's items otherwise than the
# client is not used: the hook, loaded again, builds its lines in Python.
import importlib  # noqa: E402

import kvtrail_guard  # noqa: E402

saved = kvtrail_guard.KINDS
kvtrail_guard.KINDS = dict(saved, KV=saved["LOST"], LOST=saved["KV"])
try:
    importlib.reload(kh)
    expect(kh._native is None, "the SGLang hook kept a module that misnumbers the items")
finally:
    kvtrail_guard.KINDS = saved
    importlib.reload(kh)
expect(kh._native is kvtrail_guard, "the SGLang hook refused its own module")

print(json.dumps({"failures": failures, "lines": len(nat_lines), "names": names}))
sys.exit(1 if failures else 0)
