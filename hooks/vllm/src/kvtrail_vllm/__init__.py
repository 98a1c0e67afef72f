"""kvtrail capture hook for vLLM (v1 engine core).

Enable with one line in the engine-core process::

    import kvtrail_vllm; kvtrail_vllm.install()

or by setting ``KVTRAIL_CAPTURE=unix:/run/kvtrail.sock`` in the engine's
environment (the installed ``kvtrail_vllm.pth`` then calls ``install()`` at
start-up). Events go to the ``kvtrail record`` sidecar over the wire client
shared with the SGLang hook (``kvtrail_hook_client``); docs/capture-vllm.md
says what is recorded and what it costs.

Patched entry points (each wrapper calls vLLM's original and never changes
its arguments or results; a failure inside the hook is counted in
``stats()["hook_errors"]``, logged, and the engine goes on):

- ``Scheduler.__init__``: one engine state per scheduler (its pool, role
  from the KV connector). vLLM's KV cache groups overlay the same memory
  (``kv_cache_planning.get_kv_cache_config_from_groups``: "groups alias
  from byte 0"; a block id is owned by one group at a time), so every
  attention group of the first group's block size is recorded in the
  engine's one pool: a block one group freed and another reused is seen as
  the same slots. A group of another block size has its own pool id when
  one is given for it, else it is not recorded (docs/capture-vllm.md);
- ``Scheduler.add_request``: arrival, the ORIGINAL prompt length and hash
  (before a connector may truncate it), tenant (``cache_salt``);
- ``BlockPool.get_new_blocks``: ``alloc`` of the blocks' slots, for the
  request whose single-type-manager call is running (request 0 otherwise);
- ``BlockPool._maybe_evict_cached_block``: ``free`` by request 0 of a
  cached block the engine evicts;
- ``BlockPool.free_blocks``: ``free`` of the blocks' slots;
- ``SingleTypeKVCacheManager.add_local_computed_blocks``: prefix-cache hit,
  ``share`` of the hit blocks;
- ``KVCacheManager.free``: attributes the allocator calls inside it to its
  request; ``SingleTypeKVCacheManager.allocate_new_blocks`` /
  ``allocate_external_computed_blocks`` / ``free`` / ``remove_skipped_blocks``
  (a sliding window dropping blocks mid-request) are not wrapped (they run
  per request and step): an allocator call finds the nearest of them on its
  call stack, and so its request and group;
- ``Scheduler.schedule``: per scheduled request ``write`` of the tokens
  computed this step and ``read`` of its whole context, built in one call
  into the native module ``kvtrail_guard`` (required: ``install`` raises
  without it); the NIXL consumer's
  transfer plan (``kv_connector_metadata.reqs_to_recv``);
- ``Scheduler.update_from_output``: a finished, failed or partial remote
  load (``finished_recving``, ``failed_recving``, ``invalid_block_ids``) as
  an ``xfer_pull`` the sidecar turns into copies from the producer's pool;
- ``Scheduler.schedule`` / ``update_from_output`` with vLLM's
  OffloadingConnector: the store and load jobs of its metadata, and when
  every worker reported one done (``completed_jobs``), a copy between the
  engine's pool and its cache pool (``KVTRAIL_CACHE_POOL``), a load also a
  ``share`` to the loading request;
- ``SingleTypeKVCacheManager._apply_cow`` / ``take_pending_cow_copies``
  and ``Scheduler.schedule``: each copy-on-write block copy of the step
  (``SchedulerOutput.kv_cache_block_copies``, run by the worker before the
  step's forward) as a ``copy`` inside the engine's pool for the request
  that got the private block, before the step's writes and reads, and a
  ``share`` of the copied block to it;
- ``LMCacheConnectorV1.update_state_after_alloc`` and, in the external
  ``lmcache`` package, ``LMCacheEngine.retrieve`` /
  ``_process_tokens_internal``, ``VLLMPagedMemGPUConnectorV2.batched_from_gpu``,
  ``StorageManager.batched_put``, ``TensorMemoryObj.ref_count_down`` /
  ``unpin``: with a cache pool and lmcache's engine in this process, its
  stores and loads as copies between the engine's pool and the cache pool,
  located by lmcache's memory objects (allocator addresses), a load also a
  ``share`` of the chunks stored under the key loaded, and memory objects
  lmcache frees as frees; the request's reads of a loading step wait for
  the load. Loads it cannot map are holes (docs/capture-vllm.md);
- ``Scheduler._free_request``: the request row (status as the client gets
  it, finish reason, output token count, blake3 of the output ids).

The native module ``kvtrail_guard`` (hooks/native) is required: it builds
each step's events (above) and is the guard (docs/guard.md;
``KVTRAIL_GUARD=off|alert|abort``, default alert;
``KVTRAIL_GUARD_UNKNOWN=allow|abort``, default allow), which applies the
events that change content (the step's writes in the native step, the
others through ``push``) to kvtrail's slot rule and checks a request the first time ``schedule`` gives it a step
over KV it did not compute this step (a prefix-cache hit, a remote load, a
CPU offload load-back, a later chunk). In abort mode a foreign read
finishes the request as ``FINISHED_ERROR`` right after ``schedule`` (its
output of that step is dropped) and the client gets the error output
(``RequestError`` code ``kv_isolation``: HTTP 500).
"""

import os
import sys
import threading
import time

import kvtrail_hook_client as _c
from kvtrail_hook_client import guard as _guard_mod
from kvtrail_hook_client import ALLOC, FREE, READ, SHARE, WRITE, Client

__all__ = ["install", "uninstall", "stats", "guard_stats", "guard_alerts", "flush", "tag", "request_id",
           "hash_tokens"]

_time_ns = time.time_ns
_H = None  # the installed hook state
_native = None  # kvtrail_guard: the per-step events and the guard (install)
# What the hook calls in it: a module built before any of these is refused.
_NATIVE_API = ("schedule_step", "slot_runs", "StepCache", "kv_lines", "block_lines", "Guard")
hash_tokens = _c.hash_tokens

# Status the client gets per vLLM finish reason (an ERROR finish raises
# GenerationError in the serving layer: HTTP 500; an abort is the client
# going away or the server cancelling: 499).
_HTTP = {"stop": 200, "length": 200, "repetition": 200, "error": 500, "abort": 499}


class _Ctx(threading.local):
    rid = 0  # request whose KVCacheManager.free runs (0 = engine): see _who


_ctx = _Ctx()


class _Engine:
    """One scheduler (one engine core): its pool (groups of the first
    group's block size share it: they alias the same blocks; a group of
    another block size takes its own entry of ``pools`` if given), role,
    connection and per-request state."""

    def __init__(self, sched):
        self.pools = list(_H.default_pools)
        self.role = _H.role
        self.policy = None
        self.client = None
        self.reqs = {}  # vLLM request_id -> dict
        # Copy-on-write block copies (a partial prefix hit redirected to a
        # private block): destination block -> (request id, group, index
        # of the block in the request's table, source block), from
        # _apply_cow; and (group, source, destination) of every copy the
        # managers handed to take_kv_cache_block_copies this step.
        self.cow = {}
        self.cow_taken = []
        self.plans = {}  # request_id -> (local ids per group, remote ids per group, engine id, hits)
        # CPU offload (OffloadingConnector): the cache pool, and the jobs
        # in flight: job id -> [store?, request id, GPU ids, group sizes,
        # first block index per group, CPU chunk ids, reports still due].
        self.cache_pool = _H.cache_pool
        self.jobs = {}
        # CPU chunk -> the offload key (block hash) it was last stored under.
        self.chunk_keys = {}
        # The guard: requests checked, to abort after this schedule, and
        # their error outputs for the next update_from_output.
        self.guarded = set()
        self.to_abort = []
        self.error_outputs = []
        self.blocks_per_chunk = 1
        self.workers = 1
        try:
            cfg = sched.connector.connector_scheduler.config
            self.blocks_per_chunk = int(getattr(cfg, "blocks_per_chunk", 1))
            self.workers = int(getattr(cfg, "num_workers", 1))
        except Exception:
            pass
        # SimpleCPUOffloadConnector (cpu or disk backend): its scheduler-side
        # manager, the store events in flight (event -> [GPU ids, offload
        # block ids, reports still due]) and the loads planned per request.
        self.simple = None
        self.sstores = {}
        self.sloads = {}
        # The offload tiering layer (TieringOffloadingManager): a pool per
        # secondary tier, each tier's storage locations (file, or key) ->
        # index of a chunk-sized slot range, the offload key the content at
        # each location was first stored under, and the tier jobs in flight.
        # LMCache (LMCacheConnectorV1, the external lmcache package): loads
        # accepted by the scheduler side and not yet seen done by lmcache's
        # engine (request id -> {"n": tokens, "reads": the deferred reads
        # of its first step, "check": guard due, "rid": trace id}); per
        # cache-pool location (first slot of a memory object, see
        # _lmc_loc) the chunk key its content was stored under and its
        # token count; bytes per token of lmcache's memory objects.
        self.lmc_wait = {}
        self.lmc_keys = {}
        self.lmc_tb = None
        self.lmc_alloc = None
        self.tier_pools = list(_H.tier_pools)
        self.tiers = []
        self.tier_locs = {}
        self.tier_next = {}
        self.loc_keys = {}
        self.tjobs = {}
        conn = getattr(sched, "connector", None)
        try:
            sm = getattr(conn, "scheduler_manager", None)
            if sm is not None and hasattr(sm, "_reqs_to_load") and hasattr(sm, "cpu_block_pool"):
                self.simple = sm
                self.workers = int(getattr(sm, "_expected_worker_count", 1))
            mgr = getattr(getattr(conn, "connector_scheduler", None), "manager", None)
            if mgr is not None and hasattr(mgr, "secondary_tiers"):
                self.tiers = list(mgr.secondary_tiers)
                mgr._kvtrail_engine = self
            if conn is not None and "LMCache" in type(conn).__name__:
                conn._kvtrail_engine = self
                if type(conn).__name__ == "LMCacheConnectorV1":
                    # The in-process lmcache engine's stores and loads are
                    # seen by the lmcache patches below (_lmc_*).
                    _H.lmc_engines.append(self)
        except Exception:
            pass
        self.managers = []  # the single-type managers, per group (their req_to_blocks)
        self.step_cache = _native.StepCache()  # the native step's (block ids, request ids and rows)
        self.guard_holes = set()  # pools of a step the guard missed, still to feed it as holes
        self.block_sizes = []
        self.attention = []
        try:
            kcc = sched.kv_cache_config
            for g in kcc.kv_cache_groups:
                spec = g.kv_cache_spec
                self.block_sizes.append(int(spec.block_size))
                self.attention.append("Mamba" not in type(spec).__name__)
        except Exception:
            self.block_sizes = [int(getattr(sched, "block_size", 16))]
            self.attention = [True]
        if self.role is None:
            kt = getattr(getattr(sched, "vllm_config", None), "kv_transfer_config", None)
            r = getattr(kt, "kv_role", None) if kt is not None and getattr(kt, "kv_connector", None) else None
            self.role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(r, "mixed")
        kt = getattr(getattr(sched, "vllm_config", None), "kv_transfer_config", None)
        if kt is not None and getattr(kt, "kv_connector", None):
            self.policy = getattr(kt, "kv_load_failure_policy", None)

    def block_size(self, group=0):
        """The block size of ``group`` (group 0's for a group the engine
        did not list; 16 when it listed none)."""
        bs = self.block_sizes
        if group < len(bs):
            return bs[group]
        return bs[0] if bs else 16

    def aliased(self, group):
        """The group overlays group 0's blocks slot for slot (same block
        size): recorded in the engine's first pool."""
        bs = self.block_sizes
        return group == 0 or (group < len(bs) and bs[group] == bs[0])

    def pool(self, group):
        if self.aliased(group):
            return self.pools[0] if self.pools else None
        return self.pools[group] if group < len(self.pools) else None

    def remote_pool(self, src, group):
        """The producer's pool for ``group`` (its groups alias as ours)."""
        if src is None:
            return None
        if self.aliased(group):
            return src[0] if src else None
        return src[group] if group < len(src) else None

    def put(self, pool, item, mirror=True):
        """Queues ``item`` for the sidecar and, unless ``mirror`` is false
        (a read or a free: the guard's rule needs neither), the guard."""
        push = _H.guard.push
        if push is not None and mirror:
            push(item)
        if self.client is None and not self._connect():
            return
        self.client.put(pool, item)

    def put_lines(self, ts, step):
        """Queues a step's lines built by the native module (already
        mirrored into the guard)."""
        if self.client is None and not self._connect():
            return
        self.client.put_lines(ts, step.text, step.counts, step.events)

    def put_step(self, ts, step):
        """Queues the lines of one event built by the native module
        (``kv_lines``, ``block_lines``: None when it has none); a guard
        busy in another thread missed it: a hole in its pools, fed before
        the next step's writes."""
        if step is None:
            return
        if step.holes:
            _fail("kvtrail_guard", ValueError("an event's runs could not be written: a hole"))
        if step.guard_missed:
            self.guard_holes.update(pool for pool, _ in step.counts)
        if step.text is not None:
            self.put_lines(ts, step)

    def groups(self):
        """Per KV cache group: (pool or None, block size, attention), for
        the native step."""
        n = max(1, len(self.block_sizes))
        return [(self.pool(g), self.block_size(g), self.attention[g] if g < len(self.attention) else True)
                for g in range(n)]

    def _connect(self):
        """The engine's connection, made on its first event (False: it
        records no pool)."""
        if self.client is None:
            used = {self.pool(g) for g in range(max(1, len(self.block_sizes)))}
            if self.cache_pool is not None:
                used.add(self.cache_pool)
            used.update(self.tier_pools)
            pools = sorted({p for p in used if p is not None and p >= 0})
            if not pools:
                return False
            # Our block size per engine pool (not the cache or tier pools,
            # whose chunks are another size): the hello carries it.
            sizes = {}
            for g in range(max(1, len(self.block_sizes))):
                p = self.pool(g)
                if p is not None and p >= 0 and p not in (self.cache_pool, *self.tier_pools):
                    sizes.setdefault(p, self.block_size(g))
                    if _H.guard.active:
                        _H.guard.page_size(p, self.block_size(g))
            self.client = Client(_H.capture, pools, f"{_H.worker}/{self.role}", max_queue=_H.max_queue,
                                 page_sizes=sizes)
            _H.clients.append(self.client)
        return True


class _Hook:
    def __init__(self, capture, pools, worker, tenant_field, role, remote_pools, max_queue, pseudonymize,
                 cache_pool=None, guard=None):
        self.guard = guard if guard is not None else _guard_mod.Guard()
        self.capture = capture
        self.cache_pool = cache_pool
        self.default_pools = pools
        self.worker = worker
        self.tenant_field = tenant_field
        self.role = role
        self.remote_pools = remote_pools  # remote engine id -> [pool per group]
        self.max_queue = max_queue
        self.pseudonymize = pseudonymize
        self.clients = []
        self.originals = {}
        self.errors = 0
        self.pulls_unmapped = 0
        self.offload_key_mismatch = 0
        self.offload_unverified = 0
        self.lmcache_loads = 0
        self.lmcache_copies = 0
        self.lmcache_holes = 0
        self.lmc_engines = []
        self.cow_copies = 0
        self.cow_unverified = 0
        self.tier_pools = []
        self._warned = 0.0


def _fail(where, e):
    """A hook failure: counted and logged (rate-limited); never raised."""
    _H.errors += 1
    now = time.monotonic()
    if now - _H._warned > 10:
        _H._warned = now
        _c.log.warning("kvtrail_vllm: hook %s failed (%d so far): %r", where, _H.errors, e)


def _engine_of(obj):
    """The engine state of a scheduler, block pool or single-type manager."""
    return getattr(obj, "_kvtrail_engine", None)


# ---------------------------------------------------------------- helpers


def request_id(req):
    """The trace request_id of a vLLM request: blake3 of the client's request
    id (``external_req_id``, which a P/D proxy gives both engines, else
    ``request_id``), so the prefill and decode views of one request meet."""
    ext = getattr(req, "external_req_id", None) or req.request_id
    return _c.id_of(ext)


def _tenant(req):
    v = req
    for part in _H.tenant_field.split("."):
        v = v.get(part) if isinstance(v, dict) else getattr(v, part, None)
        if v is None:
            break
    return _c.tenant_value(v, _H.pseudonymize)


def _slot_runs(table, bs, a, b):
    """Slot runs (start, count, token_pos) of token positions [a, b) in a
    block table; null blocks (id 0) are skipped (the native module's
    ``slot_runs``: the one home of this walk, which the step uses too)."""
    return _native.slot_runs(table, bs, a, b)


def _kv_runs(eng, pool, rid, op, runs, with_pos):
    """One event of ``op`` over slot runs (start, count, token_pos; the
    positions kept when ``with_pos``): its lines, built natively (one line
    of several runs), queued as one item, and mirrored into the guard."""
    ts = _time_ns()
    eng.put_step(ts, _native.kv_lines(pool, ts, rid, op, runs, with_pos, _H.guard.native))


def _blocks_kv(eng, group, rid, op, blocks):
    """One event of ``op`` over vLLM block objects (an allocation, a free,
    an eviction): their slots by ascending block id, the null block
    skipped, built natively as ``_kv_runs``."""
    pool = eng.pool(group)
    if pool is None or pool < 0 or not eng.attention[group if group < len(eng.attention) else 0]:
        return
    ts = _time_ns()
    eng.put_step(ts, _native.block_lines(pool, eng.block_size(group), ts, rid, op, blocks,
                                         _H.guard.native, eng.step_cache))


# ---------------------------------------------------------------- wrappers


def _w_sched_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if _H is None:
            return
        try:
            eng = _Engine(self)
            self._kvtrail_engine = eng
            kvm = self.kv_cache_manager
            coord = kvm.coordinator
            kvm._kvtrail_engine = eng
            eng.managers = list(coord.single_type_managers)
            coord.block_pool._kvtrail_engine = eng
            for g, m in enumerate(coord.single_type_managers):
                m._kvtrail_engine = eng
                m._kvtrail_group = g
        except Exception as e:
            _fail("Scheduler.__init__", e)

    return __init__


def _w_add_request(orig):
    def add_request(self, request, *args, **kwargs):
        eng = _engine_of(self) if _H is not None else None
        if eng is not None:
            try:
                ids = request.prompt_token_ids
                eng.reqs[request.request_id] = {
                    "id": request_id(request),
                    "ext": str(getattr(request, "external_req_id", None) or request.request_id),
                    "arrival": _time_ns(),
                    "prompt": int(request.num_prompt_tokens),
                    "hash": hash_tokens(ids) if ids is not None else None,
                    "tenant": _tenant(request),
                    "covered": 0,
                }
            except Exception as e:
                _fail("Scheduler.add_request", e)
            try:
                # The native step remembers a request by its id object: a
                # request added again (a streaming session's next chunk
                # keeps the scheduler's Request, whose id object is
                # another) must get its new row.
                eng.step_cache.forget(request.request_id)
                old = self.requests.get(request.request_id)
                if old is not None:
                    eng.step_cache.forget(old.request_id)
            except Exception as e:
                _fail("Scheduler.add_request", e)
        return orig(self, request, *args, **kwargs)

    return add_request


def _w_get_new_blocks(orig):
    def get_new_blocks(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        eng = _engine_of(self) if _H is not None else None
        if eng is not None:
            try:
                group, rid = _who(eng)
                _blocks_kv(eng, group, rid, ALLOC, out)
            except Exception as e:
                _fail("BlockPool.get_new_blocks", e)
        return out

    return get_new_blocks


def _w_evict(orig):
    def _maybe_evict_cached_block(self, block, *args, **kwargs):
        eng = _engine_of(self) if _H is not None else None
        group = None
        if eng is not None:
            try:
                h = block.block_hash
                if h is not None and not block.is_null:
                    group = int.from_bytes(bytes(h)[-4:], "big")
            except Exception as e:
                _fail("BlockPool._maybe_evict_cached_block", e)
        out = orig(self, block, *args, **kwargs)
        if out and group is not None:
            try:
                _blocks_kv(eng, group, 0, FREE, [block])
            except Exception as e:
                _fail("BlockPool._maybe_evict_cached_block", e)
        return out

    return _maybe_evict_cached_block


def _w_free_blocks(orig):
    def free_blocks(self, ordered_blocks, *args, **kwargs):
        eng = _engine_of(self) if _H is not None else None
        if eng is None:
            return orig(self, ordered_blocks, *args, **kwargs)
        blocks = list(ordered_blocks)  # an iterator (reversed): read once, forward the list
        try:
            group, rid = _who(eng)
            _blocks_kv(eng, group, rid, FREE, blocks)
        except Exception as e:
            _fail("BlockPool.free_blocks", e)
        return orig(self, blocks, *args, **kwargs)

    return free_blocks


# The single-type manager methods that take ``request_id`` first and call
# the block pool on that request's behalf (allocate_new_blocks,
# allocate_external_computed_blocks, free, remove_skipped_blocks: a sliding
# window dropping blocks mid-request), by code object, filled by _apply
# from the classes it patches. They are not wrapped: the scheduler calls
# them once per request and group per step, and a wrapper there cost more
# than all the rest of the hook. An allocator call (get_new_blocks,
# free_blocks: a few per block, not per step) finds the nearest of them on
# its call stack instead.
_CTX_CODES = set()
_CTX_METHODS = ("allocate_new_blocks", "allocate_external_computed_blocks", "free", "remove_skipped_blocks")
# How far up the stack an allocator call looks (the manager method's own
# helpers sit between: _remove_blocks_in_range, _claim_ring_block).
_CTX_DEPTH = 6


def _who(eng):
    """(group, trace request id) on whose behalf the running allocator call
    runs: the nearest single-type manager method of _CTX_CODES on the call
    stack (its manager's group, its request), else the request an outer
    ``KVCacheManager.free`` set, in group 0, else the engine (group 0,
    request 0)."""
    f = sys._getframe(2)  # the allocator wrapper's caller
    for _ in range(_CTX_DEPTH):
        if f is None:
            break
        code = f.f_code
        if code in _CTX_CODES:
            names = code.co_varnames
            loc = f.f_locals
            mgr, rid_s = loc.get(names[0]), loc.get(names[1])
            r = eng.reqs.get(rid_s)
            if r is not None:
                rid = r["id"]
            elif _ctx.rid:  # an outer KVCacheManager.free set it
                rid = _ctx.rid
            else:
                rid = _c.id_of(rid_s)
            return getattr(mgr, "_kvtrail_group", 0), rid
        f = f.f_back
    return 0, _ctx.rid


def _w_add_local(orig):
    def add_local_computed_blocks(self, request_id_, new_computed_blocks, *args, **kwargs):
        out = orig(self, request_id_, new_computed_blocks, *args, **kwargs)
        eng = _engine_of(self) if _H is not None else None
        if eng is not None and new_computed_blocks:
            try:
                g = getattr(self, "_kvtrail_group", 0)
                pool = eng.pool(g)
                r = eng.reqs.get(request_id_)
                rid = r["id"] if r else _c.id_of(request_id_)
                bs = eng.block_size(g)
                table = [b.block_id for b in self.req_to_blocks.get(request_id_, ())]
                n = len(table)
                hit = [b.block_id for b in new_computed_blocks if not b.is_null]
                if pool is not None and pool >= 0 and hit and eng.attention[g]:
                    # The hit blocks are the table's first blocks (after any
                    # skipped nulls): positions from their index.
                    first = n - len(new_computed_blocks)
                    runs = _slot_runs(table, bs, max(0, first) * bs, n * bs)
                    _kv_runs(eng, pool, rid, SHARE, runs, True)
                if r is not None:
                    r["covered"] = max(r["covered"], n * bs)
            except Exception as e:
                _fail("add_local_computed_blocks", e)
        return out

    return add_local_computed_blocks


def _w_apply_cow(orig):
    def _apply_cow(self, request_id_, block_idx, source_block, cow_block, *args, **kwargs):
        out = orig(self, request_id_, block_idx, source_block, cow_block, *args, **kwargs)
        eng = _engine_of(self) if _H is not None else None
        if eng is not None:
            try:
                r = eng.reqs.get(request_id_)
                rid = r["id"] if r else _c.id_of(request_id_)
                if len(eng.cow) > 100_000:  # never scheduled: keep memory bounded
                    eng.cow.pop(next(iter(eng.cow)))
                eng.cow[int(cow_block.block_id)] = (rid, getattr(self, "_kvtrail_group", 0), int(block_idx),
                                                    int(source_block.block_id))
            except Exception as e:
                _fail("_apply_cow", e)
        return out

    return _apply_cow


def _w_take_cow(orig):
    def take_pending_cow_copies(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        eng = _engine_of(self) if _H is not None else None
        if eng is not None and out:
            try:
                g = getattr(self, "_kvtrail_group", 0)
                if len(eng.cow_taken) > 100_000:
                    del eng.cow_taken[:1000]
                eng.cow_taken.extend((g, int(a.block_id), int(b.block_id)) for a, b in out)
            except Exception as e:
                _fail("take_pending_cow_copies", e)
        return out

    return take_pending_cow_copies


def _cow_copies(eng, copies):
    """The step's copy-on-write block copies (``kv_cache_block_copies``),
    which the worker runs before the step's forward: each a same-pool
    ``copy`` of the whole source block into the destination block, for the
    request that got the private block, followed by a ``share`` of the
    destination to that request when the copy's source is the block its
    prefix hit named (the hit's grant was on the source block; a grant
    does not follow a copy). A copy whose group the managers did not
    report cannot be given slots: a hole in the engine's pool, never a
    guess."""
    groups = {}
    for g, a, b in eng.cow_taken:
        groups[(a, b)] = g
    eng.cow_taken = []
    ts = _time_ns()
    for c in copies:
        src, dst = int(c[0]), int(c[1])
        g = groups.get((src, dst))
        info = eng.cow.pop(dst, None)
        if g is None:
            _H.cow_unverified += 1
            pool = eng.pool(0)
            if pool is not None and pool >= 0:
                eng.put(pool, (_c.LOST, pool, 1))
            continue
        if g >= len(eng.attention) or not eng.attention[g]:
            continue  # Mamba state blocks: no slots
        pool = eng.pool(g)
        if pool is None or pool < 0:
            continue
        bs = eng.block_sizes[g]
        rid = info[0] if info is not None else 0
        eng.put(pool, (_c.COPY, pool, ts, rid, pool, [(dst * bs, src * bs, bs)]))
        _H.cow_copies += 1
        if info is not None and info[3] == src and rid:
            _kv_runs(eng, pool, rid, SHARE, [(dst * bs, bs, info[2] * bs)], True)


def _w_kvm_free(orig):
    def free(self, request, *args, **kwargs):
        eng = _engine_of(self) if _H is not None else None
        if eng is None:
            return orig(self, request, *args, **kwargs)
        prev = _ctx.rid
        try:
            r = eng.reqs.get(request.request_id)
            _ctx.rid = r["id"] if r else request_id(request)
        except Exception as e:
            _fail("KVCacheManager.free", e)
        try:
            return orig(self, request, *args, **kwargs)
        finally:
            _ctx.rid = prev

    return free


def on_schedule(sched, out):
    """After ``Scheduler.schedule``: write of the tokens computed this step,
    read of the whole context, and the NIXL consumer's transfer plan."""
    eng = _engine_of(sched)
    if eng is None:
        return
    copies = getattr(out, "kv_cache_block_copies", None)
    if copies or eng.cow_taken:
        try:
            _cow_copies(eng, copies or ())
        except Exception as e:  # the step's own events still go below
            _fail("Scheduler.schedule", e)
    step = None
    if out.num_scheduled_tokens:
        # Per scheduled request and group, in one native call: the write of
        # the tokens computed this step, the read of the whole context (an
        # LMCache load into this step's blocks runs after schedule, in the
        # worker's start_load_kv: the reads and the guard wait for it), the
        # writes mirrored into the guard, and the guard's check of a
        # request's first step over KV it did not compute this step.
        native = _H.guard.native
        if eng.guard_holes:
            # A step the guard missed (busy in another thread): its holes,
            # before this step's writes.
            try:
                for pool in sorted(eng.guard_holes):
                    _H.guard.feed((_c.LOST, pool, 1))
                eng.guard_holes.clear()
            except RuntimeError:
                pass  # still busy: this step will miss it too, and retry
        ts = _time_ns()
        try:
            step = _native.schedule_step(
                out.num_scheduled_tokens, sched.requests, eng.reqs, eng.groups(),
                [m.req_to_blocks for m in eng.managers], ts, native,
                eng.guarded if native is not None else None, eng.lmc_wait, request_id, eng.step_cache)
        except Exception as e:
            # The step's events cannot be told: a hole in each pool (and
            # in the guard's view of it), never a silent gap.
            _fail("Scheduler.schedule", e)
            for pool in sorted({p for p, _, _ in eng.groups() if p is not None and p >= 0}):
                eng.put(pool, (_c.LOST, pool, 1))
            step = None
    if step is not None:
        if step.text is not None:
            eng.put_lines(ts, step)
        if step.holes:
            _fail("Scheduler.schedule", ValueError(f"{step.holes} requests' state unreadable: holes"))
        for rid_s, rid, check, reads in step.waits:
            eng.lmc_wait[rid_s].update(reads=reads, check=check, rid=rid)
        for rid_s, rid, answers in step.checks:
            _checked(eng, rid_s, rid, answers)
        if step.guard_missed:
            # The guard stayed busy in another thread: it did not see the
            # step's writes (its checks answered unknown). A hole in each
            # pool, fed before the next step's writes.
            eng.guard_holes.update(pool for pool, _ in step.counts)
    meta = getattr(out, "kv_connector_metadata", None)
    if eng.cache_pool is not None:
        try:
            status = sched.connector.connector_scheduler._jobs
        except Exception:
            status = {}
        for store, jobs in ((False, getattr(meta, "load_jobs", None)), (True, getattr(meta, "store_jobs", None))):
            for jid, job in (jobs or {}).items():
                gpu = job.src_spec if store else job.dst_spec
                cpu = job.dst_spec if store else job.src_spec
                if len(eng.jobs) > 100_000:  # never reported: keep memory bounded
                    eng.jobs.pop(next(iter(eng.jobs)))
                eng.jobs[int(jid)] = [
                    store, str(job.req_id), [int(b) for b in gpu.block_ids],
                    [int(n) for n in (getattr(gpu, "group_sizes", None) or [len(gpu.block_ids)])],
                    [int(n) for n in (getattr(gpu, "block_indices", None) or [0])],
                    [int(c) for c in cpu.block_ids], eng.workers,
                    _job_keys(status, jid),
                ]
    if eng.simple is not None and meta is not None and eng.cache_pool is not None:
        _simple_plan(sched, eng, meta)
    recv = getattr(meta, "reqs_to_recv", None)
    if recv:
        for rid_s, m in recv.items():
            remote = getattr(m, "remote", None)
            if remote is None:
                continue
            if len(eng.plans) > 100_000:  # abandoned loads: keep memory bounded
                eng.plans.pop(next(iter(eng.plans)))
            eng.plans[rid_s] = (
                [list(x) for x in m.local_block_ids],
                [list(x) for x in remote.block_ids],
                str(remote.engine_id),
                tuple(getattr(m, "local_num_computed_blocks", ()) or ()),
            )


def _check(eng, rid_s, rid, reads):
    """The guard, once per request, before its first step over KV it did
    not compute this step: every group's read of its context."""
    _checked(eng, rid_s, rid, [(pool, None, [(a, n) for a, n, _ in read]) for pool, read in reads])


def _checked(eng, rid_s, rid, answers):
    """Acts on the guard's answers for a request's reads, per group: a
    (pool, verdict, sources, slots foreign, slots unknown, slots read)
    answer the native step gave, or (pool, None, runs) still to check."""
    if len(eng.guarded) > 1_000_000:  # finished requests leave it below
        eng.guarded.clear()
    eng.guarded.add(rid_s)
    for a in answers:
        if a[1] is None:
            msg = _H.guard.decide(a[0], rid, rid_s, runs=a[2], client=eng.client)
        else:
            msg = _H.guard.decide(a[0], rid, rid_s, client=eng.client, answer=a[1:])
        if msg is not None:
            eng.to_abort.append((rid_s, msg))
            return


def _abort_guarded(sched, eng):
    """After ``schedule``: finishes the requests the guard stopped as
    FINISHED_ERROR (the step's output for them is then dropped by
    update_from_output, which skips finished requests) and keeps their
    error outputs for the client."""
    from vllm.outputs import RequestError
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.request import RequestStatus

    todo, eng.to_abort = eng.to_abort, []
    for rid_s, msg in todo:
        for req in sched.finish_requests(rid_s, RequestStatus.FINISHED_ERROR):
            eng.error_outputs.append((req.client_index, EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason(),
                events=req.take_events(), trace_headers=req.trace_headers,
                error=RequestError(code="kv_isolation", message=msg))))


def _emit_errors(eng, outputs):
    """Adds the guard's error outputs to update_from_output's result."""
    from vllm.v1.engine import EngineCoreOutputs

    todo, eng.error_outputs = eng.error_outputs, []
    for client, out in todo:
        eco = outputs.get(client)
        if eco is None:
            outputs[client] = EngineCoreOutputs(outputs=[out])
        else:
            eco.outputs.append(out)


def _pull_runs(eng, local, remote, hits, invalid):
    """Per group: (group, runs (dst_slot, dst_tok, count, token_pos), the
    remote block ids, the load's tokens) and whether any local block was
    reported invalid. The runs are of the block form (the sidecar expands
    the remote ids with the producer pool's page size): this engine does not
    know the producer's block size. ``dst_tok`` is the run's offset in the
    load's destination (the local blocks end to end, ``tail`` tokens), which
    reads the last ``tail`` tokens of the remote blocks (all of them when
    they hold fewer): NIXL's pairing, local block i reading remote block
    len(R)-len(L)+i when the sizes agree, the local blocks split into
    sub-blocks of the remote size and paired from the start when the
    remote blocks are smaller."""
    out = []
    bad = False
    for g, (L, R) in enumerate(zip(local, remote)):
        if g >= len(eng.block_sizes) or not eng.attention[g]:
            continue
        bs = eng.block_size(g)
        first = hits[g] if g < len(hits) else 0
        runs = []
        for i, lb in enumerate(L):
            if lb in invalid:
                bad = True
                break  # vLLM keeps the blocks before the first bad one
            if lb == 0:
                continue
            dst, off, pos = lb * bs, i * bs, (first + i) * bs
            if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == off:
                d, o, n, tp = runs[-1]
                runs[-1] = (d, o, n + bs, tp)
            else:
                runs.append((dst, off, bs, pos))
        out.append((g, runs, [int(b) for b in R], len(L) * bs))
    return out, bad


def on_update(sched, out, mro):
    """Before ``Scheduler.update_from_output``: remote loads that ended
    this step become ``xfer_pull`` lines (ok, partial or failed)."""
    eng = _engine_of(sched)
    if eng is None:
        return
    if eng.lmc_wait:
        _lmc_unseen(eng)
    kco = getattr(mro, "kv_connector_output", None)
    if kco is None:
        return
    if eng.jobs:
        _offload_done(sched, eng, getattr(kco, "kv_connector_worker_meta", None))
    if eng.sstores or eng.sloads:
        _simple_done(sched, eng, kco)
    done = set(getattr(kco, "finished_recving", None) or ())
    failed = set(getattr(kco, "failed_recving", None) or ())
    invalid = set(getattr(kco, "invalid_block_ids", None) or ())
    for rid_s in sorted(done | failed):
        plan = eng.plans.pop(rid_s, None)
        if plan is None:
            continue
        local, remote, engine_id, hits = plan
        r = eng.reqs.get(rid_s)
        req = sched.requests.get(rid_s)
        rid = r["id"] if r else (request_id(req) if req is not None else _c.id_of(rid_s))
        src = _H.remote_pools.get(engine_id)
        ts = _time_ns()
        if rid_s in failed:
            groups = [(g, [], None, None) for g in range(len(local))]
            bad = True
        else:
            groups, bad = _pull_runs(eng, local, remote, hits, invalid)
        # One line per group (each names its own remote blocks); a failed
        # load is one line per pool.
        lines = []
        for g, runs, blocks, tail in groups:
            pool = eng.pool(g)
            if pool is None or pool < 0:
                continue
            sp = eng.remote_pool(src, g)
            if sp is None:
                # Which pool the producer is: not configured. The copy cannot
                # be named: a hole in this pool, never a guess.
                _H.pulls_unmapped += 1
                eng.put(pool, (_c.LOST, pool, max(1, len(runs))))
                continue
            if runs or not any(ln[0] == pool and ln[1] == sp for ln in lines):
                lines.append((pool, sp, runs, blocks, tail))
        if rid_s not in failed and bad and any(ln[2] for ln in lines):
            # A partial load: the groups' lines with runs say so.
            lines = [ln for ln in lines if ln[2]]
        for pool, sp, runs, blocks, tail in lines:
            if rid_s in failed:
                outcome = "failed"
            elif bad:
                outcome = "partial" if runs else "failed"
            else:
                outcome = "ok" if runs else None
            if outcome is None:
                continue
            if outcome == "failed":
                eng.put(pool, (_c.PULL, pool, ts, rid, sp, [], outcome, eng.policy))
            else:
                eng.put(pool, (_c.PULL, pool, ts, rid, sp, runs, outcome, eng.policy, blocks, tail))


def _pair_runs(pairs, bs):
    """(dst_slot, src_slot, count, token_pos) runs of whole blocks, from
    (dst block, src block, token_pos) pairs; consecutive pairs that are
    contiguous on both sides make one run."""
    out = []
    for d, s_, tp in pairs:
        dst, src = d * bs, s_ * bs
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            a, b, n, p = out[-1]
            out[-1] = (a, b, n + bs, p)
        else:
            out.append((dst, src, bs, tp))
    return out


def _rid(sched, eng, rid_s):
    r = eng.reqs.get(rid_s)
    if r:
        return r["id"]
    req = sched.requests.get(rid_s) if sched is not None else None
    return request_id(req) if req is not None else _c.id_of(str(rid_s))


def _simple_plan(sched, eng, meta):
    """SimpleCPUOffloadConnector, after ``schedule``: the store event of the
    step (GPU block ids -> offload block ids) and, per request of the load
    event, its blocks (GPU id, offload id, block index in the request, the
    block hash the request needs there)."""
    ev = getattr(meta, "store_event", -1)
    if ev is not None and ev >= 0 and meta.store_gpu_blocks:
        if len(eng.sstores) > 100_000:  # never reported: keep memory bounded
            eng.sstores.pop(next(iter(eng.sstores)))
        eng.sstores[int(ev)] = [[int(b) for b in meta.store_gpu_blocks],
                                [int(b) for b in meta.store_cpu_blocks], eng.workers,
                                list((eng.simple._store_event_to_reqs or {}).get(ev, ()))]
    ev = getattr(meta, "load_event", -1)
    if ev is None or ev < 0:
        return
    sm = eng.simple
    kvm = sched.kv_cache_manager
    hbs = int(getattr(sm, "hash_block_size", 0) or 0)
    same = bool(eng.block_sizes) and hbs == eng.block_sizes[0]
    for rid_s in (meta.load_event_to_reqs or {}).get(ev, ()):
        st = sm._reqs_to_load.get(rid_s)
        req = sched.requests.get(rid_s)
        if st is None or req is None or st.transfer_meta is None:
            continue
        where = {}
        for g, table in enumerate(kvm.get_block_ids(rid_s)):
            if eng.aliased(g) and eng.attention[g]:
                for i, b in enumerate(table):
                    where.setdefault(b, i)
        hashes = req.block_hashes
        blocks = []
        for gb, cb in zip(st.transfer_meta.gpu_block_ids, st.transfer_meta.cpu_block_ids):
            i = where.get(gb)
            want = bytes(hashes[i]) if same and i is not None and i < len(hashes) else None
            blocks.append((int(gb), int(cb), i, want))
        if len(eng.sloads) > 100_000:
            eng.sloads.pop(next(iter(eng.sloads)))
        eng.sloads[rid_s] = blocks


def _simple_done(sched, eng, kco):
    """SimpleCPUOffloadConnector, before ``update_from_output``: a store
    event every worker reported done is a copy into the cache pool (the
    offload blocks) from the engine's pool, each offload block remembering
    the block hash vLLM registers it under (the GPU block's); a finished
    load is a copy back, and a ``share`` to the loading request of the
    blocks whose offload block was stored under the hash the request needs
    there. A block stored under another hash gets no grant (its read is
    foreign, with its true source); a block the hook never saw stored, or
    whose hash it cannot compare, is not copied but a hole (uncertain)."""
    pool, cache = eng.pool(0), eng.cache_pool
    if pool is None or pool < 0 or cache is None:
        return
    bs = eng.block_size()
    wm = getattr(kco, "kv_connector_worker_meta", None)
    gpu_pool = getattr(eng.simple, "_gpu_block_pool", None)
    for ev, n in sorted((getattr(wm, "completed_store_events", None) or {}).items()):
        job = eng.sstores.get(int(ev))
        if job is None:
            continue
        job[2] -= int(n)
        if job[2] > 0:
            continue
        del eng.sstores[int(ev)]
        gpu, cpu, _, reqs = job
        rid = _rid(sched, eng, reqs[0]) if reqs else _c.id_of("kvtrail-vllm:offload-store")
        eng.put(cache, (_c.PULL, cache, _time_ns(), rid, pool,
                        _pair_runs([(c, g, 0) for g, c in zip(gpu, cpu)], bs), "ok", None))
        if len(eng.chunk_keys) > 1 << 22:
            eng.chunk_keys.clear()  # bounded; later loads of older blocks are holes
        for g, c in zip(gpu, cpu):
            h = gpu_pool.blocks[g].block_hash if gpu_pool is not None else None
            # BlockHashWithGroupId: the block hash, then 4 bytes of group id.
            eng.chunk_keys[c] = bytes(h)[:-4] if h is not None else None
    for rid_s in sorted(getattr(kco, "finished_recving", None) or ()):
        blocks = eng.sloads.pop(rid_s, None)
        if not blocks:
            continue
        rid = _rid(sched, eng, rid_s)
        copied, granted, lost = [], [], 0
        for gb, cb, i, want in blocks:
            stored = eng.chunk_keys.get(cb)
            if i is None or want is None or stored is None:
                lost += 1
                continue
            copied.append((gb, cb, i * bs))
            if stored == want:
                granted.append((gb * bs, bs, i * bs))
            else:
                _H.offload_key_mismatch += 1
        if lost:
            _H.offload_unverified += lost
            eng.put(pool, (_c.LOST, pool, lost))
        if copied:
            eng.put(pool, (_c.PULL, pool, _time_ns(), rid, cache, _pair_runs(copied, bs), "ok", None))
        if granted:
            _kv_runs(eng, pool, rid, SHARE, granted, True)


_TIER_LOCS_MAX = 1 << 22


def _tier_loc(tier, key):
    """Where a secondary tier keeps ``key``: the file its FileMapper names
    (the fs tier), else the key itself."""
    fm = getattr(tier, "file_mapper", None)
    return fm.get_file_name(key) if fm is not None else bytes(key)


def _tier_job(eng, job, tier_idx):
    """A tier job registered: promotion (tier -> CPU chunks) or store (CPU
    chunks -> tier), with the storage location of each key."""
    tier = eng.tiers[tier_idx] if tier_idx < len(eng.tiers) else None
    items = [(bytes(k), _tier_loc(tier, k) if tier is not None else None, int(c))
             for k, c in zip(job.keys, job.chunk_ids)]
    if len(eng.tjobs) > 100_000:
        eng.tjobs.pop(next(iter(eng.tjobs)))
    rc = getattr(job, "req_context", None)
    eng.tjobs[int(job.job_id)] = (bool(job.is_promotion), int(tier_idx), items, getattr(rc, "req_id", None))


def _tier_done(eng, job_id, res):
    """A tier job finished: a store is a copy into the tier's pool (the
    locations) from the cache pool (the chunks), a promotion a copy back,
    the chunk then remembering the offload key its content was first stored
    under (so the GPU load's grant is checked against it). A promotion from
    a location the hook never saw written (another engine's files, a failed
    store, no pool for the tier) is a hole in the cache pool, never a copy."""
    job = eng.tjobs.pop(int(job_id), None)
    cache = eng.cache_pool
    if job is None or cache is None:
        return
    promo, ti, items, rid_s = job
    tp = eng.tier_pools[ti] if ti < len(eng.tier_pools) else None
    bs = eng.block_size()
    cs = max(1, eng.blocks_per_chunk) * bs
    ok = None if res.success else {bytes(k) for k in (getattr(res, "successful_keys", None) or ())}
    locs = eng.tier_locs.setdefault(ti, {})
    runs, lost = [], 0
    for key, loc, c in items:
        good = ok is None or key in ok
        if promo:
            if not good:
                continue  # vLLM does not make the chunk available
            idx = locs.get(loc) if tp is not None else None
            if idx is None:
                lost += 1
                eng.chunk_keys.pop(c, None)
                continue
            runs.append((c * cs, idx * cs, cs, 0))
            eng.chunk_keys[c] = eng.loc_keys.get((ti, idx))
        elif tp is not None:
            if not good:
                # What a failed store left at the location is unknown.
                locs.pop(loc, None)
                continue
            idx = locs.get(loc)
            if idx is None:
                if len(locs) >= _TIER_LOCS_MAX:
                    continue  # the location stays unknown: its loads are holes
                idx = eng.tier_next.get(ti, 0)
                eng.tier_next[ti] = idx + 1
                locs[loc] = idx
            runs.append((idx * cs, c * cs, cs, 0))
            eng.loc_keys[(ti, idx)] = eng.chunk_keys.get(c)
    rid = _rid(None, eng, rid_s) if rid_s is not None else _c.id_of("kvtrail-vllm:tier")
    ts = _time_ns()
    if promo:
        if lost:
            _H.offload_unverified += lost
            eng.put(cache, (_c.LOST, cache, lost))
        if runs:
            eng.put(cache, (_c.PULL, cache, ts, rid, tp, runs, "ok", None))
    elif runs:
        eng.put(tp, (_c.PULL, tp, ts, rid, cache, runs, "ok", None))


def _w_tier_register(orig):
    def _register_job(self, transfer_job, tier_idx, *args, **kwargs):
        out = orig(self, transfer_job, tier_idx, *args, **kwargs)
        eng = _engine_of(self) if _H is not None else None
        if eng is not None:
            try:
                _tier_job(eng, transfer_job, tier_idx)
            except Exception as e:
                _fail("TieringOffloadingManager._register_job", e)
        return out

    return _register_job


def _w_tier_done(orig, name, meta_at):
    """A completion path of TieringOffloadingManager taking (..., job
    metadata, job result) with the metadata at ``meta_at``."""

    def wrapper(self, *args, **kwargs):
        eng = _engine_of(self) if _H is not None else None
        if eng is not None:
            try:
                _tier_done(eng, args[meta_at].transfer_job.job_id, args[meta_at + 1])
            except Exception as e:
                _fail(name, e)
        return orig(self, *args, **kwargs)

    wrapper.__name__ = name
    return wrapper


def _w_lmcache_alloc(orig):
    """LMCache's scheduler side accepted a load of ``num_external_tokens``
    into the request's blocks. With a cache pool and the lmcache engine in
    this process (LMCacheConnectorV1 with its worker here: one engine, TP 1),
    the load is recorded when lmcache's engine performs it (_lmc_retrieve):
    a copy per chunk out of the cache pool; the request's reads of that step
    wait for it. Otherwise (no cache pool, the MP connector, the worker in
    another process) the external ``lmcache`` package fills the blocks out
    of the hook's sight: a hole in the engine's pool, after the blocks'
    alloc: their reads are uncertain, never confirmed, never clean."""

    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kwargs):
        out = orig(self, request, blocks, num_external_tokens, *args, **kwargs)
        eng = _engine_of(self) if _H is not None else None
        if eng is not None and num_external_tokens:
            try:
                pool = eng.pool(0)
                n = int(num_external_tokens)
                if pool is not None and pool >= 0 and n > 0:
                    _H.lmcache_loads += 1
                    if eng.cache_pool is not None and eng in _H.lmc_engines and len(_H.lmc_engines) == 1:
                        if len(eng.lmc_wait) > 100_000:  # abandoned: keep memory bounded
                            # Never drop deferred reads: a hole, then them.
                            old = next(iter(eng.lmc_wait))
                            _lmc_unseen(eng, only=old)
                            eng.lmc_wait.pop(old, None)
                        eng.lmc_wait[request.request_id] = {"n": n, "reads": None}
                    else:
                        _H.lmcache_holes += 1
                        eng.put(pool, (_c.LOST, pool, -(-n // eng.block_size())))
            except Exception as e:
                _fail("LMCache update_state_after_alloc", e)
        return out

    return update_state_after_alloc


# ---- LMCache's engine (the external lmcache package, in this process) ----
#
# The cache pool stands for lmcache's local CPU memory: a chunk's location
# is where lmcache's allocator put its memory object, never its key, so a
# memory object reused for other KV, or a key that names another chunk's
# memory, is seen for what it holds.


class _LmcCtx(threading.local):
    chunks = None  # retrieve: (key, memory object, start, end) of _process_tokens_internal
    saved = None  # store: id(memory object) -> (memory object, start, end, slot mapping, request)


_lctx = _LmcCtx()


def _lmc_engine():
    """The engine whose LMCacheConnectorV1 this process's lmcache engine
    serves: the only one (with several, none: their loads are holes)."""
    engs = _H.lmc_engines if _H is not None else ()
    eng = engs[0] if len(engs) == 1 else None
    return eng if eng is not None and eng.cache_pool is not None else None


def _lmc_loc(eng, obj, ntok=None):
    """The one home of the location rule: (first cache-pool slot, tokens)
    of lmcache memory object ``obj``, from its allocator address (the
    offset inside lmcache's buffer) in tokens of the engine's bytes per
    token (both learned from the first stored chunk: ``ntok`` tokens); None
    when the object has no address, belongs to another allocator than the
    first stored chunk's (another address space), or the bytes per token
    are not known yet."""
    meta = getattr(obj, "meta", None)
    addr = getattr(meta, "address", None)
    alloc = id(getattr(obj, "parent_allocator", None))
    if addr is None:
        return None
    if eng.lmc_alloc is None and ntok:
        eng.lmc_alloc = alloc
    if alloc != eng.lmc_alloc:
        return None  # another allocator's address space
    try:
        nbytes = int(obj.tensor.numel() * obj.tensor.element_size())
    except Exception:
        return None
    if ntok:
        tb = nbytes // int(ntok)
        if eng.lmc_tb is None and tb > 0 and nbytes == tb * int(ntok):
            eng.lmc_tb = tb
    tb = eng.lmc_tb
    if not tb or nbytes % tb:
        return None
    return int(addr) // tb, nbytes // tb


def _slot_list(sm, start, end):
    sm = sm[start:end]
    return [int(x) for x in (sm.tolist() if hasattr(sm, "tolist") else sm)]


def _pos_runs(pairs):
    """(dst, src, count, token_pos) runs of (dst, src, token_pos) triples."""
    out = []
    for d, s_, tp in pairs:
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s_ \
                and out[-1][3] + out[-1][2] == tp:
            a, b, n, p = out[-1]
            out[-1] = (a, b, n + 1, p)
        else:
            out.append((d, s_, 1, tp))
    return out


def _lmc_store(eng, items):
    """lmcache put memory objects it filled from vLLM's slots under their
    keys: a copy per chunk from the engine's pool into the cache pool at the
    object's location, which then remembers the key. (key, obj, start, end,
    slot mapping, request) per chunk."""
    pool = eng.pool(0)
    if pool is None or pool < 0:
        return
    ts = _time_ns()
    for key, obj, start, end, sm, rid_s in items:
        loc = _lmc_loc(eng, obj, end - start)
        if loc is None:
            continue  # its loads are holes
        first, n = loc
        src = _slot_list(sm, start, end)
        if len(src) != n:
            continue
        runs = _pos_runs([(first + i, s_, start + i) for i, s_ in enumerate(src)])
        rid = _rid(None, eng, rid_s) if rid_s is not None else _c.id_of("kvtrail-vllm:lmcache")
        eng.put(eng.cache_pool, (_c.PULL, eng.cache_pool, ts, rid, pool, runs, "ok", None))
        if len(eng.lmc_keys) > 1 << 22:
            eng.lmc_keys.clear()  # bounded; later loads are holes
        eng.lmc_keys[first] = (key, n)
        _H.lmcache_copies += 1


def _lmc_free(eng, loc):
    """lmcache's allocator got back the memory object at ``loc`` (from
    _lmc_loc: evicted, removed, or a store it dropped): a free of its slots
    in the cache pool; the key it held is forgotten (a later load from
    there is a hole unless stored again)."""
    if eng.lmc_keys.pop(loc[0], None) is None:
        return
    _kv_runs(eng, eng.cache_pool, 0, FREE, [(loc[0], loc[1], 0)], False)


def _lmc_load(eng, rid_s, chunks, sm, vllm_cached=0):
    """lmcache copied memory objects into vLLM's slots for request
    ``rid_s``: a copy per chunk from the cache pool at the object's location
    into the engine's pool, and a share of those slots to the request (an
    LMCache hit is a prefix hit: another request's KV, handed out under the
    chunk's key) only where the location was last stored under the key
    loaded. A chunk whose location the hook never saw stored (put by
    another engine, before install, an unknown allocator) is a hole.

    lmcache starts a load at a chunk boundary, so a chunk may also cover
    positions below ``vllm_cached`` (vLLM's own prefix hit): those slots
    are prefix-cache blocks other running requests may share, and the
    chunk rewrites them. Loaded under the key last stored there, it writes
    the same prefix's KV they hold: nothing is recorded for them (a copy
    would end every other sharer's grant and name the blocks' writer as
    a false source). Under another key (a stale chunk), other KV lands in
    shared blocks: the copy is recorded, so every reader of them is
    checked against what really lands."""
    pool = eng.pool(0)
    wait = eng.lmc_wait.get(rid_s)
    rid = wait.get("rid") if wait and wait.get("rid") is not None else _rid(None, eng, rid_s)
    copies, grants, lost = [], [], 0
    covered = 0  # positions at or past vllm_cached loaded
    for key, obj, start, end in chunks:
        loc = _lmc_loc(eng, obj, end - start)
        known = eng.lmc_keys.get(loc[0]) if loc is not None else None
        dst = _slot_list(sm, start, end)
        covered += max(0, end - max(start, vllm_cached))  # loaded, seen or not
        if known is None or known[1] != len(dst) or loc[1] != len(dst):
            lost += 1
            continue
        same = known[0] == key
        pairs = [(d, loc[0] + i, start + i) for i, d in enumerate(dst)
                 if d >= 0 and not (same and start + i < vllm_cached)]
        copies += pairs
        if same:
            grants += pairs
    if wait is not None and covered < int(wait["n"]):
        lost += 1  # lmcache loaded less than the scheduler was promised
    ts = _time_ns()
    if copies:
        eng.put(pool, (_c.PULL, pool, ts, rid, eng.cache_pool, _pos_runs(copies), "ok", None))
        _H.lmcache_copies += 1
    if lost:
        _H.lmcache_holes += lost
        eng.put(pool, (_c.LOST, pool, lost))
    if grants:
        _kv_runs(eng, pool, rid, SHARE, [(d, n, tp) for d, _, n, tp in _pos_runs(grants)], True)


def _lmc_release(eng, rid_s):
    """The deferred reads of a request's step with an LMCache load, after
    the load's copies (or hole), and the guard's check of them."""
    wait = eng.lmc_wait.pop(rid_s, None)
    if wait is None or wait["reads"] is None:
        if wait is not None:
            eng.lmc_wait[rid_s] = wait  # not scheduled yet
        return
    rid = wait["rid"]
    for pool, read in wait["reads"]:
        _kv_runs(eng, pool, rid, READ, read, True)
    if wait["check"]:
        _check(eng, rid_s, rid, wait["reads"])


def _lmc_unseen(eng, only=None):
    """Before update_from_output: a scheduled LMCache load the hook did not
    see lmcache perform (its worker in another process, async or layerwise
    loading, a failure): a hole over its blocks, then its reads."""
    for rid_s, wait in list(eng.lmc_wait.items()):
        if wait["reads"] is None or (only is not None and rid_s != only):
            continue
        pool = eng.pool(0)
        _H.lmcache_holes += 1
        eng.put(pool, (_c.LOST, pool, -(-int(wait["n"]) // eng.block_size())))
        _lmc_release(eng, rid_s)


def _w_lmc_retrieve(orig):
    def retrieve(self, tokens, *args, **kwargs):
        eng = _lmc_engine()
        if eng is None:
            return orig(self, tokens, *args, **kwargs)
        prev, _lctx.chunks = _lctx.chunks, []
        try:
            out = orig(self, tokens, *args, **kwargs)
            chunks = _lctx.chunks
        finally:
            _lctx.chunks = prev
        try:
            rid_s = kwargs.get("req_id")
            sm = kwargs.get("slot_mapping")
            if rid_s in eng.lmc_wait and sm is not None:
                _lmc_load(eng, rid_s, chunks, sm, int(kwargs.get("vllm_cached_tokens") or 0))
                _lmc_release(eng, rid_s)
        except Exception as e:
            _fail("LMCacheEngine.retrieve", e)
        return out

    return retrieve


def _w_lmc_process(orig):
    def _process_tokens_internal(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if _lctx.chunks is not None:
            try:
                _lctx.chunks.extend((c[0], c[1], int(c[2]), int(c[3])) for c in out[0])
            except Exception as e:
                _fail("LMCacheEngine._process_tokens_internal", e)
        return out

    return _process_tokens_internal


def _w_lmc_from_gpu(orig):
    def batched_from_gpu(self, memory_objs, starts, ends, *args, **kwargs):
        out = orig(self, memory_objs, starts, ends, *args, **kwargs)
        if _lmc_engine() is not None:
            sm, rid_s = kwargs.get("slot_mapping"), kwargs.get("req_id")
            _lctx.saved = {id(o): (o, int(a), int(b), sm, rid_s)
                           for o, a, b in zip(memory_objs, starts, ends) if sm is not None}
        return out

    return batched_from_gpu


def _w_lmc_put(orig):
    def batched_put(self, keys, memory_objs, *args, **kwargs):
        eng = _lmc_engine()
        saved, _lctx.saved = _lctx.saved, None
        if eng is not None and saved:
            # Before the put: a put lmcache drops (the key is held) frees the
            # object inside it, after this copy.
            try:
                items = []
                for k, o in zip(keys, memory_objs):
                    v = saved.get(id(o))
                    if v is not None and v[0] is o:
                        items.append((k, o, v[1], v[2], v[3], v[4]))
                _lmc_store(eng, items)
            except Exception as e:
                _fail("StorageManager.batched_put", e)
        return orig(self, keys, memory_objs, *args, **kwargs)

    return batched_put


def _w_lmc_drop(orig, name):
    """TensorMemoryObj.ref_count_down / unpin: the paths on which lmcache
    hands a memory object back to its allocator (the object turns invalid).
    Its location is taken before (an invalid object has no tensor)."""

    def wrapper(self, *args, **kwargs):
        eng = _lmc_engine()
        loc = None
        if eng is not None:
            try:
                if self.is_valid() and self.parent_allocator is not None:
                    loc = _lmc_loc(eng, self)
            except Exception:
                loc = None
        out = orig(self, *args, **kwargs)
        if loc is not None:
            try:
                if not self.is_valid():
                    _lmc_free(eng, loc)
            except Exception as e:
                _fail("TensorMemoryObj." + name, e)
        return out

    wrapper.__name__ = name
    return wrapper


def _job_keys(status, jid):
    """The offload keys (one per CPU chunk) of a job, or None."""
    st = status.get(jid) if hasattr(status, "get") else None
    keys = getattr(st, "keys", None)
    return [bytes(k) for k in keys] if keys is not None else None


def _offload_runs(eng, gpu, sizes, first, chunks, bs, grant=None):
    """(gpu_slot, cpu_slot, count, token_pos) per GPU block of group 0.
    GPU block i of a group whose first block index is k lies in chunk
    (k % bpc + i) // bpc at block offset (k % bpc + i) % bpc (a chunk is
    ``blocks_per_chunk`` blocks; the first GPU block may start inside one)."""
    bpc = max(1, eng.blocks_per_chunk)
    n = sizes[0] if sizes else len(gpu)
    k = first[0] if first else 0
    out = []
    for i, b in enumerate(gpu[:n]):
        if b == 0:
            continue
        j = k % bpc + i
        c = j // bpc
        if c >= len(chunks):
            break
        if grant is not None and not grant(c):
            continue
        g_slot, c_slot, pos = b * bs, (chunks[c] * bpc + j % bpc) * bs, (k + i) * bs
        if out and out[-1][0] + out[-1][2] == g_slot and out[-1][1] + out[-1][2] == c_slot:
            d, s, m, tp = out[-1]
            out[-1] = (d, s, m + bs, tp)
        else:
            out.append((g_slot, c_slot, bs, pos))
    return out


def _offload_done(sched, eng, wm):
    """Offload jobs every worker reported done this step (the
    OffloadingConnector's ``completed_jobs``): a store is a copy of GPU
    blocks into the cache pool, a load a copy back into GPU blocks plus a
    ``share`` of them to the loading request (an offload hit is a prefix
    hit: the KV is another request's, handed out by the engine), but only
    of chunks last stored under the key the load asked for: a chunk stored
    under another key holds another prefix, and reading it without a grant
    is reported foreign with its true source. Only group 0 is recorded;
    a load of a hybrid model's engine (several groups) is a hole
    (docs/capture-vllm.md)."""
    completed = getattr(wm, "completed_jobs", None) or {}
    pool = eng.pool(0)
    if pool is None or pool < 0:
        return
    bs = eng.block_size()
    for jid, count in sorted(completed.items()):
        job = eng.jobs.get(int(jid))
        if job is None:
            continue
        job[6] -= int(count)
        if job[6] > 0:
            continue
        del eng.jobs[int(jid)]
        store, rid_s, gpu, sizes, first, chunks, _, keys = job
        r = eng.reqs.get(rid_s)
        req = sched.requests.get(rid_s)
        rid = r["id"] if r else (request_id(req) if req is not None else _c.id_of(rid_s))
        if not store and len(sizes) > 1:
            # A load of a hybrid model's engine (several KV cache groups):
            # the hook places only group 0's chunks and keys, so none of
            # the load is attributed. A hole in each loaded group's pool: its
            # reads are uncertain, never confirmed, never clean.
            for g, n in enumerate(sizes):
                p = eng.pool(g) if n and g < len(eng.attention) and eng.attention[g] else None
                if p is not None and p >= 0:
                    _H.offload_unverified += int(n)
                    eng.put(p, (_c.LOST, p, int(n)))
            continue
        runs = _offload_runs(eng, gpu, sizes, first, chunks, bs)
        if not runs:
            continue
        ts = _time_ns()
        if store:
            # (dst, src) = (cache slot, GPU slot)
            eng.put(eng.cache_pool, (_c.PULL, eng.cache_pool, ts, rid, pool,
                                     [(c, g, n, tp) for g, c, n, tp in runs], "ok", None))
            if keys is not None:
                if len(eng.chunk_keys) > 1 << 22:
                    eng.chunk_keys.clear()  # bounded; later loads go unverified
                for c, key in zip(chunks, keys):
                    eng.chunk_keys[c] = key
        else:
            unknown = [c for c in range(len(chunks))
                       if keys is None or c >= len(keys) or eng.chunk_keys.get(chunks[c]) is None]
            if unknown:
                # Chunks the hook never saw stored (or whose key it cannot
                # compare): what they hold cannot be attributed. Not copied, a
                # hole instead: reads of those blocks are uncertain.
                _H.offload_unverified += len(unknown)
                unk = set(unknown)
                runs = _offload_runs(eng, gpu, sizes, first, chunks, bs, lambda c: c not in unk)
                eng.put(pool, (_c.LOST, pool, len(unknown)))
            if runs:
                eng.put(pool, (_c.PULL, pool, ts, rid, eng.cache_pool, runs, "ok", None))

            def grant(c):
                stored = eng.chunk_keys.get(chunks[c])
                ok = stored is not None and keys is not None and c < len(keys) and stored == keys[c]
                if stored is not None and not ok:
                    _H.offload_key_mismatch += 1
                return ok

            granted = _offload_runs(eng, gpu, sizes, first, chunks, bs, grant)
            _kv_runs(eng, pool, rid, SHARE, [(g, n, tp) for g, _, n, tp in granted], True)


def request_row(eng, req):
    """The request line for a finished vLLM request as this engine saw it."""
    r = eng.reqs.pop(req.request_id, None) or {}
    reason = req.get_finished_reason()
    finish = str(getattr(reason, "name", reason)).lower() if reason is not None else None
    out = list(req.output_token_ids)
    prompt = r.get("prompt", int(req.num_prompt_tokens))
    role = eng.role
    pool = eng.pool(0)
    prefilled = None
    if role != "decode":
        prefilled = min(prompt, int(r.get("covered", 0)))
    return {
        "type": "request",
        "request_id": r.get("id") or request_id(req),
        "external_id": r.get("ext") or str(req.request_id),
        "tenant": r.get("tenant") or _tenant(req),
        "arrival_ns": r.get("arrival") or _time_ns(),
        "finish_ns": _time_ns(),
        "prompt_tokens": prompt,
        "prefilled_tokens": prefilled,
        "output_tokens": len(out),
        "http_status": _HTTP.get(finish, 200 if finish is None else 500),
        "finish_reason": finish,
        "prefill_pool": pool if role in ("prefill", "mixed") else None,
        "decode_pool": pool if role in ("decode", "mixed") else None,
        "prompt_hash": r.get("hash"),
        "output_hash": hash_tokens(out) if out else None,
    }


def _w_free_request(orig):
    def _free_request(self, request, *args, **kwargs):
        eng = _engine_of(self) if _H is not None else None
        if eng is not None:
            try:
                eng.guarded.discard(request.request_id)
                if request.request_id in eng.lmc_wait:
                    _lmc_unseen(eng, request.request_id)
                    eng.lmc_wait.pop(request.request_id, None)
                row = request_row(eng, request)
                eng.plans.pop(request.request_id, None)
                pool = eng.pool(0)
                if pool is not None and pool >= 0:
                    eng.put(pool, (_c.REQ, pool, row))
            except Exception as e:
                _fail("Scheduler._free_request", e)
            try:
                eng.step_cache.forget(request.request_id)
            except Exception as e:
                _fail("Scheduler._free_request", e)
        return orig(self, request, *args, **kwargs)

    return _free_request


def _w_schedule(orig):
    def schedule(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        eng = _engine_of(self) if _H is not None else None
        if eng is not None:
            try:
                on_schedule(self, out)
            except Exception as e:
                _fail("Scheduler.schedule", e)
            if eng.to_abort:
                # Outside the capture's try: an abort that fails must not
                # leave the request running over foreign KV silently.
                _abort_guarded(self, eng)
        return out

    return schedule


def _w_update(orig):
    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        eng = _engine_of(self) if _H is not None else None
        if eng is not None:
            try:
                on_update(self, scheduler_output, model_runner_output)
            except Exception as e:
                _fail("Scheduler.update_from_output", e)
            if eng.to_abort:
                # The guard stopped a request after schedule (its LMCache
                # load ran in the worker's start_load_kv): finished before
                # update_from_output, which then drops its output.
                _abort_guarded(self, eng)
        out = orig(self, scheduler_output, model_runner_output, *args, **kwargs)
        eng = _engine_of(self) if _H is not None else None
        if eng is not None and eng.error_outputs:
            _emit_errors(eng, out)
        return out

    return update_from_output


_STM = "vllm.v1.core.single_type_kv_cache_manager"
_TIER = "vllm.v1.kv_offload.tiering.manager"
_KVC = "vllm.distributed.kv_transfer.kv_connector.v1."
# (module, class, attribute, wrapper factory)
_PATCHES = [
    ("vllm.v1.core.sched.scheduler", "Scheduler", "__init__", _w_sched_init),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "add_request", _w_add_request),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", _w_schedule),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", _w_update),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "_free_request", _w_free_request),
    ("vllm.v1.core.block_pool", "BlockPool", "get_new_blocks", _w_get_new_blocks),
    ("vllm.v1.core.block_pool", "BlockPool", "_maybe_evict_cached_block", _w_evict),
    ("vllm.v1.core.block_pool", "BlockPool", "free_blocks", _w_free_blocks),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "free", _w_kvm_free),
    (_STM, "SingleTypeKVCacheManager", "add_local_computed_blocks", _w_add_local),
    # Copy-on-write of a partial prefix hit's tail block: which request and
    # group each copy is for (the copy itself is recorded at schedule).
    (_STM, "SingleTypeKVCacheManager", "_apply_cow", _w_apply_cow),
    (_STM, "SingleTypeKVCacheManager", "take_pending_cow_copies", _w_take_cow),
    # The offload tiering layer: tier jobs and their completions.
    (_TIER, "TieringOffloadingManager", "_register_job", _w_tier_register),
    (_TIER, "TieringOffloadingManager", "_complete_promotion",
     lambda o: _w_tier_done(o, "_complete_promotion", 0)),
    (_TIER, "TieringOffloadingManager", "_update_backpressure",
     lambda o: _w_tier_done(o, "_update_backpressure", 1)),
    # LMCache: loads the scheduler side accepted (copies when lmcache's
    # engine runs here, else holes), and lmcache's own engine: its loads
    # (retrieve, the chunks it loads), stores (the copy out of vLLM's slots,
    # the put under keys) and its memory objects going back to the allocator.
    (_KVC + "lmcache_connector", "LMCacheConnectorV1", "update_state_after_alloc", _w_lmcache_alloc),
    ("lmcache.v1.cache_engine", "LMCacheEngine", "retrieve", _w_lmc_retrieve),
    ("lmcache.v1.cache_engine", "LMCacheEngine", "_process_tokens_internal", _w_lmc_process),
    ("lmcache.v1.gpu_connector.gpu_connectors", "VLLMPagedMemGPUConnectorV2", "batched_from_gpu",
     _w_lmc_from_gpu),
    ("lmcache.v1.storage_backend.storage_manager", "StorageManager", "batched_put", _w_lmc_put),
    ("lmcache.v1.memory_management", "TensorMemoryObj", "ref_count_down",
     lambda o: _w_lmc_drop(o, "ref_count_down")),
    ("lmcache.v1.memory_management", "TensorMemoryObj", "unpin", lambda o: _w_lmc_drop(o, "unpin")),
    (_KVC + "lmcache_mp_connector", "LMCacheMPConnectorUpstream", "update_state_after_alloc", _w_lmcache_alloc),
    (_KVC + "lmcache_mp_connector", "LMCacheMPConnector", "update_state_after_alloc", _w_lmcache_alloc),
]


def _classes(module, owner):
    """``owner`` and every subclass of it ``module`` defines."""
    return [owner] + [v for v in vars(module).values()
                      if isinstance(v, type) and issubclass(v, owner) and v is not owner]


def _apply(module):
    """Patches the classes ``module`` defines, and any subclass in it that
    overrides a patched method (e.g. a manager's own allocate_new_blocks);
    in the single-type manager module, also notes the request-context
    methods' code objects (_CTX_CODES, for _who)."""
    name = module.__name__
    if name == _STM:
        base = getattr(module, "SingleTypeKVCacheManager", None)
        for t in _classes(module, base) if base is not None else ():
            for m in _CTX_METHODS:
                fn = t.__dict__.get(m)
                if callable(fn) and hasattr(fn, "__code__"):
                    _CTX_CODES.add(fn.__code__)
    for mod, cls, attr, factory in _PATCHES:
        if mod != name:
            continue
        owner = getattr(module, cls, None)
        if owner is None:
            continue
        for t in _classes(module, owner) if mod == _STM else [owner]:
            if (t, attr) in _H.originals:
                continue
            orig = t.__dict__.get(attr)
            if orig is None or isinstance(orig, (classmethod, staticmethod, property)):
                continue
            _H.originals[(t, attr)] = orig
            w = factory(orig)
            w.__wrapped__ = orig
            setattr(t, attr, w)


def _apply_if_installed(module):
    if _H is not None:
        _apply(module)


# Patches vLLM modules as they are imported.
# The modules _apply handles: those patched, and the single-type manager
# module (its request-context methods, _CTX_CODES).
_MODULES = frozenset(m for m, _, _, _ in _PATCHES) | {_STM}

_finder = _c.PostImport(lambda name: _H is not None and name in _MODULES, _apply_if_installed)


def _parse_remote(s):
    """``engine_id=pool[/pool...]`` per producer, comma-separated."""
    out = {}
    for part in (s or "").split(","):
        part = part.strip()
        if not part:
            continue
        eid, _, pools = part.rpartition("=")
        out[eid] = [int(p) for p in pools.split("/")]
    return out


def install(capture=None, pools=None, worker=None, tenant_field=None, role=None,
            remote_pools=None, max_queue=None, pseudonymize=None, cache_pool=None, guard=None,
            guard_unknown=None, tier_pools=None):
    """Enables capture in this process. Arguments default to the environment:

    - ``KVTRAIL_CAPTURE``: sidecar address, ``unix:/path.sock`` or ``tcp:127.0.0.1:PORT``;
    - ``KVTRAIL_POOL``: this engine's pool id (comma-separated, one per KV
      cache group, for groups of another block size than group 0's; groups
      of group 0's block size alias its blocks and share the first id;
      :func:`tag` for several engines in one process);
    - ``KVTRAIL_ROLE``: prefill, decode or mixed (default: from the KV
      connector's ``kv_role``);
    - ``KVTRAIL_REMOTE_POOLS``: ``engine_id=pool[/pool...]`` per producer
      engine (comma-separated): where a consumer's remote loads come from;
    - ``KVTRAIL_WORKER``: a name for the sidecar's logs;
    - ``KVTRAIL_TENANT_FIELD``: the Request attribute (dotted path into
      dicts allowed) naming the customer, default ``cache_salt``;
    - ``KVTRAIL_TENANT_PSEUDONYMIZE=1``: record a blake3 pseudonym instead;
    - ``KVTRAIL_QUEUE``: events buffered before they are dropped as holes;
    - ``KVTRAIL_CACHE_POOL``: the pool (role ``cache``) of this engine's CPU
      offload tier (OffloadingConnector): stores and loads are recorded as
      copies to and from it (OffloadingConnector's CPU tier, or
      SimpleCPUOffloadConnector's CPU or disk blocks);
    - ``KVTRAIL_TIER_POOLS`` (``tier_pools=``): comma-separated, one pool
      (role ``cache``) per secondary tier of the offload tiering layer, in
      ``secondary_tiers`` order: stores to and promotions from each tier are
      copies between it and the cache pool (a tier without a pool: its
      promotions are holes);
    - ``KVTRAIL_GUARD`` (``guard=``): off, alert (default) or abort;
      ``KVTRAIL_GUARD_UNKNOWN`` (``guard_unknown=``): allow (default) or
      abort (docs/guard.md). Without the native module ``kvtrail_guard``
      (which builds each step's events and is the guard) ``install`` raises
      ``ImportError`` whatever the mode.
    """
    global _H, _native
    if _H is not None:
        return _H
    try:
        import kvtrail_guard
    except ImportError as e:
        raise ImportError(
            "kvtrail_vllm: the native module kvtrail_guard cannot be loaded "
            f"({e}): it builds the hook's per-step events (and is the guard); install it "
            "(docs/guard.md, \"Building\")") from e
    why = _c.native_mismatch(kvtrail_guard, _NATIVE_API)
    if why is not None:
        raise ImportError(f"kvtrail_vllm: {why}")
    _native = kvtrail_guard
    g = _guard_mod.Guard(guard, guard_unknown)
    capture = capture or os.environ.get("KVTRAIL_CAPTURE")
    if not capture:
        raise ValueError("no sidecar address: pass capture= or set KVTRAIL_CAPTURE=unix:/path.sock")
    if pools is None:
        pools = [int(p) for p in os.environ.get("KVTRAIL_POOL", "0").split(",") if p.strip()]
    if remote_pools is None:
        remote_pools = _parse_remote(os.environ.get("KVTRAIL_REMOTE_POOLS"))
    _H = _Hook(
        capture,
        list(pools),
        worker or _c.default_worker(),
        tenant_field or os.environ.get("KVTRAIL_TENANT_FIELD", "cache_salt"),
        role or os.environ.get("KVTRAIL_ROLE") or None,
        {str(k): list(v) for k, v in remote_pools.items()},
        int(max_queue or os.environ.get("KVTRAIL_QUEUE", 1 << 18)),
        bool(pseudonymize if pseudonymize is not None else os.environ.get("KVTRAIL_TENANT_PSEUDONYMIZE") == "1"),
        cache_pool if cache_pool is not None else (
            int(os.environ["KVTRAIL_CACHE_POOL"]) if os.environ.get("KVTRAIL_CACHE_POOL") else None),
        g,
    )
    if tier_pools is None:
        tier_pools = [int(p) for p in os.environ.get("KVTRAIL_TIER_POOLS", "").split(",") if p.strip()]
    _H.tier_pools = [int(p) for p in tier_pools]
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    for mod in _MODULES:
        if sys.modules.get(mod) is not None:
            _apply(sys.modules[mod])
    return _H


def tag(scheduler, pools, role=None, cache_pool=None, tier_pools=None):
    """Declares a scheduler's pool (first entry: every group of group 0's
    block size, which alias its blocks; further entries: groups of another
    block size) and role, for processes that run more than one engine.
    Call before its first request."""
    eng = _engine_of(scheduler)
    if eng is None:
        raise ValueError("not a scheduler built after kvtrail_vllm.install()")
    if eng.client is not None:
        raise ValueError("tag() after the engine's first event")
    eng.pools = [int(p) for p in pools]
    if cache_pool is not None:
        eng.cache_pool = int(cache_pool)
    if tier_pools is not None:
        eng.tier_pools = [int(p) for p in tier_pools]
    if role is not None:
        eng.role = role
    return scheduler


def uninstall():
    """Restores vLLM's originals and closes the connections."""
    global _H
    if _H is None:
        return
    h = _H
    for (owner, attr), orig in h.originals.items():
        setattr(owner, attr, orig)
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _H = None
    for cl in h.clients:
        cl.flush()
        cl.close()


def flush(timeout=10.0):
    """Waits until every queued event has been handed to the sidecar."""
    if _H is not None:
        for cl in list(_H.clients):
            cl.flush(timeout)


def guard_stats():
    """The guard's counters: checks and their verdicts (ok, foreign,
    unknown), alerts, aborts, errors, and the native module's own."""
    return _H.guard.stats() if _H is not None else {}


def guard_alerts():
    """The latest guard alerts (bounded), oldest first."""
    return list(_H.guard.alerts) if _H is not None else []


def stats():
    """Counters per connection (sent lines, drops, losses), and the hook's
    own: ``hook_errors`` (a patched entry point whose recording failed; the
    engine went on) and ``pulls_unmapped`` (loads from a producer engine
    not named in KVTRAIL_REMOTE_POOLS, sent as holes), ``offload_key_mismatch``
    (offloaded blocks loaded under another key than they were stored
    under: no share granted), ``offload_unverified`` (offloaded blocks
    loaded that the hook never saw stored, or could not compare: holes),
    ``lmcache_loads`` (LMCache loads the scheduler side accepted),
    ``lmcache_copies`` (LMCache chunk copies recorded: a store's, or a
    load's chunks from the cache pool), ``lmcache_holes`` (LMCache chunks or
    loads recorded as holes: a chunk whose store the hook never saw, a load
    the hook cannot see lmcache perform, a load short of what was
    promised), ``cow_copies``
    (copy-on-write block copies recorded) and ``cow_unverified`` (copies
    whose KV cache group the hook did not see: holes)."""
    if _H is None:
        return {}
    out = {cl.worker: dict(cl.stats) for cl in _H.clients}
    out["hook"] = {"hook_errors": _H.errors, "pulls_unmapped": _H.pulls_unmapped,
                   "offload_key_mismatch": _H.offload_key_mismatch,
                   "offload_unverified": _H.offload_unverified, "lmcache_loads": _H.lmcache_loads,
                   "lmcache_copies": _H.lmcache_copies, "lmcache_holes": _H.lmcache_holes,
                   "cow_copies": _H.cow_copies, "cow_unverified": _H.cow_unverified}
    return out
