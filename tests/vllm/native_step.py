"""The vLLM hook's native step (kvtrail_guard.schedule_step) against the
shared client's own writer, without vLLM: hand-built scheduler state in
the shapes vLLM's Scheduler has (requests with num_computed_tokens, the
single-type managers' req_to_blocks of blocks with block_id).

Checks, and prints one JSON line of facts at the end:
- every line of one run the step writes is byte-identical to the line
  the client's `_format` writes for the same event (one format, two
  writers held together); a read of several runs is one line of several
  runs, spelled as docs/jsonl.md gives it, counted as one event a run;
- the runs: null blocks skipped, a table shorter than the context ends the
  runs, a run continues only where slots and positions both do;
- a request whose state cannot be read leaves a `lost` line in its pool
  (a hole), and the others still get their lines;
- groups without a pool, or without attention, write nothing;
- the guard sees the writes and checks a request in the stream's order:
  a request scheduled after another does not see its later writes, and a
  read of another request's slots is foreign, naming it;
- an LMCache wait defers the reads and the check.

Run with PYTHONPATH=hooks/client/src:target/kvtrail-guard-native.
"""

import json
import sys

import kvtrail_guard
import kvtrail_hook_client as c


class Blk:
    def __init__(self, i):
        self.block_id = i


class Req:
    def __init__(self, computed):
        self.num_computed_tokens = computed


def tables(*per_group):
    return [{k: [Blk(i) for i in v] for k, v in g.items()} for g in per_group]


def client_lines(items):
    cl = c.Client.__new__(c.Client)
    cl._tmp = {}
    out = []
    for it in items:
        cl._format(it, out)
    return out


def runs_line(pool, ts, rid, op, runs):
    """A KV line of several runs as docs/jsonl.md spells it."""
    rs = ",".join("[%d,%d,%s]" % (a, n, "null" if t is None else t) for a, n, t in runs)
    return ('{"type":"kv","pool":%d,"ts_ns":%d,"request_id":%d,"op":"%s","runs":[%s]}'
            % (pool, ts, rid, op, rs))


failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)


BS = 4
TS = 1_700_000_000_000_000_123
rid_of_calls = []


def rid_of(req):
    rid_of_calls.append(req)
    return 777


# Request a: 10 tokens computed, 2 this step; table [5, 0, 9] (a null
# block in the middle: positions 4..7 hold nothing). Request b: 6 computed,
# all 6 this step (its first step), no hook row (rid_of). Request c: a
# broken request (its count is not a number): a hole. Group 1 has no pool,
# group 2 is not attention.
sched = {"a": 2, "b": 6, "c": 1, "z": 0}
requests = {"a": Req(10), "b": Req(6), "c": Req("x")}
reqs = {"a": {"id": 11, "covered": 3, "prompt": 8}}
groups = [(3, BS, True), (None, BS, True), (3, BS, False)]
tabs = tables({"a": [5, 0, 9], "b": [6, 7], "c": [1]}, {"a": [1, 2, 3]}, {"a": [8]})
step = kvtrail_guard.schedule_step(sched, requests, reqs, groups, tabs, TS, None, None, {}, rid_of)
lines = step.text.split("\n")
W, R = c.WRITE, c.READ
# Positions 8..9 of a are block index 2 (id 9): slots 36, 37.
want = client_lines([(c.KV, 3, TS, 11, W, range(36, 38), 8, 0)])
# a's read is two runs, block 5 (positions 0..3) and block 9 (positions
# 8..9; block 0 skipped): one line of several runs (docs/jsonl.md), two
# events.
want.append(runs_line(3, TS, 11, "read", [(20, 4, 0), (36, 2, 8)]))
want += client_lines([
    (c.KV, 3, TS, 777, W, range(24, 30), 0, 0),   # b: blocks 6, 7 contiguous: one run of 6
    (c.KV, 3, TS, 777, R, range(24, 30), 0, 0),
])
want += client_lines([(c.LOST, 3, 1)])  # the hole, as the client writes it
expect(lines == want, f"lines differ:\n{lines}\n{want}")
expect(step.counts == [(3, 6)] and step.events == 6, f"counts {step.counts} {step.events}")
expect(step.holes == 1, f"holes {step.holes}")
expect(reqs["a"]["covered"] == 8, f"covered {reqs['a']}")
expect(len(rid_of_calls) == 1 and rid_of_calls[0] is requests["b"], "rid_of called for b only")
expect(step.checks == [] and step.waits == [], "no guard, no waits")

# A read of many runs: lines of at most 128 runs (a few KiB), each run
# counted as one event. 130 blocks apart from each other: 130 runs.
step = kvtrail_guard.schedule_step({"m": 1}, {"m": Req(130 * BS)}, {"m": {"id": 9}}, [(3, BS, True)],
                                   tables({"m": [2 * i + 1 for i in range(130)]}), TS, None, None, {}, rid_of)
ls = step.text.split("\n")
expect([len(json.loads(x).get("runs", [0])) for x in ls] == [1, 128, 2], f"runs per line {ls}")
expect(max(len(x) for x in ls) < 4700 and step.counts == [(3, 131)] and step.events == 131,
       f"line sizes {[len(x) for x in ls]} counts {step.counts}")

# Contiguous slots whose positions are not contiguous are two runs: the
# table [2, 0, 3] reads blocks 2 and 3 (slots 8..11 and 12..15, adjacent)
# at positions 0..3 and 8..11.
runs = kvtrail_guard.slot_runs([2, 0, 3], 4, 0, 12)
expect(runs == [(8, 4, 0), (12, 4, 8)], f"runs across a null block {runs}")
expect(kvtrail_guard.slot_runs([2, 3], 4, 0, 20) == [(8, 8, 0)], "short table ends the runs")
expect(kvtrail_guard.slot_runs([2, 3], 4, 5, 5) == [], "empty range")

# The guard. Request p wrote block 1 (slots 4..7; block 0 is vLLM's null
# block) in an earlier step; now q is scheduled first
# and reads p's block as its own context (a stale table: foreign, naming
# p), and p then writes its next token. q's check must not see p's later
# write, and p's write must reach the guard.
g = kvtrail_guard.Guard()
g.page_size(3, BS)
g.push((c.KV, 3, 1, 21, c.ALLOC, range(4, 8), None, 0))
g.push((c.KV, 3, 2, 21, c.WRITE, range(4, 7), 0, 0))
g.push((c.KV, 3, 3, 22, c.ALLOC, range(8, 12), None, 0))
sched = {"q": 1, "p": 1}
requests = {"q": Req(4), "p": Req(4)}
reqs = {"q": {"id": 22, "covered": 0}, "p": {"id": 21, "covered": 0}}
tabs = tables({"q": [1], "p": [1]})
guarded = set()
step = kvtrail_guard.schedule_step(sched, requests, reqs, [(3, BS, True)], tabs, 5, g, guarded, {}, rid_of)
expect(len(step.checks) == 2, f"checks {step.checks}")
name, rid, answers = step.checks[0]
expect(name == "q" and rid == 22, f"first check {step.checks[0]}")
pool, verdict, sources, nf, nu, n = answers[0]
expect(verdict == "foreign" and sources == [21] and n == 4, f"q's answer {answers[0]}")
name, rid, answers = step.checks[1]
expect(name == "p" and answers[0][1] == "ok", f"p's answer {step.checks[1]}")
st = g.stats()
expect(st["events"] >= 5, f"guard events {st}")

# A request already checked is not checked again; an LMCache wait defers
# its reads (no read line) and its check.
guarded = {"q", "p"}
waits = {"p": {"reads": None}}
step = kvtrail_guard.schedule_step({"q": 1, "p": 1}, {"q": Req(5), "p": Req(5)}, reqs,
                                   [(3, BS, True)], tables({"q": [2, 3], "p": [1, 3]}), 6, g,
                                   guarded, waits, rid_of)
expect(step.checks == [], f"checked again {step.checks}")
expect(len(step.waits) == 1 and step.waits[0][0] == "p" and step.waits[0][2] is False,
       f"waits {step.waits}")
expect(step.waits[0][3] == [(3, [(4, 4, 0), (12, 1, 4)])], f"deferred reads {step.waits[0][3]}")
ops = [json.loads(x)["op"] + str(json.loads(x)["request_id"]) for x in step.text.split("\n")]
expect(ops == ["write22", "read22", "write21"], f"ops {ops}")

# Hostile numbers never panic: a block id whose slots overflow.
try:
    kvtrail_guard.slot_runs([2**64 // 16 - 1, 5], 16, 0, 32)
except BaseException as e:  # a PanicException is a BaseException
    failures.append(f"slot_runs raised {e!r}")

# A group without its table (or a table that is not a dict): each request
# is a hole in every pool, never an exception that loses the step.
step = kvtrail_guard.schedule_step({"a": 1}, {"a": Req(3)}, {"a": {"id": 5}}, [(3, BS, True), (4, BS, True)],
                                   tables({"a": [1]}), 9, None, None, {}, rid_of)
expect(step.holes == 1 and step.text.split("\n") == client_lines([(c.LOST, 3, 1), (c.LOST, 4, 1)]),
       f"missing table {step.text!r}")
step = kvtrail_guard.schedule_step({"a": 1}, {"a": Req(3)}, {"a": {"id": 5}}, [(3, BS, True)], [[]], 9,
                                   None, None, {}, rid_of)
expect(step.holes == 1 and step.counts == [(3, 1)], f"table not a dict {step.counts}")

# A slot past what a KV line holds (u32): a hole, never a line the
# sidecar refuses.
step = kvtrail_guard.schedule_step({"a": 1}, {"a": Req(3)}, {"a": {"id": 5}}, [(3, 16, True)],
                                   tables({"a": [2**29]}), 9, None, None, {}, rid_of)
expect(step.holes == 1 and step.text == client_lines([(c.LOST, 3, 1)])[0], f"slot past u32 {step.text!r}")

# Python code the step runs (rid_of) may use the guard: it is not held
# while Python runs.
g2 = kvtrail_guard.Guard()


def rid_of_using_guard(req):
    g2.stats()
    g2.push((c.KV, 3, 1, 31, c.ALLOC, range(0, 4), None, 0))
    return 31


step = kvtrail_guard.schedule_step({"r": 1}, {"r": Req(2)}, {}, [(3, BS, True)], tables({"r": [1]}), 10, g2,
                                   set(), {}, rid_of_using_guard)
expect(not step.guard_missed and step.holes == 0 and len(step.checks) == 1, f"guard in rid_of {step.checks}")

# The block-id cache: ids read once per object, and it goes with its
# engine (garbage collected with the blocks it holds).
import gc
import weakref


class Pool:
    pass


pool_obj = Pool()


class PBlk(Blk):
    def __init__(self, i):
        super().__init__(i)
        self.pool = pool_obj  # vLLM's blocks point at their pool


blocks = [PBlk(i) for i in range(8)]
cache = kvtrail_guard.StepCache()
eng = {"cache": cache, "blocks": blocks}
pool_obj.eng = eng  # a cycle through the cache, as the hook has
for _ in range(2):
    step = kvtrail_guard.schedule_step({"a": 2}, {"a": Req(6)}, {"a": {"id": 5}}, [(3, BS, True)],
                                       [{"a": [blocks[2], blocks[3]]}], 11, None, None, {}, rid_of, cache)
expect(cache.sizes() == (2, 1), f"cache sizes {cache.sizes()}")
expect(step.text.split("\n")[0].endswith('"slot_start":12,"slot_count":2,"token_pos":4}'), step.text)
# The request part: the row is read once; covered moves until the prompt,
# and a request forgotten (added again under the same id object) gets its
# new row.
row = {"id": 5, "covered": 0, "prompt": 5}
name = "a"
cache2 = kvtrail_guard.StepCache()
for end in (3, 6, 7):
    kvtrail_guard.schedule_step({name: 1}, {name: Req(end)}, {name: row}, [(3, BS, True)],
                                [{name: [blocks[2], blocks[3]]}], 12, None, None, {}, rid_of, cache2)
expect(row["covered"] == 5, f"covered with the cache {row}")
row2 = {"id": 6, "covered": 0, "prompt": 9}
cache2.forget(name)
step2 = kvtrail_guard.schedule_step({name: 1}, {name: Req(2)}, {name: row2}, [(3, BS, True)],
                                    [{name: [blocks[2]]}], 13, None, None, {}, rid_of, cache2)
expect('"request_id":6,' in step2.text and row2["covered"] == 2, f"forgotten request {step2.text} {row2}")
row2["id"] = 7  # not re-read while cached: the hook's rows never change their id
step2 = kvtrail_guard.schedule_step({name: 1}, {name: Req(3)}, {name: row2}, [(3, BS, True)],
                                    [{name: [blocks[2]]}], 14, None, None, {}, rid_of, cache2)
expect('"request_id":6,' in step2.text and row2["covered"] == 3, f"cached request {step2.text} {row2}")
# A cached request's table changed in place between steps (a block
# replaced, as a sliding window puts the null block in; blocks appended;
# the table cut shorter) is read as it is now, as a fresh cache reads it.
cache3 = kvtrail_guard.StepCache()
tbl = [blocks[1], blocks[2], blocks[3]]
row3 = {"id": 8, "covered": 12, "prompt": 4}


def step_text(cache_, end):
    s = kvtrail_guard.schedule_step({"t": 1}, {"t": Req(end)}, {"t": dict(row3)}, [(3, BS, True)],
                                    [{"t": list(tbl) if cache_ is None else tbl}], 15, None, None, {},
                                    rid_of, cache_)
    return s.text


for what, change, end in (
        ("unchanged", lambda: None, 12),
        ("a block replaced by the null block", lambda: tbl.__setitem__(0, PBlk(0)), 12),
        ("a block replaced by another", lambda: tbl.__setitem__(1, blocks[6]), 12),
        ("a block appended", lambda: tbl.append(blocks[7]), 14),
        ("the table cut shorter", lambda: tbl.__delitem__(slice(2, None)), 14),
        ("a block appended again", lambda: tbl.append(blocks[5]), 10)):
    change()
    got, fresh = step_text(cache3, end), step_text(None, end)
    expect(got == fresh, f"cached table, {what}: {got!r} != {fresh!r}")
expect('"runs":[[24,4,4],[20,2,8]]' in step_text(cache3, 10), f"cached table runs {step_text(cache3, 10)}")
# One event's lines (the hook's allocator, free and share events): one run
# is the client's own line, byte for byte; several runs are one line of
# runs counted one event a run; runs of no slot are no event; positions
# only when placed; past u32 a `lost` line of as many events.
ev = kvtrail_guard.kv_lines(3, TS, 9, c.SHARE, [(40, 4, 8)], True, None)
expect(ev.text == client_lines([(c.KV, 3, TS, 9, c.SHARE, range(40, 44), 8, 0)])[0]
       and ev.counts == [(3, 1)] and ev.events == 1, f"one run {ev.text}")
ev = kvtrail_guard.kv_lines(3, TS, 9, c.FREE, [(40, 4, 8), (0, 0, 0), (60, 2, 12)], False, None)
expect(ev.text == runs_line(3, TS, 9, "free", [(40, 4, None), (60, 2, None)]) and ev.events == 2,
       f"runs, unplaced {ev.text}")
expect(kvtrail_guard.kv_lines(3, TS, 9, c.FREE, [(5, 0, None)], False, None) is None, "no slot, no event")
ev = kvtrail_guard.kv_lines(3, TS, 9, c.ALLOC, [(1, 2, None), (1 << 33, 4, None)], False, None)
expect(ev.text == '{"type":"lost","pool":3,"n":2}' and ev.holes == 1 and ev.counts == [(3, 2)],
       f"past u32 {ev.text}")
# Values no line can hold (negative, not an int, not a run) are a hole of
# as many events, never an exception nor a silent gap.
for bad in ([(-4, 4, 0)], [(1, 2, 3), (1.5, 2, 3)], [(1, 2)], "xy"):
    ev = kvtrail_guard.kv_lines(3, TS, 9, c.ALLOC, bad, True, None)
    expect(ev.text == '{"type":"lost","pool":3,"n":%d}' % len(bad) and ev.holes == 1, f"bad runs {bad}: {ev.text}")


class BadBlk:
    @property
    def block_id(self):
        raise RuntimeError("unreadable")


ev = kvtrail_guard.block_lines(3, BS, TS, 9, c.FREE, [PBlk(2), BadBlk()], None, None)
expect(ev.text == '{"type":"lost","pool":3,"n":1}' and ev.holes == 1, f"bad block {ev.text}")
ev = kvtrail_guard.block_lines(3, 1 << 40, TS, 9, c.FREE, [PBlk(1 << 30)], None, None)
expect(ev.text == '{"type":"lost","pool":3,"n":1}', f"block past u64 slots {ev.text}")
# Blocks: by ascending id, consecutive blocks one run, the null block
# (id 0) nothing; ids from the cache when given.
blk = [PBlk(i) for i in (7, 0, 3, 2, 9)]
for cc in (None, kvtrail_guard.StepCache()):
    ev = kvtrail_guard.block_lines(3, BS, TS, 9, c.FREE, iter(blk), None, cc)
    expect(ev.text == runs_line(3, TS, 9, "free", [(8, 8, None), (28, 4, None), (36, 4, None)]),
           f"blocks {ev.text}")
expect(kvtrail_guard.block_lines(3, BS, TS, 9, c.FREE, [PBlk(0)], None, None) is None, "null block only")
# The guard: an allocation and a share reach it after what it holds; a
# free and a read do not (the rule needs neither); a guard busy elsewhere
# missed it.
g3 = kvtrail_guard.Guard()
g3.page_size(3, BS)
g3.push((c.KV, 3, 1, 31, c.ALLOC, range(0, 4), None, 0))
kvtrail_guard.block_lines(3, BS, TS, 32, c.ALLOC, [PBlk(1)], g3, None)
kvtrail_guard.kv_lines(3, TS, 32, c.WRITE, [(4, 4, 0)], True, g3)
kvtrail_guard.block_lines(3, BS, TS, 32, c.FREE, [PBlk(1)], g3, None)
kvtrail_guard.kv_lines(3, TS, 32, c.READ, [(4, 4, 0)], True, g3)
kvtrail_guard.kv_lines(3, TS, 32, c.SHARE, [(12, 1, 0), (14, 1, 2)], True, g3)
expect(g3.check_runs(3, 32, [(4, 4)])[0] == "ok" and g3.check_runs(3, 33, [(4, 4)])[:2] == ("foreign", [32]),
       f"guard state {g3.check_runs(3, 33, [(4, 4)])}")
st3 = g3.stats()
expect(st3["events"] == 5 and st3["errors"] == 0, f"guard mirror, one event a run {st3}")
kvtrail_guard.kv_lines(3, TS, 32, c.ALLOC, [(-1, 4, None)], False, g3)
st3 = g3.stats()
expect(st3["holes"] == 1 and st3["errors"] == 1, f"a hole in the guard {st3}")
ref = weakref.ref(pool_obj)
del pool_obj, eng, cache, cache2, cache3, blocks, step, step2, tbl, blk, cc
gc.collect()
expect(ref() is None, "the block-id cache kept its engine's blocks alive")

# The module numbers the queue's item kinds and ops as this client does
# (one numbering, checked when a hook loads the module); a module that
# numbers them otherwise, or names none, is refused as one that cannot be
# loaded: the guard in abort mode refuses to start, in alert mode runs
# unguarded with a warning.
expect(c.native_mismatch(kvtrail_guard) is None, f"mismatch {c.native_mismatch(kvtrail_guard)}")
expect(kvtrail_guard.OPS == c.OPS and kvtrail_guard.KINDS == c.NATIVE_KINDS,
       f"tables {kvtrail_guard.OPS} {kvtrail_guard.KINDS}")


class FakeMod:
    __file__ = "/elsewhere/kvtrail_guard.so"

    def __init__(self, kinds, ops):
        if kinds is not None:
            self.KINDS = kinds
        if ops is not None:
            self.OPS = ops


swapped = dict(c.NATIVE_KINDS, KV=c.LOST, LOST=c.KV)
why = c.native_mismatch(FakeMod(swapped, c.OPS)) or ""
expect("KV is 4 there, 0 here" in why and "LOST is 0 there, 4 here" in why and "/elsewhere" in why,
       f"swapped kinds: {why}")
why = c.native_mismatch(FakeMod(dict(c.NATIVE_KINDS, MOVE=9), c.OPS)) or ""
expect("'MOVE' is unknown here" in why, f"an extra kind: {why}")
why = c.native_mismatch(FakeMod({k: v for k, v in c.NATIVE_KINDS.items() if k != "PULL"}, c.OPS)) or ""
expect("PULL is missing there, 5 here" in why, f"a missing kind: {why}")
why = c.native_mismatch(FakeMod(dict(c.NATIVE_KINDS, **{"1": 1}, **{"x": 2}), list(c.OPS))) or ""
expect("'1' is unknown here" in why and "OPS" not in why, f"keys of mixed names, ops as a list: {why}")
why = c.native_mismatch(FakeMod(c.NATIVE_KINDS, c.OPS), needs=("schedule_step", "Guard")) or ""
expect("older than this hook (no schedule_step, Guard)" in why, f"functions missing: {why}")
why = c.native_mismatch(FakeMod(c.NATIVE_KINDS, c.OPS[::-1])) or ""
expect("OPS are" in why, f"ops reordered: {why}")
why = c.native_mismatch(FakeMod(None, None)) or ""
expect("older than this hook (no KINDS, OPS)" in why, f"an old module: {why}")
why = c.native_mismatch(FakeMod(["KV"], "ops")) or ""
expect("wrong types" in why, f"tables of the wrong types: {why}")

from kvtrail_hook_client import guard as guard_mod  # noqa: E402

saved = kvtrail_guard.KINDS
kvtrail_guard.KINDS = swapped
try:
    try:
        guard_mod.Guard("abort")
        expect(False, "abort mode started on a module that misnumbers the items")
    except guard_mod.GuardUnavailable as e:
        expect("numbers the queue's items otherwise" in str(e), f"abort refusal: {e}")
    expect(not guard_mod.Guard("alert").active, "alert mode guarded with a misnumbering module")
finally:
    kvtrail_guard.KINDS = saved
expect(guard_mod.Guard("abort").active, "the module itself is refused")

print(json.dumps({"failures": failures}))
sys.exit(1 if failures else 0)
