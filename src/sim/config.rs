//! The simulated deployment: pools, admission, engine behaviour, router,
//! mitigations, sibling-bug switches and the timing model. One serde struct
//! read from TOML or JSON (`--config FILE`) and patched by `--set key=value`.
//!
//! Engine names and releases (`EngineVersion::parse`, the family of an
//! engine string) are parsed in `engines`, below the trace layer, where the
//! prompt limit of a trace's pool reads them too; re-exported here.
//!
//! Every knob is listed in docs/simulator.md with the SGLang flag it models
//! (the per-version table there).

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use crate::engines::{EngineFamily, EngineVersion, engine_family, is_vllm_engine};
use crate::error::{Error, Location, Result};
use crate::sim::alloc::FreeListPolicy;
use crate::trace::manifest::max_req_input_len;

/// Largest timeout or delay a config may give (`*_ms` keys): one day.
pub const MAX_DELAY_MS: u64 = 86_400_000;
/// Largest fixed cost of one step (`timing.*_us` keys): one hour.
pub const MAX_STEP_US: u64 = 3_600_000_000;
/// Largest cost per token or page (`timing.*_ns_per_*` keys): one second.
pub const MAX_PER_UNIT_NS: u64 = 1_000_000_000;

/// Largest HiCache host pool (`hicache_host_tokens`): the model keeps
/// state for every slot it simulates (2^26 tokens, the what-if limit for
/// a pool).
pub const MAX_HOST_TOKENS: u64 = 1 << 26;

/// What the customer gets back from the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterMode {
    /// Dual dispatch returning decode's answer (the stored sgl-router).
    DecodeAnswer,
    /// Acts on a non-2xx prefill answer at once (decode is not cancelled).
    PrefillError,
}

/// `--disaggregation-decode-allocation-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DecodeAllocation {
    /// Decode preallocates at intake (default; all versions).
    Early,
    /// Decode reserves KV only after prefill completes (0.5.22+).
    PrefillComplete,
}

/// vLLM: which `cache_salt` the deployment's clients send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheSalt {
    /// No salt (vLLM's default): any request may hit any cached prefix.
    None,
    /// The tenant as `cache_salt`: prefix hits stay within a tenant.
    Tenant,
}

/// vLLM `kv_load_failure_policy` (`config/kv_transfer.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailurePolicy {
    /// The request finishes with an error (HTTP 500); the default.
    Fail,
    /// The request is prefilled again on decode.
    Recompute,
}

/// One KV pool of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// SGLang's max_total_num_tokens (the admission capacity).
    pub capacity_tokens: u64,
    pub page_size: u32,
}

/// The whole simulated deployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimConfig {
    /// Deployment name written to trace.json.
    pub name: String,
    pub engine: EngineVersion,
    pub context_window: u64,
    pub prefill: PoolConfig,
    pub decode: PoolConfig,
    pub router: RouterMode,
    pub free_list: FreeListPolicy,
    /// Prefill-side radix (prefix) cache: shared prefixes are granted with
    /// `share`, not re-written.
    pub prefix_cache: bool,
    /// `--disaggregation-decode-enable-radix-cache`: decode keeps a
    /// finished request's prefix pages in its own radix tree and serves
    /// them (`share`) to later requests with the same prefix; prefill then
    /// sends only the pages past the decode-side prefix. With 0.5.19, a
    /// placeholder request's stale pages are inserted too (poisoning).
    pub decode_radix_cache: bool,
    /// HiCache (`--enable-hierarchical-cache`, write-back) on the decode
    /// radix tree: a tree entry evicted from the device pool is first
    /// offloaded to a host pool (role `cache`, pool id 2) by the engine,
    /// and a later prefix hit on it loads it back into fresh device pages.
    /// Needs `decode_radix_cache`.
    pub hicache: bool,
    /// Host pool capacity in tokens (`--hicache-size`; the default is twice
    /// the default decode pool, SGLang's `--hicache-ratio 2`); a multiple of
    /// the decode page size. The host pool evicts its least recently used
    /// entries when full.
    pub hicache_host_tokens: u64,
    /// `--allow-auto-truncate`.
    pub allow_auto_truncate: bool,
    /// `--disaggregation-enable-kv-checksum` (0.5.21+).
    pub kv_checksum: bool,
    /// `--disaggregation-decode-allocation-policy` (prefill-complete: 0.5.22+).
    pub decode_allocation: DecodeAllocation,
    /// SGLANG_DISAGGREGATION_WAITING_TIMEOUT, milliseconds.
    pub waiting_timeout_ms: u64,
    /// SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE; None = the
    /// version's default (off up to 0.5.20, on from 0.5.21).
    pub deferred_release: Option<bool>,
    /// ..._DEFERRED_DECODE_KV_RELEASE_TIMEOUT, milliseconds.
    pub deferred_release_timeout_ms: u64,
    /// Delay of prefill's ABORT_ACK after decode's ABORT; None = never
    /// acknowledged (a rejected request has no sender that owns the room),
    /// so deferred release waits for its timeout.
    pub abort_ack_ms: Option<u64>,
    /// Mitigation (not an SGLang option): zero freed slots (`scrub` events).
    pub scrub_on_free: bool,
    /// Sibling bug (#24527 class): when decode fails a request while a
    /// transfer into its slots is in flight, it frees them at once, and the
    /// late transfer lands in slots already given to another request.
    pub bug_inflight_reuse: bool,
    /// Sibling bug (vLLM #52234 class): prefill frees its slots when the
    /// forward ends, before the transfer has copied them; the copy reads
    /// whatever is there when it runs.
    pub bug_stale_copy: bool,
    pub timing: Timing,
    /// vLLM `--block-size` (None: 16). The pools' page_size follows it.
    pub block_size: Option<u32>,
    /// vLLM: the `cache_salt` clients send (None: `none`).
    pub cache_salt: Option<CacheSalt>,
    /// vLLM `kv_load_failure_policy` (None: `fail`).
    pub kv_load_failure_policy: Option<FailurePolicy>,
    /// vLLM NixlConnector `kv_lease_duration` in seconds (None: 30): how
    /// long the producer holds a finished request's blocks for decode.
    pub kv_lease_duration: Option<i64>,
    /// vLLM sibling bug trigger (vllm-project/vllm#52234): parts per
    /// million of decode dispatches handed the producer reference of an
    /// earlier, already consumed transfer (None: 0).
    pub bug_stale_reference_ppm: Option<u32>,
    /// vLLM sibling bug trigger: decode's lease heartbeats never reach
    /// the producer, so a lease runs out while decode still holds the
    /// reference (None: false).
    pub bug_lease_expiry: Option<bool>,
    /// vLLM sibling bug trigger (vllm-project/vllm#52234, "out-of-range
    /// remote_block_ids: 200, garbage"): parts per million of decode
    /// dispatches whose reference names remote block ids past the end of
    /// the producer's pool for its second half of blocks (all of a
    /// one-block reference); NIXL reports the read done (None: 0).
    pub bug_out_of_range_ppm: Option<u32>,
    /// vLLM: parts per million of transfers NIXL reports failed (None: 0).
    pub transfer_failure_ppm: Option<u32>,
    /// Mitigation, not a vLLM option: the producer refuses a read of blocks
    /// it no longer holds for that reference, so the load fails and
    /// `kv_load_failure_policy` applies (None: false).
    pub reference_check: Option<bool>,
    /// vLLM: a SimpleCPUOffload-style CPU tier on the decode instance, its
    /// capacity in tokens (None: no tier). Blocks evicted from the decode
    /// block pool's prefix cache are stored there; a later prefix miss it
    /// holds is loaded back into fresh decode blocks.
    pub cpu_offload_tokens: Option<u64>,
    /// vLLM sibling bug trigger for the CPU tier: parts per million of
    /// CPU-tier evictions that free the victim's blocks without dropping its
    /// key, so a later hit loads whatever reused them (None: 0).
    pub bug_stale_cpu_offload_ppm: Option<u32>,
    /// vLLM: an LMCache-style external store shared by both instances, its
    /// capacity in tokens (None: no store). Each instance stores a
    /// finished request's prefix chunks; prefill looks chunks up by their
    /// token-chunk hash (scoped by `cache_salt`) and loads hits into fresh
    /// blocks.
    pub lmcache_tokens: Option<u64>,
    /// LMCache `chunk_size` in tokens (None: 256), a multiple of block_size.
    pub lmcache_chunk_tokens: Option<u32>,
    /// vLLM sibling bug trigger for the LMCache store, as
    /// `bug_stale_cpu_offload_ppm` (None: 0).
    pub bug_stale_lmcache_ppm: Option<u32>,
}

/// The vLLM-only keys (null and left out of trace.json for SGLang).
pub const VLLM_KEYS: [&str; 14] = [
    "block_size",
    "cache_salt",
    "kv_load_failure_policy",
    "kv_lease_duration",
    "bug_stale_reference_ppm",
    "bug_lease_expiry",
    "bug_out_of_range_ppm",
    "transfer_failure_ppm",
    "reference_check",
    "cpu_offload_tokens",
    "bug_stale_cpu_offload_ppm",
    "lmcache_tokens",
    "lmcache_chunk_tokens",
    "bug_stale_lmcache_ppm",
];

/// The vLLM tier keys: left out of trace.json while unset, so traces of
/// runs without a tier are byte for byte those of earlier versions.
pub const VLLM_TIER_KEYS: [&str; 5] = [
    "cpu_offload_tokens",
    "bug_stale_cpu_offload_ppm",
    "lmcache_tokens",
    "lmcache_chunk_tokens",
    "bug_stale_lmcache_ppm",
];

/// The SGLang-only keys (left out of trace.json for vLLM; a vLLM config
/// must keep their defaults).
pub const SGLANG_KEYS: [&str; 14] = [
    "router",
    "free_list",
    "decode_radix_cache",
    "hicache",
    "hicache_host_tokens",
    "allow_auto_truncate",
    "kv_checksum",
    "decode_allocation",
    "waiting_timeout_ms",
    "deferred_release",
    "deferred_release_timeout_ms",
    "abort_ack_ms",
    "bug_inflight_reuse",
    "bug_stale_copy",
];

/// Largest `kv_lease_duration` (seconds): one day.
pub const MAX_LEASE_S: i64 = 86_400;

/// The timing model (simulated time only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timing {
    pub prefill_base_us: u64,
    pub prefill_ns_per_token: u64,
    pub transfer_base_us: u64,
    pub transfer_ns_per_page: u64,
    pub decode_step_us: u64,
    /// Output tokens per decode block: each block writes its tokens and
    /// reads the whole context once.
    pub decode_block_tokens: u32,
    /// Share of transfers that straggle (parts per million).
    pub straggler_ppm: u32,
    pub straggler_delay_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            prefill_base_us: 2_000,
            prefill_ns_per_token: 20_000,
            transfer_base_us: 500,
            transfer_ns_per_page: 2_000,
            decode_step_us: 20_000,
            decode_block_tokens: 64,
            straggler_ppm: 0,
            straggler_delay_ms: 0,
        }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            name: "kvtrail-sim".into(),
            engine: EngineVersion::V0519,
            context_window: 16_384,
            prefill: PoolConfig {
                capacity_tokens: 10_640,
                page_size: 16,
            },
            decode: PoolConfig {
                capacity_tokens: 32_768,
                page_size: 16,
            },
            router: RouterMode::DecodeAnswer,
            free_list: FreeListPolicy::SortedStaged,
            prefix_cache: true,
            decode_radix_cache: false,
            hicache: false,
            hicache_host_tokens: 65_536,
            allow_auto_truncate: false,
            kv_checksum: false,
            decode_allocation: DecodeAllocation::Early,
            waiting_timeout_ms: 300_000,
            deferred_release: None,
            deferred_release_timeout_ms: 30_000,
            abort_ack_ms: None,
            scrub_on_free: false,
            bug_inflight_reuse: false,
            bug_stale_copy: false,
            timing: Timing::default(),
            block_size: None,
            cache_salt: None,
            kv_load_failure_policy: None,
            kv_lease_duration: None,
            bug_stale_reference_ppm: None,
            bug_lease_expiry: None,
            bug_out_of_range_ppm: None,
            transfer_failure_ppm: None,
            reference_check: None,
            cpu_offload_tokens: None,
            bug_stale_cpu_offload_ppm: None,
            lmcache_tokens: None,
            lmcache_chunk_tokens: None,
            bug_stale_lmcache_ppm: None,
        }
    }
}

impl SimConfig {
    /// Reads a TOML (`.toml`) or JSON file.
    pub fn load(path: &Path) -> Result<SimConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let cfg: SimConfig = if path.extension().is_some_and(|e| e == "toml") {
            toml::from_str(&text).map_err(|e| {
                Error::invalid(
                    Location::file(path),
                    format!("not a simulator config: {e}"),
                    "see docs/simulator.md for the keys",
                )
            })?
        } else {
            serde_json::from_str(&text).map_err(|e| {
                Error::invalid(
                    Location::file(path).row(e.line() as u64),
                    format!("not a simulator config: {e}"),
                    "see docs/simulator.md for the keys (JSON, or TOML with a .toml name)",
                )
            })?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Applies `key=value` (dotted keys, e.g. `timing.decode_step_us=5000`;
    /// the value is JSON when it parses as JSON, else a string). The
    /// caller runs [`SimConfig::validate`] after the last one.
    pub fn set(&mut self, assignment: &str) -> Result<()> {
        let bad = |what: String| {
            Error::invalid(
                Location::default().column("--set"),
                what,
                "write --set key=value with a key of docs/simulator.md, e.g. --set engine=sglang-0.5.20",
            )
        };
        let (key, raw) = assignment
            .split_once('=')
            .ok_or_else(|| bad(format!("`{assignment}` has no `=`")))?;
        let value: serde_json::Value = serde_json::from_str(raw)
            .unwrap_or_else(|_| serde_json::Value::String(raw.to_string()));
        let mut root = serde_json::to_value(&*self).map_err(|e| bad(e.to_string()))?;
        let mut node = &mut root;
        for part in key.split('.') {
            node = node
                .as_object_mut()
                .and_then(|o| o.get_mut(part))
                .ok_or_else(|| bad(format!("unknown key `{key}`")))?;
        }
        *node = value;
        let mut cfg: SimConfig =
            serde_json::from_value(root).map_err(|e| bad(format!("`{assignment}`: {e}")))?;
        if key == "engine" {
            let v = cfg.engine;
            cfg.set_engine(v);
        }
        if key == "block_size"
            && cfg.engine.is_vllm()
            && let Some(b) = cfg.block_size
        {
            // One block size per deployment: the pools follow it.
            cfg.prefill.page_size = b;
            cfg.decode.page_size = b;
        }
        // Checked by the caller once every --set is applied: keys that
        // depend on each other (hicache needs decode_radix_cache) may come
        // in any order.
        *self = cfg;
        Ok(())
    }

    /// vLLM block size.
    pub fn block_size(&self) -> u32 {
        self.block_size.unwrap_or(16)
    }

    /// vLLM cache salt.
    pub fn cache_salt(&self) -> CacheSalt {
        self.cache_salt.unwrap_or(CacheSalt::None)
    }

    /// vLLM load failure policy.
    pub fn failure_policy(&self) -> FailurePolicy {
        self.kv_load_failure_policy.unwrap_or(FailurePolicy::Fail)
    }

    /// vLLM lease in seconds (validated: 1 ..= MAX_LEASE_S).
    pub fn lease_s(&self) -> u64 {
        self.kv_lease_duration.unwrap_or(30).max(1) as u64
    }

    /// Switches the engine; a vLLM engine takes the pools' page size as
    /// its block size when none is set.
    pub fn set_engine(&mut self, v: EngineVersion) {
        self.engine = v;
        if v.is_vllm()
            && self.block_size.is_none()
            && self.prefill.page_size == self.decode.page_size
        {
            self.block_size = Some(self.decode.page_size);
        }
    }

    /// The vLLM keys with their effective values (for trace.json).
    pub fn vllm_effective(&self) -> SimConfig {
        let mut c = self.clone();
        c.block_size = Some(self.block_size());
        c.cache_salt = Some(self.cache_salt());
        c.kv_load_failure_policy = Some(self.failure_policy());
        c.kv_lease_duration = Some(self.lease_s() as i64);
        c.bug_stale_reference_ppm = Some(self.bug_stale_reference_ppm.unwrap_or(0));
        c.bug_lease_expiry = Some(self.bug_lease_expiry.unwrap_or(false));
        c.bug_out_of_range_ppm = Some(self.bug_out_of_range_ppm.unwrap_or(0));
        c.transfer_failure_ppm = Some(self.transfer_failure_ppm.unwrap_or(0));
        c.reference_check = Some(self.reference_check.unwrap_or(false));
        if self.cpu_offload_tokens.is_some() {
            c.bug_stale_cpu_offload_ppm = Some(self.bug_stale_cpu_offload_ppm.unwrap_or(0));
        }
        if self.lmcache_tokens.is_some() {
            c.lmcache_chunk_tokens = Some(self.lmcache_chunk());
            c.bug_stale_lmcache_ppm = Some(self.bug_stale_lmcache_ppm.unwrap_or(0));
        }
        c
    }

    /// LMCache chunk size in tokens.
    pub fn lmcache_chunk(&self) -> u32 {
        self.lmcache_chunk_tokens.unwrap_or(256)
    }

    /// Keys of the other engine family that this config sets: a vLLM key
    /// on an SGLang engine, or an SGLang key changed from its default on a
    /// vLLM engine.
    fn foreign_keys(&self) -> Vec<&'static str> {
        let mine = serde_json::to_value(self).expect("config serializes");
        if self.engine.is_vllm() {
            let dflt = serde_json::to_value(SimConfig::default()).expect("config serializes");
            SGLANG_KEYS
                .into_iter()
                .filter(|k| mine.get(k) != dflt.get(k))
                .collect()
        } else {
            VLLM_KEYS
                .into_iter()
                .filter(|k| mine.get(k).is_some_and(|v| !v.is_null()))
                .collect()
        }
    }

    pub fn deferred_release(&self) -> bool {
        self.deferred_release
            .unwrap_or(self.engine.deferred_release_default())
    }

    /// Prefill's `max_req_input_len`.
    pub fn prefill_limit(&self) -> u64 {
        max_req_input_len(self.context_window, self.prefill.capacity_tokens)
    }

    /// Decode's `max_req_input_len`.
    pub fn decode_limit(&self) -> u64 {
        max_req_input_len(self.context_window, self.decode.capacity_tokens)
    }

    /// Every time knob with its allowed maximum (one place; docs/simulator.md
    /// lists the same ranges).
    fn time_knobs(&self) -> [(&'static str, u64, u64, &'static str); 9] {
        let t = &self.timing;
        [
            (
                "waiting_timeout_ms",
                self.waiting_timeout_ms,
                MAX_DELAY_MS,
                "one day in ms",
            ),
            (
                "deferred_release_timeout_ms",
                self.deferred_release_timeout_ms,
                MAX_DELAY_MS,
                "one day in ms",
            ),
            (
                "abort_ack_ms",
                self.abort_ack_ms.unwrap_or(0),
                MAX_DELAY_MS,
                "one day in ms",
            ),
            (
                "timing.straggler_delay_ms",
                t.straggler_delay_ms,
                MAX_DELAY_MS,
                "one day in ms",
            ),
            (
                "timing.prefill_base_us",
                t.prefill_base_us,
                MAX_STEP_US,
                "one hour in us",
            ),
            (
                "timing.transfer_base_us",
                t.transfer_base_us,
                MAX_STEP_US,
                "one hour in us",
            ),
            (
                "timing.decode_step_us",
                t.decode_step_us,
                MAX_STEP_US,
                "one hour in us",
            ),
            (
                "timing.prefill_ns_per_token",
                t.prefill_ns_per_token,
                MAX_PER_UNIT_NS,
                "one second in ns",
            ),
            (
                "timing.transfer_ns_per_page",
                t.transfer_ns_per_page,
                MAX_PER_UNIT_NS,
                "one second in ns",
            ),
        ]
    }

    /// The vLLM keys' ranges and vLLM's own startup checks.
    fn validate_vllm(&self) -> Result<()> {
        let bad = |col: &str, what: String, hint: &str| {
            Err(Error::invalid(Location::default().column(col), what, hint))
        };
        let b = self.block_size();
        if b == 0 {
            return bad(
                "block_size",
                "block_size = 0".into(),
                "vLLM's block_size is a positive number of tokens (CacheConfig requires > 0; 16 by default)",
            );
        }
        for (role, p) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if p.page_size != b {
                return bad(
                    &format!("{role}.page_size"),
                    format!(
                        "{role}.page_size {} differs from block_size {b}",
                        p.page_size
                    ),
                    "a vLLM deployment has one block size: set block_size (the pools follow it) and leave page_size alone",
                );
            }
            if p.capacity_tokens < self.context_window {
                return bad(
                    &format!("{role}.capacity_tokens"),
                    format!(
                        "{role} pool of {} tokens is below max_model_len (context_window) {}",
                        p.capacity_tokens, self.context_window
                    ),
                    "vLLM refuses to start when one max_model_len request does not fit its KV cache (kv_cache_planning.py _check_enough_kv_cache_memory): give capacity_tokens >= context_window",
                );
            }
        }
        match self.kv_lease_duration {
            Some(l) if !(1..=MAX_LEASE_S).contains(&l) => {
                return bad(
                    "kv_lease_duration",
                    format!("kv_lease_duration = {l}"),
                    "give the lease in whole seconds from 1 to 86400 (vLLM's default is 30)",
                );
            }
            _ => {}
        }
        for (key, v) in [
            ("bug_stale_reference_ppm", self.bug_stale_reference_ppm),
            ("bug_out_of_range_ppm", self.bug_out_of_range_ppm),
            ("transfer_failure_ppm", self.transfer_failure_ppm),
            ("bug_stale_cpu_offload_ppm", self.bug_stale_cpu_offload_ppm),
            ("bug_stale_lmcache_ppm", self.bug_stale_lmcache_ppm),
        ] {
            if v.unwrap_or(0) > 1_000_000 {
                return bad(
                    key,
                    format!("{key} above 1,000,000"),
                    "give parts per million (0 to 1000000)",
                );
            }
        }
        self.validate_tiers()
    }

    /// The vLLM tier keys: whole blocks (LMCache: whole chunks), at least
    /// two blocks, at most [`MAX_HOST_TOKENS`]; a stale-page trigger needs
    /// its tier.
    fn validate_tiers(&self) -> Result<()> {
        let b = self.block_size() as u64;
        let chunk = self.lmcache_chunk() as u64;
        if self.lmcache_tokens.is_some() && (chunk == 0 || chunk % b != 0) {
            return Err(Error::invalid(
                Location::default().column("lmcache_chunk_tokens"),
                format!("lmcache_chunk_tokens = {chunk} with block_size {b}"),
                "give a positive multiple of block_size (LMCache's chunk_size; 256 by default): a load fills whole blocks",
            ));
        }
        for (key, tokens, unit, stale_key, stale) in [
            (
                "cpu_offload_tokens",
                self.cpu_offload_tokens,
                b,
                "bug_stale_cpu_offload_ppm",
                self.bug_stale_cpu_offload_ppm,
            ),
            (
                "lmcache_tokens",
                self.lmcache_tokens,
                chunk.max(1),
                "bug_stale_lmcache_ppm",
                self.bug_stale_lmcache_ppm,
            ),
        ] {
            match tokens {
                Some(t) if t < 2 * unit || t % unit != 0 || t > MAX_HOST_TOKENS => {
                    return Err(Error::invalid(
                        Location::default().column(key),
                        format!("{key} = {t} with a unit of {unit} tokens"),
                        "give a multiple of the tier's unit (block_size; for LMCache its chunk) that holds at least two units, at most 67108864 (the model keeps state for every tier slot)",
                    ));
                }
                None if stale.is_some() => {
                    return Err(Error::invalid(
                        Location::default().column(stale_key),
                        format!("{stale_key} is set but {key} is not"),
                        format!(
                            "the trigger plants stale pages in that tier: set {key} too, or drop {stale_key}"
                        ),
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Checks combinations the modelled versions do not have.
    pub fn validate(&self) -> Result<()> {
        let bad = |col: &str, what: String, hint: &str| {
            Err(Error::invalid(Location::default().column(col), what, hint))
        };
        if let Some(k) = self.foreign_keys().first() {
            return if self.engine.is_vllm() {
                bad(
                    k,
                    format!(
                        "`{k}` is an SGLang key; engine {} is vLLM",
                        self.engine.name()
                    ),
                    "leave it at its default for a vLLM engine (vLLM's keys are in docs/engine-vllm.md), or choose an sglang-0.5.x engine",
                )
            } else {
                bad(
                    k,
                    format!(
                        "`{k}` is a vLLM key; engine {} is SGLang",
                        self.engine.name()
                    ),
                    "set engine = \"vllm-0.33.0\" (--engine vllm-0.33.0) to use it, or drop the key",
                )
            };
        }
        if self.engine.is_vllm() {
            self.validate_vllm()?;
        }
        for (role, p) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if p.page_size == 0 || p.capacity_tokens < 2 * p.page_size as u64 {
                return bad(
                    role,
                    format!(
                        "{role} pool of {} tokens, page_size {}",
                        p.capacity_tokens, p.page_size
                    ),
                    "capacity_tokens must hold at least two pages and page_size must be at least 1",
                );
            }
            if p.capacity_tokens % p.page_size as u64 != 0 {
                return bad(
                    role,
                    format!(
                        "{role} capacity_tokens {} is not a multiple of page_size {}",
                        p.capacity_tokens, p.page_size
                    ),
                    if self.engine.is_vllm() {
                        "a vLLM pool is whole blocks: give capacity_tokens = (num_gpu_blocks - 1) x block_size"
                    } else {
                        "SGLang rounds max_total_num_tokens down to whole pages; give a multiple"
                    },
                );
            }
            if (p.capacity_tokens / p.page_size as u64 + 1) * p.page_size as u64 > u32::MAX as u64 {
                return bad(
                    role,
                    format!("{role} pool too large"),
                    "keep slot ids within u32",
                );
            }
        }
        let host = self.hicache_host_tokens;
        let dps = self.decode.page_size as u64;
        if !self.engine.is_vllm() && (host < 2 * dps || host % dps != 0 || host > MAX_HOST_TOKENS) {
            return bad(
                "hicache_host_tokens",
                format!(
                    "hicache_host_tokens = {host} with a decode page_size of {}",
                    self.decode.page_size
                ),
                "give a multiple of the decode page_size that holds at least two pages, at most 67108864 (the model keeps state for every host slot)",
            );
        }
        if self.hicache && !self.decode_radix_cache {
            return bad(
                "hicache",
                "hicache is on but decode_radix_cache is off".into(),
                "the model's HiCache tier backs the decode radix tree: set decode_radix_cache = true too, or turn hicache off",
            );
        }
        if self.context_window < 8 {
            return bad(
                "context_window",
                "context_window below 8".into(),
                "use a real context window",
            );
        }
        if self.kv_checksum && self.engine < EngineVersion::V0521 {
            return bad(
                "kv_checksum",
                format!("kv_checksum does not exist in {}", self.engine.name()),
                "use sglang-0.5.21 or later, or turn kv_checksum off",
            );
        }
        if self.decode_allocation == DecodeAllocation::PrefillComplete
            && self.engine < EngineVersion::V0522
        {
            return bad(
                "decode_allocation",
                format!("prefill-complete does not exist in {}", self.engine.name()),
                "use sglang-0.5.22 or later, or decode_allocation = \"early\"",
            );
        }
        if self.timing.decode_block_tokens == 0 {
            return bad(
                "timing.decode_block_tokens",
                "decode_block_tokens is 0".into(),
                "use at least 1",
            );
        }
        for (key, value, max, unit) in self.time_knobs() {
            if value > max {
                return bad(
                    key,
                    format!("{key} = {value} is above {max} ({unit})"),
                    "give a value from 0 to the maximum (docs/simulator.md, \"Timing ranges\"); the simulated clock is nanoseconds in an i64",
                );
            }
        }
        if self.timing.straggler_ppm > 1_000_000 {
            return bad(
                "timing.straggler_ppm",
                "straggler_ppm above 1,000,000".into(),
                "give parts per million",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `c` with `assignment` applied and the result validated, as the
    /// command line does after its last --set.
    fn try_set(c: &mut SimConfig, assignment: &str) -> Result<()> {
        let mut next = c.clone();
        next.set(assignment)?;
        next.validate()?;
        *c = next;
        Ok(())
    }

    #[test]
    fn set_patches_nested_keys_and_validates() {
        let mut c = SimConfig::default();
        try_set(&mut c, "engine=sglang-0.5.22").unwrap();
        try_set(&mut c, "decode_allocation=prefill-complete").unwrap();
        try_set(&mut c, "timing.decode_step_us=5").unwrap();
        assert_eq!(c.engine, EngineVersion::V0522);
        assert_eq!(c.timing.decode_step_us, 5);
        assert!(try_set(&mut c, "engine=sglang-0.5.19").is_err()); // prefill-complete needs 0.5.22
        assert!(c.set("no_such=1").is_err());
        assert!(try_set(&mut c, "prefill.capacity_tokens=1000").is_err()); // not whole pages
    }

    #[test]
    fn hicache_needs_the_decode_tree_and_a_whole_page_host_pool() {
        let mut c = SimConfig::default();
        let err = try_set(&mut c, "hicache=true").unwrap_err().to_string();
        assert!(err.contains("hicache"), "{err}");
        try_set(&mut c, "decode_radix_cache=true").unwrap();
        try_set(&mut c, "hicache=true").unwrap();
        assert!(c.hicache);
        for bad in [
            "hicache_host_tokens=1000",
            "hicache_host_tokens=16",
            "hicache_host_tokens=4294967296",
            "hicache_host_tokens=\"x\"",
        ] {
            let err = try_set(&mut c, bad).unwrap_err().to_string();
            assert!(err.contains("hicache_host_tokens"), "{bad}: {err}");
        }
        try_set(&mut c, "hicache_host_tokens=4096").unwrap();
        assert_eq!(c.hicache_host_tokens, 4096);
    }

    #[test]
    fn keys_that_depend_on_each_other_may_be_set_in_any_order() {
        let mut c = SimConfig::default();
        c.set("hicache=true").unwrap();
        c.set("decode_radix_cache=true").unwrap();
        c.validate().unwrap();
        assert!(c.hicache && c.decode_radix_cache);
    }

    #[test]
    fn one_parser_reads_every_spelling_of_a_release() {
        use EngineVersion::*;
        for (s, v) in [
            ("sglang-0.5.19", Some(V0519)),
            ("sglang 0.5.19", Some(V0519)),
            ("sglang==0.5.22", Some(V0522)),
            ("SGLang v0.5.20", Some(V0520)),
            ("sglang 0.5.19 (PD)", Some(V0519)),
            ("  sglang-0.5.19.post1 ", Some(V0519)),
            ("sglang-0.5.19-post2", Some(V0519)),
            ("sglang-0.5.21+cu128", Some(V0521)),
            ("0.5.23", Some(V0523)),
            ("0.5.19.post1", Some(V0519)),
            ("vllm-0.33.0", Some(Vllm0330)),
            ("vLLM 0.33.0", Some(Vllm0330)),
            ("vllm==0.33.0.post1", Some(Vllm0330)),
            ("sglang-0.5.20rc1", None),
            ("sglang-0.5.20.dev3", None),
            ("sglang-0.5.19.1", None),
            ("sglang-0.5.19.", None),
            ("sglang-0.5.24", None),
            ("sglang-0.5", None),
            ("sglang", None),
            ("vllm-0.34.0", None),
            ("vllm 0.5.19", None),
            ("sglang-9", None),
            ("", None),
        ] {
            assert_eq!(EngineVersion::parse(s), v, "{s:?}");
        }
        for v in EngineVersion::ALL {
            assert_eq!(EngineVersion::parse(v.name()), Some(v));
        }
        assert!(is_vllm_engine(" vLLM"));
        assert!(is_vllm_engine("vllm-0.34.0"));
        assert!(!is_vllm_engine("sglang-0.5.19"));
        assert!(!is_vllm_engine("0.33.0"));
    }

    #[test]
    fn defaults_keep_the_incident_ratio() {
        let c = SimConfig::default();
        let ratio = c.prefill.capacity_tokens as f64 / c.context_window as f64;
        assert!((ratio - 681_280.0 / 1_048_576.0).abs() < 1e-3);
        assert_eq!(c.prefill_limit(), 10_634);
        assert_eq!(c.decode_limit(), 16_378);
        assert!(!c.deferred_release());
    }
}
