"""The SGLang hook's and the guard's cost per decode step, on SGLang
0.5.19's real allocator (TokenToKVPoolAllocator), ReqToTokenPool and Req
objects on CPU, in one run: hook off, hook on with its per-event path
(the native module hidden), hook on with the native decode step
(KVTRAIL_GUARD=off), and hook + guard (alert, native step).

A decode step is what `alloc_for_decode` does for a batch (allocate one
slot a request, write req_to_token at each request's sequence length),
wrapped by the hook's own wrapper for `alloc_for_decode` as installed: the
step time is that call's wall time. Each round admits --batch requests
(their prompt slots allocated and written, and the hook told, as an
extend would), then steps --decode times and frees everything. The table
gives the median decode-step time per configuration over the rounds,
interleaved (off, python, native, guard, off, ...), and the time added
per step against hook off.

Usage (after .ci/setup.d/30-sglang.sh and 34-kvtrail-guard.sh):
  PYTHONPATH=hooks/sglang/src:hooks/client/src:target/kvtrail-guard-native \\
    ~/.cache/kvtrail/venv-sglang-0.5.19/bin/python bench/sglang_decode_step.py \\
    [--batch 256] [--prompt 64] [--decode 32] [--rounds 5] [--kvtrail target/release/kvtrail]

With --kvtrail, a `kvtrail record` sidecar receives the events (the
hook's sender thread shares the interpreter, so its cost is counted);
without, the sidecar address is unreachable and the events are counted as
lost (the engine thread's cost is the same).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from array import array

warnings.filterwarnings("ignore")

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--prompt", type=int, default=64)
ap.add_argument("--decode", type=int, default=32)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--kvtrail", default=None, help="kvtrail binary: run a record sidecar")
args = ap.parse_args()

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

import kvtrail_guard  # noqa: E402
import kvtrail_sglang as kh  # noqa: E402

B, P, D = args.batch, args.prompt, args.decode
CTX = P + D + 1
SIZE = B * CTX + 64
POOL = 0


def factory(attr):
    for mod, cls, a, f in kh._PATCHES:
        if a == attr:
            return f
    raise KeyError(attr)


def decode(batch, token_per_req):
    """What alloc_for_decode does (page size 1): the batch's new slots from
    the allocator, written into req_to_token at each request's length."""
    n = len(batch.reqs)
    out = batch.alloc.alloc(n * token_per_req)
    batch.rtp.write((batch.req_pool_indices, batch.seq_lens), out.to(torch.int32))
    return out


def run_round(mode, sock, rnd):
    """One round: admit, decode D steps, free. Decode-step times (s)."""
    if mode != "off":
        guard = "alert" if mode == "guard" else "off"
        kh.install(capture="unix:" + sock, pools=[POOL], roles={POOL: "mixed"},
                   worker="bench", guard=guard)
        kh._native = None if mode == "python" else kvtrail_guard
    alloc = TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", None, True)
    if mode != "off":
        kh.tag(alloc, POOL)
    rtp = ReqToTokenPool(size=B, max_context_len=CTX, device="cpu", enable_memory_saver=False)
    reqs = []
    for i in range(B):
        ids = array("q", [(rnd * 7919 + i * 131 + k) % 997 + 1 for k in range(P)])
        r = Req(f"r{rnd}-{i}", "", ids, SamplingParams(max_new_tokens=D), vocab_size=1000)
        reqs.append(r)
    rtp.alloc(reqs)
    idx = torch.tensor([getattr(getattr(r, "kv", None), "req_pool_idx", None) for r in reqs],
                       dtype=torch.int64)
    prompt = alloc.alloc(B * P)
    rtp.req_to_token[idx, :P] = prompt.view(B, P).to(torch.int32)
    step = factory("alloc_for_decode")(decode) if mode != "off" else decode
    if mode != "off":
        # The prompt's events, as an extend's would be (not timed).
        batch = kh.tag(types.SimpleNamespace(reqs=reqs, req_to_token_pool=rtp,
                                             token_to_kv_pool_allocator=alloc,
                                             extend_lens=[P] * B), POOL)
        for r in reqs:
            r.prefix_indices = []
        kh.on_alloc_for_extend(batch, None)
    times = []
    for k in range(D):
        seq = torch.full((B,), P + k, dtype=torch.int64)
        batch = types.SimpleNamespace(reqs=reqs, rtp=rtp, alloc=alloc, req_pool_indices=idx,
                                      seq_lens=seq, seq_lens_cpu=seq, req_to_token_pool=rtp,
                                      token_to_kv_pool_allocator=alloc)
        if mode != "off":
            kh.tag(batch, POOL)
        t0 = time.perf_counter()
        step(batch, 1)
        times.append(time.perf_counter() - t0)
    if mode != "off":
        kh.flush()
        stats = {"sent": kh.stats(), "guard": kh.guard_stats(), "hook": kh.counts()}
        kh.uninstall()
    else:
        stats = {}
    return times, stats


def main():
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "kvtrail.sock")
    side = None
    if args.kvtrail:
        dep = {"name": "bench", "engine": "sglang-0.5.19", "context_window": CTX,
               "pools": [{"id": POOL, "name": "p", "role": "mixed", "capacity_tokens": SIZE,
                          "page_size": 1}]}
        dp = os.path.join(d, "deployment.json")
        with open(dp, "w") as f:
            json.dump(dep, f)
        side = subprocess.Popen([args.kvtrail, "record", "--listen", "unix:" + sock,
                                 "--deployment", dp, "--out", os.path.join(d, "trace")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
    modes = ["off", "python", "native", "guard"]
    res = {m: [] for m in modes}
    stats = {}
    run_round("python", sock, -1)  # warm-up (imports, first allocations)
    for rnd in range(args.rounds):
        for m in modes:
            t, s = run_round(m, sock, rnd)
            res[m].append(statistics.median(t))
            stats[m] = s
    if side is not None:
        side.terminate()
        side.wait()
    print(f"SGLang {__import__('sglang').__version__} decode step on CPU, batch {B}, prompt {P}, "
          f"decode {D}, {args.rounds} rounds, sidecar {'yes' if side else 'no (unreachable)'}")
    base = statistics.median(res["off"])
    print(f"{'config':<8} {'decode step us (median)':>24} {'added/step us':>14}")
    for m in modes:
        v = statistics.median(res[m])
        print(f"{m:<8} {v * 1e6:>24.1f} {(v - base) * 1e6:>14.1f}")
    py, nat = statistics.median(res["python"]), statistics.median(res["native"])
    print(f"native step over the per-event path: {(py - base) / max(nat - base, 1e-9):.1f}x less "
          f"added per step")
    for m in modes[1:]:
        sent = {w: st.get("sent_lines") for w, st in stats[m].get("sent", {}).items()}
        print(f"{m}: lines sent in the last round {sent}")
    g = stats.get("guard", {})
    print("guard mode, last round: guard", {k: v for k, v in g.get("guard", {}).items()
                                            if k in ("native_events", "native_errors", "native_holes")},
          "hook errors", g.get("hook", {}).get("hook_errors"),
          "sent", {w: {k: v for k, v in st.items() if k in ("sent_lines", "dropped_queue", "lost_sidecar_down")}
                   for w, st in g.get("sent", {}).items()})


if __name__ == "__main__":
    main()
