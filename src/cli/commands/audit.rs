//! `kvtrail audit (--deployment FILE | TRACE) [--json]`: deploy gate. Checks
//! every pool against the context window (the incident's root cause), page
//! sizes and the scrub policy; on a trace also the requests and KV events.
//! Exit 1 on errors or warnings, 0 when clean, 2 on bad input.

use std::fmt::Write as _;
use std::path::PathBuf;

use kvtrail::audit::{AuditReport, audit_file, audit_trace};
use kvtrail::lineage::LineageOptions;
use kvtrail::text::term;

use crate::cli::output;
use crate::cli::progress::BarReporter;

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["trace", "deployment"])))]
pub struct Args {
    /// Trace directory: audit its manifest, requests and KV events.
    pub trace: Option<PathBuf>,
    /// Deployment to audit: a simulator config (TOML/JSON) or a trace.json.
    #[arg(long, value_name = "FILE")]
    pub deployment: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn human(r: &AuditReport) -> String {
    let mut s = String::new();
    let d = &r.deployment;
    let _ = writeln!(
        s,
        "audit of {} (engine {}, context window {})",
        term(&d.source),
        term(&d.engine),
        d.context_window
    );
    for p in &d.pools {
        if d.vllm.is_some() {
            // vLLM admits on max_model_len alone: no per-pool limit.
            let _ = writeln!(
                s,
                "  pool {} {:<10} {:<8} {:>12} tokens, block {:>3}",
                p.id,
                term(&p.name),
                term(&p.role),
                p.capacity_tokens,
                p.page_size,
            );
            continue;
        }
        let _ = writeln!(
            s,
            "  pool {} {:<10} {:<8} {:>12} tokens, page {:>3}, max_req_input_len {}",
            p.id,
            term(&p.name),
            term(&p.role),
            p.capacity_tokens,
            p.page_size,
            p.max_req_input_len
        );
    }
    if let Some(v) = &d.vllm {
        let or_unknown = |x: Option<String>| x.unwrap_or_else(|| "not recorded".into());
        let _ = writeln!(
            s,
            "  kv_load_failure_policy {}, kv_lease_duration {}",
            term(&or_unknown(v.kv_load_failure_policy.clone())),
            or_unknown(v.kv_lease_duration.map(|l| format!("{l} s")))
        );
    }
    for f in &r.findings {
        let sev = match f.severity {
            kvtrail::audit::Severity::Error => "ERROR",
            kvtrail::audit::Severity::Warning => "WARNING",
            kvtrail::audit::Severity::Note => "note",
        };
        let _ = writeln!(
            s,
            "\n{sev} {}{}: {}",
            term(&f.kind),
            f.subject
                .as_deref()
                .map(|x| format!(" [{}]", term(x)))
                .unwrap_or_default(),
            term(&f.detail)
        );
        if !f.request_ids.is_empty() {
            let ids: Vec<String> = f.request_ids.iter().map(|i| i.to_string()).collect();
            let _ = writeln!(s, "  requests: {}", ids.join(" "));
        }
        if let Some(rec) = &f.recommendation {
            let _ = writeln!(s, "  recommendation: {}", term(rec));
        }
    }
    let _ = writeln!(s, "\n{}", term(&r.verdict));
    s
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let r = match (&args.deployment, &args.trace) {
        (Some(path), None) => audit_file(path)?,
        (None, Some(dir)) => {
            let trace = kvtrail::trace::Trace::open(dir)?;
            audit_trace(&trace, &LineageOptions::default(), &BarReporter::default())?
        }
        _ => anyhow::bail!("give either a TRACE or --deployment FILE, not both"),
    };
    output::print(args.json, &r, |out| out.write_all(human(&r).as_bytes()))?;
    Ok(r.exit_code())
}
