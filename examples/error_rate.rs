//! kvtrail's known error rate: scope against an independent reference model
//! of the trace semantics, on random valid traces, per family of trace.
//!
//! The reference (tests/it/support/reference.rs) shares no code with the
//! engine's replay: it applies one event at a time to a full copy of every
//! slot and snapshots each pool after every event. Each trace is scoped
//! three ways (written by the Recorder; written by hand in random file
//! splits with shuffled rows and dictionary strings; and with tiny memory
//! chunks, so every sort and the copy index spill to disk), and every way
//! must give the reference's findings: affected responses, foreign, unknown
//! and uncertain slots per reader, sources with their tenants, confidence,
//! cross-tenant flags, blank reads, holes and the engine's own reads. A
//! trace whose copies wait on each other must be refused by both.
//!
//! A trace belongs to every family it shows: holes (lost events), copies
//! both ways (a `cache` tier), shares, stale grants (a share over slots
//! allocated before it), engine events (request 0), mid-capture (not from
//! the engine's start), incomplete (not closed cleanly), refused. Seeds are
//! drawn until every family has N traces. For each family, and overall, it
//! prints the disagreements and a 95% upper bound on the error rate: the
//! exact (Clopper-Pearson) one-sided bound, which is about 3/N (the rule of
//! three) when there is none.
//!
//! Run: `cargo run --release --example error_rate -- [N] [FIRST_SEED]`
//! (defaults 300 and 0). Exit 1 when any trace disagrees (each is printed
//! with its seed; tests/it/scope_reference.rs replays a seed).

use std::collections::BTreeMap;

use kvtrail::schema::Op;
use kvtrail::trace::Role;

#[allow(dead_code)]
mod support {
    #[path = "../../tests/it/support/reference.rs"]
    pub mod reference;
    #[path = "../../tests/it/support/trace_builder.rs"]
    pub mod trace_builder;
}

use support::reference::{Outcome, compare, random_trace};
use support::trace_builder::TraceBuilder;

const FAMILIES: [&str; 8] = [
    "holes",
    "copies both ways",
    "shares",
    "stale grants",
    "engine events",
    "mid-capture",
    "incomplete",
    "refused",
];

/// The families (indexes into `FAMILIES`, "refused" aside) `tb` shows.
fn families(tb: &TraceBuilder) -> Vec<usize> {
    let mut f = Vec::new();
    let mut seqs: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
    for e in &tb.events {
        seqs.entry(e.pool).or_default().push(e.seq);
    }
    let holes = seqs.values_mut().any(|v| {
        v.sort_unstable();
        v.first().is_some_and(|&s| s > 0) || v.windows(2).any(|w| w[1] > w[0] + 1)
    });
    let overlaps = |a: &kvtrail::schema::KvEvent, b: &kvtrail::schema::KvEvent| {
        a.pool == b.pool
            && a.slot_start < b.slot_start + b.slot_count
            && b.slot_start < a.slot_start + a.slot_count
    };
    let stale_grant = tb.events.iter().any(|s| {
        s.op == Op::Share
            && tb
                .events
                .iter()
                .any(|a| a.op == Op::Alloc && a.seq < s.seq && overlaps(a, s))
    });
    let flags = [
        holes,
        tb.deployment.pools.iter().any(|p| p.role == Role::Cache),
        tb.events.iter().any(|e| e.op == Op::Share),
        stale_grant,
        tb.events.iter().any(|e| e.request_id == 0),
        !tb.from_engine_start,
        !tb.complete,
    ];
    for (i, on) in flags.into_iter().enumerate() {
        if on {
            f.push(i);
        }
    }
    f
}

/// ln C(n, k)
fn ln_choose(n: u64, k: u64) -> f64 {
    let lf = |m: u64| (1..=m).map(|i| (i as f64).ln()).sum::<f64>();
    lf(n) - lf(k) - lf(n - k)
}

/// P(X <= k) for X ~ Binomial(n, p).
fn binom_cdf(k: u64, n: u64, p: f64) -> f64 {
    if p <= 0.0 {
        return 1.0;
    }
    if p >= 1.0 {
        return if k >= n { 1.0 } else { 0.0 };
    }
    (0..=k)
        .map(|i| (ln_choose(n, i) + i as f64 * p.ln() + (n - i) as f64 * (1.0 - p).ln()).exp())
        .sum::<f64>()
        .min(1.0)
}

/// The exact one-sided 95% upper bound on the rate after `k` failures in
/// `n` trials (Clopper-Pearson): the p at which P(X <= k) = 0.05.
fn upper95(k: u64, n: u64) -> f64 {
    if n == 0 {
        return 1.0;
    }
    if k >= n {
        return 1.0;
    }
    let (mut lo, mut hi) = (k as f64 / n as f64, 1.0f64);
    for _ in 0..100 {
        let mid = (lo + hi) / 2.0;
        if binom_cdf(k, n, mid) > 0.05 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    let first: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(0);
    let mut traces = [0u64; FAMILIES.len()];
    let mut wrong = [0u64; FAMILIES.len()];
    let (mut all, mut all_wrong) = (0u64, 0u64);
    let started = std::time::Instant::now();
    // The engine's panics are disagreements too: say so, do not stop.
    std::panic::set_hook(Box::new(|_| {}));
    let mut seed = first;
    while traces.iter().any(|&t| t < n) {
        let tb = random_trace(seed);
        let mut fam = families(&tb);
        let got = std::panic::catch_unwind(|| compare(seed))
            .unwrap_or_else(|_| Err(format!("seed {seed}: panicked")));
        if matches!(got, Ok(Outcome::Refused)) {
            fam.push(FAMILIES.len() - 1);
        }
        all += 1;
        if let Err(e) = &got {
            all_wrong += 1;
            println!("DISAGREES {e}");
        }
        for f in fam {
            traces[f] += 1;
            wrong[f] += got.is_err() as u64;
        }
        seed += 1;
    }
    println!(
        "scope against the reference model: {all} random traces (seeds {first}..{seed}), {:.0} s",
        started.elapsed().as_secs_f64()
    );
    println!(
        "{:<18} {:>7} {:>10} {:>22}",
        "family", "traces", "disagree", "error rate, 95% upper"
    );
    let row = |name: &str, t: u64, w: u64| {
        println!("{name:<18} {t:>7} {w:>10} {:>21.3}%", 100.0 * upper95(w, t));
    };
    for (i, name) in FAMILIES.iter().enumerate() {
        row(name, traces[i], wrong[i]);
    }
    row("all", all, all_wrong);
    if all_wrong > 0 {
        std::process::exit(1);
    }
}
