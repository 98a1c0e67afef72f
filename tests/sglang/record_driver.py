"""Drives SGLang's real classes on CPU with the kvtrail hook installed,
streaming to a `kvtrail record` sidecar (tests/it/record_sglang.rs).

    python record_driver.py SOCKET

What is real (sglang 0.5.19 from the venv, patched by kvtrail_sglang):
  - Req construction and Req.set_finish_with_abort (the 1-token placeholder),
    managers.utils.validate_input_length, mem_cache.common.kv_to_page_num /
    kv_to_page_indices;
  - PagedTokenToKVPoolAllocator alloc_extend / alloc_decode / free (need_sort=True,
    PD mode: staged frees, merged and sorted ascending) and ReqToTokenPool,
    MHATokenToKVPool (the KV tensors; freed KV is not zeroed);
  - CommonKVSender.init and CommonKVSender._prepare_send_indices (the
    last-chunk rule), on a sender whose __init__ is bypassed (no network).
What is driven directly, with the arguments SGLang passes there (their
callers need a Scheduler, model runner, Mooncake or ZMQ):
  - the alloc_for_extend / alloc_for_decode / _pre_alloc / release_kv_cache
    wrappers, around small functions that do what SGLang's do with the real
    allocator and ReqToTokenPool (same order: allocate, write req_to_token);
  - on_send_metadata (CommonKVReceiver.send_metadata sends over ZMQ),
    on_commit (DecodeTransferQueue._commit_transfer_to_req needs RDMA'd
    metadata buffers), on_prebuilt (ScheduleBatch.prepare_for_prebuilt);
  - the transfer itself: prefill's pages copied into decode's pages
    dst[index_slice] with torch indexing, as Mooncake's transfer_worker does.

Scenario (PD, page size 4): prefill pool 64 tokens, decode pool 128 tokens,
context window 1024, so prefill's max_req_input_len is 58 and decode's 122.
  A (tenant-a, 40 tokens)  ordinary PD request;
  B (tenant-b, 56 tokens)  ordinary PD request; its decode pages are freed;
  C (tenant-c, 120 tokens) over-long for prefill only: the real
     set_finish_with_abort replaces it by [0]; prefill sends 1 page as the
     last chunk; decode preallocated 30 pages (B's freed pages come first),
     commits and reads all 120 slots: the planted foreign read of B's KV.
     Its release leaves its first two decode pages in the decode radix tree.
  D (tenant-d, 40 tokens, C's prompt) hits those 8 tokens in the decode
     radix tree (_pre_alloc's prefix_indices: a share), so prefill sends
     only the rest. Page 1 holds C's one written token (current: shared);
     page 2 holds A's KV, stale since C preallocated it: the grant covers
     nothing, D's read of it is foreign (revision 2's cache poisoning).
Prints one JSON line of facts for the Rust test to check against the trace.
"""

import json
import sys
import types
from array import array

import torch

import sglang
import sglang.srt.mem_cache.allocator.paged as paged_mod
from sglang.srt.disaggregation.common.conn import CommonKVSender
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.managers.utils import validate_input_length
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.common import kv_to_page_indices, kv_to_page_num
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams

import kvtrail_sglang as kh

PS = 4
CONTEXT = 1024
P_SIZE, D_SIZE = 64, 128


def max_req_input_len(pool_size):
    return min(CONTEXT - 1, pool_size - 1) - 5


class _ExtendKernel:
    """0.5.19's Triton alloc_extend kernel cannot run on CPU ("0 active
    drivers"); sglang's own CPU reference (alloc_extend_naive) replaces it."""

    def __getitem__(self, grid):
        def run(prefix_lens, seq_lens, last_loc, free_pages, out_indices, _pow2, page_size):
            paged_mod.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices,
                                         page_size, "cpu")
        return run


class _DecodeKernel:
    def __getitem__(self, grid):
        def run(seq_lens, last_loc, free_pages, out_indices, _pow2, page_size):
            new = 0
            for i in range(len(seq_lens)):
                if (int(seq_lens[i]) - 1) % page_size == 0:
                    out_indices[i] = free_pages[new] * page_size
                    new += 1
                else:
                    out_indices[i] = last_loc[i] + 1
        return run


def patch_kernels():
    try:
        import triton.runtime.driver as drv

        drv.active.get_current_device()
        return
    except Exception:
        pass
    if hasattr(paged_mod, "alloc_extend_kernel"):
        paged_mod.alloc_extend_kernel = _ExtendKernel()
    if hasattr(paged_mod, "alloc_decode_kernel"):
        paged_mod.alloc_decode_kernel = _DecodeKernel()


def wrapper_for(attr):
    """The hook's own wrapper factory for an SGLang entry point."""
    for mod, cls, a, factory in kh._PATCHES:
        if a == attr:
            return factory
    raise KeyError(attr)


class Side:
    def __init__(self, pool_id, size, name):
        self.pool_id = pool_id
        self.alloc = kh.tag(PagedTokenToKVPoolAllocator(size, PS, torch.float32, "cpu", None, True), pool_id)
        self.rtp = ReqToTokenPool(size=8, max_context_len=300, device="cpu", enable_memory_saver=False)
        self.kv = MHATokenToKVPool(size, PS, torch.float32, 1, 2, 1, "cpu", False, enable_alt_stream=False)
        self.name = name
        self.tree_cache = kh.tag(types.SimpleNamespace(token_to_kv_pool_allocator=self.alloc), pool_id)

    def batch(self, reqs, **kw):
        b = types.SimpleNamespace(reqs=reqs, req_to_token_pool=self.rtp,
                                  token_to_kv_pool_allocator=self.alloc, **kw)
        return kh.tag(b, self.pool_id)


def t(v):
    return torch.tensor([v], dtype=torch.int64)


def row_of(side, req):
    return side.rtp.req_to_token[req.kv.req_pool_idx]


# --- the SGLang steps, each wrapped by the hook's wrapper for that entry point


def _extend(batch):
    """alloc_for_extend for one request without prefix: req slot, KV slots,
    req_to_token row (what mem_cache.allocation.alloc_for_extend does)."""
    side = batch.side
    req = batch.reqs[0]
    side.rtp.alloc([req])
    n = len(req.origin_input_ids)
    out = side.alloc.alloc_extend(t(0), t(0), t(n), t(n), t(-1), n)
    side.rtp.write((req.kv.req_pool_idx, slice(0, n)), out.to(torch.int32))
    req.kv.kv_allocated_len = n
    batch.extend_lens = [n]
    return out, None, None


def _decode(batch, token_per_req):
    side = batch.side
    req = batch.reqs[0]
    seq = int(batch.seq_lens_cpu[0])
    last = int(row_of(side, req)[seq - 1])
    out = side.alloc.alloc_decode(t(seq + 1), t(seq + 1), t(last))
    side.rtp.write((req.kv.req_pool_idx, seq), out.to(torch.int32))
    req.kv.kv_allocated_len = seq + 1
    return out


def _pre_alloc(queue, req, prefix_indices=None, prefix_len=None, total_prefix_len=None):
    """The decode radix-tree prefix (device-resident) goes into req_to_token
    first, then the rest is preallocated (as SGLang's _pre_alloc)."""
    side = queue.side
    side.rtp.alloc([req])
    fill = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
    pre = int(prefix_len or 0)
    if pre:
        side.rtp.write((req.kv.req_pool_idx, slice(0, pre)), prefix_indices.to(torch.int32))
    n = fill - pre
    kv_loc = side.alloc.alloc_extend(t(0), t(0), t(n), t(n), t(-1), n)
    side.rtp.write((req.kv.req_pool_idx, slice(pre, fill)), kv_loc.to(torch.int32))
    req.kv.kv_allocated_len = fill
    return kv_loc


def _release(req, tree_cache, is_insert=True):
    """Frees the request's slots, except its first `tree_cache.keep` ones:
    the pages the decode radix tree holds (cache_finished_req inserted them,
    or they were the request's prefix hit)."""
    side = tree_cache.side
    n = req.kv.kv_allocated_len
    keep = getattr(tree_cache, "keep", 0)
    side.alloc.free(row_of(side, req)[keep:n].to(torch.int64))
    side.rtp.free(req) if hasattr(side.rtp, "free") else None


alloc_for_extend = wrapper_for("alloc_for_extend")(_extend)
alloc_for_decode = wrapper_for("alloc_for_decode")(_decode)
pre_alloc = wrapper_for("_pre_alloc")(_pre_alloc)
release_kv_cache = wrapper_for("release_kv_cache")(_release)


class Sender(CommonKVSender):
    """A CommonKVSender without its network __init__ (recipe: bypassed)."""

    def __init__(self, room, pool):
        self.bootstrap_room = room
        self.curr_idx = 0
        self.kv_mgr = types.SimpleNamespace(enable_all_cp_ranks_for_transfer=False, is_dummy_cp_rank=False)
        kh.tag(self, pool)

    def poll(self):  # abstract in BaseKVSender; the network state machine is not driven
        raise NotImplementedError

    def failure_exception(self):
        raise NotImplementedError


def receiver(room, pool):
    """Stands in for a CommonKVReceiver (abstract; its send_metadata talks ZMQ)."""
    return kh.tag(types.SimpleNamespace(bootstrap_room=room), pool)


def make_req(rid, n, room, tenant, seed):
    ids = array("q", [(seed * 131 + i * 7) % 997 + 1 for i in range(n)])
    return Req(rid, "", ids, SamplingParams(max_new_tokens=3), vocab_size=1000,
               bootstrap_room=room, routing_key=tenant)


def write_kv(side, slots, value):
    """The forward's KV write at out_cache_loc (one layer)."""
    idx = torch.as_tensor(slots, dtype=torch.int64)
    side.kv.k_buffer[0][idx] = value


def run_request(P, D, rid, n, room, tenant, seed, facts, tree_keep=0, decode_prefix=None):
    """One PD request. `tree_keep`: decode slots the radix tree keeps at the
    end (inserted, not freed). `decode_prefix`: decode slots of a radix-tree
    prefix hit (prefix_indices)."""
    parallel = None
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel().override(tp_rank=0)
    except Exception:
        import contextlib

        parallel = contextlib.nullcontext()
    # Router: the same request to both roles.
    rp = make_req(rid, n, room, tenant, seed)
    rd = make_req(rid, n, room, tenant, seed)
    # Prefill admission (real).
    err = validate_input_length(rp, max_req_input_len(P_SIZE), False)
    if err is not None:
        with parallel:
            rp.set_finish_with_abort(err)
    # Decode admission: its own, larger limit.
    assert validate_input_length(rd, max_req_input_len(D_SIZE), False) is None
    # Decode: preallocate the full prompt, publish the page list.
    dq = kh.tag(types.SimpleNamespace(side=D), D.pool_id)
    pre = 0 if decode_prefix is None else len(decode_prefix)
    if pre:
        kv_loc = pre_alloc(dq, rd, decode_prefix, pre, pre)
    else:
        kv_loc = pre_alloc(dq, rd)
    dst_pages = kv_to_page_indices(kv_loc, PS)
    kh.on_send_metadata(receiver(room, D.pool_id), dst_pages, pre)
    # Prefill: extend (1 token for the placeholder), forward writes KV, send.
    pb = P.batch([rp], side=P)
    out, _, _ = alloc_for_extend(pb)
    write_kv(P, out, float(seed))
    sender = Sender(room, P.pool_id)
    # Prefill sends from the decode prefix on (start_send_idx = decode_prefix_len).
    src_pages = kv_to_page_indices(row_of(P, rp)[pre: len(rp.origin_input_ids)], PS)
    sender.init(kv_to_page_num(len(rp.origin_input_ids) - pre, PS))
    _, index_slice, is_last, _ = sender._prepare_send_indices(src_pages)
    # The transfer engine copies page by page into dst[index_slice].
    for s, d in zip(src_pages.tolist(), dst_pages[index_slice].tolist()):
        D.kv.k_buffer[0][d * PS:(d + 1) * PS] = P.kv.k_buffer[0][s * PS:(s + 1) * PS]
    # 0.5.19 prefill finish: FINISH_LENGTH(0) unless finished_reason is an
    # abort (the abort only lives in to_finish): a normal finish.
    rp.output_ids.append(5)
    rp.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(rp, types.SimpleNamespace(side=P, token_to_kv_pool_allocator=P.alloc, _kvtrail_pool=P.pool_id))
    # Decode: commit (Success after the last chunk), prebuilt read, decode.
    assert is_last, "the sender's last chunk"
    kh.on_commit(types.SimpleNamespace(), types.SimpleNamespace(req=rd))
    rd.output_ids.append(5)
    kh.on_prebuilt(D.batch([rd]))
    if rd.to_finish is not None:
        # The guard aborted it (KVTRAIL_GUARD=abort, tests/sglang/guard_driver.py):
        # what process_batch_result_prebuilt does next, before any decode
        # forward: the real update_finish_state, then the release.
        rd.update_finish_state()
        kept = [int(x) for x in row_of(D, rd)[:max(tree_keep, pre)].tolist()]
        release_kv_cache(rd, types.SimpleNamespace(side=D, token_to_kv_pool_allocator=D.alloc,
                                                   _kvtrail_pool=D.pool_id, keep=max(tree_keep, pre)))
        facts[rid] = {
            "request_id": kh.request_id(rd),
            "finished_reason": type(rd.finished_reason).__name__,
            "status_code": int(rd.finished_reason.status_code),
            "err_type": rd.finished_reason.err_type,
            "output_tokens": len(rd.output_ids),
            "decode_prefix_slots": kept,
        }
        return
    read_slots = row_of(D, rd)[:n].to(torch.int64)
    stale = (D.kv.k_buffer[0][read_slots][:, 0, 0] != float(seed)).sum().item()
    for step in range(2):
        seq = n + step
        db = D.batch([rd], side=D, seq_lens_cpu=torch.tensor([seq]), seq_lens=torch.tensor([seq]))
        out = alloc_for_decode(db, 1)
        write_kv(D, out, float(seed))
        rd.output_ids.append(6 + step)
    rd.finished_reason = FINISH_LENGTH(length=len(rd.output_ids))
    tree_slots = [int(x) for x in row_of(D, rd)[:max(tree_keep, pre)].tolist()]
    release_kv_cache(rd, types.SimpleNamespace(side=D, token_to_kv_pool_allocator=D.alloc, _kvtrail_pool=D.pool_id,
                                               keep=max(tree_keep, pre)))
    facts[rid] = {
        "request_id": kh.request_id(rd),
        "prompt_tokens": n,
        "prefill_input_after_admission": len(rp.origin_input_ids),
        "prefill_to_finish": type(rp.to_finish).__name__ if rp.to_finish else None,
        "pages_sent": len(src_pages),
        "pages_preallocated": len(dst_pages),
        "decode_slots_read_not_written_by_it": int(stale),
        "output_tokens": len(rd.output_ids),
        "decode_prefix_slots": tree_slots,
        "finished_reason": type(rd.finished_reason).__name__,
    }


def main():
    sock = sys.argv[1]
    patch_kernels()
    kh.install(capture="unix:" + sock, pools=[0, 1], roles={0: "prefill", 1: "decode"},
               per_pool_connections=True, worker="record-driver")
    P = Side(0, P_SIZE, "prefill")
    D = Side(1, D_SIZE, "decode")
    facts = {"sglang": sglang.__version__}
    run_request(P, D, "A", 40, 1001, "tenant-a", 1, facts)
    run_request(P, D, "B", 56, 1002, "tenant-b", 2, facts)
    run_request(P, D, "C", 120, 1003, "tenant-c", 3, facts, tree_keep=8)
    # D sends C's prompt prefix: the decode radix tree (where C's release
    # inserted C's first two decode pages) hits 8 tokens. Page 1 holds C's
    # one written token; page 2 holds A's KV, stale since C's preallocation.
    c_pages = torch.tensor(facts["C"]["decode_prefix_slots"], dtype=torch.int64)
    run_request(P, D, "D", 40, 1004, "tenant-d", 3, facts, decode_prefix=c_pages)
    kh.flush()
    facts["hook_stats"] = kh.stats()
    kh.uninstall()
    print(json.dumps(facts, sort_keys=True))


if __name__ == "__main__":
    main()
