//! `kvtrail export SCOPE_DIR --format ocsf|timesketch [--out FILE]`: the
//! findings of a scope folder for other tools (OCSF findings for a SIEM or
//! Security Hub, a Timesketch timeline), rendered again from the folder
//! after checking it against its evidence.json; without `--internal`
//! byte for byte what `scope --out` wrote.

use std::path::PathBuf;

use kvtrail::custody::statement::{Predicate, folder_input, sign_file, statement_beside};
use kvtrail::report::export::{Audience, Format, export, write_export};
use kvtrail::text::term;

use crate::cli::output;

/// Export format on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum FormatArg {
    /// OCSF 1.8.0: a Data Security Finding per affected response, an Incident Finding roll-up (findings.ocsf.jsonl).
    Ocsf,
    /// Timesketch JSONL timeline (timeline.jsonl).
    Timesketch,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Scope folder (written by `kvtrail scope TRACE --out DIR`).
    pub scope_dir: PathBuf,
    /// Output format.
    #[arg(long, value_enum)]
    pub format: FormatArg,
    /// Write to this file (owner-only, outside the scope folder) instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// With --out: replace an existing file.
    #[arg(long, requires = "out")]
    pub force: bool,
    /// For the operator's own responders only: also name the source customers and their requests, and label every event internal. Never hand this file to a customer.
    #[arg(long)]
    pub internal: bool,
    /// With --out: sign the file with this OpenSSH ed25519 private key (owner-only): an in-toto statement beside it, FILE.intoto.jsonl, citing the scope folder (`kvtrail verify FILE.intoto.jsonl` checks it).
    #[arg(long, value_name = "FILE", requires = "out")]
    pub signing_key: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    let format = match args.format {
        FormatArg::Ocsf => Format::Ocsf,
        FormatArg::Timesketch => Format::Timesketch,
    };
    let audience = if args.internal {
        Audience::Internal
    } else {
        Audience::External
    };
    let key = super::signing::load_key(args.signing_key.as_deref())?;
    if let (Some(_), Some(out)) = (&key, &args.out) {
        let st = statement_beside(out);
        if !args.force && (st.exists() || st.is_symlink()) {
            anyhow::bail!(
                "{}: already exists\n  hint: pass another --out FILE, or --force to replace it",
                term(&st.display().to_string())
            );
        }
    }
    let text = export(&args.scope_dir, format, audience)?;
    match &args.out {
        Some(out) => {
            write_export(&args.scope_dir, out, &text, args.force)?;
            if let Some(key) = key.as_deref() {
                let mut p = Predicate::new("export", &output::command_line());
                p.inputs = vec![folder_input(&args.scope_dir, "scope")?];
                p.verdict = format!("{} events, {}", text.lines().count(), audience.as_str());
                let st = sign_file(out, key, p)?;
                eprintln!("kvtrail export: wrote {}", term(&st.display().to_string()));
            }
            eprintln!(
                "kvtrail export: wrote {} ({} events, {})",
                term(&out.display().to_string()),
                text.lines().count(),
                audience.as_str()
            );
        }
        None => output::print_human(|o| o.write_all(text.as_bytes()))?,
    }
    Ok(0)
}
