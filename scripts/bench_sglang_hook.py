"""Hook cost per allocator call: SGLang's real TokenToKVPoolAllocator and
PagedTokenToKVPoolAllocator (CPU), alloc + free in a loop, without the hook
(baseline) and with kvtrail_sglang installed and streaming to a real
`kvtrail record` sidecar, in the same process, alternating 3 rounds and
keeping each side's best.

    VENV/bin/python scripts/bench_sglang_hook.py KVTRAIL_BINARY [PAIRS]

Reports microseconds per hooked call on the engine thread (what the engine
waits for) and per call including the sender thread's work (process CPU time,
which shares the GIL with the engine), plus the sidecar's verdict (events
written, holes).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hooks", "sglang", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "hooks", "client", "src"))

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402

import kvtrail_sglang as kh  # noqa: E402


def loop(alloc, pairs, need):
    """Wall time and this thread's CPU time (robust on a shared machine)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(pairs):
        x = alloc.alloc(need)
        alloc.free(x)
    return time.perf_counter() - t0, time.thread_time() - c0


def main():
    binary = sys.argv[1]
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "s.sock")
    dep = os.path.join(d, "deploy.json")
    with open(dep, "w") as f:
        json.dump({"context_window": 1 << 16, "pools": [
            {"id": 0, "role": "mixed", "capacity_tokens": 4096 + 1, "page_size": 1},
            {"id": 1, "role": "mixed", "capacity_tokens": 4096 + 16, "page_size": 16}]}, f)
    side = subprocess.Popen([binary, "record", "--listen", sock, "--deployment", dep,
                             "--out", os.path.join(d, "trace"), "--health-secs", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while not os.path.exists(sock):
        time.sleep(0.01)
    cases = [
        ("TokenToKVPoolAllocator alloc(8)/free", 0,
         lambda: TokenToKVPoolAllocator(4096, torch.float32, "cpu", None, True), 8),
        ("PagedTokenToKVPoolAllocator(page 16) alloc(32)/free", 1,
         lambda: PagedTokenToKVPoolAllocator(4096, 16, torch.float32, "cpu", None, True), 32),
    ]
    results = []
    for name, pool, make, need in cases:
        inf = float("inf")
        base_w = base_t = base_p = hooked_w = hooked_t = hooked_p = inf
        dropped = 0
        for _ in range(5):
            a = make()
            loop(a, 200, need)
            p0 = time.process_time()
            w, t = loop(a, pairs, need)
            base_w, base_t, base_p = min(base_w, w), min(base_t, t), min(base_p, time.process_time() - p0)
            kh.install(capture="unix:" + sock, pools=[0, 1], roles={}, worker="bench")
            a = kh.tag(make(), pool)
            loop(a, 200, need)
            kh.flush(60)
            p0 = time.process_time()
            w, t = loop(a, pairs, need)
            kh.flush(60)
            p = time.process_time() - p0
            st = kh.stats()
            kh.uninstall()
            dropped += sum(v["dropped_queue"] + v["lost_sidecar_down"] for v in st.values())
            hooked_w, hooked_t, hooked_p = min(hooked_w, w), min(hooked_t, t), min(hooked_p, p)
        calls = 2 * pairs
        us = lambda x: round(x / calls * 1e6, 3)  # noqa: E731
        results.append({
            "case": name,
            "baseline_us_per_call (engine thread CPU)": us(base_t),
            "hooked_us_per_call (engine thread CPU)": us(hooked_t),
            "hook_cost_us_per_call (engine thread CPU)": us(hooked_t - base_t),
            "hook_cost_us_per_call (process CPU incl. sender thread, until drained)": us(hooked_p - base_p),
            "hook_cost_us_per_call (wall, engine thread)": us(hooked_w - base_w),
            "ratio hooked/baseline (engine thread CPU)": round(hooked_t / base_t, 3),
            "dropped": dropped,
        })
    side.send_signal(15)
    out, err = side.communicate(timeout=60)
    print(json.dumps({"pairs": pairs, "results": results, "sidecar": out.decode().strip()}, indent=1))


if __name__ == "__main__":
    main()
