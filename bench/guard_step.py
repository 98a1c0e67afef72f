"""The hook's and the guard's cost per scheduler step, on vLLM 0.33.0's
real v1 Scheduler (KV cache manager, block pool, prefix cache) on CPU, in
one run: hook off, hook on (KVTRAIL_GUARD=off), hook + guard (alert).

Each round builds a fresh scheduler and freezes the heap built so far,
as vLLM's EngineCore does once it is built (freeze_gc_heap: the
collector then walks only what serving allocates), admits --batch requests (distinct
prompts, one salt) and steps schedule() + update_from_output() (the model
runner's output synthetic: one sampled token per request) until all
finish. The step time is the wall time of those two calls; the table gives
the median over decode steps (every request decoding) and the mean over
all steps (prefill included), per configuration, the median of --rounds
rounds run interleaved (off, hook, guard, off, ...), and the cost added
per step against hook off. A second table gives CPU time, which other
processes on the machine disturb less than wall time: the engine
thread's per decode step (median) and the hook's sender thread's per
decode step (its CPU from the first decode step, with what prefill
queued sent first, to the round's end, drained, divided by the decode
steps), and their sum added over hook off. Last, the native step's own
CPU per decode step in place (its inputs as cold as the scheduler leaves
them) and replayed (the same inputs, warm in the CPU's caches).

Usage (after .ci/setup.d/32-vllm.sh and 34-kvtrail-guard.sh):
  PYTHONPATH=hooks/vllm/src:hooks/client/src:target/kvtrail-guard-native \\
    ~/.cache/kvtrail/venv-vllm-0.33.0/bin/python bench/guard_step.py \\
    [--batch 256] [--prompt 64] [--decode 32] [--rounds 3] [--kvtrail target/release/kvtrail]

With --kvtrail, a `kvtrail record` sidecar receives the events (its
sender thread shares the engine's interpreter, so its cost is counted);
without, the sidecar address is unreachable and the events are counted as
lost (the engine thread's cost is the same: a deque append per item, one
item per step for the step's lines).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--prompt", type=int, default=64)
ap.add_argument("--decode", type=int, default=32)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--replay-only", action="store_true",
                help="only the guard's replayed cost (e.g. to compare guard modules)")
ap.add_argument("--kvtrail", default=None, help="kvtrail binary: run a record sidecar")
args = ap.parse_args()

import kvtrail_vllm as kh  # noqa: E402
import torch  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.gc_utils import freeze_gc_heap  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BS = 16
B = args.batch
NB = B * ((args.prompt + args.decode) // BS + 2) + 16
tmp = tempfile.mkdtemp()
with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
               "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 4096}, f)
init_none_hash(sha256)

sidecar = None
sock = os.path.join(tmp, "kvtrail.sock")
if args.kvtrail:
    dep = os.path.join(tmp, "deploy.json")
    with open(dep, "w") as f:
        json.dump({"name": "guard-bench", "engine": "vllm 0.33.0", "context_window": 4096,
                   "pools": [{"id": 0, "name": "engine-0", "role": "mixed",
                              "capacity_tokens": NB * BS, "page_size": BS}]}, f)
    sidecar = subprocess.Popen([args.kvtrail, "record", "--listen", f"unix:{sock}", "--deployment", dep,
                                "--out", os.path.join(tmp, "trace"), "--health-secs", "0"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not os.path.exists(sock):
        if time.time() - t0 > 30 or sidecar.poll() is not None:
            sys.exit("the sidecar did not start")
        time.sleep(0.02)


def make_scheduler():
    mc = ModelConfig(model=tmp, skip_tokenizer_init=True, dtype="float16", max_model_len=4096)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                    scheduler_config=SchedulerConfig(max_num_seqs=B, max_num_batched_tokens=B * args.prompt,
                                                     max_model_len=4096, is_encoder_decoder=False,
                                                     async_scheduling=False),
                    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True))
    vc.cache_config.num_gpu_blocks = NB
    groups = [KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                                            dtype=torch.float32))]
    kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(vllm_config=vc, kv_cache_config=kcc, block_size=BS, log_stats=False,
                     structured_output_manager=StructuredOutputManager(vc))


class InSitu:
    """The hook's native module, its schedule_step timed on the engine
    thread (CPU) in every decode step: the native step in place, its
    inputs as cold as the scheduler leaves them (the replayed figure below
    reads them warm)."""

    def __init__(self, mod):
        self.mod = mod
        self.times = []

    def __getattr__(self, name):
        return getattr(self.mod, name)

    def schedule_step(self, *a):
        t = time.thread_time()
        try:
            return self.mod.schedule_step(*a)
        finally:
            if len(a[0]) == B and all(v == 1 for v in a[0].values()):
                self.times.append(time.thread_time() - t)


def one_round(tag, seed):
    s = make_scheduler()
    # EngineCore.__init__ freezes the startup heap once the engine is built
    # (vllm/v1/engine/core.py: freeze_gc_heap), so the collector never
    # walks it while serving; the engine here is the scheduler.
    freeze_gc_heap()
    if tag != "off":
        kh.tag(s, [0])
    hasher = get_request_block_hasher(BS, sha256)
    for i in range(B):
        sp = SamplingParams(max_tokens=args.decode, ignore_eos=True)
        sp.update_from_generation_config({}, eos_token_id=2)
        toks = [(seed * 7919 + i * 131 + k) % 31000 + 3 for k in range(args.prompt)]
        s.add_request(Request(f"{tag}-{seed}-{i}", toks, sp, None, cache_salt="t", block_hasher=hasher))
    steps, decode, cpu = [], [], []
    sent0 = None  # the sender threads' CPU when the decode steps begin
    while s.requests:
        t = time.perf_counter()
        c0 = time.thread_time()
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        m = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              sampled_token_ids=[[] if r in s.requests and s.requests[r].is_prefill_chunk
                                                 else [7] for r in ids])
        s.update_from_output(out, m)
        dc = time.thread_time() - c0
        dt = time.perf_counter() - t
        steps.append(dt)
        if len(ids) == B and out.total_num_scheduled_tokens == B:
            if sent0 is None:
                # The first decode step: the sender's CPU counts from here,
                # once it has sent everything queued before this step.
                if tag != "off":
                    kh.flush()
                sent0 = sender_cpu()
                decode_steps = 0
            decode.append(dt)
            cpu.append(dc)
            decode_steps += 1
        if len(steps) > 10 * (args.decode + args.prompt):
            sys.exit("the scheduler did not finish the batch")
    if tag != "off":
        kh.flush()
    sent = sender_cpu()
    sender = (sum(sent[k] - (sent0 or {}).get(k, 0.0) for k in sent) / decode_steps
              if sent0 is not None and decode_steps else 0.0)
    return steps, decode, cpu, sender


def sender_cpu():
    """CPU seconds of each live sender thread of the hook (the shared
    client's `kvtrail-sender`, which shares the engine's interpreter), by
    thread."""
    import threading
    out = {}
    for t in threading.enumerate():
        if t.name == "kvtrail-sender" and t.ident is not None:
            try:
                out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:
                pass  # ended meanwhile
    return out


def replay_round(seed):
    """The guard's own engine-thread work per decode step, without the
    sender thread's GIL share: one round with the hook on, the native
    step's input of each step copied; then each decode step's native step
    run again, once unguarded and once into a fresh native guard (fed the
    round's other events as the hook pushes them, in order), timed. The
    difference is the guard's: mirroring the writes and the checks."""
    import kvtrail_guard

    kh.install(capture=f"unix:{sock}", pools=[0], worker="bench-replay", guard="off")
    per_step, cur = [], []
    g = kh._H.guard
    g.push = cur.append  # the hooks' other events: recorded, replayed in order
    real = kh._native.schedule_step

    class Blk:
        __slots__ = ("block_id",)

        def __init__(self, i):
            self.block_id = i

    class Req:
        __slots__ = ("num_computed_tokens",)

        def __init__(self, n):
            self.num_computed_tokens = n

    blk_objs = {}  # one object per block, as the engine's pool has

    def blk(i):
        b = blk_objs.get(i)
        if b is None:
            b = blk_objs[i] = Blk(i)
        return b

    class Rec:
        @staticmethod
        def schedule_step(sched_, requests, reqs, groups, tables, ts, guard, guarded, waits, rid_of, cache=None):
            snap = (dict(sched_), {k: Req(requests[k].num_computed_tokens) for k in sched_ if k in requests},
                    {k: dict(reqs[k]) for k in sched_ if k in reqs}, list(groups),
                    [{k: [blk(b.block_id) for b in t[k]] for k in sched_ if k in t} for t in tables], ts)
            per_step.append((cur[:], snap))
            cur.clear()
            return real(sched_, requests, reqs, groups, tables, ts, guard, guarded, waits, rid_of, cache)

        slot_runs = staticmethod(kh._native.slot_runs)
        StepCache = kh._native.StepCache

    kh._native = Rec
    s = make_scheduler()
    freeze_gc_heap()
    kh.tag(s, [0])
    hasher = get_request_block_hasher(BS, sha256)
    for i in range(B):
        sp = SamplingParams(max_tokens=args.decode, ignore_eos=True)
        sp.update_from_generation_config({}, eos_token_id=2)
        toks = [(seed * 7919 + i * 131 + k) % 31000 + 3 for k in range(args.prompt)]
        s.add_request(Request(f"replay-{seed}-{i}", toks, sp, None, cache_salt="t", block_hasher=hasher))
    while s.requests:
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        m = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              sampled_token_ids=[[] if s.requests[r].is_prefill_chunk else [7] for r in ids])
        s.update_from_output(out, m)
    kh.flush()
    kh.uninstall()
    kh._native = kvtrail_guard

    def run(guard):
        times = []
        checked = set()  # the hook's eng.guarded: a request is checked once
        cache = kvtrail_guard.StepCache()  # the hook's eng.step_cache
        for pushed, (sched_, requests, reqs, groups, tables, ts) in per_step:
            if guard is not None:
                for it in pushed:
                    guard.push(it)
            decode_step = len(sched_) == B and all(v == 1 for v in sched_.values())
            t = time.perf_counter()
            step = kvtrail_guard.schedule_step(sched_, requests, reqs, groups, tables, ts, guard,
                                               checked if guard is not None else None, {}, kh.request_id,
                                               cache)
            dt = time.perf_counter() - t
            checked.update(c[0] for c in step.checks)
            if decode_step:
                times.append(dt)
        return times

    bare = run(None)
    guarded = run(kvtrail_guard.Guard())
    diffs = [b - a for a, b in zip(bare, guarded)]
    return statistics.median(diffs) if diffs else float("nan"), statistics.median(bare) if bare else 0.0


results = {"off": [], "hook": [], "guard": []}
for r in range(0 if args.replay_only else args.rounds):
    for tag in ("off", "hook", "guard"):
        insitu = None
        if tag != "off":
            kh.install(capture=f"unix:{sock}", pools=[0], worker=f"bench-{tag}",
                       guard="off" if tag == "hook" else "alert")
            if tag == "guard" and not kh._H.guard.active:
                sys.exit("the guard's native module is not importable (PYTHONPATH)")
            insitu = kh._native = InSitu(kh._native)
        steps, decode, cpu, sender = one_round(tag, r)
        if tag != "off":
            g = kh.guard_stats()
            if tag == "guard" and (g["foreign"] or g["unknown"] or not g["checks"]):
                sys.exit(f"the guard tripped on a clean batch: {g}")
            kh.flush()
            kh.uninstall()
        results[tag].append((statistics.median(decode) if decode else float("nan"),
                             statistics.mean(steps), len(steps), len(decode),
                             statistics.median(cpu) if cpu else float("nan"), sender,
                             statistics.median(insitu.times) if insitu and insitu.times else 0.0))

replay = [replay_round(100 + r) for r in range(args.rounds)]

if sidecar is not None:
    sidecar.terminate()
    sidecar.wait()

if args.replay_only:
    rep = statistics.median(x[0] for x in replay)
    sys.exit(print(f"batch {B}: guard alone (replayed): {rep * 1e6:.1f} us per decode step "
                   f"({rep / B * 1e9:.0f} ns per request)"))
native_step = statistics.median(x[1] for x in replay)
print(f"vLLM {__import__('vllm').__version__} Scheduler on CPU, batch {B}, prompt {args.prompt}, "
      f"decode {args.decode}, {args.rounds} rounds, sidecar {'yes' if sidecar else 'no (unreachable)'}")
print(f"{'config':<8} {'decode step ms (median)':>24} {'all steps ms (mean)':>20} {'added/step ms':>14}")
base = statistics.median(x[0] for x in results["off"])
for tag in ("off", "hook", "guard"):
    d = statistics.median(x[0] for x in results[tag])
    a = statistics.median(x[1] for x in results[tag])
    print(f"{tag:<8} {d * 1e3:>24.3f} {a * 1e3:>20.3f} {(d - base) * 1e3:>14.3f}")
hook = statistics.median(x[0] for x in results["hook"])
guard = statistics.median(x[0] for x in results["guard"])
print(f"guard over hook: {(guard - hook) * 1e6:.0f} us per decode step ({(guard - hook) / B * 1e9:.0f} ns "
      f"per request); hook over off: {(hook - base) * 1e6:.0f} us")
# CPU time, less sensitive to what else the machine runs than wall time:
# the engine thread's per decode step, and the sender thread's per decode
# step (its CPU from the first decode step, the queue drained there, to
# the round's end, drained, over the decode steps).
cpu_off = statistics.median(x[4] for x in results["off"])
print(f"{'config':<8} {'engine thread CPU/decode step ms':>33} {'sender CPU/decode step ms':>26} "
      f"{'added CPU ms':>13}")
for tag in ("off", "hook", "guard"):
    c = statistics.median(x[4] for x in results[tag])
    snd = statistics.median(x[5] for x in results[tag])
    print(f"{tag:<8} {c * 1e3:>33.3f} {snd * 1e3:>26.3f} {(c - cpu_off + snd) * 1e3:>13.3f}")
for tag in ("hook", "guard"):
    n = statistics.median(x[6] for x in results[tag])
    print(f"the native step in place ({tag}, engine thread CPU, median decode step): {n * 1e6:.1f} us "
          f"({n / B * 1e9:.0f} ns per request)")
rep = statistics.median(x[0] for x in replay)
print(f"guard alone (its decode-step input replayed, engine thread only): {rep * 1e6:.1f} us per decode "
      f"step ({rep / B * 1e9:.0f} ns per request)")
print(f"the native step unguarded (replayed): {native_step * 1e6:.1f} us per decode step "
      f"({native_step / B * 1e9:.0f} ns per request)")
