//! The SGLang engine model: a discrete-event simulation of an SGLang-style
//! prefill/decode-disaggregated server with one prefill pool (id 0), one
//! decode pool (id 1) and, with `hicache`, a host pool (id 2, role `cache`)
//! backing the decode radix tree, captured through `capture::Recorder`
//! exactly as an engine hook would capture it.
//!
//! The request path (docs/simulator.md, per SGLang version):
//! arrival → front-end context check (400) → both roles receive the request
//! (router dual dispatch) → each role checks `max_req_input_len` of its own
//! pool → decode preallocates the prompt it saw (`early` policy) → prefill
//! bootstraps, allocates (prefix-cache hits are `share`d), forwards (write,
//! read) → transfer: the prefill pages are copied into the decode pages
//! (`write` with src on the decode pool) and Success → decode generates in
//! blocks (alloc at page boundaries, write, read of the whole context) →
//! frees → response row. Version-specific branches for a prompt that the
//! prefill rejects are in [`PrefillMode`] and [`DecodeMode`].
//!
//! Simulated time only (never the wall clock): the same workload and
//! config give a byte-identical trace. Ground truth is kept from the
//! model's own slot bookkeeping at each read (see `truth`). Memory is
//! bounded by the pools and the requests in flight, not by the run length.
//!
//! The files: `server` (the state, the event loop and the KV primitives),
//! `admit` (arrival, scheduling, preallocation, eviction), `forward`
//! (prefill forward and the transfer to decode), `decode` (generation,
//! finish, failures, the response row) and `hicache` (the host pool). What
//! both engine models share is `sim::base`.

mod admit;
mod decode;
mod forward;
mod hicache;
mod server;

use crate::sim::base::{DECODE_POOL, HOST_POOL, PREFILL_POOL};
use crate::sim::config::SimConfig;
use crate::trace::manifest::{Deployment, Pool, Role};

pub(crate) use server::Engine;

/// Config keys written into trace.json only when `hicache` is on, so that
/// traces of runs without it stay byte-identical to those written before
/// the knob existed (a reader fills in the defaults).
const HICACHE_KEYS: [&str; 2] = ["hicache", "hicache_host_tokens"];

/// The trace.json deployment of a simulated SGLang run.
pub fn deployment(cfg: &SimConfig) -> Deployment {
    let pool = |id: u16, name: &str, role: Role, p: &crate::sim::config::PoolConfig| {
        let pages = p.capacity_tokens / p.page_size as u64;
        let mut extra = serde_json::Map::new();
        // The buffers hold page 0 (reserved) too: slot ids span
        // (pages + 1) * page_size; SGLang's max_total_num_tokens is kept here.
        extra.insert("max_total_num_tokens".into(), p.capacity_tokens.into());
        Pool {
            id,
            name: name.into(),
            role,
            capacity_tokens: (pages + 1) * p.page_size as u64,
            page_size: p.page_size,
            extra,
        }
    };
    let mut extra = serde_json::Map::new();
    let mut sim = serde_json::to_value(cfg).expect("config serializes");
    if let Some(m) = sim.as_object_mut() {
        if !cfg.hicache {
            for k in HICACHE_KEYS {
                m.remove(k);
            }
        }
        for k in crate::sim::config::VLLM_KEYS {
            m.remove(k);
        }
    }
    extra.insert("simulator".into(), sim);
    let mut pools = vec![
        pool(PREFILL_POOL, "prefill-0", Role::Prefill, &cfg.prefill),
        pool(DECODE_POOL, "decode-0", Role::Decode, &cfg.decode),
    ];
    if cfg.hicache {
        let host = crate::sim::config::PoolConfig {
            capacity_tokens: cfg.hicache_host_tokens,
            page_size: cfg.decode.page_size,
        };
        pools.push(pool(HOST_POOL, "host-0", Role::Cache, &host));
    }
    Deployment {
        name: cfg.name.clone(),
        engine: cfg.engine.name().into(),
        context_window: cfg.context_window,
        pools,
        prefix_cache_scope: None,
        extra,
    }
}
