//! The one rule for every command that writes a folder: never inside its
//! input, never over unrelated files; an earlier output of the same kind
//! and input only with `--force`.

use std::path::{Path, PathBuf};

use crate::custody::evidence::EVIDENCE_JSON;
use crate::custody::inputs::list_files;
use crate::custody::record::load_evidence;
use crate::custody::statement::is_folder_record;
use crate::error::{Error, Location, Result};

/// `p` made absolute without requiring it to exist: its longest existing
/// ancestor canonicalised (links resolved), the rest appended.
fn resolve(p: &Path) -> PathBuf {
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    let mut rest = Vec::new();
    let mut cur = p.as_path();
    loop {
        if let Ok(c) = std::fs::canonicalize(cur) {
            let mut out = c;
            for r in rest.iter().rev() {
                out.push(r);
            }
            return out;
        }
        match (cur.parent(), cur.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                cur = parent;
            }
            _ => return p,
        }
    }
}

/// Checks the output folder of a command that writes a trace (`ingest`,
/// `simulate`, `replay`, `record`) before anything is written: never
/// inside (or equal to) an input trace, never a folder that holds anything
/// (a trace is never mixed with other files, and there is no `--force`: an
/// earlier trace is removed by hand). A new or empty folder is fine.
pub fn prepare_trace_out(out: &Path, inputs: &[&Path]) -> Result<()> {
    if out_is_empty(out, inputs)? {
        return Ok(());
    }
    Err(Error::invalid(
        Location::file(out),
        "the output folder exists and is not empty",
        "pass a new or empty folder for the trace (remove an earlier trace yourself if it is no longer needed)",
    ))
}

/// The checks shared by every output folder: `out` is not, and does not
/// lie inside, any of `inputs`; it is new, or an existing folder. Returns
/// whether it is new or empty.
fn out_is_empty(out: &Path, inputs: &[&Path]) -> Result<bool> {
    let at = resolve(out);
    for inp in inputs {
        let inp_at = resolve(inp);
        if at.starts_with(&inp_at) {
            return Err(Error::invalid(
                Location::file(out),
                format!(
                    "the output folder is inside the input {} (writing there would change the evidence being read)",
                    inp.display()
                ),
                "pass an output folder outside the input folder",
            ));
        }
    }
    if !out.exists() {
        return Ok(true);
    }
    if !out.is_dir() {
        return Err(Error::invalid(
            Location::file(out),
            "the output path exists and is not a folder",
            "pass a new or empty folder",
        ));
    }
    let any = std::fs::read_dir(out)
        .map_err(|e| Error::io(out, e))?
        .next()
        .is_some();
    Ok(!any)
}

/// Checks and readies the output folder of a command before anything is
/// written. `kind` is what the command records in evidence.json (scope,
/// notify) or another name for commands without one (merge); `inputs` are
/// the folders it reads, `inputs[0]` the one evidence.json records.
///
/// - `out` must not be, or lie inside, any input folder (writing there
///   would change the evidence being read, or make the trace unreadable);
/// - a new or empty folder is used as it is;
/// - a non-empty folder is refused, unless `force` is set and it is an
///   earlier output of the same `kind` from the same `inputs[0]` that holds
///   nothing but the files its evidence.json lists: those are removed first,
///   so no older file can end up certified by the new evidence.json.
pub fn prepare_out(out: &Path, kind: &str, inputs: &[&Path], force: bool) -> Result<()> {
    if out_is_empty(out, inputs)? {
        return Ok(());
    }
    let entries = list_files(out)?;
    let refuse = |what: String| {
        Error::invalid(
            Location::file(out),
            what,
            format!(
                "pass a new or empty folder; --force replaces only an earlier `kvtrail {kind}` output of the same input, holding nothing else"
            ),
        )
    };
    if !force {
        return Err(refuse(
            "the output folder exists and is not empty".to_string(),
        ));
    }
    if !out.join(EVIDENCE_JSON).is_file() {
        return Err(refuse(format!(
            "the output folder is not empty and is not an earlier `kvtrail {kind}` output (no evidence.json)"
        )));
    }
    let (ev, _) = load_evidence(out)?;
    let same_input = ev.inputs.first().is_some_and(|i| {
        inputs
            .first()
            .is_some_and(|want| resolve(&out.join(&i.root)) == resolve(want))
    });
    if ev.kind != kind || !same_input {
        return Err(refuse(format!(
            "the output folder is an earlier `kvtrail {}` output of another input; --force only replaces one of `kvtrail {kind}` on {}",
            ev.kind,
            inputs
                .first()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        )));
    }
    let listed: std::collections::BTreeSet<&str> =
        ev.outputs.iter().map(|f| f.path.as_str()).collect();
    if let Some(extra) = entries
        .iter()
        .find(|r| !is_folder_record(r) && !listed.contains(r.as_str()))
    {
        return Err(refuse(format!(
            "the output folder holds {extra}, which its evidence.json does not list; refusing to delete or certify it"
        )));
    }
    for r in entries {
        let p = out.join(&r);
        std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
    }
    remove_empty_dirs(out)
}

/// Removes the empty folders under `dir` (not `dir` itself).
fn remove_empty_dirs(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let p = e.map_err(|e| Error::io(dir, e))?.path();
        if p.is_dir() && !p.is_symlink() {
            remove_empty_dirs(&p)?;
            std::fs::remove_dir(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    Ok(())
}
