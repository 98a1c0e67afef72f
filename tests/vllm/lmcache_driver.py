"""Drives vLLM 0.33.0's LMCacheConnectorV1 over the real `lmcache` package
(0.5.6, installed by .ci/setup.d/35-lmcache.sh next to the vLLM venv, not
into it) on CPU, with the kvtrail_vllm hook installed and streaming to a
`kvtrail record` sidecar.

Usage: lmcache_driver.py SOCKET MODE, MODE one of
- hit: a (tenant-a, 64 tokens) is computed and its KV stored to LMCache;
  f (tenant-f, 160 tokens) reuses every block a freed, so vLLM's own prefix
  cache no longer holds a's blocks; a2 (tenant-a, a's 64 tokens and 2 more)
  gets an LMCache hit of 64 tokens and LMCache loads them into a2's blocks;
- cross: the same with the third request x of tenant-x: LMCache 0.5.6's
  non-multiprocess keys are the token chunks alone (no cache salt), so x
  loads a's KV;
- miss: the third request has other tokens: no LMCache hit, no load;
- stale: as hit, with lmcache's CPU backend index planted after f's store
  to name, under each of a's chunk keys, the memory object of one of f's
  chunks (a's objects go back to lmcache's allocator): a2 loads f's KV;
- unseen: four chunks holding the KV of a request the trace never saw
  ("ext") are put straight into the CPU backend (its allocator and put,
  not the engine's store path); u (tenant-u) gets a 64-token hit on them;
- evict: lmcache's local CPU backend has room for 10 chunks, so f's store
  evicts a's 4 chunks (lmcache's own LRU eviction) and puts f's chunks 6
  to 9 in a's former memory objects; five short requests (13 tokens: no
  full chunk, nothing stored) run at once and take f's partial block and
  its tail blocks 9 to 6 from vLLM's prefix cache; f2 (tenant-f, f's 160
  tokens and 2 more) hits f's first 6 blocks in vLLM and lmcache loads
  chunks 6 to 9 from the reused memory: f's own KV;
- overlap: 32-token chunks (two blocks): a is stored; c (tenant-a, a's
  first 48 tokens and 16 of its own) shares a's first three blocks in
  vLLM's prefix cache and keeps decoding; a filler takes every free block
  but one, so vLLM evicts a's block 3; b (a's tokens and 2 more) hits 48
  tokens in vLLM, and lmcache, starting its load at the chunk boundary,
  reloads positions 32 to 63: over the block c shares, with the same
  prefix's KV (c's bytes there are unchanged).

One engine, pool 0 and the cache pool 2 (deploy-vllm-lmcache.json). Two LMCacheConnectorV1
instances, as in a vLLM engine: the scheduler's (made by vLLM's Scheduler)
and the worker's (made here through vLLM's KVConnectorFactory with the
WORKER role), each over LMCache's real LMCacheConnectorV1Impl.

Real: vLLM's Scheduler, KV cache manager, block pool and LMCacheConnectorV1
(both roles); lmcache's vllm_v1_adapter (lookup, load and save specs,
request trackers, connector metadata, start_load_kv, wait_for_save),
LMCacheManager and VllmServiceFactory, the lookup client and server (ZMQ
over an ipc socket in the working directory), LMCacheEngine with its token
database (chunk keys) and local CPU backend (store, contains, pin,
retrieve), LMCache's memory allocator, and LMCache's own copy between its
memory objects and vLLM's paged KV (`device_ops.multi_layer_kv_transfer`:
on a CPU-only host lmcache resolves device_ops to its CPU backend, whose
transfer is its pure-torch fallback `torch_ops.mem_kernels`; its CUDA
kernel module `lmcache.cuda_ops` is never loaded).

Replaced, the kernel boundary only: lmcache has no vLLM connector for a
CPU device (`lmcache.v1.gpu_connector.CreateGPUConnector` raises "No
supported cpu connector found"), so `CreateGPUConnector` is replaced by a
function that builds lmcache's real `VLLMPagedMemGPUConnectorV2`, with two
CUDA-only parts swapped: its CUDA streams (`torch.cuda.Stream`,
`torch.cuda.stream`) are lmcache's own CPU stub device (`lmcache.torch_dev`,
`StubCPUDevice`: copies on CPU are synchronous), and `_initialize_pointers`
is the same table of per-layer KV pointers without its assertion that the
KV lives on a CUDA device. Every byte still moves through lmcache's
`device_ops.multi_layer_kv_transfer`.

Synthetic: the model runner. Each step it writes, for every scheduled
token, K and V values unique to (request, position, layer, K or V) into
the token's slot of the CPU KV tensors (vLLM's flash-attention layout,
[2, blocks, block size, kv heads, head size] per layer), between the worker
connector's start_load_kv and wait_for_save, as a forward pass would; and
it reports one sampled token per request. No weights, no tokenizer, no
network.

The truth: a's and f's KV are read back from their blocks after their
prefill; after the third request's load (before its forward), the bytes
its first 64 tokens' slots hold are compared with a's, and matched to the
requests whose KV they are (`sources`).

Prints one JSON line of facts last.
"""

import json
import os
import sys
import tempfile
import traceback
import types
import warnings

warnings.filterwarnings("ignore")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
# The lookup client and server meet on an ipc socket under this path: the
# driver's working directory (one per run, so runs never share it).
os.environ["VLLM_RPC_BASE_PATH"] = os.getcwd()
# LMCache's configuration (read once, from the environment): 16-token
# chunks (one vLLM block), a small local CPU backend, no disk, no remote,
# synchronous and not layerwise (its defaults), no usage telemetry (it
# would post to the network), no banner.
os.environ.update({"LMCACHE_CHUNK_SIZE": "16", "LMCACHE_LOCAL_CPU": "True",
                   "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.05", "LMCACHE_USE_LAYERWISE": "False",
                   "LMCACHE_ENABLE_ASYNC_LOADING": "False",
                   "LMCACHE_INTERNAL_API_SERVER_ENABLED": "False",
                   "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
                   "LMCACHE_DISABLE_BANNER": "1"})

SOCK, MODE = sys.argv[1], sys.argv[2]
if MODE not in ("hit", "cross", "miss", "stale", "unseen", "evict", "overlap"):
    raise SystemExit(f"unknown mode {MODE}")
if MODE == "overlap":
    # Chunks of two blocks: a load starts at a chunk boundary below
    # vLLM's own prefix hit.
    os.environ["LMCACHE_CHUNK_SIZE"] = "32"
if MODE == "evict":
    # Room for 10 chunks: a chunk's 2048 bytes take one 4096-byte slot of
    # lmcache's allocator (its alignment).
    os.environ["LMCACHE_MAX_LOCAL_CPU_SIZE"] = repr(10 * 4096 / 2**30)

# The lmcache package and the modules its import path needs, outside the
# vLLM venv (35-lmcache.sh).
LMC_DIR = os.environ.get("KVTRAIL_LMCACHE_DIR") or os.path.join(
    os.environ.get("KVTRAIL_CACHE") or os.path.expanduser("~/.cache/kvtrail"), "lmcache-0.5.6")
sys.path.append(LMC_DIR)

import kvtrail_vllm as kh  # noqa: E402

kh.install(capture=f"unix:{SOCK}", pools=[0], worker="driver", cache_pool=2)

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig,  # noqa: E402
                         ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.parallel_state import (ensure_model_parallel_initialized,  # noqa: E402
                                             init_distributed_environment)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import lmcache  # noqa: E402
import lmcache.v1.gpu_connector as lmc_gc  # noqa: E402
from lmcache.observability import LMCStatsMonitor  # noqa: E402
from lmcache.v1.gpu_connector import gpu_connectors as lmc_gcs  # noqa: E402


def _die(*exc):
    """An uncaught error ends the run at once: lmcache's service threads
    would keep the interpreter alive."""
    traceback.print_exception(*exc)
    sys.stderr.flush()
    os._exit(1)


sys.excepthook = _die

BS, NB = 16, 12  # 11 usable blocks (block 0 is vLLM's null block)
LAYERS, KV_HEADS, HEAD = 2, 1, 16
DTYPE = torch.float16


# ---- The kernel boundary (see the docstring) ----
class _TorchWithCpuStreams:
    """torch as lmcache's gpu_connectors module sees it, with `torch.cuda`
    (streams only: Stream, stream, synchronize) answered by lmcache's own
    CPU stub device."""

    cuda = lmcache.torch_dev

    def __getattr__(self, name):
        return getattr(torch, name)


class CpuPagedConnector(lmc_gcs.VLLMPagedMemGPUConnectorV2):
    """lmcache's VLLMPagedMemGPUConnectorV2 on CPU KV tensors."""

    def _initialize_pointers(self, kv_caches):
        # VLLMPagedMemGPUConnectorV2._initialize_pointers without
        # `assert self.device.type == "cuda"`: the pointer table is on CPU.
        self.device = kv_caches[0].device
        idx = self.device.index
        if idx in self.kv_cache_pointers_on_gpu:
            return self.kv_cache_pointers_on_gpu[idx]
        self.engine_kv_format, kv_caches = lmc_gcs.normalize_kv_and_discover_format(
            kv_caches, lmc_gcs.EngineType.VLLM, layout_hints=self.layout_hints)
        self.kv_cache_pointers.numpy()[:] = [t.data_ptr() for t in kv_caches]
        self.kv_cache_pointers_on_gpu[idx] = self.kv_cache_pointers.clone()
        self.num_blocks = lmc_gcs.get_num_blocks(kv_caches, self.engine_kv_format)
        self.block_size = lmc_gcs.get_block_size(kv_caches, self.engine_kv_format)
        self.page_buffer_size = self.num_blocks * self.block_size
        self.head_size = lmc_gcs.get_head_size(kv_caches, self.engine_kv_format)
        self.block_stride_elems = lmc_gcs.resolve_block_stride_and_log_layout(
            kv_caches, self.engine_kv_format, layer_idx=0, group_idx=0) or 0
        return self.kv_cache_pointers_on_gpu[idx]


def create_cpu_connector(config, metadata, engine, layout_hints=None):
    """Replaces lmcache.v1.gpu_connector.CreateGPUConnector, which has no
    vLLM connector for a CPU device."""
    return CpuPagedConnector.from_metadata(metadata, use_gpu=False, device=torch.device("cpu"),
                                           layout_hints=layout_hints)


lmc_gcs.torch = _TorchWithCpuStreams()
lmc_gc.CreateGPUConnector = create_cpu_connector
# ---- end of the kernel boundary ----

model_dir = tempfile.mkdtemp()
with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
               "num_hidden_layers": LAYERS, "vocab_size": 1024, "max_position_embeddings": 4096}, f)
init_none_hash(sha256)

mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=2048)
vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig(),
                scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                 max_model_len=2048, is_encoder_decoder=False,
                                                 async_scheduling=False),
                cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1",
                                                    kv_role="kv_both", engine_id="E0"))
vc.cache_config.num_gpu_blocks = NB
# What vLLM's engine core resolves for flash attention (NHD: each layer's
# K and V are [blocks, block size, kv heads, head size]).
vc.cache_config.kv_cache_layout = "NHD"
spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=DTYPE)
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])

facts = {"vllm": vllm.__version__, "lmcache": lmcache.__version__, "mode": MODE}
with set_current_vllm_config(vc):
    # One rank: vLLM's process groups (gloo, through a file in the working
    # directory), which lmcache's worker side asks for its TP and PP rank.
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{os.getcwd()}/dist-init")
    ensure_model_parallel_initialized(1, 1)
    # The worker side first: its LMCacheEngine and lookup server.
    W = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    kv = {n: torch.zeros(2, NB, BS, KV_HEADS, HEAD, dtype=DTYPE) for n in LAYER_NAMES}
    W.register_kv_caches(kv)
    L = Scheduler(vllm_config=vc, kv_cache_config=kcc, block_size=BS, log_stats=True,
                  structured_output_manager=StructuredOutputManager(vc))
kh.tag(L, [0], role="mixed", cache_pool=2)
facts["connectors"] = [type(L.connector).__name__, type(W).__name__,
                       type(W._lmcache_engine).__module__, type(L.connector._lmcache_engine).__module__]
facts["gpu_connector"] = type(W._lmcache_engine.lmcache_engine.gpu_connector).__name__
# The copy every store and load goes through, and where it comes from.
facts["device_ops"] = type(lmcache.device_ops).__name__
facts["transfer"] = getattr(lmcache.device_ops.multi_layer_kv_transfer, "__qualname__", None)
STATS = LMCStatsMonitor.GetOrCreate()
STATS.get_stats_and_clear()

REQ_NO = {}


def value(rid, pos, layer, k):
    """The KV the synthetic forward writes: unique per (request, position,
    layer, K or V), exact in float16."""
    base = (REQ_NO[rid] * 389 + pos * 13 + layer * 5 + k * 2) % 1900
    return torch.arange(HEAD, dtype=DTYPE).reshape(KV_HEADS, HEAD) + base


def slots(rid, start, end):
    blocks = L.kv_cache_manager.get_block_ids(rid)[0]
    return [(blocks[p // BS], p % BS) for p in range(start, end)]


def read_kv(rid, start, end):
    """The bytes a request's slots hold, positions start..end."""
    return torch.stack([torch.stack([kv[n][k, b, o] for n in LAYER_NAMES for k in (0, 1)])
                        for b, o in slots(rid, start, end)])


def forward(out):
    """The synthetic model runner: writes each scheduled token's KV."""
    starts = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    for rid, n in out.num_scheduled_tokens.items():
        s = starts[rid]
        for p, (b, o) in zip(range(s, s + n), slots(rid, s, s + n)):
            for li, name in enumerate(LAYER_NAMES):
                for k in (0, 1):
                    kv[name][k, b, o] = value(rid, p, li, k)


def whose(tokens):
    """The requests whose KV the given tokens' bytes are (by the values the
    synthetic forward, or the unseen put, wrote: unique per request,
    position, layer and K or V), "?" for bytes of no known request."""
    index = {}
    for r, t in truth.items():
        for i in range(t.shape[0]):
            index[t[i].numpy().tobytes()] = r
    return sorted({index.get(tokens[i].numpy().tobytes(), "?") for i in range(tokens.shape[0])})


finished = {}
loaded = {}  # request -> whether start_load_kv changed its first slots, to a's bytes
truth = {}


def step(check_load=None):
    out = L.schedule()
    before = None
    if check_load is not None and check_load[0] in out.num_scheduled_tokens:
        before = read_kv(check_load[0], 0, check_load[1])
    W.bind_connector_metadata(out.kv_connector_metadata)
    W.start_load_kv(types.SimpleNamespace(attn_metadata={}, no_compile_layers={}, virtual_engine=0))
    if before is not None:
        rid, n = check_load
        after = read_kv(rid, 0, n)
        loaded[rid] = {"equal_to_a": bool(torch.equal(after, truth["a"][:n])),
                       "changed": not bool(torch.equal(after, before)),
                       "sources": whose(after)}
    forward(out)
    W.wait_for_save()
    sending, recving = W.get_finished(out.finished_req_ids)
    invalid = W.get_block_ids_with_load_errors()
    W.clear_connector_metadata()
    ids = list(out.num_scheduled_tokens)
    m = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                          sampled_token_ids=[[] if r in L.requests and L.requests[r].is_prefill_chunk
                                             else [7] for r in ids],
                          kv_connector_output=KVConnectorOutput(finished_sending=sending,
                                                                finished_recving=recving,
                                                                invalid_block_ids=invalid))
    res = L.update_from_output(out, m)
    for eco in res.values():
        for o in eco.outputs:
            if o.finish_reason is not None:
                finished[o.request_id] = str(o.finish_reason)
    return out


def add(rid, tokens, salt, max_tokens=2):
    REQ_NO[rid] = len(REQ_NO) + 1
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, eos_token_id=2)
    L.add_request(Request(rid, list(tokens), sp, None, cache_salt=salt,
                          block_hasher=get_request_block_hasher(BS, sha256)))


def run(rid, tokens, salt, check_load=None, after_prefill=None):
    add(rid, tokens, salt)
    first = True
    for _ in range(12):
        out = step(check_load if first else None)
        if first:
            facts.setdefault("first_step", {})[rid] = {
                "scheduled": out.num_scheduled_tokens.get(rid),
                "computed_before": next((d.num_computed_tokens for d in out.scheduled_new_reqs
                                         if d.req_id == rid), None)}
            first = False
            if after_prefill:
                after_prefill()
        if rid in finished:
            break
    st = STATS.get_stats_and_clear()
    facts.setdefault("lmcache_stats", {})[rid] = {
        "stored": int(st.interval_stored_tokens), "lookup_hits": int(st.interval_lookup_hits),
        "retrieved": int(st.interval_hit_tokens)}


ENGINE = W._lmcache_engine.lmcache_engine
CPU = ENGINE.storage_manager.local_cpu_backend


def plant_stale(a_keys, f_keys):
    """lmcache's index of its local CPU backend made to name, under each of
    a's chunk keys, the memory object of one of f's chunks (an index entry
    left pointing at memory that now holds other KV): a's objects go back
    to the allocator, f's are referenced by both keys. Through lmcache's own
    structures (hot_cache, the objects' reference counts) only."""
    with CPU.cpu_lock:
        for ak, fk in zip(a_keys, f_keys):
            fo = CPU.hot_cache[fk]
            fo.ref_count_up()
            old = CPU.hot_cache[ak]
            CPU.hot_cache[ak] = fo
            old.ref_count_down()
    facts["planted"] = len(list(zip(a_keys, f_keys)))


def put_unseen(tokens):
    """Chunks of ``tokens`` put straight into lmcache's local CPU backend
    (its allocator, its put), not through the engine's store path the hook
    watches: as a chunk stored before the hook was installed, or by another
    engine sharing the cache. Their bytes are the KV of request "ext"."""
    REQ_NO["ext"] = len(REQ_NO) + 1
    n = 0
    rows = []
    for start, end, key in ENGINE.token_database.process_tokens(tokens=torch.tensor(tokens)):
        obj = ENGINE.storage_manager.allocate(ENGINE.metadata.get_shapes(end - start),
                                              ENGINE.metadata.get_dtypes(), fmt=ENGINE.fmt,
                                              busy_loop=False)
        for t, p in enumerate(range(start, end)):
            row = []
            for li in range(LAYERS):
                for k in (0, 1):
                    v = value("ext", p, li, k)
                    obj.tensor[k, li, t] = v.reshape(-1)
                    row.append(v)
            rows.append(torch.stack(row))
        CPU.submit_put_task(key, obj)
        obj.ref_count_down()  # the backend holds it now (as StorageManager.batched_put does)
        n += 1
    truth["ext"] = torch.stack(rows)
    facts["planted"] = n


def overlap_scenario():
    """The `overlap` mode (see the module docstring)."""
    A = list(range(100, 164))
    a_blocks = []

    def kept():
        truth.update(a=read_kv("a", 0, len(A)))
        a_blocks.extend(L.kv_cache_manager.get_block_ids("a")[0])

    run("a", A, "tenant-a", after_prefill=kept)
    # c shares a's first three blocks in vLLM's prefix cache and keeps
    # decoding while b loads.
    add("c", A[:48] + list(range(500, 516)), "tenant-a", max_tokens=30)
    step()
    step()
    c_blocks = L.kv_cache_manager.get_block_ids("c")[0]
    facts["c_shares_a_blocks"] = sum(1 for x, y in zip(a_blocks, c_blocks) if x == y)
    # Every free block but one taken: vLLM evicts a's cached block 3.
    free = L.kv_cache_manager.block_pool.get_num_free_blocks()
    add("fill", list(range(900, 900 + 16 * free - 8)), "tenant-z", max_tokens=1)
    step()
    before = read_kv("c", 32, 48)
    run("b", A + [5, 6], "tenant-a", check_load=("b", len(A)))
    facts["c_block2_unchanged"] = bool(torch.equal(read_kv("c", 32, 48), before))
    facts["c_block2_is_a"] = bool(torch.equal(read_kv("c", 32, 48), truth["a"][32:48]))
    for _ in range(40):
        if "c" in finished:
            break
        step()
    facts["third"] = "b"


if MODE == "overlap":
    overlap_scenario()
else:
    A = list(range(100, 164))  # 64 tokens: 4 blocks, 4 LMCache chunks
    F = list(range(300, 460))  # 160 tokens: takes every block a freed
    U = list(range(700, 764))  # the unseen chunks' tokens
    run("a", A, "tenant-a", after_prefill=lambda: truth.update(a=read_kv("a", 0, len(A))))
    a_keys = list(CPU.hot_cache)
    addrs_a = [CPU.hot_cache[k].meta.address for k in a_keys]
    run("f", F, "tenant-f", after_prefill=lambda: truth.update(f=read_kv("f", 0, len(F))))
    f_keys = [k for k in CPU.hot_cache if k not in a_keys]
    facts["chunks"] = {"a": len(a_keys), "f": len(f_keys)}
    if MODE == "stale":
        plant_stale(a_keys, f_keys[:4])
    elif MODE == "unseen":
        put_unseen(U)
    if MODE == "evict":
        facts["evicted_a"] = sum(1 for k in a_keys if k not in CPU.hot_cache)
        facts["addr"] = {"a": addrs_a, "f": {i: CPU.hot_cache[k].meta.address
                                             for i, k in enumerate(f_keys) if k in CPU.hot_cache}}
        # Short requests (no full chunk: lmcache stores nothing of them) take
        # the free blocks vLLM evicts first: f's partial last block, then f's
        # tail blocks 9 down to 6, whose chunks lmcache keeps in a's former
        # memory objects.
        # They run at once, each holding its block.
        for i in range(5):
            add(f"s{i}", list(range(800 + 20 * i, 813 + 20 * i)), "tenant-s")
        for _ in range(12):
            step()
            if all(f"s{i}" in finished for i in range(5)):
                break
        facts["f_kept"] = [i for i, k in enumerate(f_keys) if k in CPU.hot_cache]
    third = {"hit": ("a2", A + [5, 6], "tenant-a"), "cross": ("x", A + [5, 6], "tenant-x"),
             "miss": ("m", list(range(600, 666)), "tenant-m"), "stale": ("a2", A + [5, 6], "tenant-a"),
             "unseen": ("u", U + [5, 6], "tenant-u"), "evict": ("f2", F + [5, 6], "tenant-f")}[MODE]
    run(third[0], third[1], third[2], check_load=(third[0], len(F) if MODE == "evict" else len(A)))
    facts["third"] = third[0]
facts["cuda_ops_loaded"] = "lmcache.cuda_ops" in sys.modules
facts["bytes"] = loaded
facts["finish"] = finished
facts["free_blocks"] = L.kv_cache_manager.block_pool.get_num_free_blocks()

W.shutdown()
L.connector.shutdown()
kh.flush()
facts["hook_stats"] = kh.stats()
facts["guard"] = kh.guard_stats()
kh.uninstall()
print(json.dumps(facts))
sys.stdout.flush()
os._exit(0)  # lmcache's service threads are not joined
