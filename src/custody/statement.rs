//! Signed findings: an in-toto Statement v1 over every file of an output
//! folder, in a DSSE envelope signed with the responder's ed25519 key
//! (`custody::keys`), one envelope per line in [`STATEMENT_FILE`].
//!
//! - The envelope: `payloadType` [`PAYLOAD_TYPE`], `payload` the statement
//!   in base64, and one signature: ed25519 over the DSSE pre-authentication
//!   encoding ([`pae`]), `keyid` the key's `SHA256:` fingerprint.
//! - The statement: `_type` [`STATEMENT_TYPE`], a subject per file of the
//!   folder (its path and sha256; the statement file itself excepted), and
//!   kvtrail's predicate ([`PREDICATE_TYPE`], [`Predicate`]): the version,
//!   the command and its options, the inputs with their digests, the
//!   backend and threads, the verdict in one line and the signer's public
//!   key.
//!
//! [`sign_folder`] writes it, last, inside the folder's atomic write (so a
//! folder never appears without it); [`sign_file`] writes one beside a
//! single output file (`export --out`). [`check_statement`] checks one
//! against the files: every subject there with its sha256, no file of the
//! folder unlisted, the signature, and with allowed signers the signer
//! (namespace [`NAMESPACE`] for the `namespaces=` option). A statement that
//! cannot be read (not an envelope, not a statement, a key that is not
//! ed25519) is an error (exit 2: cannot check); one that does not hold is a
//! problem (exit 1: the evidence fails).

use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::Digest;
use ssh_key::{HashAlg, PublicKey};

use crate::custody::evidence::EVIDENCE_JSON;
use crate::custody::inputs::list_files;
use crate::custody::keys::{AllowedSigners, SigningKey};
use crate::custody::private::write_private;
use crate::custody::record::is_inner_path;
use crate::custody::seal::format::hex;
use crate::custody::seal::{SEALS_DIR, sha256_hex};
use crate::error::{Error, Location, Result};
use crate::trace::files::{open_local, read_limited};
use crate::trace::{Trace, TraceRoot};

/// The statement file of an output folder.
pub const STATEMENT_FILE: &str = "statement.intoto.jsonl";
/// The suffix of a statement beside a single file (`FILE.intoto.jsonl`).
pub const STATEMENT_SUFFIX: &str = ".intoto.jsonl";
/// DSSE payload type of an in-toto statement.
pub const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
/// in-toto Statement v1.
pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
/// kvtrail's predicate: an output folder of kvtrail and how it was made.
pub const PREDICATE_TYPE: &str = "urn:kvtrail:predicate:output-folder:v1";
/// The allowed_signers namespace a statement's signer is checked in.
pub const NAMESPACE: &str = "kvtrail-statement";
/// The largest statement file read.
const MAX_STATEMENT_BYTES: u64 = 16 << 20;

/// One input of the run, with its digests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatementInput {
    /// trace | scope | config
    pub kind: String,
    /// Where it was: a path as given on the command line, or a URL.
    pub uri: String,
    /// Digests of its record: `blake3` of trace.json or evidence.json,
    /// `sha256` of the same.
    pub digest: std::collections::BTreeMap<String, String>,
    /// A sealed trace: its last seal and that seal's sha256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seal: Option<NamedDigest>,
    /// An output folder with a statement: the statement's sha256.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub statement: Option<NamedDigest>,
}

/// A file and its sha256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedDigest {
    pub name: String,
    pub sha256: String,
}

/// Who signed: the public key (OpenSSH line) and its fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signer {
    pub public_key: String,
    pub fingerprint: String,
}

/// kvtrail's predicate ([`PREDICATE_TYPE`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Predicate {
    pub tool: String,
    pub version: String,
    /// The subcommand (scope, merge, notify, export, fleet spark, verify).
    pub command: String,
    /// The command line exactly as given: the options.
    pub argv: Vec<String>,
    pub inputs: Vec<StatementInput>,
    /// The replay backend, where there was a replay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Threads asked for (0: every core).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<u64>,
    /// The verdict in one line.
    pub verdict: String,
    pub signer: Signer,
}

impl Predicate {
    /// A predicate for `command` run as `argv`; inputs, backend and verdict
    /// are filled in by the caller, the signer by `sign_*`.
    pub fn new(command: &str, argv: &[String]) -> Predicate {
        Predicate {
            tool: "kvtrail".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            command: command.into(),
            argv: argv.to_vec(),
            inputs: Vec::new(),
            backend: None,
            threads: None,
            verdict: String::new(),
            signer: Signer {
                public_key: String::new(),
                fingerprint: String::new(),
            },
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Subject {
    name: String,
    digest: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Statement {
    #[serde(rename = "_type")]
    type_: String,
    subject: Vec<Subject>,
    #[serde(rename = "predicateType")]
    predicate_type: String,
    predicate: Predicate,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct EnvelopeSig {
    #[serde(default)]
    keyid: String,
    sig: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Envelope {
    #[serde(rename = "payloadType")]
    payload_type: String,
    payload: String,
    signatures: Vec<EnvelopeSig>,
}

/// The DSSE pre-authentication encoding: `DSSEv1 SP LEN(type) SP type SP
/// LEN(body) SP body`, lengths as ASCII decimal.
pub fn pae(payload_type: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "DSSEv1 {} {payload_type} {} ",
        payload_type.len(),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// The sha256 of a file (hex), read in blocks.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = open_local(path)?;
    let mut sha = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        sha.update(&buf[..n]);
    }
    Ok(hex(&sha.finalize()))
}

/// Whether a file of an output folder is one of its records, which
/// evidence.json does not list (evidence.json itself, and the statement
/// that lists evidence.json): the one rule, for `verify`, `--force` and
/// the statement.
pub fn is_folder_record(rel: &str) -> bool {
    rel == EVIDENCE_JSON || rel == STATEMENT_FILE
}

/// The last seal of a local sealed trace (`seals/NNNNNN.json`), with its
/// sha256; None when the trace has no seals here.
pub fn last_seal(trace_dir: &Path) -> Result<Option<NamedDigest>> {
    let dir = trace_dir.join(SEALS_DIR);
    if !dir.is_dir() {
        return Ok(None);
    }
    let mut last: Option<String> = None;
    for e in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
        let name = e
            .map_err(|e| Error::io(&dir, e))?
            .file_name()
            .to_string_lossy()
            .into_owned();
        let stem = name.strip_suffix(".json").unwrap_or("");
        if stem.len() == 6
            && stem.bytes().all(|b| b.is_ascii_digit())
            && last.as_ref().is_none_or(|l| *l < name)
        {
            last = Some(name);
        }
    }
    let Some(name) = last else { return Ok(None) };
    let sha256 = sha256_file(&dir.join(&name))?;
    Ok(Some(NamedDigest {
        name: format!("{SEALS_DIR}/{name}"),
        sha256,
    }))
}

/// A statement's digest as an input: the sha256 of the folder's statement
/// file, when it has one.
pub fn folder_statement(dir: &Path) -> Result<Option<NamedDigest>> {
    let p = dir.join(STATEMENT_FILE);
    if !p.is_file() {
        return Ok(None);
    }
    Ok(Some(NamedDigest {
        name: STATEMENT_FILE.into(),
        sha256: sha256_file(&p)?,
    }))
}

/// A trace as an input: its blake3 of trace.json (through the root it was
/// opened with, local or object storage), and for a local trace the
/// sha256 of trace.json and its last seal.
pub fn trace_input(trace: &Trace) -> Result<StatementInput> {
    let manifest = trace.dir.join("trace.json");
    let (b3, _) = trace.root.hash(&manifest)?;
    let mut digest = std::collections::BTreeMap::from([("blake3".to_string(), b3)]);
    let mut seal = None;
    if let TraceRoot::Local(_) = trace.root {
        digest.insert("sha256".into(), sha256_file(&manifest)?);
        seal = last_seal(&trace.dir)?;
    }
    Ok(StatementInput {
        kind: "trace".into(),
        uri: trace.dir.display().to_string(),
        digest,
        last_seal: seal,
        statement: None,
    })
}

/// An output folder as an input (`kind`: scope, or a shard's scope): the
/// digests of its evidence.json and its statement, when it has one.
pub fn folder_input(dir: &Path, kind: &str) -> Result<StatementInput> {
    let ev = dir.join(EVIDENCE_JSON);
    let (b3, _) = crate::custody::inputs::hash_file(&ev)?;
    Ok(StatementInput {
        kind: kind.into(),
        uri: dir.display().to_string(),
        digest: [
            ("blake3".to_string(), b3),
            ("sha256".to_string(), sha256_file(&ev)?),
        ]
        .into(),
        last_seal: None,
        statement: folder_statement(dir)?,
    })
}

/// The inputs an output folder's evidence.json records, as statement
/// inputs: each root with the blake3 evidence.json records for its record
/// file (trace.json of a trace, evidence.json of a folder), for a folder
/// signed after it was written (`fleet spark`'s shards).
pub fn evidence_inputs(dir: &Path) -> Result<Vec<StatementInput>> {
    let (ev, _) = crate::custody::record::load_evidence(dir)?;
    Ok(ev
        .inputs
        .iter()
        .map(|i| {
            let record = i
                .files
                .iter()
                .find(|f| f.path == "trace.json" || f.path == EVIDENCE_JSON);
            StatementInput {
                kind: i.kind.clone(),
                uri: i.root.clone(),
                digest: record
                    .map(|f| [("blake3".to_string(), f.blake3.clone())].into())
                    .unwrap_or_default(),
                last_seal: None,
                statement: None,
            }
        })
        .collect())
}

/// Writes `out` (a statement file) over `files` (paths relative to
/// `base`), signed with `key`. Returns the sha256 of the statement file.
fn write_statement(
    out: &Path,
    base: &Path,
    files: &[String],
    key: &SigningKey,
    mut predicate: Predicate,
) -> Result<String> {
    let mut subject = Vec::with_capacity(files.len());
    for f in files {
        subject.push(Subject {
            name: f.clone(),
            digest: [("sha256".to_string(), sha256_file(&base.join(f))?)].into(),
        });
    }
    predicate.signer = Signer {
        public_key: key.public_openssh(),
        fingerprint: key.fingerprint(),
    };
    let st = Statement {
        type_: STATEMENT_TYPE.into(),
        subject,
        predicate_type: PREDICATE_TYPE.into(),
        predicate,
    };
    let body = serde_json::to_vec(&st).expect("a statement serializes");
    let sig = key.sign_raw(&pae(PAYLOAD_TYPE, &body))?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let env = Envelope {
        payload_type: PAYLOAD_TYPE.into(),
        payload: b64.encode(&body),
        signatures: vec![EnvelopeSig {
            keyid: key.fingerprint(),
            sig: b64.encode(sig),
        }],
    };
    let mut line = serde_json::to_string(&env).expect("an envelope serializes");
    line.push('\n');
    write_private(out, &line)?;
    Ok(sha256_hex(line.as_bytes()))
}

/// Writes a statement at `out` over `files` (paths relative to `base`),
/// signed with `key` (`verify --reproduce --out FILE`: the folder's files
/// as reproduced). Returns its sha256.
pub fn sign_files(
    out: &Path,
    base: &Path,
    files: &[String],
    key: &SigningKey,
    predicate: Predicate,
) -> Result<String> {
    write_statement(out, base, files, key, predicate)
}

/// Writes the folder's statement ([`STATEMENT_FILE`]) over every other
/// file now in `dir`, signed with `key`: the last file written. Returns its
/// sha256.
pub fn sign_folder(dir: &Path, key: &SigningKey, predicate: Predicate) -> Result<String> {
    let files: Vec<String> = list_files(dir)?
        .into_iter()
        .filter(|f| f != STATEMENT_FILE)
        .collect();
    write_statement(&dir.join(STATEMENT_FILE), dir, &files, key, predicate)
}

/// The statement beside a single output file: `FILE.intoto.jsonl`.
pub fn statement_beside(file: &Path) -> PathBuf {
    let mut s = file.as_os_str().to_os_string();
    s.push(STATEMENT_SUFFIX);
    PathBuf::from(s)
}

/// Writes a statement beside the single output file `file`
/// ([`statement_beside`]), its one subject that file by name. Returns the
/// statement's path.
pub fn sign_file(file: &Path, key: &SigningKey, predicate: Predicate) -> Result<PathBuf> {
    let base = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let out = statement_beside(file);
    write_statement(&out, &base, &[name], key, predicate)?;
    Ok(out)
}

/// What checking a statement found.
#[derive(Debug, Clone, Serialize)]
pub struct StatementReport {
    /// No problem: every subject matches, nothing is unlisted, the
    /// signature holds (and, when asked, the signer is allowed).
    pub ok: bool,
    pub path: String,
    /// The signing key's fingerprint (as the statement names it).
    pub fingerprint: String,
    /// The allowed signers' principals for that key (None: not checked).
    pub principals: Option<Vec<String>>,
    pub subjects: usize,
    /// What does not hold, one line each.
    pub problems: Vec<String>,
    pub predicate: Predicate,
}

fn unreadable(path: &Path, what: impl Into<String>) -> Error {
    Error::invalid(
        Location::file(path),
        what,
        "a statement is written by kvtrail with --signing-key and never edited; restore the file from the original copy, or re-create the folder",
    )
}

/// Reads the one envelope of a statement file and its statement.
fn read_envelope(path: &Path) -> Result<(Envelope, Statement, Vec<u8>, usize)> {
    let bytes = read_limited(path, MAX_STATEMENT_BYTES, "an in-toto statement")?;
    let text = String::from_utf8(bytes).map_err(|_| unreadable(path, "not text"))?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let Some(first) = lines.first() else {
        return Err(unreadable(path, "empty: no DSSE envelope"));
    };
    let env: Envelope = serde_json::from_str(first)
        .map_err(|e| unreadable(path, format!("line 1 is not a DSSE envelope ({e})")))?;
    if env.payload_type != PAYLOAD_TYPE {
        return Err(unreadable(
            path,
            format!(
                "payloadType {:?}, expected {PAYLOAD_TYPE:?}",
                env.payload_type
            ),
        ));
    }
    let body = base64::engine::general_purpose::STANDARD
        .decode(&env.payload)
        .map_err(|e| unreadable(path, format!("the payload is not base64 ({e})")))?;
    let st: Statement = serde_json::from_slice(&body).map_err(|e| {
        unreadable(
            path,
            format!("the payload is not a kvtrail in-toto statement ({e})"),
        )
    })?;
    if st.type_ != STATEMENT_TYPE || st.predicate_type != PREDICATE_TYPE {
        return Err(unreadable(
            path,
            format!(
                "statement type {:?} with predicate {:?}, expected {STATEMENT_TYPE:?} with {PREDICATE_TYPE:?}",
                st.type_, st.predicate_type
            ),
        ));
    }
    Ok((env, st, body, lines.len()))
}

/// The signer's key as the statement names it: ed25519 only.
fn signer_key(path: &Path, st: &Statement) -> Result<PublicKey> {
    let alg = st
        .predicate
        .signer
        .public_key
        .split_whitespace()
        .next()
        .unwrap_or("");
    if alg != "ssh-ed25519" {
        return Err(unreadable(
            path,
            format!(
                "the signer's key is {:?}; kvtrail statements are signed with ed25519 only",
                alg.chars().take(64).collect::<String>()
            ),
        ));
    }
    let key = PublicKey::from_openssh(&st.predicate.signer.public_key).map_err(|e| {
        unreadable(
            path,
            format!("the signer's public key is not an OpenSSH public key ({e})"),
        )
    })?;
    if !key.key_data().is_ed25519() {
        return Err(unreadable(
            path,
            format!(
                "the signer's key is {}; kvtrail statements are signed with ed25519 only",
                key.algorithm()
            ),
        ));
    }
    Ok(key)
}

/// Checks the statement file `path` against the files under `base`. In a
/// folder (`folder`: true) every file but the statement must be a subject;
/// beside a single file, the subjects are checked only. With `allowed`,
/// the signer must be one of them (namespace [`NAMESPACE`]).
pub fn check_statement(
    path: &Path,
    base: &Path,
    folder: bool,
    allowed: Option<&AllowedSigners>,
) -> Result<StatementReport> {
    let (env, st, body, lines) = read_envelope(path)?;
    let key = signer_key(path, &st)?;
    let fingerprint = key.fingerprint(HashAlg::Sha256).to_string();
    let mut problems = Vec::new();
    if lines > 1 {
        problems.push(format!(
            "{lines} envelopes where kvtrail writes one: lines were added after signing"
        ));
    }
    if fingerprint != st.predicate.signer.fingerprint {
        problems.push(format!(
            "the statement names fingerprint {} for a key whose fingerprint is {fingerprint}",
            st.predicate.signer.fingerprint
        ));
    }
    let msg = pae(&env.payload_type, &body);
    let good = env.signatures.iter().any(|s| {
        s.keyid == fingerprint
            && base64::engine::general_purpose::STANDARD
                .decode(&s.sig)
                .ok()
                .and_then(|raw| ssh_key::Signature::new(ssh_key::Algorithm::Ed25519, raw).ok())
                .is_some_and(|sig| signature::Verifier::verify(&key, &msg, &sig).is_ok())
    });
    if env.signatures.is_empty() {
        problems.push("unsigned: the envelope holds no signature".into());
    } else if !good {
        problems.push(format!(
            "no signature by {fingerprint} matches the statement: it was altered after signing, or signed by another key"
        ));
    }
    let principals = allowed.map(|a| a.principals_for(key.key_data(), NAMESPACE));
    if principals.as_ref().is_some_and(|p| p.is_empty()) {
        problems.push(format!(
            "signed by {fingerprint}, which the allowed signers do not name for namespace {NAMESPACE:?}"
        ));
    }
    let mut listed = std::collections::BTreeSet::new();
    for s in &st.subject {
        if !is_inner_path(&s.name) {
            problems.push(format!(
                "subject {:?} is not a path inside the folder",
                s.name
            ));
            continue;
        }
        if !listed.insert(s.name.clone()) {
            problems.push(format!("subject {} is listed twice", s.name));
            continue;
        }
        let p = base.join(&s.name);
        let Some(want) = s.digest.get("sha256") else {
            problems.push(format!("subject {} has no sha256", s.name));
            continue;
        };
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
            problems.push(format!(
                "{}: a symbolic link where the statement lists a file",
                s.name
            ));
        } else if !p.is_file() {
            problems.push(format!(
                "{}: listed in the statement, missing from the folder",
                s.name
            ));
        } else if !sha256_file(&p)?.eq_ignore_ascii_case(want) {
            problems.push(format!(
                "{}: sha256 differs from the statement (changed after signing)",
                s.name
            ));
        }
    }
    if folder {
        let own = path
            .strip_prefix(base)
            .ok()
            .map(|p| p.to_string_lossy().replace('\\', "/"));
        for f in list_files(base)? {
            if Some(&f) != own.as_ref() && !listed.contains(&f) {
                problems.push(format!(
                    "{f}: in the folder, not listed in the statement (added after signing, or the statement is another folder's)"
                ));
            }
        }
    }
    Ok(StatementReport {
        ok: problems.is_empty(),
        path: path.display().to_string(),
        fingerprint,
        principals,
        subjects: st.subject.len(),
        problems,
        predicate: st.predicate,
    })
}

/// Checks an output folder's statement ([`STATEMENT_FILE`]); None when it
/// has none.
pub fn check_folder_statement(
    dir: &Path,
    allowed: Option<&AllowedSigners>,
) -> Result<Option<StatementReport>> {
    let p = dir.join(STATEMENT_FILE);
    if !p.exists() && !p.is_symlink() {
        return Ok(None);
    }
    check_statement(&p, dir, true, allowed).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pae_is_the_dsse_encoding() {
        // The example of the DSSE protocol's specification.
        assert_eq!(
            pae("http://example.com/HelloWorld", b"hello world"),
            b"DSSEv1 29 http://example.com/HelloWorld 11 hello world".to_vec()
        );
        assert_eq!(pae("", b""), b"DSSEv1 0  0 ".to_vec());
    }

    #[test]
    fn records_and_statement_paths() {
        assert!(is_folder_record(EVIDENCE_JSON));
        assert!(is_folder_record(STATEMENT_FILE));
        assert!(!is_folder_record("summary.json"));
        assert_eq!(
            statement_beside(Path::new("out/x.jsonl")),
            PathBuf::from("out/x.jsonl.intoto.jsonl")
        );
    }
}
