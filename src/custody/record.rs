//! Writing evidence.json, and reading it back as hostile input: digests
//! are blake3 hex, file paths stay inside the folder, input roots lead out
//! of it.

use std::path::Path;

use crate::custody::evidence::{
    Chunks, EVIDENCE_JSON, Evidence, FileDigest, INPUT_KINDS, Inputs, MAX_EVIDENCE_BYTES,
};
use crate::custody::inputs::list_files;
use crate::custody::private::write_private;
use crate::error::{Error, Location, Result};
use crate::trace::TraceRoot;
use crate::trace::chunked::{self, ChunkDigest};

/// Writes evidence.json last, over every other file now in `dir`. Returns
/// the evidence digest (blake3 of evidence.json).
pub fn write_evidence(
    dir: &Path,
    kind: &str,
    command: &[String],
    inputs: Vec<Inputs>,
) -> Result<String> {
    let mut outputs = Vec::new();
    for r in list_files(dir)? {
        if r == EVIDENCE_JSON {
            continue;
        }
        let (h, b, chunks) = chunked::digest_file(&dir.join(&r), ChunkDigest::Subtree)?;
        outputs.push(FileDigest {
            path: r,
            bytes: b,
            blake3: h,
            manifest_blake3: None,
            matches_manifest: None,
            chunks: chunks.map(|blake3| Chunks {
                chunk_bytes: chunked::chunk_bytes_for(b),
                digest: Some(ChunkDigest::SUBTREE.into()),
                blake3,
            }),
        });
    }
    let here = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    let inputs = inputs
        .into_iter()
        .map(|mut i| {
            i.root = relative_to(&here, Path::new(&i.root));
            i
        })
        .collect();
    let ev = Evidence {
        format: "kvtrail-evidence".into(),
        version: 1,
        kind: kind.into(),
        tool: "kvtrail".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        command: command.to_vec(),
        inputs,
        outputs,
    };
    let mut text = serde_json::to_string_pretty(&ev).expect("evidence serializes");
    text.push('\n');
    let p = dir.join(EVIDENCE_JSON);
    write_private(&p, &text)?;
    Ok(blake3::hash(text.as_bytes()).to_hex().to_string())
}

/// `to` (absolute) as a path relative to the directory `from` (absolute),
/// with `/` separators: evidence.json then reads the same wherever the
/// folders are, as long as they keep their relative places.
fn relative_to(from: &Path, to: &Path) -> String {
    let a: Vec<_> = from.components().collect();
    let b: Vec<_> = to.components().collect();
    let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    if common == 0 {
        return to.to_string_lossy().into_owned();
    }
    let mut parts: Vec<String> = vec!["..".into(); a.len() - common];
    parts.extend(
        b[common..]
            .iter()
            .map(|c| c.as_os_str().to_string_lossy().into_owned()),
    );
    if parts.is_empty() {
        ".".into()
    } else {
        parts.join("/")
    }
}

/// Reads a folder's evidence.json; returns it and its digest.
pub fn load_evidence(dir: &Path) -> Result<(Evidence, String)> {
    read_evidence(dir).map(|(ev, digest, _)| (ev, digest))
}

/// `load_evidence`, plus the size of the bytes read.
pub(crate) fn read_evidence(dir: &Path) -> Result<(Evidence, String, u64)> {
    let p = dir.join(EVIDENCE_JSON);
    let bytes = crate::trace::files::read_limited(&p, MAX_EVIDENCE_BYTES, "an evidence record")?;
    let ev: Evidence = serde_json::from_slice(&bytes).map_err(|e| {
        Error::invalid(
            Location::file(&p),
            format!("not a kvtrail evidence record: {e}"),
            "evidence.json is written by `kvtrail scope --out` and `kvtrail notify`; re-create the folder",
        )
    })?;
    if ev.format != "kvtrail-evidence" || ev.version != 1 {
        return Err(Error::invalid(
            Location::file(&p),
            format!(
                "unsupported evidence format {:?} version {}",
                ev.format, ev.version
            ),
            "use the kvtrail version that wrote the folder",
        ));
    }
    check_record(&ev, &p)?;
    Ok((
        ev,
        blake3::hash(&bytes).to_hex().to_string(),
        bytes.len() as u64,
    ))
}

pub(crate) fn bad_record(p: &Path, key: &str, what: String) -> Error {
    Error::invalid(
        Location::file(p).column(key),
        what,
        "evidence.json is written by kvtrail and never edited; re-create the folder from its input with the command it records",
    )
}

/// Whether `s` is a blake3 digest as kvtrail writes it (64 hex digits).
fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A file path inside its root: relative, `/`-separated names only (no
/// `..`, `.`, empty or absolute part).
pub(crate) fn is_inner_path(s: &str) -> bool {
    !s.is_empty()
        && s.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
        && Path::new(s)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
}

/// An input root: relative and leading out of the folder (`..` first, then
/// `..` or names).
fn is_input_root(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.first() == Some(&"..")
        && parts.iter().all(|c| !c.is_empty() && *c != ".")
        && !Path::new(s).is_absolute()
}

/// The shape rules of an evidence record read back from disk; the key of
/// the first violation is named.
fn check_record(ev: &Evidence, p: &Path) -> Result<()> {
    let files = |key: &str, files: &[FileDigest], outputs: bool| -> Result<()> {
        let mut seen = std::collections::BTreeSet::new();
        for (i, f) in files.iter().enumerate() {
            if !is_inner_path(&f.path) {
                return Err(bad_record(
                    p,
                    &format!("{key}[{i}].path"),
                    format!(
                        "{:?} is not a path inside the folder (absolute paths, `..` and `.` are refused; nothing outside the folder is opened)",
                        f.path
                    ),
                ));
            }
            if outputs && f.path == EVIDENCE_JSON {
                return Err(bad_record(
                    p,
                    &format!("{key}[{i}].path"),
                    "evidence.json cannot list itself".into(),
                ));
            }
            if !seen.insert(f.path.as_str()) {
                return Err(bad_record(
                    p,
                    &format!("{key}[{i}].path"),
                    format!("{:?} is listed twice", f.path),
                ));
            }
            if !is_digest(&f.blake3) {
                return Err(bad_record(
                    p,
                    &format!("{key}[{i}].blake3"),
                    "not a blake3 digest (64 hex digits)".into(),
                ));
            }
            if let Some(c) = &f.chunks {
                let key = format!("{key}[{i}].chunks");
                let chunk = chunked::chunk_bytes_for(f.bytes);
                if !outputs || f.bytes < chunked::CHUNKED_FROM || c.chunk_bytes != chunk {
                    return Err(bad_record(
                        p,
                        &format!("{key}.chunk_bytes"),
                        format!(
                            "chunk digests of {} bytes for a file of {} bytes; kvtrail writes chunks of {chunk} bytes for output files of at least {} bytes only",
                            c.chunk_bytes,
                            f.bytes,
                            chunked::CHUNKED_FROM
                        ),
                    ));
                }
                if c.blake3.len() as u64 != chunked::chunk_count(f.bytes) {
                    return Err(bad_record(
                        p,
                        &format!("{key}.blake3"),
                        format!(
                            "{} chunk digests for {} bytes, expected {}",
                            c.blake3.len(),
                            f.bytes,
                            chunked::chunk_count(f.bytes)
                        ),
                    ));
                }
                if let Some(d) = c.digest.as_deref().filter(|d| *d != ChunkDigest::SUBTREE) {
                    return Err(bad_record(
                        p,
                        &format!("{key}.digest"),
                        format!(
                            "unknown chunk digest {d:?} (kvtrail writes {:?}; records without it hold plain blake3 digests)",
                            ChunkDigest::SUBTREE
                        ),
                    ));
                }
                if let Some(j) = c.blake3.iter().position(|d| !is_digest(d)) {
                    return Err(bad_record(
                        p,
                        &format!("{key}.blake3[{j}]"),
                        "not a blake3 digest (64 hex digits)".into(),
                    ));
                }
            }
        }
        Ok(())
    };
    files("outputs", &ev.outputs, true)?;
    for (n, inp) in ev.inputs.iter().enumerate() {
        if !INPUT_KINDS.contains(&inp.kind.as_str()) {
            return Err(bad_record(
                p,
                &format!("inputs[{n}].kind"),
                format!(
                    "unknown input kind {:?} (expected one of {INPUT_KINDS:?})",
                    inp.kind
                ),
            ));
        }
        // A trace in object storage is recorded by its URL.
        let remote_trace = inp.kind == "trace" && TraceRoot::names_url(Path::new(&inp.root));
        if !is_input_root(&inp.root) && !remote_trace {
            return Err(bad_record(
                p,
                &format!("inputs[{n}].root"),
                format!(
                    "{:?} does not lead out of the folder (an input root is relative and begins with `..`, or a trace's object-store URL; an input is never the folder itself or inside it)",
                    inp.root
                ),
            ));
        }
        files(&format!("inputs[{n}].files"), &inp.files, false)?;
    }
    Ok(())
}
