"""Drives vLLM 0.33.0's real v1 Scheduler into a copy-on-write block copy
on CPU, with the kvtrail_vllm hook installed and streaming to a `kvtrail
record` sidecar (one engine, pool 0).

Usage: cow_driver.py SOCKET MODE, MODE one of
- cow: a partial prefix-cache hit. vLLM 0.33.0 counts a local hit in hash
  blocks (here 16 tokens) smaller than the block (64 tokens) only when a
  Mamba group in "align" mode can resume there
  (`kv_cache_utils.partial_hash_hits_enabled`), so the model is a hybrid
  of full attention and an aligned Mamba group, as vLLM's hybrid tests
  build one. x (tenant-x) runs first and frees its blocks; a (tenant-a)
  prefills 96 tokens, checkpointed at 80; b (tenant-a, a's first 80 tokens
  then its own) hits 80 tokens: 64 in a full block, 16 inside a's tail
  block, which `SingleTypeKVCacheManager._apply_cow` redirects to a fresh
  block; the step's `SchedulerOutput.kv_cache_block_copies` carries the
  copy (a's tail block -> b's private block), which the worker would run
  before the step's forward;
- cow-dropped: the same, with the full-attention manager's pending copies
  dropped before the scheduler drains them (an engine that loses the copy:
  the worker never copies, b's private block keeps what it held, x's KV).

Real: Request (block hashes with cache_salt), Scheduler.add_request /
schedule / update_from_output / _free_request, KVCacheManager, the hybrid
coordinator, FullAttentionManager and MambaManager (partial hits, CoW),
BlockPool. Synthetic: the model runner's outputs (sampled token ids). No
weights, no tokenizer: the model is a local config.json.

Prints one JSON line of facts last.
"""

import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

import kvtrail_vllm as kh  # noqa: E402

SOCK, MODE = sys.argv[1], sys.argv[2]
kh.install(capture=f"unix:{SOCK}", pools=[0], worker="cow-driver")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MambaSpec)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BS, HB, NB = 64, 16, 8

model_dir = tempfile.mkdtemp()
with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
               "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096}, f)
init_none_hash(sha256)

mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=2048)
vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                                 max_model_len=2048, is_encoder_decoder=False,
                                                 async_scheduling=False),
                cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True,
                                         mamba_cache_mode="align"))
vc.cache_config.num_gpu_blocks = NB
groups = [KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                                        dtype=torch.float32)),
          KVCacheGroupSpec(["mamba"], MambaSpec(block_size=BS, shapes=((1,),), dtypes=(torch.float32,),
                                                mamba_cache_mode="align"))]
kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)
S = Scheduler(vllm_config=vc, kv_cache_config=kcc, block_size=BS, hash_block_size=HB, log_stats=True,
              structured_output_manager=StructuredOutputManager(vc))
FA = S.kv_cache_manager.coordinator.single_type_managers[0]

if MODE == "cow-dropped":
    # The engine loses the full-attention copy: the manager's pending copies
    # are emptied before the scheduler drains them (and the hook sees them).
    orig_take = FA.take_pending_cow_copies

    def take_pending_cow_copies():
        orig_take()
        return []

    FA.take_pending_cow_copies = take_pending_cow_copies
elif MODE != "cow":
    raise SystemExit(f"unknown mode {MODE}")


def make_req(rid, tokens, salt, max_tokens=2):
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, eos_token_id=2)
    return Request(rid, list(tokens), sp, None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(HB, sha256))


finished = {}
facts = {"vllm": vllm.__version__, "mode": MODE, "copies": [], "tables": {}}


def step():
    out = S.schedule()
    ids = list(out.num_scheduled_tokens)
    for c in out.kv_cache_block_copies or ():
        facts["copies"].append([int(c.src_block_id), int(c.dst_block_id)])
    for r in ids:
        facts["tables"][r] = [list(t) for t in S.kv_cache_manager.get_block_ids(r)]
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[] if S.requests[r].is_prefill_chunk else [7] for r in ids])
    res = S.update_from_output(out, mro)
    for eco in res.values():
        for o in eco.outputs:
            if o.finish_reason is not None:
                finished[o.request_id] = str(o.finish_reason)
    return out


def run(rid, tokens, salt):
    S.add_request(make_req(rid, tokens, salt))
    for _ in range(10):
        step()
        if rid in finished:
            break
    facts[rid] = finished.get(rid)


X = list(range(600, 792))  # 192 tokens: three full-attention blocks
A = list(range(100, 196))  # 96 tokens, checkpointed at 80
B = A[:80] + list(range(500, 540))
run("x", X, "tenant-x")
x_blocks = facts["tables"]["x"][0]
run("a", A, "tenant-a")
a_blocks = facts["tables"]["a"][0]
n_before = len(facts["copies"])
run("b", B, "tenant-a")
facts["b_copies"] = facts["copies"][n_before:]
facts["x_blocks"], facts["a_blocks"] = x_blocks, a_blocks
facts["b_blocks"] = facts["tables"]["b"][0]
facts["b_computed_from_cache"] = 80
kh.flush()
facts["hook_stats"] = kh.stats()
facts["guard"] = kh.guard_stats()
kh.uninstall()
print(json.dumps(facts))
