//! `kvtrail diff TRACE NEWTRACE [--json]`: what changed per request between
//! a trace and its what-if replay, and the exposure before vs after.

use std::fmt::Write as _;
use std::path::PathBuf;

use kvtrail::lineage::LineageOptions;
use kvtrail::text::term;
use kvtrail::whatif::diff::{DiffReport, Side, diff};

use crate::cli::output;
use crate::cli::progress::BarReporter;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The recorded trace.
    pub before: PathBuf,
    /// The replayed trace.
    pub after: PathBuf,
    /// Print the full report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| "-".into())
}

fn side(s: &Side) -> String {
    let reads = match &s.foreign_reads {
        None => String::new(),
        Some(f) => {
            const SHOWN: usize = 3;
            let mut from: Vec<String> = f
                .sources
                .iter()
                .take(SHOWN)
                .map(|x| {
                    format!(
                        "{} ({}) {} {}",
                        x.request_id,
                        term(&x.tenant.to_string()),
                        x.tokens,
                        x.confidence.as_str()
                    )
                })
                .collect();
            if f.sources.len() > SHOWN {
                from.push(format!("{} more", f.sources.len() - SHOWN));
            }
            format!(
                " [{}{}{}]",
                f.confidence.as_str(),
                if from.is_empty() { "" } else { ", from " },
                from.join(", ")
            )
        }
    };
    format!(
        "{} prefilled {} foreign {}{reads} latency {} ms decode-held {:.1} slot-s",
        s.http_status,
        opt(s.prefilled_tokens),
        s.foreign_tokens,
        s.latency_ms
            .map(|x| format!("{x:.0}"))
            .unwrap_or("-".into()),
        s.decode_slot_seconds
    )
}

pub fn human(r: &DiffReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}\n", term(&r.headline));
    let e = &r.exposure;
    let _ = writeln!(s, "exposure (scope on both traces)");
    for (n, x) in [("before", &e.before), ("after", &e.after)] {
        let _ = writeln!(s, "  {n:<7} {}: {}", term(&x.engine), term(&x.verdict));
        if let Some(note) = &x.comparison_note {
            let _ = writeln!(s, "          BUT {}", term(note));
        }
    }
    let _ = writeln!(s, "\nstatus counts");
    let _ = writeln!(s, "  before {:?}", r.status_counts.before);
    let _ = writeln!(s, "  after  {:?}", r.status_counts.after);
    if !r.status_transitions.is_empty() {
        let _ = writeln!(s, "  transitions {:?}", r.status_transitions);
    }
    let _ = writeln!(
        s,
        "\ndecode capacity held by rejected requests (status >= 400)"
    );
    for (n, h) in [
        ("before", &r.rejected_decode_hold.before),
        ("after", &r.rejected_decode_hold.after),
    ] {
        let _ = writeln!(
            s,
            "  {n:<7} {}, {:.1} slot-seconds, peak {} slots, hold mean {:.1} s max {:.1} s",
            kvtrail::whatif::count(h.requests, "request", "requests"),
            h.slot_seconds,
            h.peak_slots,
            h.mean_hold_ms / 1000.0,
            h.max_hold_ms / 1000.0
        );
    }
    let _ = writeln!(
        s,
        "\nunchanged: {} of {} requests (status, prefilled, reads, output); latency moved > 1 ms for {}; output hash differs with clean reads (another prefix-cache writer) for {}",
        r.unchanged, r.requests_compared, r.unchanged_latency_moved, r.clean_output_differs
    );
    for (n, l) in [
        ("before", &r.unchanged_latency.before),
        ("after", &r.unchanged_latency.after),
    ] {
        let _ = writeln!(
            s,
            "  {n:<7} latency mean {:.0} ms p50 {:.0} p99 {:.0} max {:.0}; decode queue mean {:.1} ms max {:.1}",
            l.mean_ms, l.p50_ms, l.p99_ms, l.max_ms, l.decode_queue_mean_ms, l.decode_queue_max_ms
        );
    }
    if !r.changed.is_empty() {
        let _ = writeln!(s, "\nchanged requests ({})", r.changed.len());
        for c in &r.changed {
            let _ = writeln!(
                s,
                "  {} {} {} prompt {} [{}]\n      before: {}\n      after:  {}",
                c.request_id,
                term(c.external_id.as_deref().unwrap_or("-")),
                term(&c.tenant),
                c.prompt_tokens,
                c.what.join(", "),
                side(&c.before),
                side(&c.after)
            );
        }
    }
    if !r.only_before.is_empty() || !r.only_after.is_empty() {
        let ids = |v: &[u64]| {
            let mut x: Vec<String> = v.iter().take(20).map(|i| i.to_string()).collect();
            if v.len() > 20 {
                x.push(format!("and {} more", v.len() - 20));
            }
            x.join(" ")
        };
        let _ = writeln!(
            s,
            "\nnot compared (the comparison cannot speak for them): only in the first trace {} ({} affected there), only in the second {} ({} affected there)",
            r.only_before.len(),
            r.exposure.before.affected_not_in_other,
            r.only_after.len(),
            r.exposure.after.affected_not_in_other
        );
        if !r.only_before.is_empty() {
            let _ = writeln!(s, "  first only:  {}", ids(&r.only_before));
        }
        if !r.only_after.is_empty() {
            let _ = writeln!(s, "  second only: {}", ids(&r.only_after));
        }
    }
    s
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let b = kvtrail::trace::Trace::open(&args.before)?;
    let a = kvtrail::trace::Trace::open(&args.after)?;
    let r = diff(&b, &a, &LineageOptions::default(), &BarReporter::default())?;
    output::print(args.json, &r, |out| out.write_all(human(&r).as_bytes()))?;
    Ok(0)
}
