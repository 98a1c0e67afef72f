//! Checking a sealed trace: every seal's signature and signer (against an
//! allowed_signers file), the chain (no seal missing, reordered, altered
//! or taken from another capture), every data file against the seals that
//! cover it (whole, and every prefix sealed while it was open), trace.json
//! against the final seal, and that no data file is left unsealed.
//!
//! A problem is evidence that fails (exit 1); an error is what cannot be
//! checked (exit 2): a signature that does not parse (truncated,
//! re-armored) or was made in another namespace, an unreadable seal file.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

use serde::Serialize;
use sha2::Digest;

use super::format::{MAX_SEAL_BYTES, NAMESPACE, SEALS_DIR, hex, seal_name, sha256_hex};
use super::format::{SEAL_FORMAT, Seal};
use crate::custody::keys::{AllowedSigners, SignatureCheck, check_signature, parse_signature};
use crate::error::{Error, Location, Result};
use crate::trace::files::{TableFile, open_local, read_limited, walk};

/// The live findings `kvtrail record` writes into the trace before its
/// final seal (the one name; `record::live` uses it).
pub const LIVE_FINDINGS: &str = "live-findings.json";

/// One way a sealed trace fails.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct SealProblem {
    /// The seal (`seals/000003.json`) or file (`kv/pool=0/part-00000.parquet`)
    /// the problem is about.
    pub at: String,
    pub detail: String,
}

/// What checking a trace's seals found.
#[derive(Debug, Clone, Serialize)]
pub struct SealReport {
    /// No problem.
    pub ok: bool,
    pub seals: u64,
    pub capture_id: Option<String>,
    /// Whether the signatures were checked (an allowed_signers file given).
    pub signatures_checked: bool,
    /// The signers, as `principal (SHA256:...)`, each once.
    pub signers: Vec<String>,
    /// The last seal is marked final.
    pub final_seal: bool,
    pub files_checked: usize,
    pub problems: Vec<SealProblem>,
    /// What the sealer recorded as wrong while sealing (a seal's
    /// `problems`), by seal: signed facts, reported, not failures.
    pub notes: Vec<SealProblem>,
}

/// A digest a seal states for a file's first `bytes` bytes (the whole
/// file when `whole`).
struct Claim {
    seal: u64,
    bytes: u64,
    sha256: String,
    blake3: String,
    whole: bool,
}

/// Checks the seals of the trace at `dir`. None when it has no `seals/`.
pub fn verify_seals(dir: &Path, allowed: Option<&AllowedSigners>) -> Result<Option<SealReport>> {
    let sdir = dir.join(SEALS_DIR);
    if std::fs::symlink_metadata(&sdir).is_err() {
        return Ok(None);
    }
    let mut r = SealReport {
        ok: false,
        seals: 0,
        capture_id: None,
        signatures_checked: allowed.is_some(),
        signers: Vec::new(),
        final_seal: false,
        files_checked: 0,
        problems: Vec::new(),
        notes: Vec::new(),
    };
    let (jsons, sigs) = list_seals(&sdir, &mut r.problems)?;
    let last = jsons.iter().chain(&sigs).max().copied();
    let mut seals: Vec<Seal> = Vec::new();
    let mut previous: Option<String> = None;
    let mut signers = BTreeSet::new();
    for i in 0..last.map_or(0, |l| l + 1) {
        let name = format!("{SEALS_DIR}/{}", seal_name(i));
        let mut fail = |detail: String| {
            r.problems.push(SealProblem {
                at: name.clone(),
                detail,
            })
        };
        if !jsons.contains(&i) {
            fail("missing: the chain has a gap (a seal was deleted)".into());
            previous = None;
            continue;
        }
        let p = sdir.join(seal_name(i));
        let bytes = read_limited(&p, MAX_SEAL_BYTES, "a seal")?;
        if sigs.contains(&i) {
            let sp = sdir.join(format!("{}.sig", seal_name(i)));
            let armored = read_limited(&sp, 64 << 10, "a seal's signature")?;
            let armored = String::from_utf8(armored).map_err(|_| {
                Error::invalid(
                    Location::file(&sp),
                    "not text: not an armored SSH signature",
                    "restore the file from the original copy",
                )
            })?;
            let sig = parse_signature(&armored, &sp, NAMESPACE)?;
            if let Some(a) = allowed {
                match check_signature(&sig, &bytes, NAMESPACE, a) {
                    SignatureCheck::Good {
                        principals,
                        fingerprint,
                    } => {
                        signers.insert(format!("{} ({fingerprint})", principals.join(",")));
                    }
                    SignatureCheck::Bad(why) | SignatureCheck::UnknownSigner(why) => fail(why),
                }
            }
        } else {
            fail("unsigned: its .sig file is missing".into());
        }
        let seal: Seal = match serde_json::from_slice(&bytes) {
            Ok(s) => s,
            Err(e) => {
                fail(format!("not a kvtrail seal: {e}"));
                previous = Some(sha256_hex(&bytes));
                continue;
            }
        };
        if seal.format != SEAL_FORMAT || seal.version != 1 {
            fail(format!(
                "unsupported seal format {:?} version {}",
                seal.format, seal.version
            ));
        }
        if seal.index != i {
            fail(format!(
                "holds seal {} under the name of seal {i}: seals were renamed or reordered",
                seal.index
            ));
        }
        match &r.capture_id {
            None => r.capture_id = Some(seal.capture_id.clone()),
            Some(c) if *c != seal.capture_id => fail(format!(
                "belongs to capture {}, the chain to capture {c}: a seal from another capture (replayed)",
                seal.capture_id
            )),
            Some(_) => {}
        }
        let expected = if i == 0 { None } else { previous.clone() };
        if i > 0 && expected.is_none() {
            // The previous seal is missing: already reported.
        } else if seal.previous_sha256 != expected {
            fail(match (&seal.previous_sha256, &expected) {
                (None, _) => {
                    "names no previous seal, but is not the first: the chain was cut".into()
                }
                (Some(_), None) => {
                    "names a previous seal, but is the first: seals before it were deleted".into()
                }
                (Some(a), Some(b)) => format!(
                    "names previous seal sha256 {a}, but the previous seal's sha256 is {b}: a seal before it was altered, replaced or reordered"
                ),
            });
        }
        if let Some(prev) = seals.last()
            && seal.window.from_ns < prev.window.to_ns
        {
            fail("its window starts before the previous seal's ends".into());
        }
        if seal.last && i != last.unwrap_or(0) {
            fail("marked final, but seals follow it".into());
        }
        previous = Some(sha256_hex(&bytes));
        r.notes.extend(seal.problems.iter().map(|p| SealProblem {
            at: name.clone(),
            detail: p.clone(),
        }));
        seals.push(seal);
    }
    r.seals = seals.len() as u64;
    r.signers = signers.into_iter().collect();
    r.final_seal = seals.last().is_some_and(|s| s.last) && jsons.contains(&last.unwrap_or(0));
    if seals.is_empty() {
        r.problems.push(SealProblem {
            at: SEALS_DIR.into(),
            detail: "holds no seal".into(),
        });
    } else if !r.final_seal {
        r.problems.push(SealProblem {
            at: SEALS_DIR.into(),
            detail: "no final seal: the capture never closed, or its last seals were deleted; what was written after the last seal is not sealed".into(),
        });
    }
    check_files(dir, &seals, &mut r)?;
    r.problems.sort();
    r.problems.dedup();
    r.ok = r.problems.is_empty();
    Ok(Some(r))
}

/// The seal and signature indices in `seals/`; anything else is a problem.
fn list_seals(
    sdir: &Path,
    problems: &mut Vec<SealProblem>,
) -> Result<(BTreeSet<u64>, BTreeSet<u64>)> {
    let md = std::fs::symlink_metadata(sdir).map_err(|e| Error::io(sdir, e))?;
    if !md.is_dir() {
        return Err(Error::invalid(
            Location::file(sdir),
            "not a folder",
            "seals/ holds a trace's seals; restore it from the original copy",
        ));
    }
    let (mut jsons, mut sigs) = (BTreeSet::new(), BTreeSet::new());
    for e in std::fs::read_dir(sdir).map_err(|e| Error::io(sdir, e))? {
        let e = e.map_err(|e| Error::io(sdir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let regular = e.file_type().is_ok_and(|t| t.is_file());
        let (stem, sig) = match name.strip_suffix(".json.sig") {
            Some(s) => (s, true),
            None => (name.strip_suffix(".json").unwrap_or(""), false),
        };
        let index = (stem.len() >= 6 && stem.bytes().all(|b| b.is_ascii_digit()))
            .then(|| stem.parse::<u64>().ok())
            .flatten()
            .filter(|i| seal_name(*i) == format!("{stem}.json"));
        match index {
            Some(i) if regular => {
                if sig {
                    sigs.insert(i);
                } else {
                    jsons.insert(i);
                }
            }
            _ => problems.push(SealProblem {
                at: format!("{SEALS_DIR}/{name}"),
                detail: "not a seal nor its signature (`NNNNNN.json`, `NNNNNN.json.sig`, regular files): kvtrail writes nothing else here".into(),
            }),
        }
    }
    Ok((jsons, sigs))
}

/// Every data file and trace.json against what the seals state.
fn check_files(dir: &Path, seals: &[Seal], r: &mut SealReport) -> Result<()> {
    let mut claims: BTreeMap<String, Vec<Claim>> = BTreeMap::new();
    for s in seals {
        for f in &s.files {
            let c = claims.entry(f.path.clone()).or_default();
            if f.rewritten {
                // Earlier digests of this path no longer hold.
                c.clear();
            }
            c.push(Claim {
                seal: s.index,
                bytes: f.bytes,
                sha256: f.sha256.clone(),
                blake3: f.blake3.clone(),
                whole: true,
            });
        }
        for p in &s.open_parts {
            claims.entry(p.path.clone()).or_default().push(Claim {
                seal: s.index,
                bytes: p.bytes,
                sha256: p.sha256.clone(),
                blake3: p.blake3.clone(),
                whole: false,
            });
        }
    }
    let mut fail = |at: &str, detail: String| {
        r.problems.push(SealProblem {
            at: at.to_string(),
            detail,
        })
    };
    // The data files the readers take: each must be sealed whole.
    let mut on_disk = BTreeSet::new();
    let root = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    for table in ["kv", "requests"] {
        for (p, kind) in walk(&root, &root.join(table)).files {
            if kind == TableFile::Data {
                let rel = p.strip_prefix(&root).unwrap_or(&p);
                on_disk.insert(
                    rel.components()
                        .map(|c| c.as_os_str().to_string_lossy())
                        .collect::<Vec<_>>()
                        .join("/"),
                );
            }
        }
    }
    // The live findings `record` writes before its final seal are
    // evidence too: sealed whole, or reported unsealed.
    if root.join(LIVE_FINDINGS).is_file() {
        on_disk.insert(LIVE_FINDINGS.to_string());
    }
    for path in &on_disk {
        if !claims.get(path).is_some_and(|c| c.iter().any(|c| c.whole)) {
            fail(
                path,
                "not sealed: no seal covers this data file whole (added, or written after the last seal)".into(),
            );
        }
    }
    for (path, cs) in &claims {
        let p = dir.join(path);
        if !crate::custody::record::is_inner_path(path) {
            fail(path, "a seal names a path outside the trace".into());
            continue;
        }
        if !on_disk.contains(path) {
            if cs.iter().any(|c| c.whole) {
                fail(
                    path,
                    format!(
                        "sealed (seal {}) but missing or not a data file",
                        cs.last().map_or(0, |c| c.seal)
                    ),
                );
            }
            continue;
        }
        r.files_checked += 1;
        let mut cuts: Vec<u64> = cs.iter().map(|c| c.bytes).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let (len, at) = digests_at(&p, &cuts)?;
        for c in cs {
            let seal = format!("{SEALS_DIR}/{}", seal_name(c.seal));
            match at.get(&c.bytes) {
                _ if c.whole && c.bytes != len => fail(
                    path,
                    format!(
                        "{len} bytes, {seal} sealed {} bytes: the file was changed after sealing",
                        c.bytes
                    ),
                ),
                None => fail(
                    path,
                    format!(
                        "{len} bytes, shorter than the {} bytes {seal} sealed: the file was truncated",
                        c.bytes
                    ),
                ),
                Some((sha, b3)) if *sha != c.sha256 || *b3 != c.blake3 => fail(
                    path,
                    format!(
                        "its {} first bytes do not match {seal} (sha256 {sha}, sealed {}): the file was changed after sealing",
                        c.bytes, c.sha256
                    ),
                ),
                Some(_) => {}
            }
        }
    }
    // trace.json as the final seal covers it, and its file list.
    let Some(fin) = seals.last().filter(|s| s.last) else {
        return Ok(());
    };
    let fin_name = format!("{SEALS_DIR}/{}", seal_name(fin.index));
    if let Some(d) = &fin.trace_json {
        let (len, at) = digests_at(&dir.join("trace.json"), &[d.bytes])?;
        if len != d.bytes || at.get(&d.bytes) != Some(&(d.sha256.clone(), d.blake3.clone())) {
            fail(
                "trace.json",
                format!("does not match {fin_name}: it was changed after the capture closed"),
            );
        }
    } else {
        fail(&fin_name, "the final seal does not cover trace.json".into());
    }
    Ok(())
}

/// sha256 and blake3 (hex) by prefix length.
type Prefixes = BTreeMap<u64, (String, String)>;

/// A file's size, and its sha256 and blake3 over each first `cuts` bytes
/// (one read).
fn digests_at(path: &Path, cuts: &[u64]) -> Result<(u64, Prefixes)> {
    let mut f = open_local(path)?;
    let mut sha = sha2::Sha256::new();
    let mut b3 = blake3::Hasher::new();
    let mut out = BTreeMap::new();
    let mut at = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let mut next = cuts.iter().copied().peekable();
    loop {
        while next.peek() == Some(&at) {
            out.insert(
                at,
                (
                    hex(&sha.clone().finalize()),
                    b3.finalize().to_hex().to_string(),
                ),
            );
            next.next();
        }
        let want = next
            .peek()
            .map_or(buf.len(), |c| ((c - at) as usize).min(buf.len()));
        let n = f.read(&mut buf[..want]).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        sha.update(&buf[..n]);
        b3.update(&buf[..n]);
        at += n as u64;
    }
    Ok((at, out))
}
