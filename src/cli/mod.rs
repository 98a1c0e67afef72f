//! Command-line interface: clap derive, one file per subcommand under
//! `commands/`, progress bars and exit codes. Only this layer prints.
//!
//! Exit codes: 0 success, 1 findings the caller asked to fail on (or a trace
//! that fails verification), 2 tool error (bad input, I/O). A broken pipe on
//! stdout is success.

pub mod commands;
pub mod output;
pub mod progress;

use clap::{ColorChoice, CommandFactory, FromArgMatches, Subcommand};

/// Record-and-replay forensics for KV-cache isolation failures in LLM
/// serving engines.
#[derive(clap::Parser, Debug)]
#[command(name = "kvtrail", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands in `kvtrail --help` order: the workflow (capture, check,
/// analyse, act). clap has no headings for groups of subcommands, so the
/// groups are this order and the comments below.
#[derive(Subcommand, Debug)]
pub enum Command {
    // Capture: get a trace.
    /// Capture sidecar: receive engine hook event streams and write a trace.
    Record(commands::record::Args),
    /// Turn a JSON-lines event stream from an engine hook into a trace.
    Ingest(commands::ingest::Args),
    /// Simulate a PD-disaggregated engine and write a trace (and its ground truth).
    Simulate(commands::simulate::Args),

    // Check: is the trace (or a folder) sound, and the deployment safe?
    /// Check a trace against its manifest digests, or a scope/notify folder against its evidence.json.
    Verify(commands::verify::Args),
    /// Summarise a trace on one screen: pools, counts, tenants, seq holes.
    Inspect(commands::inspect::Args),
    /// Deploy gate: pools vs context window, page sizes, scrub policy; trace checks.
    Audit(commands::audit::Args),

    // Analyse: who read whose KV, and what if.
    /// Replay a trace: every response that read foreign KV, whose it was, who must be told.
    Scope(commands::scope::Args),
    /// Run scope on the built-in incident-mini trace and print the summary.
    Demo(commands::demo::Args),
    /// Answer "was this response affected?" from a scope folder.
    Lookup(commands::lookup::Args),
    /// Export a scope folder's findings for other tools: OCSF (SIEM, Security Hub) or a Timesketch timeline.
    Export(commands::export::Args),
    /// Combine `scope --pools` shard outputs into the report of a single run.
    Merge(commands::merge::Args),
    /// Fan native scope out by pool: print the shards (plan), or run them on Spark and merge them (spark).
    Fleet(commands::fleet::Args),
    /// Print the lineage as SQL for DuckDB, Spark or Trino (fleet-scale traces in a warehouse).
    Sql(commands::sql::Args),
    /// Re-run a trace's workload under another engine or config and capture a new trace.
    Replay(commands::replay::Args),
    /// Compare a trace with its what-if replay: per-request changes and exposure before/after.
    Diff(commands::diff::Args),
    /// Re-run affected responses with the reference model, with and without their foreign KV.
    Counterfactual(commands::counterfactual::Args),

    // Act: tell the customers.
    /// Write per-customer breach notification packs and the register entry from a scope folder.
    Notify(commands::notify::Args),

    // Shell: completion scripts and manual pages.
    /// Print a shell completion script (bash, zsh or fish) on stdout.
    Completions(commands::completions::Args),
    /// Print the manual page kvtrail.1, or write it and one page per subcommand into a folder.
    Man(commands::man::Args),
}

/// What a command asks the process to exit with.
pub type Exit = i32;

/// Whether colour is off: `NO_COLOR` set to anything but the empty string
/// (no-color.org). kvtrail's own output has no colour; this turns off
/// clap's (help, usage and parse errors), whatever else the environment
/// says (`CLICOLOR_FORCE`).
pub fn no_color() -> bool {
    std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
}

pub fn run() -> Exit {
    let mut cmd = Cli::command();
    if no_color() {
        cmd = cmd.color(ColorChoice::Never);
    }
    let parsed = cmd
        .try_get_matches()
        .and_then(|mut m| Cli::from_arg_matches_mut(&mut m));
    let cli = match parsed {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    let res = match cli.command {
        Command::Record(a) => commands::record::run(a),
        Command::Ingest(a) => commands::ingest::run(a),
        Command::Simulate(a) => commands::simulate::run(a),
        Command::Verify(a) => commands::verify::run(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Audit(a) => commands::audit::run(a),
        Command::Scope(a) => commands::scope::run(a),
        Command::Demo(a) => commands::demo::run(a),
        Command::Lookup(a) => commands::lookup::run(a),
        Command::Export(a) => commands::export::run(a),
        Command::Merge(a) => commands::merge::run(a),
        Command::Fleet(a) => commands::fleet::run(a),
        Command::Sql(a) => commands::sql::run(a),
        Command::Replay(a) => commands::replay::run(a),
        Command::Diff(a) => commands::diff::run(a),
        Command::Counterfactual(a) => commands::counterfactual::run(a),
        Command::Notify(a) => commands::notify::run(a),
        Command::Completions(a) => commands::completions::run(a, Cli::command()),
        Command::Man(a) => commands::man::run(a, Cli::command()),
    };
    match res {
        Ok(code) => code,
        Err(e) => {
            if output::is_broken_pipe(&e) {
                return 0;
            }
            // A parent kvtrail asked for its error as a JSON line.
            if kvtrail::fleet::error_line::wanted() {
                let line = kvtrail::fleet::error_line::ErrorLine::of_chain(e.chain());
                eprintln!("{}", line.to_json());
                return 2;
            }
            // Errors quote paths and trace strings: escaped, so that the
            // only line breaks are the messages' own `hint:` lines.
            eprintln!("error: {}", kvtrail::text::term_message(&format!("{e:#}")));
            2
        }
    }
}
