//! Workloads: the arrivals the engine model serves. An [`Arrival`] is what a
//! recorded request row plus its prefix structure says about a request, so
//! the same engine can run generated traffic or re-run recorded traffic
//! (what-if replay) from a `Vec<Arrival>`.
//!
//! The generator is seeded and streaming (an iterator; memory does not grow
//! with the request count) and uses only basic IEEE arithmetic (its own
//! `ln`/`exp`), so a seed gives the same workload on every platform.
//! Shape: many tenants with Zipf-skewed weights (a few heavy, a long tail),
//! Poisson arrivals, log-normal prompt lengths whose tail passes the
//! context window, log-normal output lengths, per-tenant shared system
//! prompts (prefix groups), and an optional handful of over-long prompts in
//! the window the prefill pool rejects but the context window admits.

use crate::sim::model;

/// One request offered to the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// Unique, from 1.
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: String,
    /// Simulated time, ns since the scenario start.
    pub arrival_ns: i64,
    pub prompt_tokens: u32,
    /// Tokens the request generates when it runs to the end.
    pub output_tokens: u32,
    /// Shared-prefix group (e.g. a tenant's system prompt), if any.
    pub prefix_group: Option<u64>,
    /// Length of the shared prefix (<= prompt_tokens).
    pub prefix_tokens: u32,
    /// A recorded prompt hash (what-if replay of a recorded trace): used
    /// instead of the hash of the generated token ids, so the replayed
    /// request keeps its prompt_hash and its reference-model seed.
    pub recorded_prompt_hash: Option<[u8; 32]>,
}

impl Arrival {
    /// Content seed of the request's own (non-prefix) tokens.
    pub fn content_seed(&self) -> u64 {
        model::mix64(self.request_id ^ 0xA076_1D64_78BD_642F)
    }

    /// The prompt token ids (prefix group's tokens, then its own).
    pub fn prompt_token_ids(&self, len: u32) -> impl Iterator<Item = u32> + '_ {
        let own = self.content_seed();
        let group = self.prefix_group.map(group_seed).unwrap_or(own);
        (0..len).map(move |p| {
            let s = if p < self.prefix_tokens { group } else { own };
            model::prompt_token(s, p)
        })
    }

    /// The customer's prompt_hash: blake3 of the prompt token ids (u32
    /// little-endian). A prompt longer than [`HASHED_PROMPT_TOKENS`] (far
    /// above any context window: the engine never reads it whole) is
    /// identified by blake3 of its description instead (a tag, content
    /// seeds, prefix length and length), so its cost does not grow with a
    /// recorded `prompt_tokens`.
    pub fn prompt_hash(&self) -> [u8; 32] {
        if let Some(h) = self.recorded_prompt_hash {
            return h;
        }
        if self.prompt_tokens > HASHED_PROMPT_TOKENS {
            let mut h = blake3::Hasher::new();
            h.update(b"kvtrail-sim long prompt v1");
            h.update(&self.content_seed().to_le_bytes());
            h.update(&self.prefix_group.map(group_seed).unwrap_or(0).to_le_bytes());
            h.update(&self.prefix_tokens.to_le_bytes());
            h.update(&self.prompt_tokens.to_le_bytes());
            return *h.finalize().as_bytes();
        }
        let mut h = blake3::Hasher::new();
        let mut buf = Vec::with_capacity(4096);
        for t in self.prompt_token_ids(self.prompt_tokens) {
            buf.extend_from_slice(&t.to_le_bytes());
            if buf.len() >= 4096 {
                h.update(&buf);
                buf.clear();
            }
        }
        h.update(&buf);
        *h.finalize().as_bytes()
    }
}

/// Longest prompt whose prompt_hash covers its token ids (1 Mi tokens).
pub const HASHED_PROMPT_TOKENS: u32 = 1 << 20;

/// Seed of a prefix group's tokens.
pub fn group_seed(group: u64) -> u64 {
    model::mix64(group ^ 0xE703_7ED1_A0B4_28DB)
}

/// Deterministic PRNG (splitmix64 stream).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        model::mix64(self.0.wrapping_sub(0x9E37_79B9_7F4A_7C15))
    }

    /// Uniform in (0, 1).
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Uniform integer in [lo, hi).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo).max(1)
    }

    /// Standard normal (Box-Muller with our own cos via sin-free polar form).
    pub fn normal(&mut self) -> f64 {
        loop {
            let u = 2.0 * self.unit() - 1.0;
            let v = 2.0 * self.unit() - 1.0;
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                return u * sqrt(-2.0 * ln(s) / s);
            }
        }
    }

    pub fn exponential(&mut self, mean: f64) -> f64 {
        -ln(self.unit()) * mean
    }

    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * exp(sigma * self.normal())
    }
}

/// Natural log from basic arithmetic only (platform-independent results).
pub fn ln(x: f64) -> f64 {
    debug_assert!(x > 0.0);
    let bits = x.to_bits();
    let e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let m = f64::from_bits((bits & 0x000F_FFFF_FFFF_FFFF) | 0x3FF0_0000_0000_0000);
    // ln(m) = 2 atanh((m-1)/(m+1)), m in [1, 2)
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let mut sum = 0.0;
    let mut pow = t;
    let mut k = 1.0;
    for _ in 0..30 {
        sum += pow / k;
        pow *= t2;
        k += 2.0;
    }
    2.0 * sum + e as f64 * std::f64::consts::LN_2
}

/// e^x from basic arithmetic only.
pub fn exp(x: f64) -> f64 {
    let k = (x / std::f64::consts::LN_2).round();
    let r = x - k * std::f64::consts::LN_2;
    let mut term = 1.0;
    let mut sum = 1.0;
    for i in 1..25 {
        term *= r / i as f64;
        sum += term;
    }
    let k = k.clamp(-1000.0, 1000.0) as i64;
    sum * f64::from_bits(((1023 + k.clamp(-1022, 1023)) as u64) << 52)
}

/// Square root (IEEE sqrt is exactly rounded everywhere).
fn sqrt(x: f64) -> f64 {
    x.sqrt()
}

/// Shape of generated traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    pub seed: u64,
    pub requests: u64,
    pub tenants: u32,
    /// Zipf exponent of tenant weights.
    pub tenant_skew: f64,
    /// Mean inter-arrival time, ns.
    pub mean_gap_ns: f64,
    pub prompt_median: f64,
    pub prompt_sigma: f64,
    pub output_median: f64,
    pub output_sigma: f64,
    pub output_max: u32,
    /// Share of requests that start with their tenant's shared prefix.
    pub prefix_share: f64,
    pub prefix_groups_per_tenant: u32,
    pub prefix_median: f64,
    /// Prompts longer than this (and shorter than `forbid_below`) are
    /// redrawn, so that only the injected over-long prompts fall in the
    /// window [forbid_from, forbid_below).
    pub forbid_from: u32,
    pub forbid_below: u32,
    /// Over-long prompts injected, each with a length in
    /// [forbid_from, over_long_below).
    pub over_long: u32,
    pub over_long_below: u32,
}

/// Streaming generator of [`Arrival`]s.
pub struct Generator {
    spec: WorkloadSpec,
    rng: Rng,
    cum: Vec<f64>,
    next_id: u64,
    t: f64,
    over_long_at: Vec<u64>,
}

impl Generator {
    pub fn new(spec: WorkloadSpec) -> Generator {
        let mut rng = Rng::new(spec.seed);
        let mut cum = Vec::with_capacity(spec.tenants as usize);
        let mut acc = 0.0;
        for k in 0..spec.tenants.max(1) {
            acc += 1.0 / exp(spec.tenant_skew * ln(k as f64 + 1.0));
            cum.push(acc);
        }
        // Over-long prompts: spread over the run, one per equal slice, never
        // in the first 5% (the pools are warm when they come).
        let mut over_long_at = Vec::new();
        let n = spec.requests.max(1);
        let k = (spec.over_long as u64).min(n);
        for i in 0..k {
            let lo = n / 20 + (n - n / 20) * i / k.max(1);
            let hi = n / 20 + (n - n / 20) * (i + 1) / k.max(1);
            over_long_at.push(rng.range(lo, hi.max(lo + 1)) + 1);
        }
        over_long_at.sort_unstable();
        over_long_at.dedup();
        Generator {
            spec,
            rng,
            cum,
            next_id: 1,
            t: 0.0,
            over_long_at,
        }
    }

    /// Request ids that got an injected over-long prompt.
    pub fn over_long_ids(&self) -> &[u64] {
        &self.over_long_at
    }

    fn tenant(&mut self) -> u32 {
        let total = *self.cum.last().expect("at least one tenant");
        let x = self.rng.unit() * total;
        self.cum.partition_point(|&c| c < x).min(self.cum.len() - 1) as u32
    }
}

impl Iterator for Generator {
    type Item = Arrival;

    fn next(&mut self) -> Option<Arrival> {
        if self.next_id > self.spec.requests {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        let s = &self.spec;
        let (mean_gap, pm, psig, om, osig, omax) = (
            s.mean_gap_ns,
            s.prompt_median,
            s.prompt_sigma,
            s.output_median,
            s.output_sigma,
            s.output_max,
        );
        let (share, groups, prefix_median) =
            (s.prefix_share, s.prefix_groups_per_tenant, s.prefix_median);
        let (lo, hi, ol_hi) = (s.forbid_from, s.forbid_below, s.over_long_below);
        self.t += self.rng.exponential(mean_gap);
        let tenant = self.tenant();
        let prompt = if self.over_long_at.binary_search(&id).is_ok() {
            self.rng.range(lo as u64, ol_hi.max(lo + 1) as u64) as u32
        } else {
            loop {
                let p = self.rng.lognormal(pm, psig).clamp(1.0, 4e9) as u32;
                if !(lo..hi).contains(&p) {
                    break p.max(1);
                }
            }
        };
        let output = (self.rng.lognormal(om, osig) as u32).clamp(1, omax.max(1));
        let (group, prefix) = if groups > 0 && self.rng.unit() < share {
            let g = self.rng.range(0, groups as u64);
            let gid = tenant as u64 * groups as u64 + g + 1;
            // A group's prefix length is a property of the group.
            let mut grng = Rng::new(group_seed(gid));
            let len = grng.lognormal(prefix_median, 0.5).clamp(1.0, 1e9) as u32;
            (Some(gid), len.min(prompt.saturating_sub(1)))
        } else {
            (None, 0)
        };
        Some(Arrival {
            request_id: id,
            external_id: Some(format!("req-{id:08}")),
            tenant: format!("tenant-{tenant:04}"),
            arrival_ns: self.t as i64,
            prompt_tokens: prompt,
            output_tokens: output,
            prefix_group: if prefix > 0 { group } else { None },
            prefix_tokens: prefix,
            recorded_prompt_hash: None,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.spec.requests + 1).saturating_sub(self.next_id) as usize;
        (left, Some(left))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::hash_tokens;

    #[test]
    fn ln_and_exp_are_accurate() {
        for x in [1e-9, 0.3, 1.0, 2.5, 1234.5, 1e12] {
            assert!(
                (ln(x) - x.ln()).abs() < 1e-12 * x.ln().abs().max(1.0),
                "{x}"
            );
        }
        for x in [-20.0, -1.0, 0.0, 0.5, 3.0, 40.0] {
            assert!((exp(x) - x.exp()).abs() <= 1e-13 * x.exp(), "{x}");
        }
    }

    #[test]
    fn prompt_hash_matches_hash_tokens() {
        let a = Arrival {
            request_id: 3,
            external_id: None,
            tenant: "t".into(),
            arrival_ns: 0,
            prompt_tokens: 5000,
            output_tokens: 1,
            prefix_group: Some(9),
            prefix_tokens: 100,
            recorded_prompt_hash: None,
        };
        let toks: Vec<u32> = a.prompt_token_ids(5000).collect();
        assert_eq!(a.prompt_hash(), hash_tokens(&toks));
    }

    #[test]
    fn generator_is_seeded_skewed_and_injects_over_long() {
        let spec = WorkloadSpec {
            seed: 5,
            requests: 4000,
            tenants: 100,
            tenant_skew: 1.2,
            mean_gap_ns: 1e8,
            prompt_median: 800.0,
            prompt_sigma: 1.2,
            output_median: 100.0,
            output_sigma: 0.8,
            output_max: 1000,
            prefix_share: 0.5,
            prefix_groups_per_tenant: 2,
            prefix_median: 300.0,
            forbid_from: 10_000,
            forbid_below: 16_000,
            over_long: 4,
            over_long_below: 15_000,
        };
        let a: Vec<Arrival> = Generator::new(spec.clone()).collect();
        let b: Vec<Arrival> = Generator::new(spec).collect();
        assert_eq!(a, b);
        assert_eq!(a.len(), 4000);
        let window = a
            .iter()
            .filter(|r| (10_000..16_000).contains(&r.prompt_tokens))
            .count();
        assert_eq!(window, 4);
        let top = a.iter().filter(|r| r.tenant == "tenant-0000").count();
        let tail = a.iter().filter(|r| r.tenant == "tenant-0099").count();
        assert!(top > 20 * tail.max(1), "top {top} tail {tail}");
        assert!(
            a.iter().any(|r| r.prompt_tokens >= 16_000),
            "tail past the window"
        );
        assert!(a.windows(2).all(|w| w[0].arrival_ns <= w[1].arrival_ns));
    }
}
