"""Cost of the kvtrail vLLM hook: engine-thread time per Scheduler step
(schedule + update_from_output, 8 running requests) and per BlockPool
allocator call (get_new_blocks(4) + free_blocks), real vLLM 0.33.0 on CPU,
process CPU time (the sender thread's formatting included),
without the hook (baseline) and with kvtrail_vllm installed and streaming
to a real `kvtrail record` sidecar, in the same process. Ratios printed.

Usage: VENV/bin/python scripts/bench_vllm_hook.py KVTRAIL_BINARY [N]
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "hooks", "vllm", "src"))
sys.path.insert(0, os.path.join(here, "..", "hooks", "client", "src"))
# The native module the hook needs (.ci/setup.d/34-kvtrail-guard.sh).
sys.path.insert(0, os.path.join(here, "..", "target", "kvtrail-guard-native"))

import kvtrail_vllm as kh  # noqa: E402

BIN = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
tmp = tempfile.mkdtemp()
sock = os.path.join(tmp, "s.sock")
deploy = os.path.join(tmp, "deploy.json")
BS, NB = 16, 1024
with open(deploy, "w") as f:
    json.dump({"name": "bench", "engine": "vllm 0.33.0", "context_window": 4096,
               "pools": [{"id": 0, "role": "mixed", "capacity_tokens": BS * NB, "page_size": BS}]}, f)
side = subprocess.Popen([BIN, "record", "--listen", f"unix:{sock}", "--deployment", deploy,
                         "--out", os.path.join(tmp, "trace"), "--health-secs", "0"],
                        stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
while not os.path.exists(sock):
    time.sleep(0.05)
kh.install(capture=f"unix:{sock}", pools=[0])

import torch  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

d = tempfile.mkdtemp()
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
           "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096},
          open(f"{d}/config.json", "w"))
init_none_hash(sha256)


def make():
    mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype="float16", max_model_len=4096)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                    scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096,
                                                     max_model_len=4096, is_encoder_decoder=False,
                                                     async_scheduling=False),
                    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True))
    vc.cache_config.num_gpu_blocks = NB
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    return Scheduler(vllm_config=vc, kv_cache_config=kcc, block_size=BS, log_stats=False,
                     structured_output_manager=StructuredOutputManager(vc))


def run_steps(s, steps):
    """8 requests of 512 prompt tokens decoding: time per step."""
    for i in range(8):
        sp = SamplingParams(max_tokens=steps + 2)
        sp.update_from_generation_config({}, eos_token_id=2)
        s.add_request(Request(f"q{i}-{time.time_ns()}", [3 + i] * 512, sp, None,
                              block_hasher=get_request_block_hasher(BS, sha256)))
    out = s.schedule()  # prefill step (not timed)
    ids = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                sampled_token_ids=[[7] for _ in ids]))
    t = time.process_time()
    for _ in range(steps):
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids]))
    dt = (time.process_time() - t) / steps
    for r in list(s.requests):
        s.finish_requests([r], RequestStatus.FINISHED_ABORTED)
    return dt


def run_alloc(s, n):
    bp = s.kv_cache_manager.block_pool
    t = time.process_time()
    for _ in range(n):
        bp.free_blocks(bp.get_new_blocks(4))
    return (time.process_time() - t) / n


res = {}
for name, hooked in (("baseline", False), ("hooked", True)):
    s = make()
    if not hooked:
        # The hook stays installed; detaching the engine state makes every
        # wrapper a plain pass-through (the baseline pays only the call).
        s._kvtrail_engine = None
        s.kv_cache_manager.coordinator.block_pool._kvtrail_engine = None
        for m in s.kv_cache_manager.coordinator.single_type_managers:
            m._kvtrail_engine = None
    steps = max(50, N // 20)
    res[name] = {"step_us": run_steps(s, steps) * 1e6, "alloc_us": run_alloc(s, N) * 1e6}
kh.flush()
st = kh.stats()
kh.uninstall()
side.terminate()
side.wait()
b, h = res["baseline"], res["hooked"]
print(f"scheduler step (8 decoding requests, 512-token prompts): {b['step_us']:.1f} -> "
      f"{h['step_us']:.1f} us ({h['step_us'] / b['step_us']:.2f}x)")
print(f"get_new_blocks(4) + free_blocks: {b['alloc_us']:.2f} -> {h['alloc_us']:.2f} us "
      f"({h['alloc_us'] / b['alloc_us']:.2f}x)")
print(json.dumps({"baseline": b, "hooked": h, "hook_stats": st}))
