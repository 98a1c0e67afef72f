//! Named scenarios: a deployment config plus a workload shape.
//!
//! - `incident`: a scaled-down replay of the disclosed incident. Context
//!   window 16,384 and a 10,640-token prefill pool keep the incident's
//!   pool/context ratio (681,280 / 1,048,576); the decode pool is twice the
//!   context window, as in the disclosed deployment. Ordinary traffic of
//!   many skewed tenants, with a handful of over-long prompts in the window
//!   only the prefill pool rejects; the two-week window is compressed to
//!   0.5 s between arrivals on average. Engine `sglang-0.5.19` by default.
//! - `steady`: the same deployment and traffic without over-long prompts:
//!   no defect is triggered.
//! - `sibling-inflight`: fixed engine (0.5.23) with the #24527-class bug
//!   switched on: some transfers straggle past decode's waiting timeout,
//!   decode frees their slots at once, the late copy lands in slots already
//!   given to another request.
//! - `sibling-stale-copy`: the vLLM #52234-class bug switched on: prefill
//!   frees its slots when its forward ends, the transfer runs later and
//!   copies whatever the next prefill wrote there.
//! - `vllm-steady`: vLLM 0.33.0 with the NixlConnector, per-tenant
//!   `cache_salt`, default lease and failure policy: no defect triggered.
//! - `vllm-stale-reference`: as `vllm-steady` with the #52234 trigger on:
//!   2% of decode dispatches carry an earlier, consumed producer reference;
//!   decode reads blocks the producer released and answers 200.
//! - `vllm-lease-expiry`: decode's heartbeats never reach the producer and
//!   3% of transfers straggle 8 s, past a 5 s lease: the producer releases
//!   the blocks (and may reuse them) before the pull reads them.
//! - `vllm-cpu-offload`: as `vllm-steady` with a decode KV cache of two
//!   maximal requests and a SimpleCPUOffload-style CPU tier (four): blocks
//!   the decode prefix cache evicts go to the CPU pool and come back on a
//!   later miss. No defect.
//! - `vllm-cpu-offload-stale`: a CPU tier of one maximal request, and 30%
//!   of its evictions free the victim's blocks without dropping its key:
//!   a later hit loads whatever reused them.
//! - `vllm-lmcache`: as `vllm-steady` with a prefill KV cache of two
//!   maximal requests and an LMCache-style store (eight) both instances
//!   store into and prefill loads from. No defect.
//! - `vllm-lmcache-stale`: a store of half a maximal request (32 chunks),
//!   with the same planted stale-key defect as `vllm-cpu-offload-stale`.

use crate::error::{Error, Location, Result};
use crate::sim::alloc::FreeListPolicy;
use crate::sim::config::{CacheSalt, EngineVersion, PoolConfig, SimConfig};
use crate::sim::workload::WorkloadSpec;

/// Scenario names, in `--scenario` order.
pub const SCENARIOS: [&str; 11] = [
    "incident",
    "steady",
    "sibling-inflight",
    "sibling-stale-copy",
    "vllm-steady",
    "vllm-stale-reference",
    "vllm-lease-expiry",
    "vllm-cpu-offload",
    "vllm-cpu-offload-stale",
    "vllm-lmcache",
    "vllm-lmcache-stale",
];

/// The vLLM scenarios' deployment: max_model_len 16,384; each instance's
/// KV cache holds eight maximal requests (131,072 tokens); 16-token
/// blocks; clients send their tenant as `cache_salt`.
fn vllm_config(name: &str) -> SimConfig {
    SimConfig {
        name: format!("kvtrail-sim {name}"),
        engine: EngineVersion::Vllm0330,
        prefill: PoolConfig {
            capacity_tokens: 131_072,
            page_size: 16,
        },
        decode: PoolConfig {
            capacity_tokens: 131_072,
            page_size: 16,
        },
        block_size: Some(16),
        cache_salt: Some(CacheSalt::Tenant),
        ..SimConfig::default()
    }
}

/// A named scenario, ready to run.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub config: SimConfig,
    pub workload: WorkloadSpec,
}

impl Scenario {
    /// Re-derives the workload's length windows from the (possibly patched)
    /// config: natural prompts avoid [prefill limit, context window);
    /// injected over-long prompts fall in [prefill limit, decode limit).
    pub fn fit_workload(&mut self) {
        let c = &self.config;
        let plim = c.prefill_limit().min(u32::MAX as u64) as u32;
        self.workload.forbid_from = plim;
        self.workload.forbid_below = c.context_window.min(u32::MAX as u64) as u32;
        self.workload.over_long_below =
            c.decode_limit().min(c.context_window).min(u32::MAX as u64) as u32;
    }
}

/// Builds scenario `name` with `requests` (or its default) and `seed`.
pub fn scenario(name: &str, requests: Option<u64>, seed: u64) -> Result<Scenario> {
    let base = WorkloadSpec {
        seed,
        requests: 5_000,
        tenants: 400,
        tenant_skew: 1.1,
        mean_gap_ns: 5e8,
        prompt_median: 700.0,
        prompt_sigma: 1.3,
        output_median: 120.0,
        output_sigma: 0.9,
        output_max: 2_048,
        prefix_share: 0.6,
        prefix_groups_per_tenant: 3,
        prefix_median: 400.0,
        forbid_from: 0,
        forbid_below: 0,
        over_long: 0,
        over_long_below: 0,
    };
    let mut config = SimConfig {
        name: format!("kvtrail-sim {name}"),
        ..SimConfig::default()
    };
    let mut workload = base;
    match name {
        "incident" => {
            workload.over_long = 6;
        }
        "steady" => {
            workload.requests = 20_000;
            workload.mean_gap_ns = 3e8;
        }
        "sibling-inflight" => {
            config.engine = EngineVersion::V0523;
            config.bug_inflight_reuse = true;
            config.free_list = FreeListPolicy::MostRecentlyFreed;
            config.waiting_timeout_ms = 5_000;
            config.timing.straggler_ppm = 20_000;
            config.timing.straggler_delay_ms = 8_000;
            workload.mean_gap_ns = 2e8;
        }
        "sibling-stale-copy" => {
            config.engine = EngineVersion::V0523;
            config.bug_stale_copy = true;
            config.free_list = FreeListPolicy::MostRecentlyFreed;
            config.timing.transfer_base_us = 40_000;
            workload.mean_gap_ns = 1.5e8;
            workload.prompt_median = 400.0;
        }
        "vllm-steady" => {
            config = vllm_config(name);
            workload.mean_gap_ns = 3e8;
        }
        "vllm-stale-reference" => {
            config = vllm_config(name);
            config.bug_stale_reference_ppm = Some(20_000);
            workload.mean_gap_ns = 1.5e8;
        }
        "vllm-lease-expiry" => {
            config = vllm_config(name);
            config.bug_lease_expiry = Some(true);
            config.kv_lease_duration = Some(5);
            config.timing.straggler_ppm = 30_000;
            config.timing.straggler_delay_ms = 8_000;
            workload.mean_gap_ns = 1.5e8;
        }
        "vllm-cpu-offload" | "vllm-cpu-offload-stale" => {
            config = vllm_config(name);
            config.decode.capacity_tokens = 32_768;
            if name.ends_with("-stale") {
                config.cpu_offload_tokens = Some(16_384);
                config.bug_stale_cpu_offload_ppm = Some(300_000);
            } else {
                config.cpu_offload_tokens = Some(65_536);
            }
            workload.mean_gap_ns = 3e8;
        }
        "vllm-lmcache" | "vllm-lmcache-stale" => {
            config = vllm_config(name);
            config.prefill.capacity_tokens = 32_768;
            if name.ends_with("-stale") {
                config.lmcache_tokens = Some(8_192);
                config.bug_stale_lmcache_ppm = Some(300_000);
            } else {
                config.lmcache_tokens = Some(131_072);
            }
            workload.mean_gap_ns = 3e8;
        }
        _ => {
            return Err(Error::invalid(
                Location::default().column("--scenario"),
                format!("unknown scenario `{name}`"),
                format!("choose one of: {}", SCENARIOS.join(", ")),
            ));
        }
    }
    if let Some(n) = requests {
        workload.requests = n;
    }
    let mut s = Scenario {
        name: name.to_string(),
        config,
        workload,
    };
    s.fit_workload();
    Ok(s)
}
