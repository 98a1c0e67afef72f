"""Differential-test driver: runs alloc/free sequences through the REAL
sglang allocators (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator) on
CPU and checks the real admission code (validate_input_length,
Req.set_finish_with_abort). Reads one JSON document on stdin, writes one on
stdout. Used by tests/it/sim_sglang_fidelity.rs, which runs kvtrail's
allocator on the same sequences and requires identical slot indices.

Input:
  {"cases": [{"page_size": P, "size": S, "need_sort": B,
              "ops": [{"op": "alloc", "req": k, "n": tokens}
                    | {"op": "extend", "req": k, "to": seq_len}
                    | {"op": "decode", "req": k}
                    | {"op": "free", "req": k}]}],
   "admission": [{"prompt": N, "max_req_input_len": M, "truncate": B}]}
Output:
  {"sglang": version, "cases": [[slots or null per op] + ["available", n]],
   "admission": [{"error": bool, "len_after": n, "first_id": x,
                  "status": code or null, "finished": bool,
                  "finished_after_update": bool}]}

On CPU the Triton kernels of 0.5.19 cannot run ("0 active drivers"): the
kernel objects are replaced by sglang's own CPU reference (alloc_extend_naive,
exported by the same module) and, for decode, by the kernel's two-line rule;
the allocator methods around them (merge triggers, free-list accounting)
are the real ones. From 0.5.22 the allocator picks its CPU fallback itself.
"""

import json
import sys
from array import array

import torch

import sglang
import sglang.srt.mem_cache.allocator.paged as paged_mod
from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)


class _ExtendKernel:
    def __getitem__(self, grid):
        def run(prefix_lens, seq_lens, last_loc, free_pages, out_indices, _pow2, page_size):
            need = int(((seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size).sum())
            if need > len(free_pages):
                # The GPU kernel reads past the list here; alloc_extend then
                # returns None without using the output.
                return
            paged_mod.alloc_extend_naive(
                prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, "cpu"
            )

        return run


class _DecodeKernel:
    def __getitem__(self, grid):
        def run(seq_lens, last_loc, free_pages, out_indices, _pow2, page_size):
            new = 0
            for i in range(len(seq_lens)):
                if (int(seq_lens[i]) - 1) % page_size == 0:
                    if new >= len(free_pages):
                        return  # alloc_decode returns None, output unused
                    out_indices[i] = free_pages[new] * page_size
                    new += 1
                else:
                    out_indices[i] = last_loc[i] + 1

        return run


def _patch_kernels():
    try:
        import triton.runtime.driver as drv

        drv.active.get_current_device()
        return  # a GPU driver exists: leave the real kernels
    except Exception:
        pass
    if hasattr(paged_mod, "alloc_extend_kernel"):
        paged_mod.alloc_extend_kernel = _ExtendKernel()
    if hasattr(paged_mod, "alloc_decode_kernel"):
        paged_mod.alloc_decode_kernel = _DecodeKernel()


def make_allocator(case):
    ps, size, need_sort = case["page_size"], case["size"], case["need_sort"]
    if ps == 1:
        return TokenToKVPoolAllocator(size, torch.float32, "cpu", None, need_sort)
    return PagedTokenToKVPoolAllocator(size, ps, torch.float32, "cpu", None, need_sort)


def run_case(case):
    a = make_allocator(case)
    ps = case["page_size"]
    slots = {}
    out = []
    for op in case["ops"]:
        k = op["req"]
        kind = op["op"]
        if kind in ("decode", "free") and k not in slots or kind == "extend" and k not in slots and op.get("grow"):
            # Our allocator and sglang's already disagreed on this request.
            out.append("diverged")
            continue
        if kind == "alloc":
            r = a.alloc(op["n"])
            res = None if r is None else [int(x) for x in r]
            if res is not None:
                slots[k] = slots.get(k, []) + res
        elif kind == "extend":
            have = slots.get(k, [])
            prefix, seq = len(have), op["to"]
            last = have[-1] if have else -1
            t = lambda v: torch.tensor([v], dtype=torch.int64)
            if ps == 1:
                r = a.alloc(seq - prefix)
            else:
                r = a.alloc_extend(t(prefix), t(prefix), t(seq), t(seq), t(last), seq - prefix)
            res = None if r is None else [int(x) for x in r]
            if res is not None:
                slots[k] = have + res
        elif kind == "decode":
            have = slots[k]
            seq = len(have) + 1
            t = lambda v: torch.tensor([v], dtype=torch.int64)
            if ps == 1:
                r = a.alloc(1)
            else:
                r = a.alloc_decode(t(seq), t(seq), t(have[-1]))
            res = None if r is None else [int(x) for x in r]
            if res is not None:
                slots[k] = have + res
        elif kind == "free":
            a.free(torch.tensor(slots.pop(k, []), dtype=torch.int64))
            res = []
        else:
            raise ValueError(kind)
        out.append(res)
    out.append(["available", int(a.available_size())])
    return out


def run_admission(item):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
    from sglang.srt.managers.utils import validate_input_length
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        from sglang.srt.runtime_context import get_parallel

        ctx = get_parallel().override(tp_rank=0)
    except Exception:  # older layout: no parallel context needed
        import contextlib

        ctx = contextlib.nullcontext()
    req = Req("rid", "", array("q", range(1, item["prompt"] + 1)),
              SamplingParams(max_new_tokens=8), vocab_size=1000)
    err = validate_input_length(req, item["max_req_input_len"], item["truncate"])
    res = {"error": err is not None}
    if err is not None:
        with ctx:
            req.set_finish_with_abort(err)
    tf = req.to_finish
    res["len_after"] = len(req.origin_input_ids)
    res["first_id"] = int(req.origin_input_ids[0])
    res["status"] = int(tf.status_code) if isinstance(tf, FINISH_ABORT) else None
    res["finished"] = bool(req.finished())
    if tf is not None:
        req.update_finish_state() if hasattr(req, "update_finish_state") else None
    res["finished_after_update"] = bool(req.finished())
    return res


def main():
    doc = json.load(sys.stdin)
    _patch_kernels()
    out = {
        "sglang": sglang.__version__,
        "cases": [run_case(c) for c in doc.get("cases", [])],
        "admission": [run_admission(x) for x in doc.get("admission", [])],
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
