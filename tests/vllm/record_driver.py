"""Drives vLLM 0.33.0's real v1 Scheduler, KV cache manager, block pool and
NixlConnector scheduler side (NixlPullConnectorScheduler) on CPU, with the
kvtrail_vllm hook installed and streaming to a `kvtrail record` sidecar.

Usage: record_driver.py SOCKET MODE, MODE one of
- clean: a P/D request the normal way (prefill engine, pool 0 -> decode
  engine, pool 1), the producer's blocks released and reused by a second
  request that decode also loads properly, then a local prefix-cache hit
  on decode (same cache_salt);
- stale: vllm-project/vllm#52234's stale reference: decode is handed the
  first request's (already consumed) kv_transfer_params after the
  producer freed and reused those blocks for another tenant's request;
  NIXL reports the read done, so the request answers 200 over that KV;
- hetero, hetero-stale: clean and stale again with a producer of 8-token
  blocks (decode's are 16): the hook reports the producer's block ids and
  the sidecar expands them with pool 0's page_size (deploy-vllm-hetero.json);
- faults: out-of-range remote block ids reported done (fail-open), a
  failed load and a partial load (invalid block ids) under
  kv_load_failure_policy "fail";
- hybrid: the stale reference again, on a hybrid model: two KV cache
  groups (full attention + a 32-token sliding window, vLLM's
  HybridKVCacheCoordinator over one shared BlockPool) on both engines; the
  groups alias the same blocks, so each engine is one pool (producer 0,
  decode 1) and the producer's reuse of a block by the other group is
  seen; decode's sliding window drops blocks mid-request
  (remove_skipped_blocks);
- offload, offload-stale: vLLM's own CPU offload (OffloadingConnector with
  its CPUOffloadingSpec) on one engine (pool 0, its CPU tier pool 2): a's
  blocks are stored to the tier, evicted from the GPU by b, and loaded back
  for a2 (same prompt, same salt); in offload-stale the tier's index is
  corrupted first (a's chunks pointed at b's, as a tier that reused a chunk
  without dropping its key would), so a2 loads b's KV;
- simple, simple-disk, simple-stale: the same with SimpleCPUOffloadConnector
  (cpu backend; disk backend; cpu with the offload pool's index planted to
  name b's blocks under a's hashes);
- tier, tier-stale: the same with the offload tiering layer
  (TieringOffloadingSpec, a small CPU primary tier and vLLM's fs tier, real
  files): a's chunks are evicted from the CPU tier too and come back from
  disk; in tier-stale the fs tier's file mapper is planted to send four of
  b's keys to a's files;
- lmcache: LMCacheConnectorV1 over a stand-in for the lmcache package's
  engine, reporting a 48-token hit for a2 (the load is out of sight);
  lmcache-pool: the same with a cache pool tagged (the hook waits for
  lmcache's engine to perform the load, which is not in this process);
- broken: the hook's native step and slot mapping made to raise; the engine must not notice.

Real: Request construction (block hashes, cache_salt), Scheduler.add_request
/ schedule / update_from_output / _free_request, KVCacheManager, the
coordinator (unitary, or hybrid), FullAttentionManager,
SlidingWindowManager, BlockPool (allocation, prefix cache,
eviction), NixlPullConnectorScheduler (get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, request_finished with the
producer's block hold), the load-failure handling of the scheduler.
Synthetic: the model runner's outputs (sampled token ids, and the
KVConnectorOutput a NIXL worker would report: finished_recving,
finished_sending, failed_recving, invalid_block_ids). No weights, no
tokenizer, no network: the model is a local config.json.

Prints one JSON line of facts last.
"""

import json
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

import kvtrail_vllm as kh  # noqa: E402

SOCK, MODE = sys.argv[1], sys.argv[2]
kh.install(capture=f"unix:{SOCK}", pools=[0], remote_pools={"P0": [0]}, worker="driver")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig,  # noqa: E402
                         ModelConfig, SchedulerConfig, VllmConfig)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BS = 16
NB_P, NB_D = 8, 32  # the producer's pool is small, so freed blocks are reused
HETERO = MODE.startswith("hetero")
if HETERO:
    # The producer's blocks are 8 tokens, decode's 16 (vLLM's NIXL pairs
    # each decode block with two producer blocks); same producer tokens.
    BS_P, NB_P = 8, 16
else:
    BS_P = BS
HYBRID = MODE in ("hybrid", "offload-hybrid")
WINDOW = 32  # the sliding-window group's window (tokens)

model_dir = tempfile.mkdtemp()
with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
               "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096}, f)
init_none_hash(sha256)


def make_scheduler(nb, kv, tensors=False, bs=BS):
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=2048)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                    scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                     max_model_len=2048, is_encoder_decoder=False,
                                                     async_scheduling=False),
                    cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True),
                    kv_transfer_config=kv)
    vc.cache_config.num_gpu_blocks = nb
    groups = [KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1,
                                                            dtype=torch.float32))]
    if HYBRID:
        # As vLLM's own hybrid tests build one: a second group of
        # sliding-window layers sharing the block pool.
        groups.append(KVCacheGroupSpec(["swa"], SlidingWindowSpec(
            block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=WINDOW)))
    page = groups[0].kv_cache_spec.page_size_bytes
    # SimpleCPUOffloadConnector sizes its tier from the GPU tensors' bytes.
    kct = [KVCacheTensor(size=page * nb, layers=["layer"], layer_stride=page * nb,
                         block_stride=page)] if tensors else []
    kcc = KVCacheConfig(num_blocks=nb, kv_cache_tensors=kct, kv_cache_groups=groups)
    return Scheduler(vllm_config=vc, kv_cache_config=kcc, block_size=bs, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc))


P = kh.tag(make_scheduler(NB_P, KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer",
                                                   engine_id="P0"), bs=BS_P), [0])
D = kh.tag(make_scheduler(NB_D, KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer",
                                                   engine_id="D0", kv_load_failure_policy="fail")),
           [1])


def make_req(rid, tokens, salt, max_tokens, ktp=None, bs=BS):
    sp = SamplingParams(max_tokens=max_tokens,
                        extra_args={"kv_transfer_params": dict(ktp)} if ktp else None)
    sp.update_from_generation_config({}, eos_token_id=2)
    return Request(rid, list(tokens), sp, None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(bs, sha256))


def mro(s, out, tok=7, **kv):
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             # (a request the guard finished after schedule is still in
                             # the step: the runner samples for it; vLLM drops it)
                             sampled_token_ids=[[] if r in s.requests and s.requests[r].is_prefill_chunk
                                                else [tok] for r in ids],
                             kv_connector_output=KVConnectorOutput(**kv) if kv else None)


finished = {}  # request id -> (finish reason, kv_transfer_params)


def step(s, **kv):
    out = s.schedule()
    res = s.update_from_output(out, mro(s, out, **kv))
    for eco in res.values():
        for o in eco.outputs:
            if o.finish_reason is not None:
                finished[o.request_id] = (str(o.finish_reason), o.kv_transfer_params)
    return out


def prefill(rid, tokens, salt):
    """The producer computes the prompt and holds its blocks for decode."""
    P.add_request(make_req(rid, tokens, salt, 1, {"do_remote_decode": True}, bs=BS_P))
    for _ in range(10):
        step(P)
        if rid in finished:
            break
    ktp = finished[rid][1]
    assert ktp and ktp["remote_block_ids"], finished[rid]
    return ktp


def release(rid):
    """The producer hears decode finished reading: it frees the blocks."""
    step(P, finished_sending={rid})


def decode(rid, tokens, salt, ktp, max_tokens=3, **load):
    """Decode loads the remote KV (NIXL reports the outcome in `load`,
    default: done) and decodes."""
    D.add_request(make_req(rid, tokens, salt, max_tokens, dict(ktp, do_remote_prefill=True)))
    o = step(D)
    plan = o.kv_connector_metadata.reqs_to_recv[rid]
    if not load:
        load = {"finished_recving": {rid}}
    step(D, **load)
    for _ in range(10):
        if rid in finished:
            break
        step(D)
    return {"local": [list(x) for x in plan.local_block_ids],
            "remote": [list(x) for x in plan.remote.block_ids],
            "finish": finished.get(rid, (None,))[0]}


facts = {"vllm": vllm.__version__, "mode": MODE}
A = list(range(100, 140))  # 40 tokens
B = list(range(300, 412))  # 112 tokens: 7 full blocks, the producer's whole pool
C = list(range(600, 640))  # 40 tokens

if MODE in ("clean", "stale", "hetero", "hetero-stale"):
    ktp1 = prefill("r1", A, "tenant-a")
    facts["r1_remote"] = ktp1["remote_block_ids"]
    facts["r1"] = decode("r1", A, "tenant-a", ktp1)
    release("r1")
    ktp2 = prefill("r2", B, "tenant-b")
    facts["r2_remote"] = ktp2["remote_block_ids"]
    if MODE in ("clean", "hetero"):
        facts["r2"] = decode("r2", B, "tenant-b", ktp2)
        release("r2")
        # A local prefix-cache hit on decode: r1's loaded blocks, same salt.
        D.add_request(make_req("r4", A + [5, 6], "tenant-a", 2))
        for _ in range(10):
            step(D)
            if "r4" in finished:
                break
        facts["r4_finish"] = finished.get("r4", (None,))[0]
        facts["d_prefix_hits"] = D.kv_cache_manager.prefix_cache_stats.hits \
            if getattr(D.kv_cache_manager, "prefix_cache_stats", None) else None
    else:
        # r3 (tenant-c) gets r1's consumed reference: r1's blocks now hold r2's KV.
        facts["r3"] = decode("r3", C, "tenant-c", ktp1)
        facts["stale_blocks_now_r2"] = sorted(set(facts["r1_remote"][0]) & set(facts["r2_remote"][0]))
elif MODE == "faults":
    ktp1 = prefill("r1", A, "tenant-a")
    facts["r1"] = decode("r1", A, "tenant-a", ktp1)
    release("r1")
    bad = dict(ktp1, remote_block_ids=[[100, 101, 102]], remote_request_id="gone")
    facts["r5"] = decode("r5", C, "tenant-c", bad)  # out of range, reported done
    facts["r6"] = decode("r6", C, "tenant-d", ktp1,
                         failed_recving={"r6"}, finished_recving={"r6"})
    # Partial: the second local block failed (invalid_block_ids).
    D.add_request(make_req("r7", A, "tenant-e", 3, dict(ktp1, do_remote_prefill=True)))
    o = step(D)
    plan = o.kv_connector_metadata.reqs_to_recv["r7"]
    local = [list(x) for x in plan.local_block_ids]
    step(D, finished_recving={"r7"}, invalid_block_ids={local[0][1]})
    for _ in range(10):
        if "r7" in finished or "r7" not in D.requests:
            break
        step(D)
    facts["r7"] = {"local": local, "finish": finished.get("r7", (None,))[0]}
elif MODE == "hybrid":
    A2 = list(range(100, 140))  # 40 tokens: 3 blocks per group
    B2 = list(range(300, 340))  # another 40: reuses the producer's freed blocks
    ktp1 = prefill("r1", A2, "tenant-a")
    facts["r1_remote"] = ktp1["remote_block_ids"]
    facts["r1"] = decode("r1", A2, "tenant-a", ktp1)
    release("r1")
    ktp2 = prefill("r2", B2, "tenant-b")
    facts["r2_remote"] = ktp2["remote_block_ids"]
    # r3 (tenant-c) gets r1's consumed reference; it decodes past the
    # window, so decode's sliding-window group drops blocks as it goes.
    facts["r3"] = decode("r3", C, "tenant-c", ktp1, max_tokens=40)
    for _ in range(60):
        if "r3" in finished:
            break
        step(D)
    facts["r3"]["finish"] = finished.get("r3", (None,))[0]
    facts["stale_blocks_now_r2"] = [sorted(set(a) & set(b)) for a, b in
                                    zip(facts["r1_remote"], facts["r2_remote"])]
    facts["groups"] = [type(m).__name__ for m in D.kv_cache_manager.coordinator.single_type_managers]
elif MODE in ("offload", "offload-stale", "offload-hybrid"):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import \
        OffloadingWorkerMetadata  # noqa: E402
    O = make_scheduler(12, KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            engine_id="E0",
                                            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 16}))
    kh.tag(O, [0], role="mixed", cache_pool=2)
    jobs = {"store": [], "load": []}

    def ostep(loads_done=()):
        """One step; the CPU worker finishes every job of the step at once
        (synthetic OffloadingWorkerMetadata), loads reported received."""
        out = O.schedule()
        meta = out.kv_connector_metadata
        done = {}
        recv = set(loads_done)
        for kind, js in (("load", meta.load_jobs), ("store", meta.store_jobs)):
            for j, t in js.items():
                done[j] = 1
                jobs[kind].append({"req": t.req_id, "src": [int(x) for x in t.src_spec.block_ids],
                                   "dst": [int(x) for x in t.dst_spec.block_ids]})
                if kind == "load":
                    recv.add(t.req_id)
        ids = list(out.num_scheduled_tokens)
        m = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              sampled_token_ids=[[] if r in O.requests and O.requests[r].is_prefill_chunk
                                                 else [7] for r in ids],
                              kv_connector_output=KVConnectorOutput(
                                  finished_recving=recv or None,
                                  kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done)))
        res = O.update_from_output(out, m)
        for eco in res.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = (str(o.finish_reason), None)

    def orun(rid, tokens, salt, max_tokens=2):
        O.add_request(make_req(rid, tokens, salt, max_tokens))
        for _ in range(12):
            ostep()
            if rid in finished and not O.connector.connector_scheduler._jobs:
                break

    A3 = list(range(100, 164))  # 64 tokens: 4 full blocks
    orun("a", A3, "tenant-a")
    # 160 tokens (80 with the hybrid model's second group): evicts a's GPU blocks
    orun("b", list(range(300, 380 if HYBRID else 460)), "tenant-b")
    if MODE == "offload-stale":
        # The plant: the tier's index sends a's keys to b's chunks.
        pol = O.connector.connector_scheduler.manager._policy
        a_chunks = {c for j in jobs["store"] if j["req"] == "a" for c in j["dst"]}
        b_chunks = [c for j in jobs["store"] if j["req"] == "b" for c in j["dst"]]
        n = 0
        for st in pol.chunks.values():
            if st.chunk_id in a_chunks:
                st.chunk_id = b_chunks[n]
                n += 1
        facts["planted"] = n
    orun("a2", A3 + [5, 6], "tenant-a")
    facts["offload_jobs"] = jobs
    facts["finish"] = {r: finished.get(r, (None,))[0] for r in ("a", "b", "a2")}
    facts["p_free_blocks_o"] = O.kv_cache_manager.block_pool.get_num_free_blocks()
elif MODE in ("simple", "simple-stale", "simple-disk", "tier", "tier-stale"):
    # SimpleCPUOffloadConnector (its cpu or disk backend) or the offload
    # tiering layer (OffloadingConnector + TieringOffloadingSpec, a CPU
    # primary tier of 10 chunks and vLLM's real file-system tier in a temp
    # directory), on one engine: pool 0, the CPU (or disk) blocks pool 2,
    # the fs tier pool 3. The scheduler sides are vLLM's; the GPU<->CPU
    # worker is synthetic (it reports every job of a step done in that
    # step, copying nothing); the fs tier's store and load threads are
    # vLLM's own, writing and reading real files.
    from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402
    SIMPLE = MODE.startswith("simple")
    disk = tempfile.mkdtemp()
    if SIMPLE:
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata  # noqa: E402
        extra = {"cpu_bytes_to_use": 1 << 14}
        if MODE == "simple-disk":
            extra.update(kv_offload_backend="disk", disk_path=disk, disk_capacity_bytes=1 << 14)
        kvc = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                               engine_id="E0", kv_connector_extra_config=extra)
    else:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import \
            OffloadingWorkerMetadata  # noqa: E402
        kvc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", engine_id="E0",
                               kv_connector_extra_config={
                                   "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 40960,
                                   "tier_poll_interval_s": 0,
                                   "secondary_tiers": [{"type": "fs", "root_dir": disk,
                                                        "n_read_threads": 1, "n_write_threads": 1}]})
    O = make_scheduler(12, kvc, tensors=SIMPLE)
    kh.tag(O, [0], role="mixed", cache_pool=2, tier_pools=[3])
    conn = O.connector
    pending = (lambda: conn.scheduler_manager.has_pending_stores()) if SIMPLE else \
        (lambda: bool(conn.connector_scheduler._jobs) or conn.connector_scheduler.manager.has_pending_work())
    jobs = {"store": [], "load": [], "tier": []}

    def tstep():
        out = O.schedule()
        meta = out.kv_connector_metadata
        recv = set()
        if SIMPLE:
            done = {}
            if meta.store_event >= 0:
                done[meta.store_event] = 1
                jobs["store"].append({"src": list(meta.store_gpu_blocks), "dst": list(meta.store_cpu_blocks)})
            if meta.load_event >= 0:
                jobs["load"].append({"req": meta.load_event_to_reqs[meta.load_event],
                                     "src": list(meta.load_cpu_blocks), "dst": list(meta.load_gpu_blocks)})
                recv.update(meta.load_event_to_reqs[meta.load_event])
            wm = SimpleCPUOffloadWorkerMetadata(completed_store_events=done)
        else:
            done = {}
            for kind, js in (("load", meta.load_jobs), ("store", meta.store_jobs)):
                for j, t in js.items():
                    done[j] = 1
                    jobs[kind].append({"req": t.req_id, "src": [int(x) for x in t.src_spec.block_ids],
                                       "dst": [int(x) for x in t.dst_spec.block_ids]})
                    if kind == "load":
                        recv.add(t.req_id)
            wm = OffloadingWorkerMetadata(completed_jobs=done)
        ids = list(out.num_scheduled_tokens)
        m = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              sampled_token_ids=[[] if r in O.requests and O.requests[r].is_prefill_chunk
                                                 else [7] for r in ids],
                              kv_connector_output=KVConnectorOutput(finished_recving=recv or None,
                                                                    kv_connector_worker_meta=wm))
        res = O.update_from_output(out, m)
        for eco in res.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = (str(o.finish_reason), None)

    def trun(req):
        O.add_request(req)
        for _ in range(200):
            tstep()
            if req.request_id in finished and not pending():
                break
            time.sleep(0.005)  # the fs tier's threads

    A3 = list(range(100, 164))  # 64 tokens: 4 full blocks
    B3 = list(range(300, 460))  # 160 tokens: evicts a's GPU blocks (and CPU chunks)
    trun(make_req("a", A3, "tenant-a", 2))
    breq = make_req("b", B3, "tenant-b", 2)
    if MODE == "tier-stale":
        # The plant: the fs tier's file mapper sends b's keys 4..7 to a's
        # files (a collision), so b's store overwrites a's files while a's
        # keys still name them. b never looks those keys up (its lookup
        # stops at its first miss, key 0).
        fm = conn.connector_scheduler.manager.secondary_tiers[0].file_mapper
        orig_name = fm.get_file_name
        a_keys = [make_offload_key(h, 0) for h in make_req("x", A3, "tenant-a", 1).block_hashes]
        to_a = {make_offload_key(h, 0): orig_name(a_keys[j])
                for j, h in enumerate(breq.block_hashes[4:8])}
        fm.get_file_name = lambda key: to_a.get(key) or orig_name(key)
        facts["planted"] = len(to_a)
    trun(breq)
    if MODE == "simple-stale":
        # The plant: the tier's index sends a's hashes to b's blocks (a tier
        # block reused for b without dropping a's key).
        bp = conn.scheduler_manager.cpu_block_pool
        a_cpu, b_cpu = jobs["store"][0]["dst"], jobs["store"][1]["dst"]
        n = 0
        for key, v in list(bp.cached_block_hash_to_block._cache.items()):
            if getattr(v, "block_id", None) in a_cpu:
                bp.cached_block_hash_to_block._cache[key] = bp.blocks[b_cpu[a_cpu.index(v.block_id)]]
                n += 1
        facts["planted"] = n
    trun(make_req("a2", A3 + [5, 6], "tenant-a", 2))
    if not SIMPLE:
        for root, _, files in os.walk(disk):
            jobs["tier"] += [f for f in files if f.endswith(".bin")]
    facts["offload_jobs"] = jobs
    facts["finish"] = {r: finished.get(r, (None,))[0] for r in ("a", "b", "a2")}
elif MODE in ("lmcache", "lmcache-pool"):
    # LMCacheConnectorV1 (vLLM's class, real) over a stand-in for the
    # external lmcache package's engine (the one import it makes,
    # lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl):
    # the stand-in says it holds the first 48 tokens of a2's prompt and
    # loads them (synchronously, as lmcache does by default). The package
    # is not installed: what it would put in the blocks is unknown here,
    # as it is to the hook.
    import types  # noqa: E402

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata  # noqa: E402

    class Impl:
        def __init__(self, vllm_config, role, parent):
            self.loads = []

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 48 if request.request_id == "a2" else 0

        def update_state_after_alloc(self, request, num_external_tokens):
            if num_external_tokens:
                self.loads.append((request.request_id, num_external_tokens))

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def request_finished(self, request, block_ids):
            return False, None

        def update_connector_output(self, connector_output):
            pass

        def get_kv_events(self):
            return []

    names = ["lmcache", "lmcache.integration", "lmcache.integration.vllm",
             "lmcache.integration.vllm.vllm_v1_adapter"]
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[names[-1]].LMCacheConnectorV1Impl = Impl
    L = make_scheduler(12, KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both",
                                            engine_id="E0"))
    # lmcache-pool: with a cache pool, but no lmcache engine in the process
    # (as when vLLM's worker runs in another process): the hook never sees
    # lmcache perform the load.
    kh.tag(L, [0], role="mixed", cache_pool=2 if MODE == "lmcache-pool" else None)

    def lrun(rid, tokens, salt):
        L.add_request(make_req(rid, tokens, salt, 2))
        for _ in range(12):
            out = L.schedule()
            res = L.update_from_output(out, mro(L, out))
            for eco in res.values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        finished[o.request_id] = (str(o.finish_reason), None)
            if rid in finished:
                break

    lrun("a", list(range(100, 164)), "tenant-a")
    lrun("b", list(range(300, 460)), "tenant-b")  # reuses a's freed blocks
    lrun("a2", list(range(100, 166)), "tenant-c")
    facts["lmcache_loads"] = L.connector._lmcache_engine.loads
    facts["finish"] = {r: finished.get(r, (None,))[0] for r in ("a", "b", "a2")}
elif MODE == "broken":
    # A hook failure must never reach the engine: make the hook's own
    # slot mapping raise and run a request on the producer to its end.
    def boom(*a, **k):
        raise RuntimeError("planted hook failure")

    class Broken:  # the native module's per-step events and slot runs
        def __getattr__(self, name):
            return boom

    kh._native = Broken()
    P.add_request(make_req("b1", A, "tenant-a", 1))
    for _ in range(10):
        step(P)
        if "b1" in finished:
            break
    facts["b1_finish"] = finished.get("b1", (None,))[0]
else:
    raise SystemExit(f"unknown mode {MODE}")

facts["p_free_blocks"] = P.kv_cache_manager.block_pool.get_num_free_blocks()
if os.environ.get("KVTRAIL_DRIVER_EXIT") == "plain":
    # Exit as an engine does, without uninstall(): the hook's exit handler
    # must send what is queued and say goodbye.
    facts["hook_stats"] = kh.stats()
    facts["guard"] = kh.guard_stats()
    facts["alerts"] = kh.guard_alerts()
    print(json.dumps(facts))
    sys.stdout.flush()
else:
    kh.flush()
    facts["hook_stats"] = kh.stats()
    facts["guard"] = kh.guard_stats()
    facts["alerts"] = kh.guard_alerts()
    kh.uninstall()
    print(json.dumps(facts))
