"""The guard shared by kvtrail's engine hooks (docs/guard.md).

The decision is not made here: the native module ``kvtrail_guard`` (built
from kvtrail, hooks/native) keeps the engine's pools by kvtrail's lineage
slot rule, fed with the very events the hook queues for the sidecar, and
classifies a read. This file only reads the settings, loads the module,
counts, logs the alerts and tells the hook whether to abort.

- ``KVTRAIL_GUARD=off|alert|abort`` (default ``alert``);
- ``KVTRAIL_GUARD_UNKNOWN=allow|abort`` (default ``allow``): what ``abort``
  mode does with a read whose owner this process cannot see.

In ``abort`` mode a native module that cannot be loaded, or that numbers
the queue's items otherwise than this client
(``kvtrail_hook_client.native_mismatch``), is an error at install (the
engine does not start unguarded); in ``alert`` mode it is one warning.
(The vLLM hook needs the module to capture at all: its install raises
without it in every mode.)
"""

import collections
import logging
import os
import time

from kvtrail_hook_client import native_mismatch

log = logging.getLogger("kvtrail")

MODES = ("off", "alert", "abort")
UNKNOWN = ("allow", "abort")

class GuardUnavailable(RuntimeError):
    """KVTRAIL_GUARD=abort, and the native module cannot be loaded."""


class Guard:
    """One engine process's guard: mode, unknown policy, the native state."""

    def __init__(self, mode=None, unknown=None):
        mode = (mode or os.environ.get("KVTRAIL_GUARD") or "alert").strip().lower()
        unknown = (unknown or os.environ.get("KVTRAIL_GUARD_UNKNOWN") or "allow").strip().lower()
        if mode not in MODES:
            raise ValueError(f"KVTRAIL_GUARD={mode!r}: expected one of {', '.join(MODES)}")
        if unknown not in UNKNOWN:
            raise ValueError(f"KVTRAIL_GUARD_UNKNOWN={unknown!r}: expected one of {', '.join(UNKNOWN)}")
        self.mode = mode
        self.unknown = unknown
        self.native = None
        # The native module's ``push`` (None while unguarded). The hooks call
        # it once per queued item (the vLLM hook's step writes go to the
        # module in its native step instead); the module holds the items and
        # applies them in one pass before anything reads its state.
        self.push = None
        self.page_sizes = {}
        self.counts = {"checks": 0, "ok": 0, "foreign": 0, "unknown": 0, "alerts": 0,
                       "aborts": 0, "errors": 0}
        # The latest alerts (bounded): dicts with the request and sources.
        self.alerts = collections.deque(maxlen=1024)
        if mode == "off":
            return
        try:
            import kvtrail_guard

            why = native_mismatch(kvtrail_guard)
            if why is not None:
                raise ImportError(why)
        except ImportError as e:
            if mode == "abort":
                raise GuardUnavailable(
                    "kvtrail: KVTRAIL_GUARD=abort but the guard's native module (kvtrail_guard) "
                    f"cannot be loaded ({e}); install it (docs/guard.md) or set KVTRAIL_GUARD=alert "
                    "or off: refusing to run unguarded") from e
            log.warning("kvtrail: the guard's native module (kvtrail_guard) cannot be loaded (%s): "
                        "running unguarded (KVTRAIL_GUARD=alert)", e)
            return
        self.native = kvtrail_guard.Guard()
        self.push = self.native.push

    @property
    def active(self):
        return self.native is not None

    def feed(self, item):
        """Mirrors one queued item (the hook's put); the hooks call
        ``push`` directly. An item the module cannot apply is counted in its
        ``errors`` and leaves a hole in its pool; only a module busy in
        another thread raises (RuntimeError)."""
        if self.push is not None:
            self.push(item)

    def feed_many(self, items):
        """Mirrors many queued items, in order, in one native call."""
        if self.native is not None:
            self.native.feed_many(items)

    def page_size(self, pool, ps):
        if self.page_sizes.get(pool) != ps:
            self.page_sizes[pool] = ps
            self.native.page_size(pool, int(ps))

    def decide(self, pool, rid, name, slots=None, runs=None, client=None, answer=None):
        """Checks a request's read of ``slots`` (indices) or ``runs``
        ((start, count)) of ``pool`` before its first forward over KV it did
        not compute, or takes the native module's ``answer`` to that check
        (verdict, sources, slots foreign, slots unknown, slots read: the
        vLLM hook's native step checks in the stream's order). Returns None
        to let it run, or the error message to
        abort it with. A decision that is not ``ok`` also goes to the
        sidecar as a ``guard`` line through ``client`` (the connection
        holding ``pool``), where it is counted and, with live detection,
        alerted; an ``ok`` one is counted there (``guard_ok`` lines)."""
        c = self.counts
        c["checks"] += 1
        try:
            if answer is not None:
                verdict, sources, nf, nu, n = answer
            elif runs is not None:
                verdict, sources, nf, nu, n = self.native.check_runs(pool, rid, runs)
            else:
                verdict, sources, nf, nu, n = self.native.check(pool, rid, slots)
        except Exception as e:
            # A check that failed is a read the guard cannot vouch for.
            c["errors"] += 1
            verdict, sources, nf, nu, n = "unknown", [], 0, 0, 0
            log.warning("kvtrail: guard check failed for request %s: %s", name, e)
        c[verdict] += 1
        if verdict == "ok":
            if client is not None:
                client.guard_ok += 1  # the sidecar's count (guard_ok lines)
            return None
        if verdict == "unknown" and self.unknown == "allow":
            self._report(client, pool, rid, verdict, "allow", sources, n, nf, nu)
            return None
        if verdict == "foreign":
            what = (f"{nf} of {n} KV slots it is about to read hold other requests' content "
                    f"(request ids {', '.join(str(s) for s in sources)})")
        else:
            what = f"{nu} of {n} KV slots it is about to read have an owner this node cannot see"
        abort = self.mode == "abort"
        c["aborts" if abort else "alerts"] += 1
        self._report(client, pool, rid, verdict, "abort" if abort else "alert", sources, n, nf, nu)
        self.alerts.append({"request": str(name), "request_id": rid, "pool": pool, "verdict": verdict,
                            "sources": list(sources), "slots_foreign": nf, "slots_unknown": nu,
                            "slots": n, "action": "abort" if abort else "alert"})
        msg = f"kvtrail guard: request {name}: {what}"
        log.error("%s%s", msg, "; aborted" if abort else "; alert only (KVTRAIL_GUARD=alert)")
        return msg if abort else None

    def _report(self, client, pool, rid, verdict, action, sources, n, nf, nu):
        if client is None:
            return
        try:
            client.put_guard(pool, time.time_ns(), rid, verdict, action, sources, n, nf, nu)
        except Exception as e:  # never into the engine
            c = self.counts
            c["report_errors"] = c.get("report_errors", 0) + 1
            log.warning("kvtrail: could not queue the guard decision for the sidecar: %s", e)

    def stats(self):
        out = dict(self.counts)
        out["mode"] = self.mode
        out["unknown_policy"] = self.unknown
        if self.native is not None:
            out.update({f"native_{k}": v for k, v in self.native.stats().items()})
        return out
