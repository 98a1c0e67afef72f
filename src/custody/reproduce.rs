//! Comparing an output folder with its re-run (`verify --reproduce`):
//! every file, byte for byte, and the first difference named. The one
//! exception (docs/evidence.md, "Reproducing a verdict") is the folder's
//! statement: it signs the folder, is not an output of the analysis, and
//! `verify` checks it against the very files compared here. Nothing else
//! is excepted: a scope folder holds no time of its own run, no duration
//! and no host name, and its paths are relative to the folder (the re-run
//! is written beside it).

use std::io::Read;
use std::path::Path;

use serde::Serialize;

use crate::custody::evidence::EVIDENCE_JSON;
use crate::custody::inputs::list_files;
use crate::custody::statement::STATEMENT_FILE;
use crate::error::{Error, Result};
use crate::trace::files::open_local;

/// What comparing a folder with its re-run found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Comparison {
    /// The folder's files compared (its statement excepted: it signs the
    /// folder, and is checked by `verify`).
    pub files: Vec<String>,
    /// Files byte for byte the same.
    pub identical: usize,
    /// The first file that differs (in path order, evidence.json last),
    /// and where.
    pub first_difference: Option<String>,
}

/// The offset of the first byte where two files differ (None: the same
/// bytes).
fn first_differing_byte(a: &Path, b: &Path) -> Result<Option<u64>> {
    let (mut fa, mut fb) = (open_local(a)?, open_local(b)?);
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    let mut at = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba, a)?;
        let nb = read_full(&mut fb, &mut bb, b)?;
        if let Some(i) = ba[..na.min(nb)]
            .iter()
            .zip(&bb[..na.min(nb)])
            .position(|(x, y)| x != y)
        {
            return Ok(Some(at + i as u64));
        }
        if na != nb {
            return Ok(Some(at + na.min(nb) as u64));
        }
        if na == 0 {
            return Ok(None);
        }
        at += na as u64;
    }
}

/// Reads until `buf` is full or the file ends.
fn read_full(f: &mut std::fs::File, buf: &mut [u8], p: &Path) -> Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let k = f.read(&mut buf[n..]).map_err(|e| Error::io(p, e))?;
        if k == 0 {
            break;
        }
        n += k;
    }
    Ok(n)
}

/// Compares the folder `orig` with its re-run `rerun`, file by file.
pub fn compare_folders(orig: &Path, rerun: &Path) -> Result<Comparison> {
    let a: Vec<String> = list_files(orig)?
        .into_iter()
        .filter(|f| f != STATEMENT_FILE)
        .collect();
    let b = list_files(rerun)?;
    let mut c = Comparison {
        files: a.clone(),
        ..Default::default()
    };
    // evidence.json last: it records the digests of every other file, so
    // a change anywhere shows there too; the file itself is named first.
    let mut all: Vec<&String> = a
        .iter()
        .chain(&b)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    all.sort_by_key(|f| (f.as_str() == EVIDENCE_JSON, f.as_str()));
    for f in all {
        let (in_a, in_b) = (a.contains(f), b.contains(f));
        let diff = if !in_b {
            Some(format!("{f}: in the folder, not written by the re-run"))
        } else if !in_a {
            Some(format!(
                "{f}: written by the re-run, missing from the folder"
            ))
        } else {
            first_differing_byte(&orig.join(f), &rerun.join(f))?
                .map(|at| format!("{f}: differs from the re-run at byte {at}"))
        };
        match diff {
            None => c.identical += 1,
            Some(d) => {
                if c.first_difference.is_none() {
                    c.first_difference = Some(d);
                }
            }
        }
    }
    Ok(c)
}
