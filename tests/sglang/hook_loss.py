"""The hook never stalls the engine and never loses events silently
(tests/it/record_sglang.rs). Real SGLang TokenToKVPoolAllocator on CPU.

    python hook_loss.py SOCKET

1. Sidecar down (a socket path nobody listens on): 2N hooked calls run at
   full speed; every event is counted as lost (stats), none is queued forever.
2. Sender starved (the engine thread holds the GIL for a whole switch
   interval) with a 64-event queue: events are dropped and counted; the
   count reaches the live sidecar as a `lost` line in stream order.
3. An allocator built on tensor-parallel rank 1 is marked not captured.
4. Pool claimed by another live connection: the sidecar refuses the
   hook's hello; the hook sends nothing and counts every event as lost.
Guard decisions that cannot be sent (a full queue, the sidecar down) are
counted apart (`guard_lost`), never as events lost of a pool.
Prints one JSON line of facts.
"""

import json
import sys
import time

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

import kvtrail_sglang as kh

N = 5000


def work(a, n):
    t0 = time.perf_counter()
    for _ in range(n):
        a.free(a.alloc(8))
    return time.perf_counter() - t0


def main():
    sock = sys.argv[1]
    facts = {}
    kh.install(capture="unix:" + sock + ".nobody", pools=[0], roles={}, worker="down")
    a = kh.tag(TokenToKVPoolAllocator(4096, torch.float32, "cpu", None, True), 0)
    dt = work(a, N)
    kh.flush(30)
    st = list(kh.stats().values())[0]
    kh.uninstall()
    facts["down"] = {"us_per_call": dt / (2 * N) * 1e6, **st}

    # Guard decisions that cannot be sent (a full queue, the sidecar down)
    # are counted apart (guard_lost), never as a KV event lost of the pool.
    from kvtrail_hook_client import Client

    full = Client("unix:" + sock + ".nobody", [0], "guard-full", max_queue=0)
    down = Client("unix:" + sock + ".nobody", [0], "guard-down")
    for rid in (1, 2, 3):
        full.put_guard(0, time.time_ns(), rid, "foreign", "alert", [9], 4, 4, 0)
        down.put_guard(0, time.time_ns(), rid, "unknown", "allow", [], 4, 0, 4)
    down.flush(30)
    facts["guard_loss"] = {"full": dict(full.stats), "full_pool": dict(full.dropped),
                           "down": dict(down.stats), "down_pool": dict(down.down_lost),
                           "down_counts": [down.enqueued, down.sent_items, down.dropped_items]}
    full.close(0)
    down.close(0)

    kh.install(capture="unix:" + sock, pools=[0], roles={}, worker="starved", max_queue=64)
    a = kh.tag(TokenToKVPoolAllocator(4096, torch.float32, "cpu", None, True), 0)
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # the sender thread gets no GIL during the loop
    work(a, N)
    sys.setswitchinterval(old)
    kh.flush(30)
    work(a, 1)  # events after the loss: the hole is inside the stream
    kh.flush(30)
    st = list(kh.stats().values())[0]
    kh.uninstall()
    facts["starved"] = {"calls": 2 * N + 2, **st}

    # Tensor-parallel rank > 0: its allocator is not captured.
    from sglang.srt.runtime_context import get_parallel

    kh.install(capture="unix:" + sock + ".nobody", pools=[0], roles={}, worker="tp")
    guard = []
    for rank in (1, 0):
        with get_parallel().override(tp_rank=rank):
            a = TokenToKVPoolAllocator(64, torch.float32, "cpu", None, True)
        guard.append(getattr(a, "_kvtrail_pool", None))
    kh.uninstall()
    facts["tp_rank_pools"] = guard

    # Pool 0 held by another live connection: the hook's hello is refused.
    import socket

    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.settimeout(10)
    holder.connect(sock)
    holder.sendall(b'{"type":"hello","pools":[0],"worker":"holder"}\n')
    welcome = holder.recv(4096)
    kh.install(capture="unix:" + sock, pools=[0], roles={}, worker="refused")
    a = kh.tag(TokenToKVPoolAllocator(4096, torch.float32, "cpu", None, True), 0)
    work(a, 100)
    kh.flush(30)
    st = list(kh.stats().values())[0]
    kh.uninstall()
    holder.close()
    facts["claimed"] = {"holder_welcome": json.loads(welcome), **st}
    print(json.dumps(facts, sort_keys=True))


if __name__ == "__main__":
    main()
