//! `kvtrail merge OUT_DIRS... --out DIR`: combine the `scope --pools LIST
//! --out DIR` folders of shards (disjoint pools covering the deployment)
//! into the report of a single run, written the same way (summary.json,
//! responses.csv, tenants.csv, findings.parquet, requests.csv,
//! timeline.json, findings.ocsf.jsonl and timeline.jsonl: byte for byte),
//! plus report.html and an evidence.json
//! whose inputs are the shard folders. Each shard is checked against its
//! evidence.json, and all against one trace, before anything is merged;
//! the folder is written whole or not at all (`report::folder`). With
//! `--allowed-signers` every shard's signed statement is checked first
//! (a shard that fails is refused by name); without it the result is
//! marked "shards not authenticated".

use std::path::PathBuf;

use kvtrail::custody::keys::AllowedSigners;
use kvtrail::custody::statement::{Predicate, STATEMENT_FILE, check_folder_statement};
use kvtrail::report;
use kvtrail::report::writer::Signing;
use kvtrail::scope::merge::{merge, merge_unauthenticated};
use kvtrail::scope::shard::load_shards;
use kvtrail::text::{term, term_message};

use crate::cli::output;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Shard output folders (each from `kvtrail scope --pools LIST --out DIR`).
    #[arg(required = true, value_name = "OUT_DIRS")]
    pub parts: Vec<PathBuf>,
    /// Write the merged scope folder here (a new or empty folder outside the shard folders; owner-only files).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Print the merged report as JSON on stdout (default: the one-screen summary).
    #[arg(long)]
    pub json: bool,
    /// OpenSSH allowed_signers file: merge only shards whose signed statement (statement.intoto.jsonl, `scope --signing-key`) matches the folder and is signed by a key it names; any other shard is refused, by name. Without it the merged result is marked "shards not authenticated" and is never complete evidence.
    #[arg(long, value_name = "FILE")]
    pub allowed_signers: Option<PathBuf>,
    /// Sign the merged folder with this OpenSSH ed25519 private key (owner-only): an in-toto statement over every file, citing each shard's statement.
    #[arg(long, value_name = "FILE")]
    pub signing_key: Option<PathBuf>,
}

/// Refuses a shard whose statement is missing, does not match its folder,
/// is unsigned or is signed by a key `allowed` does not name; returns the
/// signers, one line per shard.
fn authenticate(parts: &[PathBuf], allowed: &AllowedSigners) -> anyhow::Result<Vec<String>> {
    let mut signers = Vec::new();
    for dir in parts {
        let shown = dir.display().to_string();
        let shown = term(&shown);
        let rep = match check_folder_statement(dir, Some(allowed)) {
            Ok(Some(r)) => r,
            Ok(None) => anyhow::bail!(
                "merge: shard {shown} has no signed statement ({STATEMENT_FILE}); refused (--allowed-signers)\n  hint: re-create the shard with `kvtrail scope TRACE --pools LIST --out DIR --signing-key KEY`"
            ),
            Err(e) => anyhow::bail!("merge: shard {shown}: its statement cannot be checked: {e}"),
        };
        if !rep.ok {
            anyhow::bail!(
                "merge: shard {shown} is not authenticated; refused (--allowed-signers): {}\n  hint: merge only the unedited shard folders their signer wrote",
                term_message(&rep.problems.join("; "))
            );
        }
        signers.push(format!(
            "{shown}: signed by {} ({})",
            term(&rep.principals.unwrap_or_default().join(", ")),
            rep.fingerprint
        ));
    }
    Ok(signers)
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let inputs: Vec<&std::path::Path> = args.parts.iter().map(|p| p.as_path()).collect();
    kvtrail::custody::prepare_out(&args.out, "merge", &inputs, false)?;
    let key = super::signing::load_key(args.signing_key.as_deref())?;
    let authenticated = match &args.allowed_signers {
        Some(p) => {
            let allowed = AllowedSigners::load(p)?;
            for line in authenticate(&args.parts, &allowed)? {
                eprintln!("kvtrail: shard {line}");
            }
            true
        }
        None => false,
    };
    let shards = load_shards(&args.parts)?;
    let parts: Vec<_> = shards
        .iter()
        .map(|s| (s.report.clone(), s.info.clone()))
        .collect();
    let r = if authenticated {
        merge(&parts)?
    } else {
        eprintln!(
            "kvtrail: warning: shards not authenticated (no --allowed-signers): the merged result says so and is never complete evidence"
        );
        merge_unauthenticated(&parts)?
    };
    let command = output::command_line();
    let sign = key.as_deref().map(|key| Signing {
        key,
        predicate: Predicate::new("merge", &command),
    });
    let w =
        report::writer::write_merged_folder_signed(&args.out, &shards, &r, &command, sign, || {
            Ok(())
        })?;
    for f in w.files {
        eprintln!("kvtrail: wrote {}", term(&f.display().to_string()));
    }
    eprintln!(
        "kvtrail: evidence digest (blake3 of evidence.json): {}",
        w.digest
    );
    output::print(args.json, &r, |out| {
        out.write_all(report::human(&r).as_bytes())
    })?;
    Ok(0)
}
