//! The vLLM engine model: a discrete-event simulation of a vLLM 0.33.0
//! prefill/decode deployment with the NixlConnector (pull), one prefill
//! instance (pool 0) and one decode instance (pool 1), captured through
//! `capture::Recorder` exactly as an engine hook would capture it. The
//! rules and where they were read in the released package are in
//! docs/engine-vllm.md.
//!
//! The request path: front end (prompt >= max_model_len: 400) → prefill
//! (`BlockPool`: prefix hits `share`d, scoped by `cache_salt`; new blocks
//! `alloc`ed from the head of the free queue; forward `write` + `read`) →
//! the producer holds the request's blocks under a lease (`request_finished`
//! with `kv_lease_duration`) → decode (local prefix hits, `alloc` of the
//! rest, pull: a `write` with src on the decode pool per run of blocks, end
//! aligned as `_apply_prefix_caching` pairs them; the notification releases
//! the producer's blocks) → the last prompt token recomputed, decode in
//! blocks (alloc at block boundaries, write, read of the whole context) →
//! free. A failed load follows `kv_load_failure_policy`: `fail` answers
//! 500, `recompute` prefills again on decode.
//!
//! Fail-open paths (vllm-project/vllm#52234): a load NIXL reports done is
//! a success to decode whatever it read. `bug_stale_reference_ppm` hands
//! decode an earlier, consumed reference; `bug_lease_expiry` keeps decode's
//! heartbeats from the producer, whose lease then runs out while decode
//! still holds the reference. Either way decode reads blocks the producer
//! released (and may have reused), caches them and answers 200.
//! `bug_out_of_range_ppm` names remote blocks past the end of the
//! producer's pool: the read brings in memory of no request (`garbage` in
//! the truth), and the capture records each such run as a hole in the
//! decode pool, as the sidecar records the hook's out-of-range `xfer_pull`
//! run. `reference_check` (a mitigation, not a vLLM option) fails such a
//! load.
//!
//! Simulated time only; the ground truth comes from the model's own slot
//! bookkeeping at each read (`truth`), as in the SGLang model.
//!
//! The files: `server` (the state, the event loop and the KV primitives),
//! `scheduler` (front end, prefill, decode admission and steps, finish),
//! `connector` (the NixlConnector's pull, lease and heartbeats, failed
//! loads), `block_pool` (vLLM's block pool) and `tier` (the KV tiers
//! behind the block pools: a SimpleCPUOffload-style CPU tier on decode,
//! an LMCache-style store both instances share, each a `cache` pool) with
//! `offload` (the engine's stores into them and loads from them).
//! What both engine models share is `sim::base`.

mod block_pool;
mod connector;
mod offload;
mod scheduler;
mod server;
mod tier;

use crate::sim::base::{DECODE_POOL, PREFILL_POOL};
use crate::sim::config::{CacheSalt, PoolConfig, SGLANG_KEYS, SimConfig, VLLM_TIER_KEYS};
use crate::trace::manifest::{Deployment, Pool, PrefixCacheScope, Role};

pub(crate) use server::Engine;

pub use crate::sim::base::{CPU_POOL, LMCACHE_POOL};

/// The trace.json deployment of a simulated vLLM run: two pools of
/// `num_gpu_blocks` blocks each (block 0 is vLLM's null block), and the
/// effective config with the vLLM keys filled in.
pub fn deployment(cfg: &SimConfig) -> Deployment {
    let bs = cfg.block_size();
    let pool = |id: u16, name: &str, role: Role, p: &crate::sim::config::PoolConfig| {
        let blocks = p.capacity_tokens / bs as u64;
        let mut extra = serde_json::Map::new();
        extra.insert("num_gpu_blocks".into(), (blocks + 1).into());
        // The usable tokens, under the key what-if replay reads.
        extra.insert("max_total_num_tokens".into(), p.capacity_tokens.into());
        Pool {
            id,
            name: name.into(),
            role,
            capacity_tokens: (blocks + 1) * bs as u64,
            page_size: bs,
            extra,
        }
    };
    let mut sim = serde_json::to_value(cfg.vllm_effective()).expect("config serializes");
    if let Some(m) = sim.as_object_mut() {
        for k in SGLANG_KEYS {
            m.remove(k);
        }
        for k in VLLM_TIER_KEYS {
            if m.get(k).is_some_and(|v| v.is_null()) {
                m.remove(k);
            }
        }
    }
    let mut extra = serde_json::Map::new();
    extra.insert("simulator".into(), sim);
    let mut pools = vec![
        pool(PREFILL_POOL, "prefill-0", Role::Prefill, &cfg.prefill),
        pool(DECODE_POOL, "decode-0", Role::Decode, &cfg.decode),
    ];
    for (id, name, tokens) in [
        (CPU_POOL, "cpu-0", cfg.cpu_offload_tokens),
        (LMCACHE_POOL, "lmcache-0", cfg.lmcache_tokens),
    ] {
        if let Some(t) = tokens {
            let p = PoolConfig {
                capacity_tokens: t,
                page_size: bs,
            };
            let mut tier = pool(id, name, Role::Cache, &p);
            tier.extra.remove("num_gpu_blocks");
            pools.push(tier);
        }
    }
    Deployment {
        name: cfg.name.clone(),
        engine: cfg.engine.name().into(),
        context_window: cfg.context_window,
        pools,
        prefix_cache_scope: (cfg.prefix_cache && cfg.cache_salt() == CacheSalt::Tenant)
            .then_some(PrefixCacheScope::Tenant),
        extra,
    }
}
