//! `kvtrail verify PATH`: a trace (recompute digests, check files and rows
//! against trace.json) or an output folder of scope/notify (detected by its
//! evidence.json: re-hash every output and input file, name every change).
//! A sealed trace (seals/) is checked against its seals too: the chain,
//! the files, and with `--allowed-signers` every signature and signer.
//! An output folder's signed statement (statement.intoto.jsonl) is checked
//! against the folder, and with `--allowed-signers` its signer; a
//! statement beside an exported file (`FILE.intoto.jsonl`) against that
//! file. `--reproduce` re-runs a scope folder's analysis
//! (`super::reproduce`).

use std::io::Write;
use std::path::PathBuf;

use kvtrail::custody::keys::AllowedSigners;
use kvtrail::custody::seal::{SealReport, verify_seals};
use kvtrail::custody::statement::{
    STATEMENT_FILE, STATEMENT_SUFFIX, StatementReport, check_folder_statement, check_statement,
};
use kvtrail::custody::{FolderReport, is_output_folder, verify_folder};
use kvtrail::text::{term, term_message};
use kvtrail::trace::verify::verify;
use kvtrail::words::{count, noun};

use crate::cli::output;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace directory (holds trace.json), or a scope/notify output folder (holds evidence.json).
    pub trace: PathBuf,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// OpenSSH allowed_signers file: check every seal's signature and signer.
    #[arg(long, value_name = "FILE")]
    pub allowed_signers: Option<PathBuf>,
    /// Fail a trace that is not sealed, or an output folder that has no signed statement (with --allowed-signers).
    #[arg(long, requires = "allowed_signers")]
    pub require_signature: bool,
    /// For a scope folder: re-run the analysis from the inputs its evidence.json records (a local trace or object storage) and compare every output byte with the folder's (exceptions: docs/evidence.md); exit 1 naming the first difference.
    #[arg(long, conflicts_with_all = ["allowed_signers", "require_signature"])]
    pub reproduce: bool,
    /// With --reproduce and --out: sign a statement of the reproduction with this OpenSSH ed25519 private key (owner-only).
    #[arg(long, value_name = "FILE", requires_all = ["reproduce", "out"])]
    pub signing_key: Option<PathBuf>,
    /// With --reproduce --signing-key: write the reproduction's signed statement to this file (a new file outside the scope folder).
    #[arg(long, value_name = "FILE", requires = "reproduce")]
    pub out: Option<PathBuf>,
}

/// The trace's report, and its seals' when it is sealed (or a signature
/// was asked for).
#[derive(serde::Serialize)]
struct Checked<'a> {
    #[serde(flatten)]
    trace: &'a kvtrail::trace::verify::VerifyReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    seals: Option<&'a SealReport>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    unsealed: bool,
    /// The verdict over the trace and its seals (`ok` is the trace's own
    /// checks; `seals.ok` the seals'); only for a sealed trace or one a
    /// signature was asked of.
    #[serde(skip_serializing_if = "Option::is_none")]
    all_ok: Option<bool>,
    /// live-findings.json against a fresh scope (a trace recorded live).
    #[serde(skip_serializing_if = "Option::is_none")]
    live: Option<&'a kvtrail::record::live::compare::Comparison>,
}

fn print_seals(out: &mut dyn Write, s: &SealReport) -> std::io::Result<()> {
    for p in &s.problems {
        writeln!(
            out,
            "FAIL seal         {}: {}",
            term(&p.at),
            term_message(&p.detail)
        )?;
    }
    for n in &s.notes {
        writeln!(
            out,
            "NOTE recorded by the sealer in {}: {}",
            term(&n.at),
            term_message(&n.detail)
        )?;
    }
    let id = s.capture_id.as_deref().unwrap_or("?");
    let seals = count(s.seals, "seal", "seals");
    let files = count(s.files_checked as u64, "data file", "data files");
    if !s.ok {
        writeln!(
            out,
            "SEALS FAILED: {seals} of capture {}, {files} checked",
            term(id),
        )
    } else if s.signatures_checked {
        writeln!(
            out,
            "SEALED: {seals} of capture {}, signed by {}; chain whole, {files} {} their seals, none unsealed",
            term(id),
            term(&s.signers.join("; ")),
            noun(s.files_checked as u64, "matches", "match"),
        )
    } else {
        writeln!(
            out,
            "sealed, signatures not checked: {seals} of capture {}; chain and {files} match the seals, but who signed is unknown (pass --allowed-signers FILE)",
            term(id),
        )
    }
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let allowed = match &args.allowed_signers {
        Some(p) => Some(AllowedSigners::load(p)?),
        None => None,
    };
    if args.reproduce {
        return super::reproduce::run(
            &args.trace,
            args.signing_key.as_deref(),
            args.out.as_deref(),
            args.json,
        );
    }
    if is_output_folder(&args.trace) {
        return run_folder(args, allowed.as_ref());
    }
    if is_statement_file(&args.trace) {
        return run_statement_file(args, allowed.as_ref());
    }
    let report = verify(&args.trace)?;
    let seals = verify_seals(&args.trace, allowed.as_ref())?;
    // A trace recorded live: its live findings against a fresh scope
    // (fails when live said less); not run over a trace that fails.
    let live = match report.ok {
        true => kvtrail::record::live::compare::compare_trace(&args.trace)?,
        false => None,
    };
    let live_ok = live.as_ref().is_none_or(|c| !c.live_said_less);
    let unsealed = seals.is_none() && args.require_signature;
    // One verdict: the trace's own checks and its seals'. Neither "OK"
    // nor `all_ok` is said while either fails.
    let all_ok = report.ok && seals.as_ref().is_none_or(|s| s.ok) && !unsealed && live_ok;
    let checked = Checked {
        trace: &report,
        seals: seals.as_ref(),
        unsealed,
        all_ok: (seals.is_some() || unsealed).then_some(all_ok),
        live: live.as_ref(),
    };
    output::print(args.json, &checked, |out| {
        if let Some(s) = &seals {
            print_seals(out, s)?;
        }
        if unsealed {
            writeln!(
                out,
                "FAIL unsealed     {}: no seals/ folder: the trace is not signed (--require-signature)",
                term(&args.trace.display().to_string())
            )?;
        }
        if let Some(c) = &live {
            print_live(out, c)?;
        }
        for p in &report.problems {
            writeln!(
                out,
                "FAIL {:<12} {}: {}",
                p.kind,
                term(&p.path),
                term_message(&p.detail)
            )?;
        }
        writeln!(
            out,
            "{}: {} files, {} bytes hashed, {} rows checked, capture {}{}",
            if all_ok { "OK" } else { "FAILED" },
            report.files_checked,
            report.bytes_hashed,
            report.rows_checked,
            if report.complete {
                "complete"
            } else {
                "INCOMPLETE"
            },
            if report.seq_holes > 0 {
                format!(
                    " ({} lost in {}: no analysis of this trace is complete)",
                    count(report.lost_events, "event", "events"),
                    count(report.seq_holes, "seq hole", "seq holes")
                )
            } else {
                String::new()
            }
        )
    })?;
    Ok(if all_ok { 0 } else { 1 })
}

fn print_folder(out: &mut dyn Write, r: &FolderReport, depth: usize) -> std::io::Result<()> {
    let pad = "  ".repeat(depth);
    for p in &r.problems {
        writeln!(
            out,
            "{pad}FAIL {:<9} {} {}: {}",
            p.kind,
            p.side,
            term(&p.path),
            term(&p.detail)
        )?;
    }
    for u in &r.inputs_unavailable {
        writeln!(
            out,
            "{pad}NOTE inputs not on this machine, not re-checked: {}",
            term(u)
        )?;
    }
    for p in &r.recorded_input_problems {
        writeln!(
            out,
            "{pad}NOTE recorded when the folder was written: {}",
            term(p)
        )?;
    }
    writeln!(
        out,
        "{pad}{}: {} folder, {} output files and {} input files checked; evidence digest {}",
        if r.problems.is_empty() {
            "OK"
        } else {
            "FAILED"
        },
        r.kind,
        r.outputs_checked,
        r.inputs_checked,
        r.evidence_blake3
    )?;
    for n in &r.nested {
        print_folder(out, n, depth + 1)?;
    }
    Ok(())
}

/// An output folder's report, and its statement's when it has one (or a
/// signature was asked for).
#[derive(serde::Serialize)]
struct FolderChecked<'a> {
    #[serde(flatten)]
    folder: &'a FolderReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    statement: Option<&'a StatementReport>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    unsigned: bool,
    /// The verdict over the folder and its statement; only for a signed
    /// folder or one a signature was asked of.
    #[serde(skip_serializing_if = "Option::is_none")]
    all_ok: Option<bool>,
}

/// What a statement check found, printed.
fn print_statement(out: &mut dyn Write, s: &StatementReport, what: &str) -> std::io::Result<()> {
    for p in &s.problems {
        writeln!(out, "FAIL statement    {}", term_message(p))?;
    }
    match (&s.principals, s.ok) {
        (_, false) => writeln!(
            out,
            "STATEMENT FAILED: {} ({} subjects, signature by {})",
            term(&s.path),
            s.subjects,
            s.fingerprint
        ),
        (Some(p), true) => writeln!(
            out,
            "SIGNED: {what} signed by {} ({}); {} files match the statement, none unlisted",
            term(&p.join(", ")),
            s.fingerprint,
            s.subjects
        ),
        (None, true) => writeln!(
            out,
            "signed, signer not checked: {what} signed by {}; {} files match the statement, but who signed is unknown (pass --allowed-signers FILE)",
            s.fingerprint, s.subjects
        ),
    }
}

fn run_folder(args: Args, allowed: Option<&AllowedSigners>) -> anyhow::Result<i32> {
    let r = verify_folder(&args.trace, true)?;
    let st = check_folder_statement(&args.trace, allowed)?;
    let unsigned = st.is_none() && args.require_signature;
    let all_ok = r.ok && st.as_ref().is_none_or(|s| s.ok) && !unsigned;
    let checked = FolderChecked {
        folder: &r,
        statement: st.as_ref(),
        unsigned,
        all_ok: (st.is_some() || unsigned).then_some(all_ok),
    };
    output::print(args.json, &checked, |out| {
        print_folder(out, &r, 0)?;
        if let Some(s) = &st {
            print_statement(out, s, "the folder is")?;
        }
        if unsigned {
            writeln!(
                out,
                "FAIL unsigned     {}: no {STATEMENT_FILE}: the folder is not signed",
                term(&args.trace.display().to_string())
            )?;
        }
        if st.is_some() || unsigned {
            writeln!(out, "{}", if all_ok { "OK" } else { "FAILED" })?;
        }
        Ok(())
    })?;
    Ok(if all_ok { 0 } else { 1 })
}

/// Whether `p` is a statement beside a single file (`export --out FILE
/// --signing-key`: FILE.intoto.jsonl).
fn is_statement_file(p: &std::path::Path) -> bool {
    p.is_file()
        && p.file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with(STATEMENT_SUFFIX))
}

/// `verify FILE.intoto.jsonl`: the statement against the files it names,
/// beside it.
fn run_statement_file(args: Args, allowed: Option<&AllowedSigners>) -> anyhow::Result<i32> {
    let base = match args.trace.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let s = check_statement(&args.trace, &base, false, allowed)?;
    output::print(args.json, &s, |out| print_statement(out, &s, "the file is"))?;
    Ok(if s.ok { 0 } else { 1 })
}

/// The `--signing-key` of a trace writer, loaded (and refused when unsafe)
/// before anything is written.
pub(super) fn load_key(
    path: Option<&std::path::Path>,
) -> anyhow::Result<Option<std::sync::Arc<kvtrail::custody::keys::SigningKey>>> {
    super::signing::load_key(path)
}

/// Seals a trace an offline writer (`ingest`, `simulate`) has finished:
/// one final seal over every file.
pub(super) fn seal_written(
    out: &std::path::Path,
    key: Option<std::sync::Arc<kvtrail::custody::keys::SigningKey>>,
    writer: &str,
) -> anyhow::Result<()> {
    if let Some(key) = key {
        let fp = key.fingerprint();
        let id = kvtrail::custody::seal::seal_trace(out, key, writer)?;
        eprintln!(
            "{}: sealed (capture {id}, signed by {fp}); check: kvtrail verify --allowed-signers FILE",
            term(&out.display().to_string())
        );
    }
    Ok(())
}

/// The live findings against a fresh scope: one line per difference, then
/// the verdict.
fn print_live(
    out: &mut dyn Write,
    c: &kvtrail::record::live::compare::Comparison,
) -> std::io::Result<()> {
    for d in &c.differences {
        writeln!(
            out,
            "{} live         {} {} {}: live {}, scope {}",
            if d.live_said_less { "FAIL" } else { "NOTE" },
            d.finding,
            d.request_id,
            term(&d.field),
            term(&d.live),
            term(&d.scope)
        )?;
    }
    let verdict = if c.equal {
        "live findings equal a fresh scope"
    } else if c.live_said_less {
        "FAILED: live findings said less than a fresh scope"
    } else {
        "live findings said more than a fresh scope, never less"
    };
    writeln!(
        out,
        "{verdict}: {} affected responses and {} cross-tenant prefix hits live, {} and {} in scope{}",
        c.live_affected,
        c.live_prefix_hits,
        c.scope_affected,
        c.scope_prefix_hits,
        if c.live_exact {
            ""
        } else {
            " (the live view was not exact: see live-findings.json)"
        }
    )
}
