"""Drives SGLang 0.5.19's real HiCache on CPU with the kvtrail hook
installed, streaming to a `kvtrail record` sidecar
(tests/it/record_hicache.rs).

    python hicache_driver.py SOCKET MODE

MODE: clean, stale, fault, decode, decode-stale, unified, unified-stale,
decode-unified, decode-unified-stale, storage, uncached, retract,
retract-uncached, retract-cpu, unified-unhooked, linker, linker-stale.

Real (sglang 0.5.19 from the venv, patched by kvtrail_sglang): HiRadixCache
(insert with write-through backup, match_prefix, evict, init_load_back /
load_back, ready_to_load_host_cache, writing_check / loading_check),
HiCacheController (write, load, start_writing, start_loading, evict_device,
the L2TransferEngine), MHATokenToKVPoolHost (alloc, free,
backup_from_device_all_layer, load_to_device_per_layer on the direct io
backend, layer_first layout), TokenToKVPoolAllocator, MHATokenToKVPool,
ReqToTokenPool, Req.

Replaced, and only these (both need CUDA or HIP; SGLang imports the
kernels only there): the kernel boundary `transfer_kv_direct` of
sgl_kernel.kvcacheio, by a CPU copy of the same rows between the same
tensors (`cpu_transfer_kv_direct` below); and the host pool is built
with pin_memory=False (pinning registers the buffer with the CUDA driver).
The extend and release steps are the hook's own wrappers around small
functions doing what SGLang's alloc_for_extend and cache_finished_req do
with the real allocator and tree (as in record_driver.py).

Scenario (page size 1; device pool 16 slots; tenant-a's A and C send the
same 12-token prefix, tenant-b's B another):
  A prefills; its release inserts it into the tree, and write-through
    backs it up to host memory (an offload); its device slots are evicted.
  B prefills into A's former device slots and is backed up too.
  C hits A's prefix on the host: load_back evicts B from the device and
    loads A's host copy into B's former slots (a load back); C extends
    2 tokens and reads the whole prefix.
clean: nothing is wrong; the capture must report nothing (without the
  copies, C's read would look foreign with B as the source).
stale: the host pool is small, and A's host slots are freed while the tree
  keeps A's node naming them (a host slot reused without dropping its key);
  B's backup takes them, so C's load brings back B's KV (and one of A's
  slots nothing reused). The KV C really reads, by its marker in the
  tensors, is printed for the test to compare with scope's sources.
fault: as clean, with the hook's copy encoding made to raise: the engine
  runs to the end, the hook counts the failures and leaves holes.
unified, unified-stale: clean and stale on the tree SGLang 0.5.19 builds by
  default with --enable-hierarchical-cache (registry.create_tree_cache):
  UnifiedRadixCache with a Full component and init_hicache, whose
  controller is a HybridCacheController over a HostPoolGroup (its anchor
  is the MHATokenToKVPoolHost). Real besides the above: the unified tree
  core (insert with write-through backup, match_prefix, evict, load_back
  and build_load_back_spec, init_load_back, loading_check, writing_check)
  and SGLang's release_kv_cache / cache_finished_req. The host pool class
  the assembler builds is the same one, unpinned, and the kernel boundary
  the same CPU copy.
uncached: unified, with the hook given no cache pool (no
  KVTRAIL_CACHE_POOL): the host tier is out of the capture, so the load
  back is a hole in the device pool.
unified-unhooked: unified, with the tree core's build_load_back_spec and
  _split_node left unpatched (as with a tree core the hook does not
  patch, SGLang's Rust one): the load back's expected nodes are unseen,
  so the load is a hole after its copy.
retract, retract-uncached: the unified tree's decode retraction to the
  host pool (the default backend of a PD decode worker with an MHA
  model): A prefills and is retracted, SGLang's retraction_backup copying
  its device KV to host slots; its device slots are freed and B prefills
  into them; A resumes into the same slots (the allocator hands them back)
  and SGLang's retraction_restore copies A's host backup over B's KV; A
  then reads its whole row, as the decode step after a resume does
  (on_prebuilt). The KV A reads is A's own; without the copies recorded
  its read would look foreign with B, an innocent customer, as the
  source. retract-uncached: the same without a cache pool (the restore is
  a hole in the device pool). retract-cpu: the same with the cpu_tensor
  backend (Req.offload_kv_cache / load_kv_cache through SGLang's
  retraction_backup / retraction_restore): the restore is a hole.
decode-unified, decode-unified-stale: decode and decode-stale with the
  decode pool's tree the unified one, released by SGLang's own
  release_kv_cache.
storage: the unified tree with L3 storage, SGLang's `file` backend
  (HiCacheFile) in a temporary folder: A is backed up to host and to
  storage (the backup thread), then evicted from device and host; B runs;
  C misses on device and host, SGLang prefetches A's pages from storage
  into host slots (prefetch_from_storage, the prefetch and IO threads,
  check_prefetch_progress, _handle_prefetch_result grafting them into the
  tree), and loads them back. Real besides the above: the storage threads,
  HiCacheFile, the page hashes (SGLang's C++ hash extension, built by
  torch's JIT loader with ninja). The single rank's parallel values (tp,
  pp, attention ranks 0 of 1) are set through SGLang's own
  get_parallel().override, as a server's initialized groups would give.
linker, linker-stale: the unified tree with SGLang's direct L3 path (no
  host tier): UnifiedRadixCache.init_cache_linker with an external store,
  driven by SGLang's real UnifiedCacheLinkerWrapper (match's lookup and
  hit marker, load_back's slot allocation, tree insert and queued load,
  write-through offload_nodes, check_hicache_events' completion steps).
  Replaced: the store backend only. SGLang's one backend for it,
  MooncakeDirectLinker, reads and writes GPU buffers through Mooncake's
  RDMA transfer engine, which does not run here; `MemLinker` below
  implements SGLang's UnifiedCacheLinker interface over a dict of page
  copies keyed by SGLang's own page hashes (the hash extension is built
  as in `storage`). A (tenant-a) prefills, is offloaded to the store and
  evicted from device; B (tenant-b) runs in A's former slots and is
  evicted too; C (tenant-a) misses on device, hits A's pages in the store
  and load_back brings them into slots B's KV had occupied. C's read is
  A's KV (clean) or, with linker-stale (A's keys planted to hold B's
  pages), B's. The store is out of the capture's sight either way: the
  load is a hole, C is possible, never confirmed, never clean.
Prints one JSON line of facts.
"""

import json
import os
import sys
import types
from array import array

import torch
import torch.distributed as dist

import kvtrail_sglang as kh

SOCK, MODE = sys.argv[1], sys.argv[2]
DECODE = MODE.startswith("decode")
STORAGE = MODE == "storage"
RETRACT = MODE.startswith("retract")
LINKER = MODE.startswith("linker")
UNCACHED = MODE.endswith("uncached")
UNIFIED = "unified" in MODE or STORAGE or UNCACHED or RETRACT or LINKER
STALE = MODE.endswith("stale")
DEV = 16
PREFILL = 32
MARK = {"A": 1.0, "B": 2.0, "C": 3.0}


def cpu_transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """What sgl_kernel.kvcacheio.transfer_kv_direct does, on CPU: copy rows
    src_indices of each source tensor into rows dst_indices of its target."""
    for s, d in zip(src_layers, dst_layers):
        d[dst_indices.to(torch.int64)] = s[src_indices.to(torch.int64)]


def _extend(batch):
    """alloc_for_extend for one request: the prefix hit's slots, then new
    slots for the rest, the req_to_token row, and the forward's KV (the
    request's marker) in the new slots."""
    req = batch.reqs[0]
    rtp, alloc, kv = batch.req_to_token_pool, batch.token_to_kv_pool_allocator, batch.kv
    rtp.alloc([req])
    pre = len(req.prefix_indices)
    n = len(req.origin_input_ids) - pre
    out = alloc.alloc(n)
    assert out is not None, "device pool full"
    row = torch.cat([req.prefix_indices.to(torch.int64), out.to(torch.int64)])
    rtp.write((req.kv.req_pool_idx, slice(0, pre + n)), row.to(torch.int32))
    for layer in range(kv.layer_num):
        kv.k_buffer[layer][out] = MARK[req.rid]
        kv.v_buffer[layer][out] = MARK[req.rid]
    batch.extend_lens = [n]
    # What SGLang's release_kv_cache reads (the unified tree's path).
    req.kv.kv_committed_len = req.kv.kv_allocated_len = pre + n
    req.kv.cache_protected_len = pre
    return out, None, None


def _release(req, tree_cache, is_insert=True):
    """cache_finished_req: the request's KV goes into the tree (write-
    through backs a new node up to host memory at once), its lock on the
    matched node is dropped. A pool without a tree (prefill) frees it."""
    rtp, alloc = tree_cache.req_to_token_pool, tree_cache.token_to_kv_pool_allocator
    n = len(req.origin_input_ids)
    row = rtp.req_to_token[req.kv.req_pool_idx][:n].to(torch.int64)
    if not hasattr(tree_cache, "cache_controller"):
        alloc.free(row)
        return
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    r = tree_cache.insert(InsertParams(key=RadixKey(array("q", req.origin_input_ids)), value=row))
    pre = len(req.prefix_indices)
    if r.prefix_len > pre:
        alloc.free(row[pre:r.prefix_len])  # duplicates of the tree's slots
    if getattr(req, "last_node", None) is not None:
        tree_cache.dec_lock_ref(req.last_node)
    tree_cache.writing_check()


_WRAP = {a: f for _, _, a, f in kh._PATCHES}
alloc_for_extend = _WRAP["alloc_for_extend"](_extend)
release_kv_cache = _WRAP["release_kv_cache"](_release)


def device_batch(tree, kv, req):
    """A one-request batch on the pool of `tree`'s allocator."""
    alloc = tree.token_to_kv_pool_allocator
    b = types.SimpleNamespace(reqs=[req], req_to_token_pool=tree.req_to_token_pool,
                              token_to_kv_pool_allocator=alloc, kv=kv)
    return kh.tag(b, alloc._kvtrail_pool)


def prefill(cache, kv, name, ids, tenant, prefix=None, last_node=None):
    """Request `name` of `tenant` prefilled on `cache`'s pool: `prefix` the
    slots of its prefix hit; on the unified tree it holds the lock on its
    matched node (`last_node`, else the root), as the scheduler takes it."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(name, "", array("q", ids), SamplingParams(max_new_tokens=1), vocab_size=1000)
    req.routing_key = tenant
    req.prefix_indices = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
    req.output_ids.append(7)
    if UNIFIED:
        req.last_node = cache.tree_core.root_node.id if last_node is None else last_node
        cache.inc_lock_ref(req.last_node)
    alloc_for_extend(device_batch(cache, kv, req))
    return req


def main():
    if DECODE:
        # PD: prefill pool 0; decode pool 1, its HiCache host pool 2.
        kh.install(capture=f"unix:{SOCK}", pools=[0, 1], roles={0: "prefill", 1: "decode"},
                   worker="hicache-decode-cpu", cache_pools={1: 2}, tenant_field="routing_key",
                   per_pool_connections=True)
    else:
        kh.install(capture=f"unix:{SOCK}", pools=[0], worker="hicache-cpu",
                   cache_pools={} if UNCACHED else {0: 1}, tenant_field="routing_key")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)

    import sglang.srt.mem_cache.hiradix_cache as hrc
    import sglang.srt.mem_cache.pool_host.mha as mha
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InitLoadBackParams,
                                                        InsertParams, MatchPrefixParams)
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_params import SamplingParams

    if MODE == "fault":
        def broken(*a):
            raise RuntimeError("planted hook failure")
        kh._c.copy_runs = broken
    # The kernel boundary (CUDA/HIP only), and pinning (the CUDA driver).
    mha.transfer_kv_direct = cpu_transfer_kv_direct
    import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as hpa
    host_cls = hrc.get_mha_host_pool_cls
    unpinned = lambda dev: (lambda *a, **k: host_cls(dev)(*a, pin_memory=False, **k))  # noqa: E731
    hrc.get_mha_host_pool_cls = hpa.get_mha_host_pool_cls = unpinned

    ratio = 0.75 if STALE else 2.0  # host slots: 13 / 33
    storage = {}
    if LINKER:
        # SGLang's page hash extension is built by torch's JIT loader with
        # ninja, found on PATH as in an activated venv.
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    if STORAGE:
        import tempfile

        from sglang.srt.runtime_context import _PARALLEL_FIELDS, get_parallel

        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = tempfile.mkdtemp(prefix="kvtrail-l3-")
        # The hash extension's JIT build finds ninja on PATH, as in an
        # activated venv.
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
        storage = dict(hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                       hicache_storage_backend_extra_config='{"prefetch_threshold": 1}')
        single = ("tp", "pp", "attn_tp", "attn_cp", "attn_dcp", "attn_dp", "world")
        ranks = {f"{p}_{k}": (0 if k == "rank" else 1) for p in single for k in ("rank", "size")}
        global _PARALLEL
        _PARALLEL = get_parallel().override(**{k: v for k, v in ranks.items() if k in _PARALLEL_FIELDS})
        _PARALLEL.__enter__()  # held for the process: no scheduler builds the groups here
    sa = get_context().override_server_args(
        enable_hierarchical_cache=True, hicache_ratio=ratio, hicache_io_backend="direct",
        hicache_mem_layout="layer_first", hicache_write_policy="write_through", page_size=1,
        **storage).install()
    kv = MHATokenToKVPool(size=DEV, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
                          layer_num=2, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    alloc = kh.tag(TokenToKVPoolAllocator(DEV, torch.float32, device="cpu", kvcache=kv,
                                          need_sort=False), 1 if DECODE else 0)
    rtp = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    g = dist.new_group([0], backend="gloo")
    params = CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                             page_size=1, tp_cache_group=g, attn_cp_cache_group=g,
                             attn_tp_cache_group=g, pp_cache_group=g)
    if UNIFIED:
        # What registry.create_tree_cache builds by default.
        from sglang.srt.mem_cache.common import release_kv_cache as sglang_release
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        if MODE == "unified-unhooked":
            from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

            for name in ("build_load_back_spec", "_split_node"):
                setattr(UnifiedTreeCore, name, getattr(UnifiedTreeCore, name).__wrapped__)
        params.tree_components = (ComponentType.FULL,)
        cache = UnifiedRadixCache(params)
        if LINKER:
            cache.init_cache_linker(MemLinker(kv))
            linker_scenario(cache, kv)
            return
        cache.init_hicache(sa, params)
        full = ComponentType.FULL

        def host_value(node):
            v = cache.tree_core.node_by_id(node).component_data[full].host_value
            return None if v is None else v.tolist()

        def evicted_on_host(node):
            cd = cache.tree_core.node_by_id(node).component_data[full]
            return cd.value is None and cd.host_value is not None

        release = sglang_release
    else:
        cache = hrc.HiRadixCache(params, sa)

        def host_value(node):
            return None if node.host_value is None else node.host_value.tolist()

        def evicted_on_host(node):
            return node.evicted and node.backuped

        release = release_kv_cache
    ctrl = cache.cache_controller
    want = (1, 2) if DECODE else (0, None) if UNCACHED else (0, 1)
    assert getattr(ctrl, "_kvtrail_pools", None) == want, "controller not tagged"
    if DECODE:
        decode_scenario(cache, kv, host_value, evicted_on_host, release)
        return
    if STORAGE:
        storage_scenario(cache, kv, release, host_value)
        return
    if RETRACT:
        retract_scenario(cache, kv)
        return

    def run(name, ids, tenant, prefix=None, last_node=None):
        return prefill(cache, kv, name, ids, tenant, prefix, last_node)

    def node_of(ids):
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
        return m

    a_ids = list(range(1, 13))
    b_ids = list(range(101, 113))
    facts = {"mode": MODE}

    a = run("A", a_ids, "tenant-a")
    release(a, cache)
    cache.writing_check()
    a_node = node_of(a_ids).last_device_node
    facts["A_host"] = host_value(a_node)
    cache.evict(EvictParams(num_tokens=12))
    assert evicted_on_host(a_node), "A is not only on the host"
    if STALE:
        # The planted defect: A's host slots go back to the host pool while
        # the tree keeps A's node naming them.
        ctrl.mem_pool_host.free(torch.tensor(facts["A_host"], dtype=torch.int64))
    b = run("B", b_ids, "tenant-b")
    facts["B_device"] = rtp.req_to_token[b.kv.req_pool_idx][:12].tolist()
    release(b, cache)
    cache.writing_check()
    facts["B_host"] = host_value(node_of(b_ids).last_device_node)

    m = node_of(a_ids + [13, 14])
    assert m.host_hit_length == 12, m
    c_ids = a_ids + [13, 14]
    creq = Req("C", "", array("q", c_ids), SamplingParams(max_new_tokens=1), vocab_size=1000)
    creq.last_node = m.last_device_node
    loaded, c_node = cache.init_load_back(InitLoadBackParams(
        best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=creq))
    assert len(loaded) == 12, "no load back"
    cache.ready_to_load_host_cache()
    cache.loading_check()
    facts["C_loaded_into"] = loaded.tolist()
    facts["C_loaded_into_B_slots"] = len(set(loaded.tolist()) & set(facts["B_device"]))
    c = run("C", c_ids, "tenant-a", prefix=loaded, last_node=c_node)
    # What C really reads in its prefix: the marker each slot holds.
    owner = {v: k for k, v in MARK.items()}
    truth = {}
    for s in loaded.tolist():
        who = owner[float(kv.k_buffer[0][s, 0, 0])]
        truth[who] = truth.get(who, 0) + 1
    facts["C_prefix_true_owner"] = truth
    release(c, cache)
    kh.flush()
    facts["counts"] = kh.counts()
    facts["hook_stats"] = kh.stats()
    kh.uninstall()
    print(json.dumps(facts))


class MemLinker:
    """SGLang's UnifiedCacheLinker interface over an in-memory store: page
    hash -> that page's K and V rows of every layer. Loads run at
    start_layer_wise_loading, offloads at once; both complete in order."""

    def __init__(self, kv):
        self.kv = kv
        self.store = {}
        self.layer_done_counter = None
        self.pending = {}
        self.loads_done = []
        self.offloads_done = []

    def _pages(self, t):
        return t.device_indices.to(torch.int64).reshape(len(t.keys), -1)

    def lookup(self, rid, transfers):
        out = []
        for i, k in enumerate(transfers[0].keys):
            if k not in self.store:
                break
            out.append(i + 1)
        return out

    def load(self, rid, transfers):
        self.pending[rid] = transfers
        return True

    def start_layer_wise_loading(self):
        if not self.pending:
            return -1
        for transfers in self.pending.values():
            for t in transfers:
                for k, rows in zip(t.keys, self._pages(t)):
                    ks, vs = self.store[k]
                    for layer in range(self.kv.layer_num):
                        self.kv.k_buffer[layer][rows] = ks[layer]
                        self.kv.v_buffer[layer][rows] = vs[layer]
        self.loads_done.append(list(self.pending))
        self.pending = {}
        return 0

    def cancel_queued_load(self, rid):
        return self.pending.pop(rid, None) is not None

    def num_completed_loads(self):
        return len(self.loads_done)

    def pop_completed_load(self):
        return self.loads_done.pop(0)

    def offload(self, transfers):
        for t in transfers:
            for k, rows in zip(t.keys, self._pages(t)):
                self.store[k] = ([self.kv.k_buffer[i][rows].clone() for i in range(self.kv.layer_num)],
                                 [self.kv.v_buffer[i][rows].clone() for i in range(self.kv.layer_num)])
        self.offloads_done.append(True)
        return True

    def num_completed_offloads(self):
        return len(self.offloads_done)

    def pop_completed_offload(self):
        return self.offloads_done.pop(0)

    def reset(self):
        self.pending.clear()

    def close(self):
        self.reset()


def linker_scenario(cache, kv):
    """The `linker` modes (see the module docstring)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    rtp = cache.req_to_token_pool
    store = cache.linker.cache_linker.store

    def run(name, ids, tenant, prefix=None, last_node=None):
        return prefill(cache, kv, name, ids, tenant, prefix, last_node)

    def offloaded(req, ids):
        """Release into the tree (write-through offloads to the store), the
        scheduler's completion step, then eviction from the device."""
        before = set(store)
        release_kv_cache(req, cache)
        cache.check_hicache_events()
        cache.evict(EvictParams(num_tokens=len(ids)))
        return [k for k in store if k not in before]

    a_ids, b_ids = list(range(1, 13)), list(range(101, 113))
    c_ids = a_ids + [13, 14]
    facts = {"mode": MODE}
    a = run("A", a_ids, "tenant-a")
    facts["A_device"] = rtp.req_to_token[a.kv.req_pool_idx][:12].tolist()
    a_keys = offloaded(a, a_ids)
    b = run("B", b_ids, "tenant-b")
    facts["B_device"] = rtp.req_to_token[b.kv.req_pool_idx][:12].tolist()
    b_keys = offloaded(b, b_ids)
    facts["store_pages"] = {"A": len(a_keys), "B": len(b_keys)}
    if MODE == "linker-stale":
        # The planted defect: A's keys name B's pages in the store.
        for ka, kb in zip(a_keys, b_keys):
            store[ka] = store[kb]
    creq = Req("C", "", array("q", c_ids), SamplingParams(max_new_tokens=1), vocab_size=1000)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", c_ids)), req=creq))
    assert len(m.device_indices) == 0 and m.host_hit_length == 12, m
    creq.last_node = m.last_device_node
    loaded, c_node = cache.init_load_back(InitLoadBackParams(
        best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=creq))
    assert len(loaded) == 12, "no load back"
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    facts["C_loaded_into"] = loaded.tolist()
    facts["C_loaded_into_B_slots"] = len(set(loaded.tolist()) & set(facts["B_device"]))
    c = run("C", c_ids, "tenant-a", prefix=loaded, last_node=c_node)
    owner = {v: k for k, v in MARK.items()}
    truth = {}
    for slot in loaded.tolist():
        who = owner[float(kv.k_buffer[0][slot, 0, 0])]
        truth[who] = truth.get(who, 0) + 1
    facts["C_prefix_true_owner"] = truth
    release_kv_cache(c, cache)
    kh.flush()
    facts["counts"] = kh.counts()
    facts["hook_stats"] = kh.stats()
    kh.uninstall()
    print(json.dumps(facts))


def retract_scenario(cache, kv):
    """The `retract` modes (see the module docstring)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    rtp, alloc = cache.req_to_token_pool, cache.token_to_kv_pool_allocator
    facts = {"mode": MODE}

    def run(name, ids, tenant):
        req = Req(name, "", array("q", ids), SamplingParams(max_new_tokens=4), vocab_size=1000)
        req.routing_key = tenant
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.output_ids.append(7)
        alloc_for_extend(device_batch(cache, kv, req))
        return req

    def drop(req):
        row = rtp.req_to_token[req.kv.req_pool_idx][:12].to(torch.int64)
        alloc.free(row)
        rtp.free(req)
        return row.tolist()

    a = run("A", list(range(1, 13)), "tenant-a")
    assert a.seqlen - 1 == 12
    if MODE == "retract-cpu":
        from sglang.srt.mem_cache import common

        assert common.retraction_backup(a, cache, rtp, alloc, "cpu_tensor")
        restore = lambda: common.retraction_restore(a, cache, rtp, alloc, "cpu_tensor")  # noqa: E731
    else:
        backup = cache.retraction_backup(a)
        assert backup is not None, "no host room for the backup"
        restore = lambda: cache.retraction_restore(a, backup)  # noqa: E731
    facts["A_device"] = drop(a)
    b = run("B", list(range(101, 113)), "tenant-b")
    facts["B_device"] = drop(b)
    # A resumes: its row is preallocated (as _pre_alloc does, in A's name),
    # and its KV restored from the host backup.
    rtp.alloc([a])
    with kh.request_context(a):
        new = alloc.alloc(12)
    rtp.write((a.kv.req_pool_idx, slice(0, 12)), new.to(torch.int32))
    facts["A_resumed_into_B_slots"] = len(set(new.tolist()) & set(facts["B_device"]))
    restore()
    batch = device_batch(cache, kv, a)
    kh.on_prebuilt(batch)
    owner = {v: k for k, v in MARK.items()}
    truth = {}
    for s in new.tolist():
        who = owner[float(kv.k_buffer[0][s, 0, 0])]
        truth[who] = truth.get(who, 0) + 1
    facts["A_reads_true_owner"] = truth
    drop(a)
    kh.flush()
    facts["counts"] = kh.counts()
    kh.uninstall()
    print(json.dumps(facts))


def storage_scenario(cache, kv, release, host_value):
    """The `storage` mode (see the module docstring)."""
    import time

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    rtp = cache.req_to_token_pool

    def pump(done, what):
        """Scheduler steps (SGLang's per-step HiCache polling) until done."""
        t = time.monotonic()
        while not done():
            cache.check_hicache_events()
            cache.writing_check()
            assert time.monotonic() - t < 120, f"{what}: not done in 120 s"
            time.sleep(0.005)

    def run(name, ids, tenant, prefix=None, last_node=None):
        return prefill(cache, kv, name, ids, tenant, prefix, last_node)

    def node_of(ids):
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))

    a_ids, b_ids = list(range(1, 13)), list(range(101, 113))
    c_ids = a_ids + [13, 14]
    facts = {"mode": MODE}
    release(run("A", a_ids, "tenant-a"), cache)
    pump(lambda: not cache.ongoing_write_through and not cache.ongoing_backup, "A's backups")
    facts["storage_files"] = len(os.listdir(os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"]))
    a_node = node_of(a_ids).last_device_node
    facts["A_host"] = host_value(a_node)
    cache.evict(EvictParams(num_tokens=12))
    facts["A_evicted_from_host"] = cache.evict_host(12)
    b = run("B", b_ids, "tenant-b")
    facts["B_device"] = rtp.req_to_token[b.kv.req_pool_idx][:12].tolist()
    release(b, cache)
    pump(lambda: not cache.ongoing_write_through and not cache.ongoing_backup, "B's backups")
    m = node_of(c_ids)
    assert len(m.device_indices) == 0 and m.host_hit_length == 0, m
    # The scheduler's L3 step for a request that misses on device and host.
    cache.prefetch_from_storage("C", m.last_host_node, array("q", c_ids))
    pump(lambda: cache.check_prefetch_progress("C"), "C's prefetch")
    facts["C_from_storage"] = cache.pop_prefetch_loaded_tokens("C")
    m = node_of(c_ids)
    assert m.host_hit_length == 12, m
    creq = Req("C", "", array("q", c_ids), SamplingParams(max_new_tokens=1), vocab_size=1000)
    creq.last_node = m.last_device_node
    loaded, c_node = cache.init_load_back(InitLoadBackParams(
        best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=creq))
    assert len(loaded) == 12, "no load back"
    cache.ready_to_load_host_cache()
    cache.loading_check()
    facts["C_loaded_into"] = loaded.tolist()
    facts["C_loaded_into_B_slots"] = len(set(loaded.tolist()) & set(facts["B_device"]))
    c = run("C", c_ids, "tenant-a", prefix=loaded, last_node=c_node)
    owner = {v: k for k, v in MARK.items()}
    truth = {}
    for s in loaded.tolist():
        who = owner[float(kv.k_buffer[0][s, 0, 0])]
        truth[who] = truth.get(who, 0) + 1
    facts["C_prefix_true_owner"] = truth
    release(c, cache)
    kh.flush()
    facts["counts"] = kh.counts()
    facts["hook_stats"] = kh.stats()
    kh.uninstall()
    cache.shutdown()
    print(json.dumps(facts))


def decode_scenario(cache, kv, host_value, evicted_on_host, release):
    """The decode modes: `cache` is the decode pool's HiRadixCache or
    unified tree; its KV arrives by transfer from a prefill pool (see the
    module docstring). `release` frees a decode request into the tree."""
    from record_driver import Sender, receiver

    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
    from sglang.srt.disaggregation.decode_hicache_mixin import (DecodeHiCachePreallocMixin,
                                                                DecodeHiCacheTransferMixin,
                                                                HiCacheRestoreResult)
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.common import kv_to_page_indices, kv_to_page_num
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    rtp, alloc, ctrl = cache.req_to_token_pool, cache.token_to_kv_pool_allocator, cache.cache_controller
    pkv = MHATokenToKVPool(size=PREFILL, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
                           layer_num=2, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    # The prefill pool: no tree; a finished request's KV is freed.
    prefill = types.SimpleNamespace(
        req_to_token_pool=ReqToTokenPool(size=4, max_context_len=64, device="cpu",
                                         enable_memory_saver=False),
        token_to_kv_pool_allocator=kh.tag(TokenToKVPoolAllocator(
            PREFILL, torch.float32, device="cpu", kvcache=pkv, need_sort=False), 0))

    class Queue(DecodeHiCachePreallocMixin, DecodeHiCacheTransferMixin):
        """The decode queues' HiCache steps, SGLang's own: the prefix match
        and lock (DecodePreallocQueue._match_prefix_and_lock), the L1/L2
        split, the load back and its commit into the request. The queues'
        __init__ needs a Scheduler and a transfer backend."""

        _match_prefix_and_lock = DecodePreallocQueue._match_prefix_and_lock

        def __init__(self):
            self.tree_cache = cache
            self.scheduler = types.SimpleNamespace(enable_decode_hicache=True)
            self.transfer_queue = types.SimpleNamespace(queue=[])

    queue = kh.tag(Queue(), 1)

    def _pre_alloc(queue, req, prefix_indices=None, prefix_len=None, total_prefix_len=None):
        """DecodePreallocQueue._pre_alloc: the device prefix (L1) into
        req_to_token, new slots for the tokens past the whole prefix (L1 +
        host); the host part's slots come from the load back."""
        pre, total = int(prefix_len or 0), int(total_prefix_len or prefix_len or 0)
        rtp.alloc([req])
        fill = len(req.origin_input_ids)
        if pre:
            rtp.write((req.kv.req_pool_idx, slice(0, pre)), prefix_indices.to(torch.int32))
        out = alloc.alloc(fill - total)
        assert out is not None, "decode pool full"
        rtp.write((req.kv.req_pool_idx, slice(total, fill)), out.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = fill
        req.kv.cache_protected_len = pre
        req.prefix_indices = prefix_indices if pre else torch.empty((0,), dtype=torch.int64)
        return out

    def _commit(queue, decode_req):
        """_commit_transfer_to_req on success: SGLang's own restore commit
        (the loaded slots into the row, req.prefix_indices), then the
        handoff token (the metadata buffers need RDMA)."""
        queue._commit_hicache_local_restore_to_req(decode_req)
        decode_req.req.output_ids.append(5)

    pre_alloc = _WRAP["_pre_alloc"](_pre_alloc)
    commit = _WRAP["_commit_transfer_to_req"](_commit)
    facts = {"mode": MODE}

    def pd(name, ids, tenant, room):
        """One PD request: decode matches its tree (device and host),
        preallocates and publishes its pages; prefill computes the prompt
        and sends the pages past decode's prefix; decode loads the host
        part back, commits and reads the whole prompt."""
        reqs = []
        for _ in range(2):  # the router sends the request to both roles
            r = Req(name, "", array("q", ids), SamplingParams(max_new_tokens=1), vocab_size=1000,
                    bootstrap_room=room)
            r.routing_key = tenant
            reqs.append(r)
        rp, rd = reqs
        dr = DecodeRequest(req=rd, kv_receiver=None)
        dr.prefix_match = queue._match_prefix_and_lock(rd)
        pm = dr.prefix_match
        total = pm.decode_prefix_len
        kv_loc = pre_alloc(queue, rd, pm.prefix_indices, pm.l1_prefix_len, total)
        dst_pages = kv_to_page_indices(kv_loc, 1)
        kh.on_send_metadata(receiver(room, 1), dst_pages, total)
        # Prefill: the whole prompt (its pool has no tree), then the send.
        rp.prefix_indices = torch.empty(0, dtype=torch.int64)
        alloc_for_extend(device_batch(prefill, pkv, rp))
        prow = prefill.req_to_token_pool.req_to_token[rp.kv.req_pool_idx]
        src_pages = kv_to_page_indices(prow[total:len(ids)], 1)
        sender = Sender(room, 0)
        sender.init(kv_to_page_num(len(ids) - total, 1))
        _, index_slice, is_last, _ = sender._prepare_send_indices(src_pages)
        assert is_last, "the sender's last chunk"
        src = torch.as_tensor(src_pages, dtype=torch.int64)
        dst = torch.as_tensor(dst_pages[index_slice], dtype=torch.int64)
        cpu_transfer_kv_direct(pkv.k_buffer + pkv.v_buffer, kv.k_buffer + kv.v_buffer, src, dst, 1)
        rp.output_ids.append(5)
        rp.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(rp, prefill)
        # Decode: the host part of the prefix loads back (SGLang's restore
        # state machine, two ticks: queue and start the load, then done).
        if pm.needs_local_restore:
            for _ in range(2):
                queue._process_hicache_local_restores([dr])
                cache.loading_check()
            assert dr.hicache_restore_status == HiCacheRestoreResult.READY, dr.hicache_restore_status
            facts[name + "_loaded_into"] = dr.hicache_restored_kv_indices.tolist()
        commit(queue, dr)
        kh.on_prebuilt(device_batch(cache, kv, rd))
        row = rtp.req_to_token[rd.kv.req_pool_idx][:len(ids)].tolist()
        facts[name + "_device"] = row
        # What the request really reads in its decode prefix: the marker
        # each slot holds.
        owner = {v: k for k, v in MARK.items()}
        truth = {}
        for s in row[:total]:
            who = owner[float(kv.k_buffer[0][s, 0, 0])]
            truth[who] = truth.get(who, 0) + 1
        facts[name + "_prefix_true_owner"] = truth
        rd.finished_reason = FINISH_LENGTH(length=1)
        release(rd, cache)
        return rd

    def node_of(ids):
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))

    a_ids = list(range(1, 13))
    b_ids = list(range(101, 113))
    pd("A", a_ids, "tenant-a", 1001)
    cache.writing_check()
    a_node = node_of(a_ids).last_device_node
    facts["A_host"] = host_value(a_node)
    cache.evict(EvictParams(num_tokens=12))
    assert evicted_on_host(a_node), "A is not only on the host"
    if STALE:
        ctrl.mem_pool_host.free(torch.tensor(facts["A_host"], dtype=torch.int64))
    pd("B", b_ids, "tenant-b", 1002)
    cache.writing_check()
    facts["B_host"] = host_value(node_of(b_ids).last_device_node)
    m = node_of(a_ids + [13, 14])
    assert m.host_hit_length == 12, m
    pd("C", a_ids + [13, 14], "tenant-a", 1003)
    facts["C_loaded_into_B_slots"] = len(set(facts["C_loaded_into"]) & set(facts["B_device"]))
    kh.flush()
    facts["counts"] = kh.counts()
    facts["hook_stats"] = kh.stats()
    kh.uninstall()
    print(json.dumps(facts))


main()
