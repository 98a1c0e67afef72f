"""kvtrail capture hook for SGLang.

Enable with one line in the engine process::

    import kvtrail_sglang; kvtrail_sglang.install()

or by setting ``KVTRAIL_CAPTURE=unix:/run/kvtrail.sock`` in the engine's
environment (the installed ``kvtrail_sglang.pth`` then calls ``install()``
at start-up). Events go to the ``kvtrail record`` sidecar; see
docs/capture-sglang.md for what is recorded and what it costs.

Patched entry points (each wrapper calls SGLang's original first or around
it, and never changes arguments or results):

- ``Req.__init__``: arrival time, ORIGINAL prompt length, prompt hash, tenant;
- ``Req.set_finish_with_abort``: marks the rejection, keeps the original
  length the placeholder ``[0]`` is about to overwrite;
- ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` ``alloc``,
  ``alloc_extend``, ``alloc_decode``, ``free``, ``free_segment``,
  ``free_group_end``: alloc/free of slots, attributed to the request whose
  outer call is running (engine = request 0 otherwise, e.g. radix eviction);
- ``alloc_for_extend`` (prefill): per request alloc, share (radix prefix
  hit), write and read of the extend;
- ``alloc_for_decode``: per request alloc, write and read of the new token;
- ``DecodePreallocQueue._pre_alloc``: decode preallocation, and the share
  of a decode radix-tree prefix hit (``prefix_indices[:prefix_len]``);
- ``CommonKVSender._prepare_send_indices`` (prefill) and
  ``CommonKVReceiver.send_metadata`` + ``DecodeTransferQueue._commit_transfer_to_req``
  (decode): the KV transfer, joined by the sidecar into copies with src;
- ``ScheduleBatch.prepare_for_prebuilt``: decode's read of the transferred
  (or merely preallocated) prompt KV;
- ``release_kv_cache``: frees, then the request row (status, finish reason,
  output token count and blake3 of the output ids; never content);
- HiCache (``--enable-hierarchical-cache``), when a ``cache`` pool is given
  (``KVTRAIL_CACHE_POOL``): the host pool's ``alloc`` / ``free``
  (``HostKVCache``; ``evict_host`` frees through it), ``HiCacheController.write``
  (an offload: a ``copy`` into the cache pool from the device pool) and
  ``HiCacheController.load`` (a load back: a ``copy`` into the device
  slots it allocated), stamped with the source pool's position (the
  engine's own order); ``HiRadixCache.load_back`` and ``_split_node`` tell
  which tree node each host slot was written for, so a prefix hit is a
  ``share`` only of loaded slots that hold the hit node's KV (a host slot
  reused under a stale key gets no grant: its read is foreign, with its
  true source). The unified tree SGLang builds by default is hooked the
  same way: ``HybridCacheController.write`` / ``load`` (it overrides
  both; its host pool is a ``HostPoolGroup``, whose anchor KV pool
  records), ``UnifiedRadixCache.load_back`` with the tree core's
  ``build_load_back_spec`` and ``_split_node``. An L3 storage prefetch
  grafted into either tree (``_handle_prefetch_result``) is a ``lost`` line
  in the cache pool: what the storage backend wrote is unverifiable.
- the unified tree's direct L3 linker (``UnifiedCacheLinkerWrapper.load_back``,
  an external store loading straight into device slots, no host tier): a
  load back that had a hit is a ``lost`` line in the device pool, with or
  without a cache pool (the store's content is unverifiable).

The guard (docs/guard.md; ``KVTRAIL_GUARD=off|alert|abort``, default
alert; ``KVTRAIL_GUARD_UNKNOWN=allow|abort``, default allow) mirrors every
event queued here into kvtrail's slot rule (the native ``kvtrail_guard``
module) and checks a request before its first forward over KV it did not
compute: at ``prepare_for_prebuilt`` (decode after a transfer, and a decode
radix-tree hit) and at ``alloc_for_extend`` with a prefix (a radix or
HiCache hit). In abort mode a foreign read ends the request with
``FINISH_ABORT`` (HTTP 500, err_type ``KVIsolationError``) before its
first token.
"""

import os
import sys
import threading
import time

import kvtrail_hook_client as _c
from kvtrail_hook_client import guard as _guard_mod

try:
    # The guard's native module also builds the decode step's lines
    # (on_alloc_for_decode); without it the hook builds them in Python.
    import kvtrail_guard as _native
except ImportError:
    _native = None
if _native is not None and _c.native_mismatch(_native) is not None:
    # Its items would be misread: the lines are built here instead. The
    # guard refuses the module likewise, by its own policy, and says why.
    _native = None
from kvtrail_hook_client import ALLOC, FREE, READ, SHARE, WRITE, Client, capture_indices

__all__ = ["install", "uninstall", "stats", "counts", "guard_stats", "flush", "request_id", "tag",
           "hash_tokens"]

_time_ns = time.time_ns
_H = None  # the installed hook state


class _Ctx(threading.local):
    rid = 0  # request on whose behalf allocator calls run (0 = engine)
    suppress = 0  # >0: an outer hook records these allocator calls itself
    pool = None


_ctx = _Ctx()


class _Hook:
    def __init__(self, capture, pools, worker, tenant_field, roles, per_pool, max_queue, pseudonymize,
                 cache_pools=None, guard=None):
        # First: in abort mode without its native module, refuse to start.
        self.guard = guard if guard is not None else _guard_mod.Guard()
        self.capture = capture
        self.default_pool = pools[0]
        # device pool -> its HiCache `cache` pool (declared in the same hello)
        self.cache_pools = dict(cache_pools or {})
        pools = list(pools) + [c for c in self.cache_pools.values() if c not in pools]
        self.roles = roles
        self.tenant_field = tenant_field
        self.pseudonymize = pseudonymize
        self.clients = {}
        if per_pool:
            # A device pool's `cache` pool goes on the device pool's
            # connection: the tier copies between them name a source pool
            # that the connection must hold.
            cached = set(self.cache_pools.values())
            for p in pools:
                if p in cached:
                    continue
                held = [p] + ([self.cache_pools[p]] if p in self.cache_pools else [])
                cl = Client(capture, held, f"{worker}/pool{p}", max_queue=max_queue)
                for h in held:
                    self.clients[h] = cl
        else:
            cl = Client(capture, pools, worker, max_queue=max_queue)
            for p in pools:
                self.clients[p] = cl
        self.page_sizes = {}  # pool -> its allocator's page size, once seen
        self.metadata = {}  # bootstrap_room -> (dst pages, decode prefix len), decode side
        self.originals = {}  # (owner, name) -> original
        self.wrapped_funcs = {}  # original function -> wrapper (module-level functions)
        self.disabled = False
        # Pools whose decode step the guard missed (busy in another
        # thread): a hole fed to it before the next step's writes.
        self.guard_holes = set()
        # HiCache: host slot -> id of the tree node it was last written for,
        # per cache pool; device slots a load filled with KV of another node
        # than the one hit (no grant at the prefix hit, until freed).
        self.host_node = {}
        self.ungranted = {}
        self.counts = {"hook_errors": 0, "hicache_offloads": 0, "hicache_loads": 0,
                       "hicache_key_mismatch": 0, "hicache_storage_loads": 0,
                       "hicache_storage_tokens": 0, "hicache_loads_unverified": 0,
                       "hicache_retraction_backups": 0, "hicache_retraction_restores": 0,
                       "linker_loads_unverified": 0, "linker_tokens": 0}

    def put(self, pool, item, mirror=True):
        """Queues ``item`` for the sidecar and, unless ``mirror`` is false
        (a read or a free: the guard's rule needs neither), the guard."""
        push = self.guard.push
        if push is not None and mirror:
            push(item)
        cl = self.clients.get(pool)
        if cl is not None:
            cl.put(pool, item)


# ---------------------------------------------------------------- helpers


hash_tokens = _c.hash_tokens


def request_id(req):
    """The trace request_id of an SGLang Req: its bootstrap_room in PD mode
    (shared by the prefill and decode sides), else derived from rid."""
    rid = getattr(req, "_kvtrail_id", None)
    if rid is not None:
        return rid
    room = getattr(req, "bootstrap_room", None)
    if isinstance(room, int) and room > 0:
        rid = room & 0x7FFFFFFFFFFFFFFF or 1
    else:
        rid = _c.id_of(req.rid)
    try:
        req._kvtrail_id = rid
    except AttributeError:
        pass
    return rid


def tag(obj, pool):
    """Declares which trace pool an allocator (or sender/receiver/queue)
    belongs to, for processes that hold more than one pool."""
    obj._kvtrail_pool = pool
    if _H is not None and hasattr(obj, "page_size") and hasattr(obj, "alloc"):
        _guard("page size", _note_page_size, obj)
    return obj


def _pool_of(obj):
    p = getattr(obj, "_kvtrail_pool", None)
    if p is None:
        for attr in ("token_to_kv_pool_allocator", "allocator", "kv_mgr"):
            inner = getattr(obj, attr, None)
            if inner is not None:
                p = getattr(inner, "_kvtrail_pool", None)
                if p is not None:
                    break
    return _H.default_pool if p is None else p


def _row(req_to_token_pool, req):
    idx = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if idx is None:
        idx = getattr(req, "req_pool_idx", None)
    return req_to_token_pool.req_to_token[idx]


def _tenant(req):
    v = req
    for part in _H.tenant_field.split("."):
        if isinstance(v, dict):
            v = v.get(part)
        else:
            v = getattr(v, part, None)
        if v is None:
            break
    return _c.tenant_value(v, _H.pseudonymize)


def _role(req, pool):
    r = _H.roles.get(pool)
    if r:
        return r
    mode = getattr(req, "disagg_mode", None)
    name = getattr(mode, "name", str(mode or "")).lower()
    return name if name in ("prefill", "decode") else "mixed"


def _kv(pool, rid, op, idx, tpos=None):
    _H.put(pool, (_c.KV, pool, _time_ns(), rid, op, capture_indices(idx), tpos, 0),
           op != READ and op != FREE)


# ---------------------------------------------------------------- request hooks


def on_req_init(req):
    """After ``Req.__init__``: arrival, original prompt length and hash, tenant."""
    if _H is None or _H.disabled:
        return
    ids = req.origin_input_ids
    req._kvtrail_arrival = _time_ns()
    req._kvtrail_prompt_tokens = len(ids)
    req._kvtrail_prompt_hash = hash_tokens(ids)
    req._kvtrail_prefilled = None


def before_set_finish_with_abort(req):
    """Before ``Req.set_finish_with_abort`` overwrites the prompt with [0]."""
    if _H is None:
        return
    if getattr(req, "_kvtrail_prompt_tokens", None) is None:
        on_req_init(req)
    req._kvtrail_rejected = True


def request_row(req, pool):
    """The request line for ``req`` as this process saw it."""
    role = _role(req, pool)
    reason = getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)
    rname = type(reason).__name__ if reason is not None else None
    status = 200
    finish = None
    if rname == "FINISH_ABORT":
        status = int(getattr(reason, "status_code", None) or 500)
        finish = "abort"
    elif rname == "FINISH_LENGTH":
        finish = "length"
    elif rname and rname.startswith("FINISH_MATCHED"):
        finish = "stop"
    elif rname:
        finish = rname.lower()
    out = list(getattr(req, "output_ids", []) or [])
    prompt_tokens = getattr(req, "_kvtrail_prompt_tokens", None)
    if prompt_tokens is None:
        prompt_tokens = len(req.origin_input_ids)
    prefilled = None
    if role != "decode":
        prefilled = getattr(req, "_kvtrail_prefilled", None)
        if prefilled is None:
            prefilled = len(req.origin_input_ids)
    row = {
        "type": "request",
        "request_id": request_id(req),
        "external_id": str(req.rid),
        "tenant": _tenant(req),
        "arrival_ns": getattr(req, "_kvtrail_arrival", None) or _time_ns(),
        "finish_ns": _time_ns(),
        "prompt_tokens": prompt_tokens,
        "prefilled_tokens": prefilled,
        "output_tokens": len(out),
        "http_status": status,
        "finish_reason": finish,
        "prefill_pool": pool if role in ("prefill", "mixed") else None,
        "decode_pool": pool if role in ("decode", "mixed") else None,
        "prompt_hash": getattr(req, "_kvtrail_prompt_hash", None),
        "output_hash": hash_tokens(out) if out else None,
    }
    return row


def on_release(req, tree_cache):
    """After ``release_kv_cache``: the request row."""
    if _H is None or _H.disabled or getattr(req, "_kvtrail_done", False):
        return
    pool = getattr(req, "_kvtrail_pool", None)
    if pool is None:
        pool = _pool_of(tree_cache)
    req._kvtrail_done = True
    _H.put(pool, (_c.REQ, pool, request_row(req, pool)))


# ---------------------------------------------------------------- batch hooks


def _share(pool, rid, idx, pos=0):
    """A prefix hit's ``share`` (from token position ``pos``), less the
    device slots a HiCache load filled with another node's KV (a stale host
    slot): those grant nothing."""
    bad = _H.ungranted.get(pool)
    if not bad:
        _kv(pool, rid, SHARE, idx, pos)
        return
    slots = _c._as_list(capture_indices(idx))
    start = None
    for i, x in enumerate(slots + [None]):
        ok = x is not None and x not in bad
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            _kv(pool, rid, SHARE, slots[start:i], pos + start)
            start = None


def on_alloc_for_extend(batch, out_cache_loc):
    """After ``alloc_for_extend(batch)``: per request alloc, share, write, read."""
    if _H is None or _H.disabled:
        return
    pool = _pool_of(batch)
    pool_t = batch.req_to_token_pool
    ext_lens = getattr(batch, "extend_lens", None)
    for i, req in enumerate(batch.reqs):
        rid = request_id(req)
        req._kvtrail_pool = pool
        pre = len(req.prefix_indices) if req.prefix_indices is not None else 0
        ext = ext_lens[i] if ext_lens is not None else req.extend_input_len
        row = _row(pool_t, req)
        if pre:
            _share(pool, rid, row[:pre])
        new = row[pre:pre + ext]
        _kv(pool, rid, ALLOC, new)
        _kv(pool, rid, WRITE, new, pre)
        _kv(pool, rid, READ, row[:pre + ext], 0)
        req._kvtrail_prefilled = (getattr(req, "_kvtrail_prefilled", None) or 0) + ext
        if pre:
            _check(req, pool, rid, row[:pre])


_ABORT_STATUS = 500


def _check(req, pool, rid, slots):
    """The guard, before the request's first forward over KV it did not
    compute (once per request); an abort becomes the request's
    ``to_finish``, as SGLang's own prebuilt path aborts (the scheduler ends
    it with an error status when the batch result is processed). True when
    the request is to be aborted."""
    g = _H.guard
    if g.native is None or getattr(req, "_kvtrail_guarded", False):
        return False
    req._kvtrail_guarded = True
    msg = g.decide(pool, rid, req.rid, slots=slots, client=_H.clients.get(pool))
    if msg is None:
        return False
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.to_finish = FINISH_ABORT(msg, _ABORT_STATUS, "KVIsolationError")
    return True


def on_alloc_for_decode(batch, out_cache_loc, token_per_req=1):
    """After ``alloc_for_decode``: per request alloc, write and read of the
    new slot(s). (The prefix read is recorded once, at extend/prebuilt.)"""
    if _H is None or _H.disabled:
        return
    pool = _pool_of(batch)
    locs = out_cache_loc.tolist() if hasattr(out_cache_loc, "tolist") else list(out_cache_loc)
    seq = batch.seq_lens_cpu.tolist() if hasattr(batch, "seq_lens_cpu") else batch.seq_lens.tolist()
    step = getattr(_native, "decode_step", None)
    if (step is not None and type(pool) is int and 0 <= pool <= 0xFFFF
            and type(batch.reqs) is list and type(seq) is list):
        _decode_native(step, batch, pool, locs, seq, token_per_req)
        return
    for i, req in enumerate(batch.reqs):
        rid = request_id(req)
        new = locs[i * token_per_req:(i + 1) * token_per_req]
        # seq_lens is read before the step's increment: the new token's position.
        pos = int(seq[i])
        _kv(pool, rid, ALLOC, new)
        _kv(pool, rid, WRITE, new, pos)
        _kv(pool, rid, READ, new, pos)


def _decode_native(step, batch, pool, locs, seq, token_per_req):
    """``on_alloc_for_decode``'s events built in one native call
    (``kvtrail_guard.decode_step``): the same lines the per-event items
    make, queued as one item, and the allocs and writes mirrored into the
    guard."""
    g = _H.guard
    if _H.guard_holes:
        # A step the guard missed (busy in another thread): its holes,
        # before this step's writes.
        try:
            for p in sorted(_H.guard_holes):
                g.feed((_c.LOST, p, 1))
            _H.guard_holes.clear()
        except RuntimeError:
            pass  # still busy: this step will miss it too, and retry
    ts = _time_ns()
    try:
        out = step(pool, ts, batch.reqs, locs, seq, int(token_per_req), g.native, request_id)
    except Exception as e:
        # The step's events cannot be told: a hole in the pool (and in the
        # guard's view of it), never a silent gap.
        _H.counts["hook_errors"] += 1
        _c.log.warning("kvtrail: hook alloc_for_decode failed: %s", e)
        _H.put(pool, (_c.LOST, pool, 1))
        return
    cl = _H.clients.get(pool)
    if out.text is not None and cl is not None:
        cl.put_lines(ts, out.text, out.counts, out.events)
    if out.holes:
        _H.counts["hook_errors"] += 1
        _c.log.warning("kvtrail: hook alloc_for_decode: %d requests' state unreadable: holes",
                       out.holes)
    if out.guard_missed:
        _H.guard_holes.add(pool)


def on_pre_alloc(queue, req, kv_loc, prefix_indices=None, prefix_len=None):
    """After ``DecodePreallocQueue._pre_alloc``: a decode radix-tree hit on
    the first ``prefix_len`` tokens (``prefix_indices``, device-resident,
    with ``--disaggregation-decode-enable-radix-cache``) is a ``share`` of
    those slots; then the preallocated slots. Under revision 2 the share
    covers only current content: tree pages that a placeholder inserted
    without writing them (stale since its preallocation) grant nothing, so
    reading them is foreign (cache poisoning)."""
    if _H is None or _H.disabled:
        return
    pool = _pool_of(queue)
    req._kvtrail_pool = pool
    rid = request_id(req)
    n = int(prefix_len or 0)
    if n > 0 and prefix_indices is not None and len(prefix_indices):
        _share(pool, rid, prefix_indices[:n])
    if kv_loc is not None and len(kv_loc):
        _kv(pool, rid, ALLOC, kv_loc)


def on_prebuilt(batch):
    """After ``ScheduleBatch.prepare_for_prebuilt``: decode reads the whole
    prompt KV it preallocated (written by the transfer, or not)."""
    if _H is None or _H.disabled:
        return
    pool = _pool_of(batch)
    for req in batch.reqs:
        seq_len = len(req.origin_input_ids) + max(0, len(req.output_ids) - 1)
        row = _row(batch.req_to_token_pool, req)[:seq_len]
        rid = request_id(req)
        # An aborted request never attends over the KV: no read.
        if not _check(req, pool, rid, row):
            _kv(pool, rid, READ, row, 0)


def on_send_indices(sender, kv_indices, result):
    """After ``CommonKVSender._prepare_send_indices``: a chunk of prefill
    pages (ids, not slots) into the decode list at ``index_slice``."""
    if _H is None or _H.disabled:
        return
    _, index_slice, is_last, skip = result
    if skip:
        return
    pool = _pool_of(sender)
    room = int(sender.bootstrap_room)
    _H.put(pool, (_c.SEND, pool, _time_ns(), room, int(index_slice.start),
                  capture_indices(kv_indices), bool(is_last)))


def on_send_metadata(receiver, kv_indices, decode_prefix_len=0):
    """After ``CommonKVReceiver.send_metadata``: the decode destination pages."""
    if _H is None or _H.disabled:
        return
    room = int(receiver.bootstrap_room)
    if len(_H.metadata) > 100_000:  # abandoned rooms: keep memory bounded
        _H.metadata.pop(next(iter(_H.metadata)))
    _H.metadata[room] = (capture_indices(kv_indices), int(decode_prefix_len or 0), _pool_of(receiver))


def on_commit(queue, decode_req):
    """After ``DecodeTransferQueue._commit_transfer_to_req``: the transfer
    succeeded (unless the commit aborted the request)."""
    if _H is None or _H.disabled:
        return
    req = decode_req.req
    reason = getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)
    room = int(req.bootstrap_room or 0)
    meta = _H.metadata.pop(room, None)
    if type(reason).__name__ == "FINISH_ABORT" or meta is None:
        return
    pages, prefix_len, pool = meta
    # Decode HiCache: the host part of the prefix hit (positions
    # [l1, l1 + restored) of the row), loaded back into the device and
    # written into the request's row by _commit_hicache_local_restore_to_req
    # inside the commit, is a share like the device part (_pre_alloc's).
    pm = getattr(decode_req, "prefix_match", None)
    restored = getattr(decode_req, "hicache_restored_kv_indices", None)
    if pm is not None and restored is not None and len(restored) and pm.needs_local_restore:
        _share(pool, request_id(req), restored, int(pm.l1_prefix_len))
    _H.put(pool, (_c.COMMIT, pool, _time_ns(), room, request_id(req), prefix_len, pages))


# ---------------------------------------------------------------- allocator wrappers


def _wrap_alloc(orig):
    def alloc(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if _H is not None:
            _guard("page size", _note_page_size, self)
        if out is not None and _H is not None and not _ctx.suppress and not _H.disabled:
            pool = getattr(self, "_kvtrail_pool", None)
            if pool is None:
                pool = _H.default_pool
            _H.put(pool, (_c.KV, pool, _time_ns(), _ctx.rid, ALLOC, capture_indices(out), None, 0))
        return out

    alloc.__wrapped__ = orig
    return alloc


def _note_page_size(alloc):
    """The allocator's page size for its pool, once: the guard places
    transfer pages with it, and the pool's connection claims it in its
    hello (``page_sizes``; the sidecar refuses a claim the deployment
    contradicts). Only a size an allocator of the pool reported is
    claimed, and only on a connection not yet made: the client connects
    when its first event is queued, after the allocator that queued it
    noted its size here."""
    pool = getattr(alloc, "_kvtrail_pool", None)
    pool = _H.default_pool if pool is None else pool
    if pool < 0 or pool in _H.page_sizes:
        return
    ps = int(getattr(alloc, "page_size", 1) or 1)
    _H.page_sizes[pool] = ps
    if _H.guard.native is not None:
        _H.guard.page_size(pool, ps)
    cl = _H.clients.get(pool)
    if cl is not None and cl.sock is None and pool in cl.pools:
        cl.page_sizes[pool] = ps


def _wrap_free(orig):
    def free(self, free_index, *args, **kwargs):
        if _H is not None and not _ctx.suppress and not _H.disabled and free_index.numel():
            pool = getattr(self, "_kvtrail_pool", None)
            if pool is None:
                pool = _H.default_pool
            idx = capture_indices(free_index)
            _H.put(pool, (_c.KV, pool, _time_ns(), _ctx.rid, FREE, idx, None, 0))
            if _H.ungranted.get(pool):
                _H.ungranted[pool].difference_update(_c._as_list(idx))
        return orig(self, free_index, *args, **kwargs)

    free.__wrapped__ = orig
    return free


def _wrap_paged_free(orig):
    """Paged ``free``/``free_segment`` release whole pages: record the pages'
    slots (what the allocator will hand out again)."""

    def free(self, free_index, *args, **kwargs):
        if _H is not None and not _ctx.suppress and not _H.disabled and free_index.numel():
            pool = getattr(self, "_kvtrail_pool", None)
            if pool is None:
                pool = _H.default_pool
            # Pages are expanded to slots in the sender thread.
            idx = capture_indices(free_index)
            _H.put(pool, (_c.KV, pool, _time_ns(), _ctx.rid, FREE, idx, None, self.page_size))
            if _H.ungranted.get(pool):
                ps = self.page_size
                _H.ungranted[pool].difference_update(
                    {p * ps + o for p in {x // ps for x in _c._as_list(idx)} for o in range(ps)})
        return orig(self, free_index, *args, **kwargs)

    free.__wrapped__ = orig
    return free


def _wrap_group_end(orig):
    # Frees were recorded when called; the group's final free() is the same slots.
    def free_group_end(self, *args, **kwargs):
        _ctx.suppress += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            _ctx.suppress -= 1

    free_group_end.__wrapped__ = orig
    return free_group_end


def _wrap_ctx(orig, after, rid_arg=None, suppress=True):
    """A function whose allocator calls the wrapper attributes (rid_arg) or
    records itself (suppress), then calls ``after(args, result)``."""

    def wrapper(*args, **kwargs):
        if _H is None or _H.disabled:
            return orig(*args, **kwargs)
        prev = _ctx.rid
        if rid_arg is not None:
            _ctx.rid = request_id(_arg(args, kwargs, rid_arg, "req"))
        if suppress:
            _ctx.suppress += 1
        try:
            out = orig(*args, **kwargs)
        finally:
            _ctx.rid = prev
            if suppress:
                _ctx.suppress -= 1
        try:
            after(args, kwargs, out)
        except Exception as e:  # capture must never break the engine
            _c.log.warning("kvtrail: hook %s failed: %s", getattr(orig, "__name__", orig), e)
        return out

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", "wrapper")
    return wrapper


# ---------------------------------------------------------------- HiCache


class _Load(threading.local):
    expect = None  # host slot -> node id, for the load_back running


_load = _Load()


def _guard(name, fn, *args, hole=None):
    """Runs a hook function; a failure is counted and logged, never raised.
    ``hole``: the pool whose events the failure may have lost; it gets a
    ``lost`` event (a hole: the capture is incomplete, later reads of it
    uncertain), so a missed copy never reads as clean or confirmed."""
    try:
        fn(*args)
    except Exception as e:  # capture must never break the engine
        if _H is not None:
            _H.counts["hook_errors"] += 1
            if hole is not None:
                try:
                    _H.put(hole, (_c.LOST, hole, 1))
                except Exception:
                    pass
        _c.log.warning("kvtrail: hook %s failed: %s", name, e)


def _hicache_pools(ctrl):
    """(device pool, cache pool) of a HiCacheController, or None."""
    return getattr(ctrl, "_kvtrail_pools", None)


def on_controller_init(ctrl):
    """After ``HiCacheController.__init__``: its host pool records into the
    device pool's `cache` pool (when one is configured). Without one, the
    host tier is out of the capture: each load back is a hole in the device
    pool (``on_load``), never a copy of unknown content."""
    if _H is None or _H.disabled:
        return
    dev = getattr(ctrl.mem_pool_device_allocator, "_kvtrail_pool", None)
    dev = _H.default_pool if dev is None else dev
    if dev < 0:
        return
    cache = _H.cache_pools.get(dev)
    ctrl._kvtrail_pools = (dev, cache)
    if cache is None:
        _c.log.warning("kvtrail: HiCache is on for pool %s without a cache pool (KVTRAIL_CACHE_POOL): "
                       "its loads back are recorded as holes, so reads of them are uncertain", dev)
        return
    host = ctrl.mem_pool_host
    host._kvtrail_pool = cache
    # The unified tree's controller (HybridCacheController) holds a
    # HostPoolGroup: its anchor entry is the KV host pool whose alloc and
    # free record (side pools of hybrid models are not recorded).
    anchor = getattr(host, "anchor_entry", None)
    if anchor is not None:
        anchor.host_pool._kvtrail_pool = cache


def _copy(pool, src_pool, dst_idx, src_idx):
    rs = _c.copy_runs(capture_indices(dst_idx), capture_indices(src_idx))
    _H.put(pool, (_c.COPY, pool, _time_ns(), 0, src_pool, rs))


def on_write(ctrl, device_indices, node_id, host_indices):
    """After ``HiCacheController.write``: the offload's copy (queued and
    started in the call, from the device slots as they are now)."""
    pools = _hicache_pools(ctrl)
    if _H is None or _H.disabled or pools is None or pools[1] is None or host_indices is None:
        return
    dev, cache = pools
    _copy(cache, dev, host_indices, device_indices)
    _H.counts["hicache_offloads"] += 1
    m = _H.host_node.setdefault(cache, {})
    for h in _c._as_list(capture_indices(host_indices)):
        m[h] = node_id


def on_load(ctrl, host_indices, device_indices):
    """After ``HiCacheController.load``: the load back's copy into the
    device slots it allocated (recorded by the allocator hook). Device slots
    whose host slot was last written for another node than the one the
    load is for get no grant at the prefix hit."""
    pools = _hicache_pools(ctrl)
    if _H is None or _H.disabled or pools is None or device_indices is None:
        return
    dev, cache = pools
    if cache is None:
        # No cache pool: what the host slots hold is out of sight.
        if len(_c._as_list(capture_indices(device_indices))):
            _H.put(dev, (_c.LOST, dev, 1))
            _H.counts["hicache_loads_unverified"] += 1
        return
    _copy(dev, cache, device_indices, host_indices)
    _H.counts["hicache_loads"] += 1
    expect = _load.expect
    if expect is _UNSEEN:
        # Inside a load back whose expected nodes the hook did not see (a
        # tree core it does not hook, e.g. SGLang's Rust one, or a failure
        # in the hook): whether a loaded host slot still holds the hit
        # node's KV is unknown. Granting it could hide a stale key's
        # exposure, withholding it could name the prefix's owner: a hole
        # after the copy, so reads of the loaded slots are uncertain.
        _H.put(dev, (_c.LOST, dev, 1))
        _H.counts["hicache_loads_unverified"] += 1
        return
    if expect is None:
        return
    written = _H.host_node.get(cache, {})
    hosts = _c._as_list(capture_indices(host_indices))
    devs = _c._as_list(capture_indices(device_indices))
    # A slot filled from storage is already a hole (unverifiable), not a
    # key mismatch.
    bad = [d for h, d in zip(hosts, devs)
           if written.get(h) is not _FROM_STORAGE and written.get(h) != expect.get(h)]
    if bad:
        _H.counts["hicache_key_mismatch"] += len(bad)
        _H.ungranted.setdefault(dev, set()).update(bad)


def _host_value(node):
    """A tree node's host slots, or None: ``HiRadixCache``'s TreeNode holds
    them itself, the unified tree's node in its Full component's data."""
    if getattr(node, "component_data", None) is None:
        return getattr(node, "host_value", None)
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return node.component(ComponentType.FULL).host_value


# _load.expect inside a load back before its expected nodes are known.
_UNSEEN = object()

# Marks a host slot whose content came from L3 storage (a prefetch): what
# it holds is out of the capture's sight, not a node's backup.
_FROM_STORAGE = object()


def _wrap_prefetch_result(orig):
    """``_handle_prefetch_result(self, operation)`` (HiRadixCache and the
    unified tree): the prefetch's pages were read from L3 storage into
    host slots by a storage backend the hook does not see, and are grafted
    into the tree. Whose KV they hold is unverifiable: a ``lost`` line (a
    hole) in the `cache` pool, so every read of them, loaded back or not,
    is uncertain, never confirmed with a source and never clean."""

    def handle(self, operation, *args, **kwargs):
        host = getattr(operation, "host_indices", None)
        done = int(getattr(operation, "completed_tokens", 0) or 0)
        out = orig(self, operation, *args, **kwargs)
        pools = _hicache_pools(getattr(self, "cache_controller", None))
        if (_H is not None and not _H.disabled and pools is not None and pools[1] is not None
                and host is not None and done > 0):
            _guard("prefetch result", _on_storage_load, pools[1], host, done, hole=pools[1])
        return out

    handle.__wrapped__ = orig
    return handle


def _on_storage_load(cache, host, done):
    slots = _c._as_list(capture_indices(host))[:done]
    _H.put(cache, (_c.LOST, cache, max(1, len(slots))))
    _H.counts["hicache_storage_loads"] += 1
    _H.counts["hicache_storage_tokens"] += len(slots)
    m = _H.host_node.setdefault(cache, {})
    for h in slots:
        m[h] = _FROM_STORAGE


def _expected_nodes(node):
    """Host slot -> node id of the evicted nodes ``load_back(node)`` loads."""
    out = {}
    while node is not None and getattr(node, "evicted", False) and node.host_value is not None:
        for h in _c._as_list(capture_indices(node.host_value)):
            out[h] = node.id
        node = node.parent
    return out


def _set_expected(node):
    _load.expect = _expected_nodes(node)


def on_load_back_spec(core, out):
    """After ``UnifiedTreeCore.build_load_back_spec``: host slot -> node id
    of the nodes the load back is about to load (its KV transfer's
    ``nodes_to_load``), for the controller's load that follows."""
    if not _H.cache_pools:
        return
    xfer = out[0] if isinstance(out, tuple) and out else None
    expect = {}
    for nid in getattr(xfer, "nodes_to_load", None) or ():
        hv = _host_value(core.node_by_id(nid))
        if hv is not None:
            for h in _c._as_list(capture_indices(hv)):
                expect[h] = nid
    _load.expect = expect


def _wrap_load_back(orig, expected=_set_expected):
    """``load_back(self, node, ...)``: the host slots each loaded node's KV
    is expected in hold while it runs. ``expected(node)`` sets them before
    (HiRadixCache); None: a step inside sets them (the unified tree's
    ``build_load_back_spec``)."""

    def load_back(self, node, *args, **kwargs):
        if _H is None or _H.disabled or not _H.cache_pools:
            return orig(self, node, *args, **kwargs)
        # Until the expected nodes are known (set before the call, or by
        # the tree core's build_load_back_spec inside it), a load is
        # unverifiable (on_load).
        _load.expect = _UNSEEN
        if expected is not None:
            _guard("HiRadixCache.load_back", expected, node)
        try:
            return orig(self, node, *args, **kwargs)
        finally:
            _load.expect = None

    load_back.__wrapped__ = orig
    return load_back


def on_split(child, new_node):
    """After a tree's ``_split_node``: the host slots of the new prefix node
    were written for the node it was split from."""
    if isinstance(new_node, tuple):  # the unified tree: (new node, action)
        new_node = new_node[0]
    hv = _host_value(new_node) if new_node is not None else None
    if _H is None or _H.disabled or hv is None:
        return
    for m in _H.host_node.values():
        for h in _c._as_list(capture_indices(hv)):
            if m.get(h) == child.id:
                m[h] = new_node.id


def _retraction_device(tree, req):
    """The device slots a retraction backup or restore of ``req`` moves:
    its row's first ``seqlen - 1`` slots, padded to whole pages as SGLang's
    ``_retraction_device_transfers`` pads them (the pad lies in the row's
    last page)."""
    import torch

    n = req.seqlen - 1
    row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    return tree._pad_retraction_indices(row, tree.page_size)


def _retraction_pools(tree):
    if _H is None or _H.disabled:
        return None
    return _hicache_pools(getattr(tree, "cache_controller", None))


def _wrap_retraction_backup(orig):
    """``UnifiedRadixCache.retraction_backup(self, req)``: a PD decode
    worker's retraction copies the request's device KV to host slots with
    the transfer engine itself (not the controller's ``write``), and waits
    for it. Recorded after it returns (the copy is done, the device slots
    unchanged since): a copy into the `cache` pool."""

    def backup(self, req, *args, **kwargs):
        out = orig(self, req, *args, **kwargs)
        pools = _retraction_pools(self)
        if out is not None and pools is not None and pools[1] is not None:
            _guard("retraction backup", _on_retraction_backup, self, req, out, pools, hole=pools[1])
        return out

    backup.__wrapped__ = orig
    return backup


def _on_retraction_backup(tree, req, out, pools):
    dev, cache = pools
    _copy(cache, dev, out.host_indices, _retraction_device(tree, req))
    _H.counts["hicache_retraction_backups"] += 1


def _wrap_retraction_restore(orig):
    """``UnifiedRadixCache.retraction_restore(self, req, backup)``: the
    backup is copied back into the request's newly preallocated device
    slots by the transfer engine, waited for, and its host slots freed.
    Recorded after it returns: a copy from the `cache` pool (a host slot's
    content is unchanged by its free); without a cache pool, a hole in the
    device pool. If SGLang raises part way, what reached the device slots
    is unknown: a hole in the device pool too."""

    def restore(self, req, backup, *args, **kwargs):
        pools = _retraction_pools(self)
        host = getattr(backup, "host_indices", None)
        try:
            out = orig(self, req, backup, *args, **kwargs)
        except BaseException:
            if pools is not None:
                _guard("retraction restore", _lost, pools[0])
            raise
        if pools is not None:
            _guard("retraction restore", _on_retraction_restore, self, req, host, pools, hole=pools[0])
        return out

    restore.__wrapped__ = orig
    return restore


def _lost(pool):
    _H.put(pool, (_c.LOST, pool, 1))
    _H.counts["hicache_loads_unverified"] += 1


def _on_retraction_restore(tree, req, host, pools):
    dev, cache = pools
    if cache is None or host is None:
        _lost(dev)
        return
    _copy(dev, cache, _retraction_device(tree, req), host)
    _H.counts["hicache_retraction_restores"] += 1


def _wrap_linker_load_back(orig):
    """``UnifiedCacheLinkerWrapper.load_back(self, req)``: the unified
    tree's direct L3 path (an external KV store linked straight to the
    device pool, no host tier; SGLang's ``MooncakeDirectLinker``) allocates
    device slots for the stored tail of a prefix hit, queues the store's
    load into them and inserts them into the tree. The store is keyed by
    content hash, shared across engines and restarts, and its backend
    writes the slots on its own threads: whose KV lands there is out of
    the capture's sight. A load back that had a hit and returns loaded
    slots (or raises part way) is a hole in the device pool after it
    (``linker_loads_unverified``, ``linker_tokens``): reads of the loaded
    slots are uncertain, never clean and never confirmed with the slots'
    earlier writer as the source."""

    def load_back(self, req, *args, **kwargs):
        if _H is None or _H.disabled:
            return orig(self, req, *args, **kwargs)
        try:
            hit = req.rid in self.hit_markers
        except Exception:
            hit = True  # unknown: a hole if slots come back
        pool = _linker_pool(self)
        try:
            out = orig(self, req, *args, **kwargs)
        except BaseException:
            if hit and pool is not None:
                _guard("linker load back", _linker_lost, pool, None, hole=pool)
            raise
        if hit and pool is not None:
            _guard("linker load back", _linker_lost, pool, out, hole=pool)
        return out

    load_back.__wrapped__ = orig
    return load_back


def _linker_pool(wrapper):
    """The recorded pool the linker's KV slots come from: the full
    attention allocator's (the SWA allocator's full part, as SGLang's
    FullComponent takes them), or None when it is not recorded."""
    try:
        alloc = wrapper.cache.token_to_kv_pool_allocator
        alloc = getattr(alloc, "full_attn_allocator", None) or alloc
        pool = getattr(alloc, "_kvtrail_pool", None)
        pool = _H.default_pool if pool is None else pool
    except Exception:
        pool = _H.default_pool
    return pool if pool is not None and pool >= 0 else None


def _linker_lost(pool, out):
    """A hole after a linker load back that returned loaded slots (``out``
    its result), or raised (``out`` None)."""
    tokens = 0
    if out is not None:
        idx = out[0] if isinstance(out, tuple) and out else None
        tokens = 0 if idx is None else len(_c._as_list(capture_indices(idx)))
        if not tokens:
            return
    _H.put(pool, (_c.LOST, pool, 1))
    _H.counts["linker_loads_unverified"] += 1
    _H.counts["linker_tokens"] += tokens


def _wrap_load_kv_cache(orig):
    """``Req.load_kv_cache(self, req_to_token_pool, allocator)``: decode
    retraction's ``cpu_tensor`` backend restores the request's KV from a
    per-request CPU tensor into its new device slots. That tensor is in no
    pool, and a copy is stamped with its source as it is now, not as it was
    at the backup: the restore is a hole in the device pool (the restored
    slots must not read as the stale KV the trace last saw there)."""

    def load_kv_cache(self, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs):
        try:
            return orig(self, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs)
        finally:
            if _H is not None and not _H.disabled:
                pool = getattr(token_to_kv_pool_allocator, "_kvtrail_pool", None)
                pool = _H.default_pool if pool is None else pool
                if pool >= 0:
                    _guard("retraction restore", _lost, pool)

    load_kv_cache.__wrapped__ = orig
    return load_kv_cache


def _wrap_host_alloc(orig):
    def alloc(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        pool = getattr(self, "_kvtrail_pool", None)
        if out is not None and pool is not None and _H is not None and not _H.disabled:
            _guard("host alloc", lambda: _H.put(pool, (_c.KV, pool, _time_ns(), 0, ALLOC,
                                                       capture_indices(out), None, 0)))
        return out

    alloc.__wrapped__ = orig
    return alloc


def _wrap_host_free(orig):
    def free(self, indices, *args, **kwargs):
        pool = getattr(self, "_kvtrail_pool", None)
        if pool is not None and _H is not None and not _H.disabled:
            def rec():
                idx = capture_indices(indices)
                if len(idx):
                    _H.put(pool, (_c.KV, pool, _time_ns(), 0, FREE, idx, None, 0))
                    m = _H.host_node.get(pool)
                    if m:
                        for h in _c._as_list(idx):
                            m.pop(h, None)
            _guard("host free", rec)
        return orig(self, indices, *args, **kwargs)

    free.__wrapped__ = orig
    return free


def _wrap_after(name, after, hole=None):
    """A method wrapper: SGLang's original, then ``after(self, args,
    kwargs, result)`` under the guard (``hole(self)``: the pool a failure
    leaves a hole in, or None)."""

    def factory(orig):
        def wrapper(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            if _H is not None and not _H.disabled:
                pools = _hicache_pools(self)
                _guard(name, after, self, args, kwargs, out,
                       hole=hole(pools) if hole is not None and pools is not None else None)
            return out

        wrapper.__wrapped__ = orig
        wrapper.__name__ = getattr(orig, "__name__", name)
        return wrapper

    return factory


# ---------------------------------------------------------------- patch table


def _req_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        try:
            on_req_init(self)
        except Exception as e:
            _c.log.warning("kvtrail: Req hook failed: %s", e)

    __init__.__wrapped__ = orig
    return __init__


def _set_finish_with_abort(orig):
    def set_finish_with_abort(self, *args, **kwargs):
        try:
            before_set_finish_with_abort(self)
        except Exception as e:
            _c.log.warning("kvtrail: abort hook failed: %s", e)
        return orig(self, *args, **kwargs)

    set_finish_with_abort.__wrapped__ = orig
    return set_finish_with_abort


def _arg(args, kwargs, i, name, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _tp_rank():
    try:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().tp_rank
    except Exception:
        return None


def _alloc_init(orig):
    """Tensor-parallel ranks > 0 hold the same slot ids as rank 0: their
    allocators are marked not to be captured (rank 0 records the pool)."""

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        try:
            if getattr(self, "_kvtrail_pool", None) is None and _tp_rank() not in (None, 0):
                self._kvtrail_pool = -1  # no client has pool -1: not captured
        except Exception as e:
            _c.log.warning("kvtrail: allocator hook failed: %s", e)

    __init__.__wrapped__ = orig
    return __init__


def _swa_alloc_init(orig):
    """SGLang's SWA allocator (sliding-window models) holds a full-attention
    and a sliding-window allocator, both of the classes this hook records.
    The sliding-window one hands out slots of another pool (the SWA KV
    pool, not recorded): it is marked not to be captured, or its events
    would land in the full-attention pool under slot ids that name other
    slots there. A pure-SWA allocator (one allocator for both) stays."""

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        try:
            swa = getattr(self, "swa_attn_allocator", None)
            if swa is not None and swa is not getattr(self, "full_attn_allocator", None):
                swa._kvtrail_pool = -1  # no client has pool -1: not captured
        except Exception as e:
            _c.log.warning("kvtrail: SWA allocator hook failed: %s", e)

    __init__.__wrapped__ = orig
    return __init__


# (module, class or None, attribute, wrapper factory)
_PATCHES = [
    ("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator", "__init__", _swa_alloc_init),
    ("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator", "__init__", _alloc_init),
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator", "__init__", _alloc_init),
    ("sglang.srt.managers.schedule_batch", "Req", "__init__", _req_init),
    ("sglang.srt.managers.schedule_batch", "Req", "set_finish_with_abort", _set_finish_with_abort),
    ("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator", "alloc", _wrap_alloc),
    ("sglang.srt.mem_cache.allocator.token", "TokenToKVPoolAllocator", "free", _wrap_free),
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator", "alloc", _wrap_alloc),
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator", "alloc_extend", _wrap_alloc),
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator", "alloc_decode", _wrap_alloc),
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator", "free", _wrap_paged_free),
    ("sglang.srt.mem_cache.allocator.paged", "PagedTokenToKVPoolAllocator", "free_segment", _wrap_paged_free),
    ("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator", "free_group_end", _wrap_group_end),
    ("sglang.srt.mem_cache.allocation", None, "alloc_for_extend",
     lambda o: _wrap_ctx(o, lambda a, k, out: on_alloc_for_extend(_arg(a, k, 0, "batch"), out[0]))),
    ("sglang.srt.mem_cache.allocation", None, "alloc_for_decode",
     lambda o: _wrap_ctx(o, lambda a, k, out: on_alloc_for_decode(
         _arg(a, k, 0, "batch"), out, _arg(a, k, 1, "token_per_req", 1)))),
    ("sglang.srt.mem_cache.common", None, "release_kv_cache",
     lambda o: _wrap_ctx(o, lambda a, k, out: on_release(_arg(a, k, 0, "req"), _arg(a, k, 1, "tree_cache")),
                         rid_arg=0, suppress=False)),
    ("sglang.srt.disaggregation.decode", "DecodePreallocQueue", "_pre_alloc",
     lambda o: _wrap_ctx(o, lambda a, k, out: on_pre_alloc(
         a[0], _arg(a, k, 1, "req"), out, _arg(a, k, 2, "prefix_indices"), _arg(a, k, 3, "prefix_len")))),
    ("sglang.srt.disaggregation.decode", "DecodeTransferQueue", "_commit_transfer_to_req",
     lambda o: _wrap_ctx(o, lambda a, k, out: on_commit(a[0], _arg(a, k, 1, "decode_req")), suppress=False)),
    ("sglang.srt.disaggregation.decode_schedule_batch_mixin", "ScheduleBatchDisaggregationDecodeMixin",
     "prepare_for_prebuilt", lambda o: _wrap_ctx(o, lambda a, k, out: on_prebuilt(a[0]), suppress=False)),
    ("sglang.srt.disaggregation.common.conn", "CommonKVSender", "_prepare_send_indices",
     lambda o: _wrap_ctx(o, lambda a, k, out: on_send_indices(a[0], _arg(a, k, 1, "kv_indices"), out),
                         suppress=False)),
    ("sglang.srt.managers.cache_controller", "HiCacheController", "__init__",
     _wrap_after("HiCacheController.__init__", lambda s, a, k, out: on_controller_init(s))),
    ("sglang.srt.managers.cache_controller", "HiCacheController", "write",
     _wrap_after("HiCacheController.write", lambda s, a, k, out: on_write(
         s, _arg(a, k, 0, "device_indices"), _arg(a, k, 2, "node_id", -1), out),
         hole=lambda pools: pools[1])),
    ("sglang.srt.managers.cache_controller", "HiCacheController", "load",
     _wrap_after("HiCacheController.load", lambda s, a, k, out: on_load(
         s, _arg(a, k, 0, "host_indices"), out),
         hole=lambda pools: pools[0])),
    # The unified tree (SGLang's default with --enable-hierarchical-cache):
    # its controller overrides write and load; its tree core builds the load
    # back and splits nodes.
    ("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "HybridCacheController", "write",
     _wrap_after("HybridCacheController.write", lambda s, a, k, out: on_write(
         s, _arg(a, k, 0, "device_indices"), _arg(a, k, 2, "node_id", -1), out),
         hole=lambda pools: pools[1])),
    ("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", "HybridCacheController", "load",
     _wrap_after("HybridCacheController.load", lambda s, a, k, out: on_load(
         s, _arg(a, k, 0, "host_indices"), out),
         hole=lambda pools: pools[0])),
    ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", "load_back",
     lambda o: _wrap_load_back(o, None)),
    ("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedTreeCore", "build_load_back_spec",
     _wrap_after("UnifiedTreeCore.build_load_back_spec", lambda s, a, k, out: on_load_back_spec(s, out))),
    ("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedTreeCore", "_split_node",
     _wrap_after("UnifiedTreeCore._split_node", lambda s, a, k, out: on_split(_arg(a, k, 1, "child"), out))),
    # L3 storage: a prefetch's pages grafted into the host tree.
    ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", "_handle_prefetch_result",
     _wrap_prefetch_result),
    ("sglang.srt.mem_cache.hiradix_cache", "HiRadixCache", "_handle_prefetch_result",
     _wrap_prefetch_result),
    # Decode retraction to the host pool: copies by the transfer engine.
    ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", "retraction_backup",
     _wrap_retraction_backup),
    ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", "retraction_restore",
     _wrap_retraction_restore),
    ("sglang.srt.managers.schedule_batch", "Req", "load_kv_cache", _wrap_load_kv_cache),
    # The unified tree's direct L3 linker (no host tier): loads are holes.
    ("sglang.srt.mem_cache.unified_cache.unified_cache_linker", "UnifiedCacheLinkerWrapper", "load_back",
     _wrap_linker_load_back),
    ("sglang.srt.mem_cache.pool_host.base", "HostKVCache", "alloc", _wrap_host_alloc),
    ("sglang.srt.mem_cache.pool_host.base", "HostKVCache", "free", _wrap_host_free),
    ("sglang.srt.mem_cache.hiradix_cache", "HiRadixCache", "load_back", _wrap_load_back),
    ("sglang.srt.mem_cache.hiradix_cache", "HiRadixCache", "_split_node",
     _wrap_after("HiRadixCache._split_node", lambda s, a, k, out: on_split(_arg(a, k, 1, "child"), out))),
    ("sglang.srt.disaggregation.common.conn", "CommonKVReceiver", "send_metadata",
     lambda o: _wrap_ctx(o, lambda a, k, out: on_send_metadata(
         a[0], _arg(a, k, 1, "kv_indices"), _arg(a, k, 4, "decode_prefix_len", 0)), suppress=False)),
]


def _apply(module):
    """Patches what ``module`` defines, and rebinds names it imported from
    already patched modules (``from ... import release_kv_cache``)."""
    name = module.__name__
    for mod, cls, attr, factory in _PATCHES:
        if mod != name:
            continue
        owner = getattr(module, cls, None) if cls else module
        if owner is None or (owner, attr) in _H.originals:
            continue
        orig = owner.__dict__.get(attr) if cls else getattr(owner, attr, None)
        if orig is None:
            continue
        w = factory(orig)
        _H.originals[(owner, attr)] = orig
        setattr(owner, attr, w)
        if cls is None:
            _H.wrapped_funcs[orig] = w
    if _H.wrapped_funcs:
        for k, v in list(vars(module).items()):
            try:
                w = _H.wrapped_funcs.get(v)
            except TypeError:
                continue
            if w is not None:
                setattr(module, k, w)


def _apply_if_installed(module):
    if _H is not None:
        _apply(module)


# Patches sglang modules as they are imported.
_finder = _c.PostImport(lambda name: _H is not None and name.startswith("sglang."), _apply_if_installed)


def install(capture=None, pools=None, worker=None, tenant_field=None, roles=None,
            per_pool_connections=False, max_queue=None, pseudonymize=None, cache_pools=None,
            guard=None, guard_unknown=None):
    """Enables capture in this process. Arguments default to the environment:

    - ``KVTRAIL_CAPTURE``: sidecar address, ``unix:/path.sock`` or ``tcp:127.0.0.1:PORT``;
    - ``KVTRAIL_POOL``: this process's pool id (comma-separated for several;
      use :func:`tag` to say which allocator is which);
    - ``KVTRAIL_ROLE``: prefill, decode or mixed (default: from the request's disagg mode);
    - ``KVTRAIL_WORKER``: a name for the sidecar's logs;
    - ``KVTRAIL_TENANT_FIELD``: the Req attribute (dotted path into dicts
      allowed) naming the customer, default ``routing_key``;
    - ``KVTRAIL_TENANT_PSEUDONYMIZE=1``: record a blake3 pseudonym instead;
    - ``KVTRAIL_QUEUE``: events buffered before they are dropped as holes;
    - ``KVTRAIL_CACHE_POOL``: the HiCache `cache` pool of the (first) device
      pool (``cache_pools={device: cache}`` for several); declared in the same
      hello, so the engine's copies are stamped by position;
    - ``KVTRAIL_GUARD`` (``guard=``): off, alert (default) or abort;
      ``KVTRAIL_GUARD_UNKNOWN`` (``guard_unknown=``): allow (default) or
      abort (docs/guard.md). ``abort`` without the native module raises
      ``kvtrail_hook_client.guard.GuardUnavailable``.
    """
    global _H
    if _H is not None:
        return _H
    g = _guard_mod.Guard(guard, guard_unknown)
    capture = capture or os.environ.get("KVTRAIL_CAPTURE")
    if not capture:
        raise ValueError("no sidecar address: pass capture= or set KVTRAIL_CAPTURE=unix:/path.sock")
    if pools is None:
        pools = [int(p) for p in os.environ.get("KVTRAIL_POOL", "0").split(",") if p.strip()]
    if cache_pools is None:
        cp = os.environ.get("KVTRAIL_CACHE_POOL", "").strip()
        cache_pools = {int(pools[0]): int(cp)} if cp else {}
    if roles is None:
        r = os.environ.get("KVTRAIL_ROLE")
        roles = {p: r for p in pools} if r else {}
    _H = _Hook(
        capture,
        list(pools),
        worker or _c.default_worker(),
        tenant_field or os.environ.get("KVTRAIL_TENANT_FIELD", "routing_key"),
        dict(roles),
        per_pool_connections,
        int(max_queue or os.environ.get("KVTRAIL_QUEUE", 1 << 18)),
        bool(pseudonymize if pseudonymize is not None else os.environ.get("KVTRAIL_TENANT_PSEUDONYMIZE") == "1"),
        cache_pools,
        g,
    )
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("sglang.") and m is not None]:
        _apply(mod)
    return _H


def uninstall():
    """Restores SGLang's originals and closes the connection(s)."""
    global _H
    if _H is None:
        return
    h = _H
    for (owner, attr), orig in h.originals.items():
        setattr(owner, attr, orig)
    back = {w: o for o, w in h.wrapped_funcs.items()}
    for n, m in list(sys.modules.items()):
        if n.startswith("sglang.") and m is not None:
            for k, v in list(vars(m).items()):
                try:
                    o = back.get(v)
                except TypeError:
                    continue
                if o is not None:
                    setattr(m, k, o)
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _H = None
    for cl in set(h.clients.values()):
        cl.flush()
        cl.close()


def flush(timeout=10.0):
    """Waits until every queued event has been handed to the sidecar."""
    if _H is not None:
        for cl in set(_H.clients.values()):
            cl.flush(timeout)


def stats():
    """Counters per connection: sent lines, drops, losses."""
    if _H is None:
        return {}
    return {cl.worker: dict(cl.stats) for cl in set(_H.clients.values())}


def counts():
    """The hook's own counters: ``hook_errors`` (a failure inside a hook
    function, caught and logged: the engine went on), HiCache offloads and
    loads recorded, ``hicache_key_mismatch`` (loaded slots whose host copy
    was written for another tree node: no grant at the prefix hit),
    ``hicache_loads_unverified`` (loads back and retraction restores
    recorded as holes in the device pool), ``hicache_storage_loads`` /
    ``hicache_storage_tokens`` (L3 prefetches grafted, recorded as holes),
    ``hicache_retraction_backups`` / ``hicache_retraction_restores``
    (decode retraction to the host pool, recorded as copies)."""
    return dict(_H.counts) if _H is not None else {}


def guard_stats():
    """The guard's counters: checks and their verdicts (ok, foreign,
    unknown), alerts, aborts, errors, and the native module's own."""
    return _H.guard.stats() if _H is not None else {}


def guard_alerts():
    """The latest guard alerts (bounded), oldest first."""
    return list(_H.guard.alerts) if _H is not None else []


def request_context(req):
    """Attributes allocator calls in the ``with`` block to ``req`` (the same
    thing the patched outer entry points do)."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        prev = _ctx.rid
        _ctx.rid = request_id(req)
        try:
            yield
        finally:
            _ctx.rid = prev

    return ctx()
