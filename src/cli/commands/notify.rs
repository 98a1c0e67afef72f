//! `kvtrail notify SCOPE_DIR --out DIR`: per-customer notification packs,
//! the processor notice and the breach-register entry from a scope folder,
//! the letters laid out by the built-in templates of `--lang` or the
//! operator's own (`--templates DIR`); `notify --write-default-templates
//! DIR` writes the built-in ones out to start from.

use std::path::PathBuf;

use kvtrail::custody::statement::{Predicate, STATEMENT_FILE, folder_input, sign_folder};
use kvtrail::notify::templates::write_defaults;
use kvtrail::notify::{Lang, NotifyConfig, Templates, notify};
use kvtrail::text::term;

use crate::cli::output;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Scope folder (written by `kvtrail scope TRACE --out DIR`).
    #[arg(required_unless_present = "write_default_templates")]
    pub scope_dir: Option<PathBuf>,
    /// Write the packs here (a new or empty folder outside the scope folder; owner-only files).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "write_default_templates"
    )]
    pub out: Option<PathBuf>,
    /// Language of the letters and of the sentences in notice.json and the register.
    #[arg(long, value_name = "LANG", default_value = "en", value_parser = clap::builder::PossibleValuesParser::new(Lang::ALL.map(Lang::code)))]
    pub lang: String,
    #[arg(long, value_name = "DIR", help = templates_help())]
    pub templates: Option<PathBuf>,
    /// Write the built-in templates of --lang into DIR to start your own from, and do nothing else.
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with_all = ["scope_dir", "out", "templates", "config", "force"]
    )]
    pub write_default_templates: Option<PathBuf>,
    /// Replace an earlier `kvtrail notify` folder of the same scope folder (it must hold nothing but the files its evidence.json lists).
    #[arg(long)]
    pub force: bool,
    /// Operator settings: operator_name, dpo_contact, incident_id, became_aware, measures, ...
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Sign the output folder with this OpenSSH ed25519 private key (owner-only): an in-toto statement over every file, citing the scope folder's own statement (statement.intoto.jsonl).
    #[arg(long, value_name = "FILE", conflicts_with = "write_default_templates")]
    pub signing_key: Option<PathBuf>,
}

/// `--templates`' help, naming the template files `Templates::load` takes.
fn templates_help() -> String {
    format!(
        "Folder of your own templates ({}; any subset): each replaces the built-in one of that name.",
        kvtrail::notify::templates::NAMES.join(", ")
    )
}

pub fn run(args: Args) -> anyhow::Result<i32> {
    // clap admits only the languages there are.
    let lang = Lang::parse(&args.lang).unwrap_or_default();
    if let Some(dir) = &args.write_default_templates {
        let files = write_defaults(lang, dir)?;
        output::print_human(|out| {
            for f in &files {
                writeln!(out, "wrote {}", term(&f.display().to_string()))?;
            }
            writeln!(
                out,
                "edit them, then pass --templates {} (files you delete fall back to the built-in ones)",
                term(&dir.display().to_string())
            )
        })?;
        return Ok(0);
    }
    let (Some(scope_dir), Some(out_dir)) = (&args.scope_dir, &args.out) else {
        anyhow::bail!("kvtrail notify needs SCOPE_DIR and --out DIR");
    };
    let key = super::signing::load_key(args.signing_key.as_deref())?;
    let templates = Templates::load(lang, args.templates.as_deref())?;
    let cfg = match &args.config {
        Some(p) => NotifyConfig::load(p)?,
        None => NotifyConfig::default(),
    };
    let command = output::command_line();
    let o = notify(
        scope_dir,
        out_dir,
        &cfg,
        args.config.as_deref(),
        &command,
        args.force,
        &templates,
    )?;
    if let Some(key) = key.as_deref() {
        // Last, over every file notify wrote, evidence.json included.
        let mut p = Predicate::new("notify", &command);
        p.inputs = vec![folder_input(scope_dir, "scope")?];
        p.verdict = format!(
            "{} notification packs, the register entry and evidence.json",
            o.packs.len()
        );
        sign_folder(out_dir, key, p)?;
        eprintln!(
            "kvtrail notify: signed by {} ({STATEMENT_FILE})",
            key.fingerprint()
        );
    }
    if !o.unfilled.is_empty() {
        eprintln!(
            "kvtrail notify: warning: not set in the config, shown as {} in every letter: {}",
            match lang {
                Lang::En => "[to fill in: ...]",
                Lang::De => "[bitte ergänzen: ...]",
            },
            o.unfilled.join(", ")
        );
    }
    output::print_human(|out| {
        for p in &o.packs {
            writeln!(out, "pack {}", term(p))?;
        }
        writeln!(
            out,
            "{} notification packs, register entry and evidence.json written to {}; evidence digest {}",
            o.packs.len(),
            term(&out_dir.display().to_string()),
            o.evidence_digest
        )
    })?;
    Ok(0)
}
