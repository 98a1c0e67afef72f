"""The connection to the `kvtrail record` sidecar, shared by kvtrail's
engine hooks (kvtrail_sglang, kvtrail_vllm).

The engine thread only appends small tuples to a bounded deque (the hot
path: no JSON, no socket, no lock), or a block of lines the native module
already wrote (the vLLM hook's step: a ``LINES`` item). A daemon thread
turns the tuples into JSON lines (the `kvtrail ingest` shape plus the sidecar's `lost`, `xfer_send`,
`xfer_commit`, `xfer_pull`, `copy` and `guard` messages) and sends them in
batches. The count of guard checks answered ok goes with the marks as
`guard_ok` lines.

Never stalls the engine: when the deque is full, events are dropped and
counted per pool; the count goes to the sidecar as a `lost` line ahead of
the next event of that pool, which the sidecar records as an explicit seq
hole. When the sidecar is unreachable, batches are counted as lost and
reported (log + `stats()`), and reported again as `lost` lines once a
connection is back.

Marks. Whenever the sender has emptied the queue it sends
`{"type":"mark","ts_ns":T}`: every event stamped at or before T has been
sent (T trails the clock by MARK_LAG_NS, more than an engine thread ever
sits between stamping an event and queueing it). The sidecar holds a pull
from these pools until their connection has marked past the pull's time,
so a pull is stamped against the producer's whole history up to the load,
whatever order the connections' lines arrive in.

Positions. An engine copy between two pools of this connection (`copy`:
HiCache's offload to host memory and load back) carries `src_pos`, the
source pool's position: how many events of that pool this connection has
reported before the copy (each KV event 1: a KV line 1, a native step's
line of several runs one per run; each `lost` line its n, each
`copy` into the pool its number of runs), counted in the sender thread
over what actually reaches the sidecar and restarted at each connection.
The sidecar turns the position into the source seq; the queue is in the
engine's order, so the copy carries exactly the source state the engine
copied, whatever the clocks say.

Close. `close()` (and the exit handler the hooks register) flushes the
queue within a deadline, reports what it could not send as `lost`, and
ends with `{"type":"bye","enqueued":E,"sent":S,"dropped":D}`. A connection
that ends without it (a crash, a kill) leaves the capture incomplete.
"""

import atexit
import collections
import importlib.abc
import json
import logging
import os
import socket
import sys
import threading
import time

log = logging.getLogger("kvtrail")

# Event kinds in the queue. GUARD is no KV event: a decision of the guard
# (docs/guard.md) that was not ``ok``, sent as a ``guard`` line. LINES is a
# block of lines already formatted (the vLLM hook's native step: its KV and
# ``lost`` lines), with its line count per pool.
KV, REQ, SEND, COMMIT, LOST, PULL, COPY, GUARD, LINES = 0, 1, 2, 3, 4, 5, 6, 7, 8
# Items that are no KV event of a pool: never counted as a pool's loss.
NOT_KV = (REQ, GUARD)
# The most source request ids one ``guard`` line names (the sidecar's bound).
GUARD_MAX_SOURCES = 256
OPS = ("alloc", "write", "read", "free", "share", "scrub")
ALLOC, WRITE, READ, FREE, SHARE, SCRUB = range(6)
# The item kinds the native module (kvtrail_guard) reads from the queue.
NATIVE_KINDS = {"KV": KV, "REQ": REQ, "SEND": SEND, "COMMIT": COMMIT, "LOST": LOST, "PULL": PULL,
                "COPY": COPY}


def native_mismatch(mod, needs=()):
    """Why the native module ``mod`` (kvtrail_guard) cannot serve this
    client, or None: it must have the functions ``needs`` names, and number
    the item kinds (``KINDS``) and the ops (``OPS``, in code order) exactly
    as this client does. A module built from another kvtrail would misread
    every item, so the hooks refuse it (as a module that cannot be loaded)
    rather than run on it. The one home of both checks."""
    where = getattr(mod, "__file__", "?")
    rebuild = "rebuild it (docs/guard.md, \"Building\")"
    missing = [f for f in needs if not hasattr(mod, f)]
    kinds, ops = getattr(mod, "KINDS", None), getattr(mod, "OPS", None)
    if not isinstance(kinds, dict) or not isinstance(ops, (tuple, list)):
        missing += [n for n, v in (("KINDS", kinds), ("OPS", ops)) if v is None]
    if missing:
        return (f"the native module kvtrail_guard at {where} is older than this hook "
                f"(no {', '.join(missing)}): {rebuild}")
    if not isinstance(kinds, dict) or not isinstance(ops, (tuple, list)):
        return (f"the native module kvtrail_guard at {where} gives KINDS and OPS of the wrong "
                f"types ({type(kinds).__name__}, {type(ops).__name__}): {rebuild}")
    bad = [f"{k} is {repr(kinds[k]) if k in kinds else 'missing'} there, {v} here"
           for k, v in NATIVE_KINDS.items() if k not in kinds or kinds[k] != v]
    bad += [f"{k} is unknown here" for k in sorted(map(repr, set(kinds) - set(NATIVE_KINDS)))]
    if tuple(ops) != OPS:
        bad.append(f"OPS are {tuple(ops)!r} there, {OPS!r} here")
    if bad:
        return (f"the native module kvtrail_guard at {where} numbers the queue's items otherwise "
                f"than this hook ({'; '.join(bad)}): install the module and the hooks from one "
                "kvtrail (docs/guard.md, \"Building\")")
    return None


# Index lists longer than this are copied as numpy arrays (vectorised runs).
SMALL = 4096

# How far a mark trails the clock: longer than an engine thread holds an
# event between stamping it and queueing it (a few GIL switch intervals).
MARK_LAG_NS = 100_000_000
# Idle marks at most this often (seconds).
MARK_EVERY = 0.02


def parse_addr(addr):
    """`unix:/path`, `tcp:host:port`, `host:port` or a bare path."""
    if addr.startswith("unix:"):
        return socket.AF_UNIX, addr[5:]
    if addr.startswith("tcp:"):
        addr = addr[4:]
    elif "/" in addr or ":" not in addr:
        return socket.AF_UNIX, addr
    host, _, port = addr.rpartition(":")
    return socket.AF_INET, (host.strip("[]"), int(port))


def runs(idx):
    """Contiguous runs [(start, count), ...] of an index list, array or range."""
    if isinstance(idx, range):
        return [(idx.start, len(idx))] if len(idx) and idx.step == 1 else runs(list(idx))
    if isinstance(idx, list):
        out = []
        if not idx:
            return out
        start = prev = idx[0]
        for x in idx[1:]:
            if x == prev + 1:
                prev = x
                continue
            out.append((start, prev - start + 1))
            start = prev = x
        out.append((start, prev - start + 1))
        return out
    import numpy as np

    a = np.asarray(idx, dtype=np.int64).reshape(-1)
    if a.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(a) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [a.size]))
    return list(zip(a[starts].tolist(), (ends - starts).tolist()))


def copy_runs(dst, src):
    """Runs [(dst_start, src_start, count), ...] of two equally long index
    lists copied element by element (both contiguous within a run)."""
    dst, src = _as_list(dst), _as_list(src)
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} slots into {len(dst)}")
    out = []
    for d, s_ in zip(dst, src):
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s_:
            out[-1][2] += 1
        else:
            out.append([d, s_, 1])
    return [tuple(r) for r in out]


def _as_list(idx):
    if isinstance(idx, range):
        return list(idx)
    return idx if isinstance(idx, list) else idx.tolist()


def capture_indices(t):
    """A private copy of an index tensor/array/list, cheap for small ones.

    Copying matters: callers pass views of req_to_token rows, which SGLang
    rewrites when the row is reused, possibly before the sender thread runs.
    """
    if isinstance(t, list):
        return list(t)
    n = t.numel() if hasattr(t, "numel") else len(t)
    if n <= SMALL:
        return t.tolist() if hasattr(t, "tolist") else list(t)
    if hasattr(t, "detach"):
        return t.detach().to("cpu").numpy().copy()
    import numpy as np

    return np.array(t, dtype=np.int64)


# Live clients, closed by the exit handler (bounded: KVTRAIL_EXIT_FLUSH_S
# seconds in all, default 5) so an engine that exits without uninstalling
# still sends what it queued and says goodbye.
_LIVE = set()
_LIVE_LOCK = threading.Lock()


def _exit_flush():
    try:
        budget = float(os.environ.get("KVTRAIL_EXIT_FLUSH_S", "5"))
    except ValueError:
        budget = 5.0
    end = time.monotonic() + max(0.0, budget)
    with _LIVE_LOCK:
        clients = list(_LIVE)
    for c in clients:
        c.close(max(0.0, end - time.monotonic()))


atexit.register(_exit_flush)


class Client:
    """One connection (one hello) for a set of pools."""

    def __init__(self, addr, pools, worker, max_queue=1 << 18, batch=4096, interval=0.002,
                 page_sizes=None):
        self.addr = addr
        self.family, self.target = parse_addr(addr)
        self.pools = sorted(set(pools))
        self.worker = worker
        # pool -> the engine's block size there, when it knows it: the hello
        # carries it, and the sidecar refuses a claim whose deployment says
        # otherwise (it expands block-form pulls with the deployment's).
        self.page_sizes = {int(p): int(n) for p, n in (page_sizes or {}).items() if p in self.pools}
        self.max_queue = max_queue
        self.batch = batch
        self.interval = interval
        self.q = collections.deque()
        self.dropped = {}  # pool -> events dropped on a full queue, not yet reported
        self.down_lost = {}  # pool -> events lost while the sidecar was down, not yet reported
        self.sock = None
        self.stats = {"sent_lines": 0, "dropped_queue": 0, "lost_sidecar_down": 0,
                      "connect_failures": 0, "requests_lost": 0, "guard_lost": 0}
        self.enqueued = 0  # items accepted (engine thread)
        self.handled = 0  # items sent or counted lost (sender thread)
        self.sent_items = 0  # items whose lines reached a socket
        # Lines held in LINES items beyond the one each item counts in the
        # queue's length: queued (engine thread) and taken off the queue
        # (sender thread); the queue's bound counts every line once.
        self._lines_in = 0
        self._lines_out = 0
        self.dropped_items = 0  # items counted lost (queue full, sidecar down, exit deadline)
        self._last_mark = 0.0
        # Guard checks answered ok through this client: counted by the
        # engine thread (its only writer), reported by the sender thread as
        # `guard_ok` lines with the marks and before `bye` (the sender's
        # own count of what it reported).
        self.guard_ok = 0
        self._guard_ok_sent = 0
        # Pool positions (see "Positions"): committed once a batch is sent,
        # and the working copy while a batch is formatted.
        self._pos = {}
        self._tmp = {}
        self._connect_err = None
        self._deadline = float("inf")
        self._stop = False
        self._wake = threading.Event()
        self._last_warn = 0.0
        self._next_try = 0.0
        self.thread = threading.Thread(target=self._run, name="kvtrail-sender", daemon=True)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self.thread.start()

    # ---- hot path (engine thread) ----
    def put(self, pool, item):
        if len(self.q) + self._lines_in - self._lines_out >= self.max_queue:
            self.dropped[pool] = self.dropped.get(pool, 0) + 1
            self.stats["dropped_queue"] += 1
            self.enqueued += 1
            self.dropped_items += 1
            return
        if self.dropped:
            # The loss goes into the stream where it happened: before this event.
            n = self.dropped.pop(pool, 0)
            if n:
                self.enqueued += 1
                self.q.append((LOST, pool, n))
        self.enqueued += 1
        self.q.append(item)

    def put_lines(self, ts, text, counts, n):
        """Queues lines formatted natively, ``n`` events in all
        (newline-separated, KV and ``lost`` lines of the pools in
        ``counts``: (pool, events), a line of several runs counting one per
        run and a ``lost`` line its n), stamped ``ts``, as one item. On a full queue
        they are dropped and counted per pool, as ``put``'s events are."""
        if len(self.q) + self._lines_in - self._lines_out + n > self.max_queue:
            for pool, k in counts:
                self.dropped[pool] = self.dropped.get(pool, 0) + k
            self.stats["dropped_queue"] += n
            self.enqueued += 1
            self.dropped_items += 1
            return
        if self.dropped:
            for pool, _ in counts:
                k = self.dropped.pop(pool, 0)
                if k:
                    self.enqueued += 1
                    self.q.append((LOST, pool, k))
        self.enqueued += 1
        self._lines_in += n - 1
        # it[1] is no pool here: LINES items carry their pools in counts.
        self.q.append((LINES, counts[0][0] if counts else -1, ts, text, counts, n))

    def put_guard(self, pool, ts, rid, verdict, action, sources, slots_read, slots_foreign,
                  slots_unknown):
        """Queues a guard decision (engine thread). It is no KV event: on a
        full queue it is dropped and counted (``guard_lost``), never a hole
        in the pool."""
        self.enqueued += 1
        if len(self.q) + self._lines_in - self._lines_out >= self.max_queue:
            self.stats["guard_lost"] += 1
            self.dropped_items += 1
            return
        srcs = tuple(sorted({int(s) for s in sources}))[:GUARD_MAX_SOURCES]
        self.q.append((GUARD, pool, ts, rid, verdict, action, srcs, slots_read, slots_foreign,
                       slots_unknown))

    # ---- sender thread ----
    def _connect(self):
        s = socket.socket(self.family, socket.SOCK_STREAM)
        s.settimeout(5.0)
        try:
            s.connect(self.target)
        except OSError:
            s.close()
            raise
        hello = {"type": "hello", "pools": self.pools, "worker": self.worker}
        if self.page_sizes:
            hello["page_sizes"] = {str(p): n for p, n in sorted(self.page_sizes.items())}
        try:
            s.sendall((json.dumps(hello) + "\n").encode())
            # The sidecar answers one line: welcome (the claim holds) or
            # error (refused: unknown pool, pool held by another live
            # connection, too many connections). Until a welcome, nothing is
            # sent: events go to the loss counters, never into a refused
            # connection.
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise OSError("the sidecar closed the connection before answering the hello")
                reply += chunk
                if len(reply) > 1 << 16:
                    raise OSError("the sidecar's answer to the hello is too long")
            try:
                ans = json.loads(reply)
            except ValueError:
                raise OSError(f"the sidecar's answer to the hello is not JSON: {reply[:200]!r}")
            if ans.get("type") != "welcome":
                raise OSError(f"the sidecar refused the hello: {ans.get('error', ans)}")
        except OSError:
            s.close()
            raise
        self.sock = s
        self._pos = {}  # positions count per connection

    def _format(self, item, out):
        kind = item[0]
        if kind == LINES:
            _, _, _, text, counts, _ = item
            out.append(text)
            for pool, k in counts:
                self._tmp[pool] = self._tmp.get(pool, 0) + k
            return
        if kind == KV:
            _, pool, ts, rid, op, idx, tpos, ps = item
            if ps:
                # Paged free: the whole pages of these slots go back.
                rs = [(p * ps, n * ps) for p, n in runs(sorted({x // ps for x in _as_list(idx)}))]
            else:
                rs = runs(idx)
            for start, count in rs:
                tp = "null" if tpos is None else str(tpos)
                out.append(
                    '{"type":"kv","pool":%d,"ts_ns":%d,"request_id":%d,"op":"%s",'
                    '"slot_start":%d,"slot_count":%d,"token_pos":%s}'
                    % (pool, ts, rid, OPS[op], start, count, tp)
                )
                if tpos is not None:
                    tpos += count
                self._tmp[pool] = self._tmp.get(pool, 0) + 1
            return
        if kind == COPY:
            # (COPY, pool, ts, rid, src_pool, runs); runs (dst, src, count).
            _, pool, ts, rid, src_pool, rs = item
            if not rs:
                return
            out.append(json.dumps({"type": "copy", "pool": pool, "ts_ns": ts, "request_id": rid,
                                   "src_pool": src_pool, "src_pos": self._tmp.get(src_pool, 0),
                                   "runs": [list(r) for r in rs]}, separators=(",", ":")))
            self._tmp[pool] = self._tmp.get(pool, 0) + len(rs)
            return
        if kind == REQ:
            out.append(json.dumps(item[2], separators=(",", ":")))
            return
        if kind == GUARD:
            _, pool, ts, rid, verdict, action, srcs, nr, nf, nu = item
            out.append(json.dumps({"type": "guard", "pool": pool, "ts_ns": ts, "request_id": rid,
                                   "verdict": verdict, "action": action, "sources": list(srcs),
                                   "slots_read": nr, "slots_foreign": nf, "slots_unknown": nu},
                                  separators=(",", ":")))
            return
        if kind == LOST:
            out.append('{"type":"lost","pool":%d,"n":%d}' % (item[1], item[2]))
            self._tmp[item[1]] = self._tmp.get(item[1], 0) + item[2]
            return
        if kind == SEND:
            _, pool, ts, room, dst_index, pages, last = item
            rs = runs(pages)
            if not rs:
                return
            out.append(json.dumps({"type": "xfer_send", "room": room, "pool": pool, "ts_ns": ts,
                                   "dst_index": dst_index, "src_pages": rs, "last": bool(last)},
                                  separators=(",", ":")))
            return
        if kind == PULL:
            # (PULL, pool, ts, rid, src_pool, runs, outcome, policy[, src_blocks,
            # tail]); runs are (dst_slot, src_slot, count, token_pos), or with
            # src_blocks (the source's block ids: the block form, which the
            # sidecar expands with the source pool's page size)
            # (dst_slot, src_tok, count, token_pos).
            _, pool, ts, rid, src_pool, rs, outcome, policy = item[:8]
            msg = {"type": "xfer_pull", "pool": pool, "ts_ns": ts, "request_id": rid,
                   "src_pool": src_pool, "runs": [list(r) for r in rs], "outcome": outcome}
            if policy is not None:
                msg["policy"] = policy
            if len(item) > 8 and item[8] is not None:
                msg["src_blocks"] = [int(b) for b in item[8]]
                if item[9] is not None:
                    msg["tail"] = int(item[9])
            out.append(json.dumps(msg, separators=(",", ":")))
            return
        if kind == COMMIT:
            _, pool, ts, room, rid, prefix_len, pages = item
            rs = runs(pages)
            if not rs:
                return
            out.append(json.dumps({"type": "xfer_commit", "room": room, "pool": pool, "ts_ns": ts,
                                   "request_id": rid, "prefix_len": prefix_len, "dst_pages": rs},
                                  separators=(",", ":")))

    def _lost_lines(self, counts):
        return ['{"type":"lost","pool":%d,"n":%d}' % (p, n) for p, n in sorted(counts.items()) if n]

    def _run(self):
        while True:
            if not self.q:
                if self._stop:
                    break
                self._mark(time.time_ns())
                self._wake.wait(self.interval)
                self._wake.clear()
                continue
            if self._stop and time.monotonic() > self._deadline:
                self._abandon()
                break
            t0 = time.time_ns()
            items = []
            q = self.q
            for _ in range(min(self.batch, len(q))):
                it = q.popleft()
                if it[0] == LINES:
                    self._lines_out += it[5] - 1
                items.append(it)
            drained = not q
            lines = []
            self._ensure_connected()
            self._tmp = dict(self._pos)
            for p, k in self.down_lost.items():
                # Sent ahead of this batch (see _send) when it goes out.
                self._tmp[p] = self._tmp.get(p, 0) + k
            for it in items:
                try:
                    self._format(it, lines)
                except Exception as e:  # a bad item is a lost event, never a crash
                    if it[0] == LINES:
                        for pool, k in it[4]:
                            self.dropped[pool] = self.dropped.get(pool, 0) + k
                    elif it[0] not in NOT_KV:
                        pool = it[1]
                        self.dropped[pool] = self.dropped.get(pool, 0) + 1
                    log.warning("kvtrail: could not encode an event: %s", e)
            self._send(lines, items)
            self.handled += len(items)
            if drained:
                self._mark(t0, force=True)
            else:
                # Busy: what is left starts at the head's stamp (the queue is
                # in stamping order), so everything before it has been sent.
                try:
                    head = q[0]
                except IndexError:
                    head = None
                if head is not None and head[0] in (KV, SEND, COMMIT, PULL, COPY, LINES):
                    self._mark(min(t0, head[2]), force=True, busy=True)
        self._close()

    def _abandon(self):
        """The close's deadline passed: what is still queued is counted lost
        per pool (reported in the closing lines)."""
        while self.q:
            it = self.q.popleft()
            self.handled += 1
            self.dropped_items += 1
            if it[0] == LINES:
                self._lines_out += it[5] - 1
                for pool, k in it[4]:
                    self.dropped[pool] = self.dropped.get(pool, 0) + k
                continue
            if it[0] in NOT_KV:
                self.stats["requests_lost" if it[0] == REQ else "guard_lost"] += 1
                continue
            k = it[2] if it[0] == LOST else 1
            self.dropped[it[1]] = self.dropped.get(it[1], 0) + k

    def _mark(self, t0, force=False, busy=False):
        """Tells the sidecar every event stamped before t0 - MARK_LAG_NS
        has been sent (t0: a time the queue was seen empty after, or the
        stamp of the queue's head)."""
        now = time.monotonic()
        if self.sock is None or (not force and now - self._last_mark < MARK_EVERY):
            return
        if self.q and not busy:
            return
        self._last_mark = now
        ok_line, n_ok = self._guard_ok_line()
        try:
            self.sock.sendall((ok_line + '{"type":"mark","ts_ns":%d}\n' % (t0 - MARK_LAG_NS)).encode())
            self._guard_ok_sent += n_ok
        except OSError:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def _guard_ok_line(self):
        """The `guard_ok` line of the ok checks not yet reported ("" when
        none) and their number."""
        n = self.guard_ok - self._guard_ok_sent
        if n <= 0:
            return "", 0
        return '{"type":"guard_ok","n":%d}\n' % n, n

    def _ensure_connected(self):
        """Connects (before a batch is formatted: its positions count on
        the connection it goes to), backing off after a failure."""
        if self.sock is not None:
            return
        if time.monotonic() < self._next_try:
            self._connect_err = "retrying in under a second"
            return
        try:
            self._connect()
            self._connect_err = None
        except OSError as e:
            self.stats["connect_failures"] += 1
            self._next_try = time.monotonic() + 1.0  # back off: do not spin on connect
            self._connect_err = e

    def _send(self, lines, items):
        carried = {}
        if self.sock is None:
            self._count_down(items, carried, self._connect_err or "not connected")
            return
        if self.down_lost:
            # Losses while the sidecar was unreachable: holes, reported first.
            carried, self.down_lost = self.down_lost, {}
            lines[:0] = self._lost_lines(carried)
        lines.append("")  # the last line's newline, without another copy of the batch
        data = "\n".join(lines).encode()
        lines.pop()
        try:
            self.sock.sendall(data)
            self.stats["sent_lines"] += len(lines) + sum(it[5] - 1 for it in items if it[0] == LINES)
            self.sent_items += len(items)
            self._pos = self._tmp
        except OSError as e:
            try:
                self.sock.close()
            finally:
                self.sock = None
            self._count_down(items, carried, e)

    def _count_down(self, items, carried, err):
        """Items that could not be sent: counted per pool, reported later."""
        for p, k in carried.items():
            self.down_lost[p] = self.down_lost.get(p, 0) + k
        n = 0
        self.dropped_items += len(items)
        for it in items:
            if it[0] == LINES:
                for pool, k in it[4]:
                    self.down_lost[pool] = self.down_lost.get(pool, 0) + k
                n += it[5]
                continue
            if it[0] in NOT_KV:
                self.stats["requests_lost" if it[0] == REQ else "guard_lost"] += 1
                continue
            k = it[2] if it[0] == LOST else 1
            self.down_lost[it[1]] = self.down_lost.get(it[1], 0) + k
            n += 0 if it[0] == LOST else 1
        self.stats["lost_sidecar_down"] += n
        now = time.monotonic()
        if now - self._last_warn > 10:
            self._last_warn = now
            log.warning("kvtrail: sidecar %s unreachable (%s): %d events lost so far (counted, "
                        "reported as seq holes when it is back)", self.addr, err,
                        self.stats["lost_sidecar_down"])

    def flush(self, timeout=10.0):
        """Waits until the queue is sent (tests, shutdown)."""
        end = time.monotonic() + timeout
        while self.handled < self.enqueued and time.monotonic() < end:
            self._wake.set()
            time.sleep(0.0005)

    def close(self, timeout=10.0):
        """Sends what is queued within `timeout` seconds, then the closing
        `bye` (what could not be sent by then is reported lost)."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self._stop:
            return
        self._deadline = time.monotonic() + timeout
        self._stop = True
        self._wake.set()
        self.thread.join(timeout + 1.0)

    def _close(self):
        if self.sock is None:
            try:
                self._connect()
            except OSError:
                return
        counts = dict(self.down_lost)
        for p, n in self.dropped.items():
            counts[p] = counts.get(p, 0) + n
        self.down_lost, self.dropped = {}, {}
        lines = self._lost_lines(counts)
        ok_line, n_ok = self._guard_ok_line()
        if n_ok:
            lines.append(ok_line.rstrip("\n"))
        lines.append('{"type":"bye","enqueued":%d,"sent":%d,"dropped":%d}'
                     % (self.enqueued, self.sent_items, self.dropped_items))
        try:
            self.sock.sendall(("\n".join(lines) + "\n").encode())
            self._guard_ok_sent += n_ok
        except OSError:
            pass
        try:
            self.sock.close()
        finally:
            self.sock = None


def hash_tokens(ids):
    """blake3 of token ids, each as little-endian u32 (the trace contract)."""
    import blake3
    import numpy as np

    if isinstance(ids, (bytes, bytearray)):
        raise TypeError("token ids, not bytes")
    if hasattr(ids, "typecode"):  # array.array
        a = np.frombuffer(ids, dtype=np.dtype(ids.typecode)).astype("<u4")
    else:
        a = np.asarray(ids, dtype=np.int64).astype("<u4")
    return blake3.blake3(a.tobytes()).hexdigest()


def id_of(name):
    """A trace request_id (1..2^63-1) derived from an engine's request id string."""
    import blake3

    d = blake3.blake3(str(name).encode()).digest()
    return int.from_bytes(d[:8], "little") & 0x7FFFFFFFFFFFFFFF or 1


def tenant_value(v, pseudonymize):
    """The tenant as recorded: ``unknown`` when absent, a ``t-<blake3>``
    pseudonym when asked."""
    if v is None or v == "":
        return "unknown"
    v = str(v)
    if pseudonymize:
        import blake3

        return "t-" + blake3.blake3(v.encode()).hexdigest()[:16]
    return v


def default_worker():
    return os.environ.get("KVTRAIL_WORKER") or f"{socket.gethostname()}:{os.getpid()}"


class PostImport(importlib.abc.MetaPathFinder):
    """Applies a hook's patches to modules as they are imported: for a
    module name ``wants(fullname)`` accepts, the module is loaded by the
    finder that would have loaded it, then ``apply(module)`` runs (both
    callables check that the hook is still installed)."""

    def __init__(self, wants, apply):
        self._wants = wants
        self._apply = apply

    def find_spec(self, fullname, path, target=None):
        if not self._wants(fullname):
            return None
        for f in sys.meta_path:
            if f is self or not hasattr(f, "find_spec"):
                continue
            spec = f.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        orig_exec = loader.exec_module
        apply = self._apply

        def exec_module(module):
            orig_exec(module)
            apply(module)

        loader.exec_module = exec_module
        return spec
