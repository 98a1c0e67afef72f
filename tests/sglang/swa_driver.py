"""SGLang 0.5.19's SWA allocator (sliding-window models) with the kvtrail
hook installed, streaming to a `kvtrail record` sidecar
(tests/it/record_sglang.rs, sglang_swa_allocator_records_the_full_pool_only).

    python swa_driver.py SOCKET

Real: SWAKVPool (a full-attention and a sliding-window MHA pool on CPU)
and SWATokenToKVPoolAllocator, whose alloc and free call its two inner
allocators (the classes the hook records). Request A allocates 6 tokens
and frees them, request B allocates 4; the slot ids of each inner
allocator are printed. The sliding-window pool is not recorded: only the
full-attention allocator's slots may reach the trace.
"""

import json
import sys
import types

import torch

import kvtrail_sglang as kh

SOCK = sys.argv[1]
kh.install(capture=f"unix:{SOCK}", pools=[0], worker="swa-cpu", tenant_field="routing_key")

from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402

kv = SWAKVPool(size=32, size_swa=16, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
               swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
alloc = SWATokenToKVPoolAllocator(32, 16, 1, torch.float32, "cpu", kv, need_sort=False)
facts = {"swa_tag": getattr(alloc.swa_attn_allocator, "_kvtrail_pool", None),
         "full_tag": getattr(alloc.full_attn_allocator, "_kvtrail_pool", None)}


def req(rid):
    r = types.SimpleNamespace(rid=rid, routing_key="tenant-" + rid.lower())
    return r


for rid, n in (("A", 6), ("B", 4)):
    with kh.request_context(req(rid)):
        full = alloc.alloc(n)
        facts[rid] = {"full": full.tolist(),
                      "swa": alloc.full_to_swa_index_mapping[full].tolist()}
        if rid == "A":
            alloc.free(full)
kh.flush()
facts["counts"] = kh.counts()
kh.uninstall()
print(json.dumps(facts))
