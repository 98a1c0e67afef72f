//! `kvtrail verify SCOPE_DIR --reproduce` (not a command of its own): the
//! folder's analysis run again from the inputs its evidence.json records
//! (the trace, local or in object storage, for `scope`; the shard folders
//! for `merge` and `fleet spark`), with the options of the command line it records, written
//! as a sibling of the folder (so every relative path in it is the same)
//! and compared with the folder file by file, byte for byte, apart from
//! the exceptions of `custody::reproduce`. Exit 0 when identical, 1 naming
//! the first difference, 2 when it cannot be re-run.

use std::path::{Path, PathBuf};

use clap::{Args as _, FromArgMatches as _};
use kvtrail::custody::reproduce::{Comparison, compare_folders};
use kvtrail::custody::statement::{Predicate, folder_input, sign_files};
use kvtrail::custody::{Evidence, load_evidence};
use kvtrail::lineage::BackendConfig;
use kvtrail::progress::NoReporter;
use kvtrail::report::writer::{self, one_line};
use kvtrail::scope::run::ScopeRun;
use kvtrail::text::term;

use crate::cli::output;

/// Where an input root of evidence.json is, seen from here: a URL or an
/// absolute path as recorded, a relative one from the folder.
fn input_path(dir: &Path, root: &str) -> PathBuf {
    if kvtrail::trace::TraceRoot::names_url(Path::new(root)) || Path::new(root).is_absolute() {
        PathBuf::from(root)
    } else {
        dir.join(root)
    }
}

fn cannot(dir: &Path, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!(
        "{}: cannot reproduce: {what}",
        term(&dir.display().to_string())
    )
}

/// Re-runs the analysis of `ev` into the empty folder `dest`. Returns the
/// backend note (scope) for the statement.
fn rerun(dir: &Path, ev: &Evidence, dest: &Path) -> anyhow::Result<Option<String>> {
    // The recorded command line parsed by the commands' own definitions.
    let cmd =
        clap::Command::new("kvtrail")
            .subcommand(super::scope::Args::augment_args(clap::Command::new(
                "scope",
            )))
            .subcommand(super::merge::Args::augment_args(clap::Command::new(
                "merge",
            )))
            .subcommand(clap::Command::new("fleet").subcommand(
                super::fleet::SparkArgs::augment_args(clap::Command::new("spark")),
            ));
    let parsed = cmd
        .try_get_matches_from(&ev.command)
        .and_then(|m| match m.subcommand() {
            Some(("scope", sub)) => super::scope::Args::from_arg_matches(sub).map(Recorded::Scope),
            Some(("merge", sub)) => super::merge::Args::from_arg_matches(sub)
                .map(|a| Recorded::Merge(a.allowed_signers.is_some())),
            // `fleet spark` merged the shard folders its own job wrote,
            // unmarked: re-run as a merge of them.
            Some(("fleet", f)) => match f.subcommand() {
                Some(("spark", sub)) => {
                    super::fleet::SparkArgs::from_arg_matches(sub).map(|_| Recorded::Merge(true))
                }
                _ => Err(clap::Error::new(clap::error::ErrorKind::InvalidSubcommand)),
            },
            _ => Err(clap::Error::new(clap::error::ErrorKind::InvalidSubcommand)),
        });
    let recorded = parsed.map_err(|e| {
        cannot(
            dir,
            format!("evidence.json's command line does not parse as `kvtrail scope`, `kvtrail merge` or `kvtrail fleet spark`, the commands that are re-run ({})", e.kind()),
        )
    })?;
    match recorded {
        Recorded::Scope(a) => {
            let [inp] = &ev.inputs[..] else {
                return Err(cannot(dir, "a scope folder records one trace input"));
            };
            if inp.kind != "trace" {
                return Err(cannot(
                    dir,
                    format!("its input is a {}, not a trace", inp.kind),
                ));
            }
            let trace = input_path(dir, &inp.root);
            let config = BackendConfig::new(a.backend, a.threads.map_or(0, usize::from));
            let run = ScopeRun::open_with(&trace, config)?;
            let note = run.backend_note().to_string();
            eprintln!(
                "kvtrail: reproducing from {}; replay backend: {note}",
                term(&trace.display().to_string())
            );
            let s = run.run(a.pools, &NoReporter)?;
            writer::write_scope_folder(dest, &s.trace, &s.report, s.shard.as_ref(), &ev.command)?;
            Ok(Some(note))
        }
        Recorded::Merge(authenticated) => {
            let parts: Vec<PathBuf> = ev.inputs.iter().map(|i| input_path(dir, &i.root)).collect();
            if ev.inputs.iter().any(|i| i.kind != "scope") || parts.is_empty() {
                return Err(cannot(
                    dir,
                    "a merged folder records shard folders as its inputs",
                ));
            }
            let shards = kvtrail::scope::shard::load_shards(&parts)?;
            let parts: Vec<_> = shards
                .iter()
                .map(|s| (s.report.clone(), s.info.clone()))
                .collect();
            // The marking follows the recorded command: with
            // --allowed-signers the shards were authenticated then (and are
            // the same bytes now: load_shards checked them).
            let r = if authenticated {
                kvtrail::scope::merge::merge(&parts)?
            } else {
                kvtrail::scope::merge::merge_unauthenticated(&parts)?
            };
            writer::write_merged_folder(dest, &shards, &r, &ev.command, || Ok(()))?;
            Ok(None)
        }
    }
}

/// The verdict when an input the folder recorded (evidence.json) has
/// changed since, as `verify SCOPE_DIR` checks it; None when none has (an
/// input out of reach, gone or in object storage, is not judged here).
fn changed_input(dir: &Path) -> anyhow::Result<Option<String>> {
    let checked = kvtrail::custody::folder::verify_folder(dir, true)?;
    Ok(checked
        .problems
        .iter()
        .find(|p| p.side == "input")
        .map(|p| {
            format!(
                "NOT reproduced: the recorded input has changed since the folder was written: {} ({}: {}); the re-run cannot stand for the folder",
                p.path, p.kind, p.detail
            )
        }))
}

/// The command a scope folder records: only scope and merge (also the
/// merge of `fleet spark`) are re-run; a merge says whether its result was
/// left unmarked (shards authenticated, or written by its own job).
enum Recorded {
    Scope(super::scope::Args),
    Merge(bool),
}

pub fn run(
    dir: &Path,
    signing_key: Option<&Path>,
    out: Option<&Path>,
    json: bool,
) -> anyhow::Result<i32> {
    let key = super::signing::load_key(signing_key)?;
    if let Some(o) = out {
        if o.exists() {
            anyhow::bail!(
                "{}: exists; --out names a new file for the reproduction's statement",
                term(&o.display().to_string())
            );
        }
        if std::path::absolute(o)?.starts_with(std::path::absolute(dir)?) {
            anyhow::bail!(
                "{}: inside the scope folder; write the statement outside it",
                term(&o.display().to_string())
            );
        }
    }
    let (ev, _) = load_evidence(dir)?;
    if ev.kind != "scope" {
        return Err(cannot(
            dir,
            format!("it is a {} folder; only scope folders are re-run", ev.kind),
        ));
    }
    // The reproduction lies beside the folder, so that the input roots
    // evidence.json records relative to it are the same.
    let at = std::fs::canonicalize(dir).map_err(|e| cannot(dir, e))?;
    let parent = at.parent().unwrap_or(Path::new("/"));
    let name = at
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}.reproduce."))
        .tempdir_in(parent)
        .map_err(|e| cannot(dir, format!("no room beside it for the re-run ({e})")))?;
    let rerun_result = rerun(dir, &ev, tmp.path());
    let cmp = match &rerun_result {
        Ok(_) => Some(compare_folders(dir, tmp.path())?),
        Err(_) => None,
    };
    // A re-run that failed or differs may come from inputs that are not
    // the recorded ones: then say so, naming the input, rather than some
    // output byte. (A re-run identical to the folder needs no such check:
    // evidence.json, compared with the rest, records every input's digest.)
    if cmp.as_ref().is_none_or(|c| c.first_difference.is_some())
        && let Some(verdict) = changed_input(dir)?
    {
        output::print(
            json,
            &ReproduceReport {
                ok: false,
                comparison: &Comparison::default(),
                verdict: &verdict,
            },
            |o| writeln!(o, "FAILED: {}", term(&verdict)),
        )?;
        return Ok(1);
    }
    let backend = rerun_result?;
    let cmp = cmp.unwrap_or_default();
    let ok = cmp.first_difference.is_none();
    let verdict = match &cmp.first_difference {
        None => format!(
            "reproduced: all {} files byte for byte the same as a re-run from the recorded inputs",
            cmp.identical
        ),
        Some(d) => format!("NOT reproduced: {d}"),
    };
    if let (Some(key), Some(out)) = (key.as_deref(), out) {
        let mut p = Predicate::new("verify --reproduce", &output::command_line());
        p.inputs = vec![folder_input(dir, "scope")?];
        p.backend = backend;
        p.verdict = one_line(&verdict);
        sign_files(out, dir, &cmp.files, key, p)?;
        eprintln!("kvtrail: wrote {}", term(&out.display().to_string()));
    }
    output::print(
        json,
        &ReproduceReport {
            ok,
            comparison: &cmp,
            verdict: &verdict,
        },
        |o| {
            writeln!(
                o,
                "{}: {}",
                if ok { "OK" } else { "FAILED" },
                term(&verdict)
            )
        },
    )?;
    drop(tmp);
    Ok(if ok { 0 } else { 1 })
}

#[derive(serde::Serialize)]
struct ReproduceReport<'a> {
    ok: bool,
    #[serde(flatten)]
    comparison: &'a Comparison,
    verdict: &'a str,
}
