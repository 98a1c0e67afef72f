"""Drives SGLang 0.5.19's real HiCache on CPU with the kvtrail hook
installed, streaming to a `kvtrail record` sidecar
(tests/it/record_hicache.rs).

    python hicache_driver.py SOCKET clean|stale|fault

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
DEV = 16
MARK = {"A": 1.0, "B": 2.0, "C": 3.0}


def cpu_transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """What sgl_kernel.kvcacheio.transfer_kv_direct does, on CPU: copy rows
    src_indices of each source tensor into rows dst_indices of its target."""
    for s, d in zip(src_layers, dst_layers):
        d[dst_indices.to(torch.int64)] = s[src_indices.to(torch.int64)]


def main():
    kh.install(capture=f"unix:{SOCK}", pools=[0], worker="hicache-cpu", cache_pools={0: 1},
               tenant_field="routing_key")
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
    host_cls = hrc.get_mha_host_pool_cls
    hrc.get_mha_host_pool_cls = lambda dev: (lambda *a, **k: host_cls(dev)(*a, pin_memory=False, **k))

    ratio = 0.75 if MODE == "stale" else 2.0  # host slots: 13 / 33
    sa = get_context().override_server_args(
        enable_hierarchical_cache=True, hicache_ratio=ratio, hicache_io_backend="direct",
        hicache_mem_layout="layer_first", hicache_write_policy="write_through", page_size=1).install()
    kv = MHATokenToKVPool(size=DEV, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
                          layer_num=2, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    alloc = kh.tag(TokenToKVPoolAllocator(DEV, torch.float32, device="cpu", kvcache=kv,
                                          need_sort=False), 0)
    rtp = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    g = dist.new_group([0], backend="gloo")
    params = CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
                             page_size=1, tp_cache_group=g, attn_cp_cache_group=g,
                             attn_tp_cache_group=g, pp_cache_group=g)
    cache = hrc.HiRadixCache(params, sa)
    ctrl = cache.cache_controller
    assert getattr(ctrl, "_kvtrail_pools", None) == (0, 1), "controller not tagged"

    wrap = {a: f for _, _, a, f in kh._PATCHES}

    def _extend(batch):
        """alloc_for_extend for one request: the prefix hit's slots, then
        new slots for the rest, the req_to_token row, and the forward's KV
        (the request's marker) in the new slots."""
        req = batch.reqs[0]
        rtp.alloc([req])
        pre = len(req.prefix_indices)
        n = len(req.origin_input_ids) - pre
        out = alloc.alloc(n)
        assert out is not None, "device pool full"
        row = torch.cat([req.prefix_indices.to(torch.int64), out.to(torch.int64)])
        rtp.write((req.kv.req_pool_idx, slice(0, pre + n)), row.to(torch.int32))
        for layer in range(kv.layer_num):
            kv.k_buffer[layer][out] = batch.mark
            kv.v_buffer[layer][out] = batch.mark
        batch.extend_lens = [n]
        return out, None, None

    def _release(req, tree_cache, is_insert=True):
        """cache_finished_req: the request's KV goes into the tree (write-
        through backs a new node up to host memory at once)."""
        n = len(req.origin_input_ids)
        row = rtp.req_to_token[req.kv.req_pool_idx][:n].to(torch.int64)
        r = cache.insert(InsertParams(key=RadixKey(array("q", req.origin_input_ids)), value=row))
        if r.prefix_len:
            alloc.free(row[:r.prefix_len])  # duplicates of the tree's slots
        cache.writing_check()

    alloc_for_extend = wrap["alloc_for_extend"](_extend)
    release_kv_cache = wrap["release_kv_cache"](_release)

    def run(name, ids, tenant, prefix=None):
        req = Req(name, "", array("q", ids), SamplingParams(max_new_tokens=1), vocab_size=1000)
        req.routing_key = tenant
        req.prefix_indices = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
        req.output_ids = [7]
        batch = kh.tag(types.SimpleNamespace(reqs=[req], req_to_token_pool=rtp,
                                             token_to_kv_pool_allocator=alloc, mark=MARK[name]), 0)
        alloc_for_extend(batch)
        return req

    def node_of(ids):
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
        return m

    a_ids = list(range(1, 13))
    b_ids = list(range(101, 113))
    facts = {"mode": MODE}

    a = run("A", a_ids, "tenant-a")
    release_kv_cache(a, cache)
    a_node = node_of(a_ids).last_device_node
    facts["A_host"] = a_node.host_value.tolist()
    cache.evict(EvictParams(num_tokens=12))
    assert a_node.evicted and a_node.backuped, "A is not only on the host"
    if MODE == "stale":
        # The planted defect: A's host slots go back to the host pool while
        # the tree keeps A's node naming them.
        ctrl.mem_pool_host.free(a_node.host_value)
    b = run("B", b_ids, "tenant-b")
    facts["B_device"] = rtp.req_to_token[b.kv.req_pool_idx][:12].tolist()
    release_kv_cache(b, cache)
    b_node = node_of(b_ids).last_device_node
    facts["B_host"] = b_node.host_value.tolist() if b_node.host_value is not None else None

    m = node_of(a_ids + [13, 14])
    assert m.host_hit_length == 12, m
    loaded, _ = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                        host_hit_length=m.host_hit_length))
    assert len(loaded) == 12, "no load back"
    cache.ready_to_load_host_cache()
    cache.loading_check()
    facts["C_loaded_into"] = loaded.tolist()
    facts["C_loaded_into_B_slots"] = len(set(loaded.tolist()) & set(facts["B_device"]))
    c = run("C", a_ids + [13, 14], "tenant-a", prefix=loaded)
    # What C really reads in its prefix: the marker each slot holds.
    owner = {v: k for k, v in MARK.items()}
    truth = {}
    for s in loaded.tolist():
        who = owner[float(kv.k_buffer[0][s, 0, 0])]
        truth[who] = truth.get(who, 0) + 1
    facts["C_prefix_true_owner"] = truth
    release_kv_cache(c, cache)
    kh.flush()
    facts["counts"] = kh.counts()
    facts["hook_stats"] = kh.stats()
    kh.uninstall()
    print(json.dumps(facts))


main()
