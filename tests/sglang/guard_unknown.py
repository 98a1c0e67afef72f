"""What the guard cannot know, it says (tests/it/guard.rs): a decode-only
SGLang process, fed the items its hook queues (kvtrail_hook_client's
tuples), never sees the prefill pool. Prints one JSON line.

- a commit without its sends (the prefill ran elsewhere): the request's own
  read of the transferred pages is `unknown`; allowed by default, aborted
  under KVTRAIL_GUARD_UNKNOWN=abort, alerted under alert + abort;
- another request reading those pages later (stale, preallocated again):
  `foreign` all the same (the content was received for someone else);
- a `lost` item (a hook failure): what the pool held before it is unknown;
- items pushed (the hooks' hot path) are held and applied in order before
  a check; one the module cannot apply is counted and leaves a hole, and
  never raises into the engine;
- a write at slot 2^32 - 2 costs a page of the guard's table, not 96 GB;
- bad settings are refused with the variable named.
"""

import json

from kvtrail_hook_client import ALLOC, COMMIT, KV, LOST, READ, WRITE
from kvtrail_hook_client.guard import Guard

PS = 4


def decode_node(g):
    """Pool 1 only: X (room 7) gets 2 pages by transfer, then Y (room 8)
    is preallocated the same pages and reads them unwritten."""
    g.page_size(1, PS)
    g.feed((KV, 1, 0, 11, ALLOC, list(range(0, 8)), None, 0))
    g.feed((COMMIT, 1, 0, 7, 11, 0, [0, 1]))
    x = g.decide(1, 11, "X", slots=list(range(0, 8)))
    g.feed((KV, 1, 0, 11, WRITE, [8], 8, 0))
    g.feed((KV, 1, 0, 11, READ, [8], 8, 0))  # reads are checks, not events
    g.feed((KV, 1, 0, 12, ALLOC, list(range(0, 8)), None, 0))
    y = g.decide(1, 12, "Y", slots=list(range(0, 8)))
    return x, y


out = {}
for mode, unknown in (("alert", "allow"), ("abort", "allow"), ("abort", "abort"), ("alert", "abort")):
    g = Guard(mode, unknown)
    x, y = decode_node(g)
    out[f"{mode}/{unknown}"] = {"x": x, "y": y, "stats": g.stats(), "alerts": list(g.alerts)}

# A hook failure: a hole; the request's own earlier write is then unknown.
g = Guard("abort", "abort")
g.feed((KV, 3, 0, 21, ALLOC, [0, 1], None, 0))
g.feed((KV, 3, 0, 21, WRITE, [0, 1], 0, 0))
before = g.decide(3, 21, "Z", slots=[0, 1])
g.feed((LOST, 3, 1))
after = g.native.check(3, 21, [0, 1])
out["hole"] = {"before": before, "after": list(after)}

# Memory follows the slots touched, not the highest index: a write at the
# top of the 2^32-slot range and another at 0 allocate two pages, and a
# read of the far slot by another request is still foreign.
import resource  # noqa: E402

g = Guard("alert", "allow")
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
top = (1 << 32) - 2
g.feed((KV, 4, 0, 31, WRITE, [0, top, top + 1], 0, 0))
far = g.native.check(4, 32, [top, top + 1])
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out["far"] = {"check": list(far), "rss_growth_kib": rss1 - rss0,
              "slots_allocated": g.native.stats()["slots_allocated"]}

# The hot path: items held, applied in order before the check; a bad item
# (a kind that is no number, a non-tuple) is counted, never raised, and a
# bad item of a pool is a hole there: the write before it is unknown, the
# write after it foreign.
g = Guard("alert", "allow")
g.feed_many([(KV, 5, 0, 41, ALLOC, [0, 1], None, 0), (KV, 5, 0, 41, WRITE, range(0, 2), 0, 0)])
g.push(("bad", 5))
g.push(7)
g.push((KV, 5, 0, 42, WRITE, range(1, 2), 0, 0))
held = g.native.stats()
out["push"] = {"check": list(g.native.check(5, 43, [0, 1])),
               "errors": held["errors"], "holes": held["holes"], "events": held["events"]}

errs = []
for m, u in (("block", None), (None, "maybe")):
    try:
        Guard(m, u)
    except ValueError as e:
        errs.append(str(e))
out["bad_settings"] = errs
print(json.dumps(out, sort_keys=True))
