//! `kvtrail inspect TRACE [--json]`: one screen on a trace for a responder.

use std::io::Write;
use std::path::PathBuf;

use kvtrail::inspect::{Count, Finding, InspectReport, inspect};
use kvtrail::text::{rfc3339, term};
use kvtrail::trace::Trace;

use crate::cli::output;
use crate::cli::progress::BarReporter;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace directory (holds trace.json).
    pub trace: PathBuf,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let trace = Trace::open(&args.trace)?;
    let report = inspect(&trace, &BarReporter::default())?;
    output::print(args.json, &report, |out| {
        print_text(out, &args.trace, &report)
    })?;
    Ok(0)
}

fn counts<K: std::fmt::Display>(c: &[Count<K>]) -> String {
    let parts: Vec<String> = c
        .iter()
        .filter(|c| c.count > 0)
        .map(|c| format!("{} {}", term(&c.key.to_string()), c.count))
        .collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

fn finding(f: &Finding) -> String {
    if f.count == 0 {
        return "0".into();
    }
    let ex: Vec<String> = f.examples.iter().map(u64::to_string).collect();
    format!(
        "{} ({} with 2xx), e.g. request {}",
        f.count,
        f.with_2xx,
        ex.join(", ")
    )
}

fn ns(t: Option<i64>) -> String {
    t.map_or("-".into(), rfc3339)
}

fn print_text(
    out: &mut dyn Write,
    path: &std::path::Path,
    r: &InspectReport,
) -> std::io::Result<()> {
    let d = &r.deployment;
    writeln!(out, "trace       {}", term(&path.display().to_string()))?;
    writeln!(
        out,
        "deployment  {} | {} | context_window {}",
        term(&d.name),
        term(&d.engine),
        d.context_window
    )?;
    for p in &d.pools {
        writeln!(
            out,
            "  pool {:<3} {:<16} {:<7} capacity {} tokens, page {}{}",
            p.id,
            term(&p.name),
            p.role,
            p.capacity_tokens,
            p.page_size,
            p.max_req_input_len
                .map(|l| format!(", prompts >= {l} tokens exceed it"))
                .unwrap_or_default()
        )?;
    }
    let c = &r.capture;
    writeln!(
        out,
        "capture     {} | {} | from engine start: {} | writer {}",
        if c.complete { "complete" } else { "INCOMPLETE" },
        format_args!("{} .. {}", rfc3339(c.started_ns), rfc3339(c.ended_ns)),
        match c.from_engine_start {
            Some(true) => "yes",
            Some(false) => "no",
            None => "unknown",
        },
        term(&c.writer)
    )?;
    let f = &r.files;
    writeln!(
        out,
        "files       {} request, {} kv; {}",
        f.request_files,
        f.kv_files,
        match f.listed {
            Some(n) => format!("{n} listed with digests"),
            None => "NONE listed: unverifiable".into(),
        }
    )?;
    writeln!(
        out,
        "time range  {} .. {} (data)",
        ns(r.time_range.first_ns),
        ns(r.time_range.last_ns)
    )?;
    let q = &r.requests;
    writeln!(
        out,
        "requests    {} from {} tenants; top: {}",
        q.count,
        q.tenants,
        counts(&q.top_tenants)
    )?;
    writeln!(out, "  status    {}", counts(&q.statuses))?;
    writeln!(out, "  prefilled < prompt: {}", finding(&q.short_prefill))?;
    writeln!(
        out,
        "  prompt over prefill limit: {}",
        finding(&q.over_long_prompts)
    )?;
    writeln!(out, "kv events   {}: {}", r.kv.events, counts(&r.kv.by_op))?;
    if r.kv.unknown_request_events.count > 0 {
        let u = &r.kv.unknown_request_events;
        let ex: Vec<String> = u.examples.iter().map(u64::to_string).collect();
        writeln!(
            out,
            "  events of requests not in the requests table: {}, e.g. request {}",
            u.count,
            ex.join(", ")
        )?;
    }
    for p in &r.kv.pools {
        writeln!(
            out,
            "  pool {:<3} {} events, seq {}..{}: {}",
            p.pool,
            p.events,
            p.first_seq.map_or("-".into(), |s| s.to_string()),
            p.last_seq.map_or("-".into(), |s| s.to_string()),
            counts(&p.by_op)
        )?;
        writeln!(
            out,
            "            seq holes {} ({} events missing), duplicate seqs {}",
            p.holes, p.missing_events, p.duplicate_seqs
        )?;
        for h in &p.holes_listed {
            writeln!(
                out,
                "              missing {} between seq {} and {}",
                h.missing,
                h.after_seq.map_or("start".into(), |s| s.to_string()),
                h.before_seq
            )?;
        }
        if p.holes > p.holes_listed.len() as u64 {
            writeln!(
                out,
                "              ... {} more holes (see --json for counts)",
                p.holes - p.holes_listed.len() as u64
            )?;
        }
    }
    if r.evidence_warnings.is_empty() {
        writeln!(
            out,
            "evidence    complete: no holes, clean capture, verifiable"
        )?;
    } else {
        writeln!(out, "evidence    WARNINGS:")?;
        for w in &r.evidence_warnings {
            writeln!(out, "  - {}", term(w))?;
        }
    }
    Ok(())
}
