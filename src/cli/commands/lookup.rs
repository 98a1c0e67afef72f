//! `kvtrail lookup SCOPE_DIR --external-id ID | --output-hash HEX | --tenant NAME`:
//! was this response affected, on which side, with the evidence digest.
//! `--tenant` with `--external-id` or `--output-hash` restricts the answer
//! to that customer's requests.

use std::path::PathBuf;

use kvtrail::lookup::{CHECKED_BYTES_READ, PREFIX_CACHE_BREACH, Query, lookup_checked};
use kvtrail::text::{term, utc};

use crate::cli::output;

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("query").required(true).multiple(true).args(["external_id", "output_hash", "tenant"])))]
pub struct Args {
    /// Scope folder (written by `kvtrail scope TRACE --out DIR`).
    pub scope_dir: PathBuf,
    /// The request id the customer saw.
    #[arg(long, value_name = "ID", conflicts_with = "output_hash")]
    pub external_id: Option<String>,
    /// blake3 of the response's output token ids (64 hex digits).
    #[arg(long, value_name = "HEX")]
    pub output_hash: Option<String>,
    /// Every affected request of one customer; with --external-id or
    /// --output-hash: only that customer's requests (an id or hash that
    /// several customers share is otherwise answered with counts only).
    #[arg(long, value_name = "NAME")]
    pub tenant: Option<String>,
    /// Re-hash every file of the folder against evidence.json before
    /// answering (by default the look-up checks the bytes it reads; see
    /// `evidence_check` in the answer).
    #[arg(long)]
    pub full_check: bool,
    /// Print the answer as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let (q, only) = match (args.external_id, args.output_hash, args.tenant) {
        (Some(x), _, t) => (Query::ExternalId(x), t),
        (_, Some(h), t) => (Query::OutputHash(h), t),
        (_, _, Some(t)) => (Query::Tenant(t), None),
        _ => anyhow::bail!("give --external-id, --output-hash or --tenant"),
    };
    let a = lookup_checked(&args.scope_dir, &q, only.as_deref(), args.full_check)?;
    output::print(args.json, &a, |out| {
        writeln!(out, "{}", term(&a.message))?;
        for m in &a.matches {
            let side = match (&m.as_recipient, &m.as_source) {
                (Some(_), Some(_)) => "recipient and source",
                (Some(_), None) => "recipient (its response read data not its own)",
                (None, Some(_)) => "source (its data was read by other responses)",
                (None, None) => match &m.prefix_cache {
                    Some(p) if p.kind == PREFIX_CACHE_BREACH => "prefix-cache isolation breach",
                    Some(_) => "cross-tenant prefix-cache hit (information)",
                    None => "not affected",
                },
            };
            writeln!(
                out,
                "  request {} ext {} tenant {} arrived {} HTTP {}: {side}",
                m.request_id,
                match m.external_id.as_deref() {
                    None => "-".into(),
                    // An empty id is shown as one, never as the absent one.
                    Some("") => "\"\"".into(),
                    Some(x) => term(x),
                },
                term(&m.tenant),
                utc(m.arrival_ns),
                m.http_status
            )?;
            if let Some(r) = &m.as_recipient {
                writeln!(
                    out,
                    "    response read {} foreign tokens ({} exposed), another customer's data: {}, {}",
                    r.foreign_tokens,
                    r.exposed_tokens,
                    yes_no(r.other_customer_data),
                    r.confidence.as_str()
                )?;
            }
            if let Some(s) = &m.as_source {
                writeln!(
                    out,
                    "    its KV was read by {} responses ({} tokens), reached another customer: {}, {}",
                    s.responses,
                    s.tokens,
                    yes_no(s.reached_other_customers),
                    s.confidence.as_str()
                )?;
            }
            if let Some(p) = &m.prefix_cache {
                let what = if p.kind == PREFIX_CACHE_BREACH {
                    "prefix-cache isolation breach"
                } else {
                    "information: the prefix cache is shared across customers"
                };
                if let Some(r) = &p.as_reader {
                    writeln!(
                        out,
                        "    served {} tokens from a prefix cached by {} other customer request(s) ({what})",
                        r.tokens, r.source_requests
                    )?;
                }
                if let Some(s) = &p.as_source {
                    writeln!(
                        out,
                        "    its cached prefix served {} other customer response(s) ({} tokens) ({what})",
                        s.responses, s.tokens
                    )?;
                }
            }
        }
        if a.unaffected_matches > 0 {
            writeln!(
                out,
                "  {} more requests in the trace, not affected",
                a.unaffected_matches
            )?;
        }
        writeln!(
            out,
            "evidence: {} ({}; evidence {})",
            a.evidence_blake3,
            if a.evidence_intact && a.evidence_check == CHECKED_BYTES_READ {
                "every byte read matches evidence.json; `kvtrail verify` checks the whole folder"
            } else if a.evidence_intact {
                "folder matches evidence.json"
            } else {
                "FOLDER DOES NOT MATCH evidence.json"
            },
            if a.evidence_complete {
                "complete"
            } else {
                "INCOMPLETE"
            }
        )?;
        for p in &a.evidence_problems {
            writeln!(out, "  FAIL {}", term(p))?;
        }
        for n in &a.notes {
            writeln!(out, "note: {}", term(n))?;
        }
        Ok(())
    })?;
    Ok(if a.evidence_intact { 0 } else { 1 })
}

/// yes / no / unknown (a customer on the other side is not known).
fn yes_no(b: Option<bool>) -> &'static str {
    match b {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown (a customer on the other side is not known)",
    }
}
