//! One seal as JSON (docs/trace-format.md, "Seals"), and the names and
//! helpers the writer and the check share (namespace, folder, file names,
//! digests, the interval parser). A seal is read back with
//! unknown keys refused: a seal is signed as written, so a reader never
//! has to guess at one.

use serde::{Deserialize, Serialize};

/// `seals/NNNNNN.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Seal {
    /// `kvtrail-seal`.
    pub format: String,
    /// 1.
    pub version: u32,
    /// The capture's id (random, chosen when sealing began): every seal of
    /// a trace names the same one.
    pub capture_id: String,
    /// 0, 1, 2, ... (the file name says the same).
    pub index: u64,
    /// The last seal: written when the trace was closed.
    #[serde(rename = "final")]
    pub last: bool,
    pub window: Window,
    /// The sha256 of the previous seal's JSON bytes; null for seal 0.
    pub previous_sha256: Option<String>,
    /// The signing key's `SHA256:` fingerprint (the signature is what
    /// proves it; this names it for a reader).
    pub signer: String,
    /// The writer of the trace (`record`, `ingest`, `simulate`).
    pub writer: String,
    /// Data files completed in the window (or rewritten: `rewritten`).
    pub files: Vec<SealedFile>,
    /// Part files still open at the window's end: their bytes so far.
    pub open_parts: Vec<SealedPart>,
    /// Per pool, what was recorded up to the window's end.
    pub pools: Vec<PoolSeal>,
    /// Events lost so far, all pools (seq values skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_events: Option<u64>,
    /// Holes so far, all pools (places where seqs were skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holes: Option<u64>,
    /// The sidecar's connection counts so far (`record` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<std::collections::BTreeMap<String, u64>>,
    /// The final seal: trace.json as the writer left it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_json: Option<Digests>,
    /// What the sealer found wrong while sealing (a file that changed
    /// between its writing and its sealing).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

/// The wall-clock window a seal covers, in ns since the epoch:
/// `from_ns` is the previous seal's `to_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Window {
    pub from_ns: i64,
    pub to_ns: i64,
}

/// The digests of a whole file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Digests {
    pub bytes: u64,
    pub sha256: String,
    pub blake3: String,
}

/// A data file completed in the window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealedFile {
    /// As trace.json spells it (`kv/pool=0/part-00000.parquet`).
    pub path: String,
    pub rows: u64,
    pub bytes: u64,
    /// Bytes of the file earlier seals covered (as an open part); the
    /// bytes from here on were written in this window.
    pub bytes_from: u64,
    pub sha256: String,
    pub blake3: String,
    /// Rewritten after an earlier seal covered it (request rows removed
    /// at close, `capture.request_conflicts`): earlier digests of this
    /// path no longer hold.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rewritten: bool,
}

/// A part file still open: the digests of its first `bytes` bytes, which
/// hold its first `row_groups` row groups (`rows` rows) and which the
/// finished file begins with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealedPart {
    /// The path the file will have once finished.
    pub path: String,
    pub rows: u64,
    pub row_groups: u64,
    /// Row groups earlier seals covered; the rest closed in this window.
    pub row_groups_from: u64,
    pub bytes: u64,
    pub bytes_from: u64,
    pub sha256: String,
    pub blake3: String,
}

/// One pool at the window's end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSeal {
    pub pool: u16,
    /// Events recorded so far.
    pub events: u64,
    /// Events recorded in this window.
    pub events_in_window: u64,
    /// The window's seqs: `seq_from` (the first seq not in an earlier
    /// window) up to, not including, `seq_to`; lost seqs included.
    /// Absent for offline writers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_from: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_to: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_events: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holes: Option<u64>,
}

/// `format` of a seal.
pub const SEAL_FORMAT: &str = "kvtrail-seal";

/// The SSHSIG namespace of seals.
pub const NAMESPACE: &str = "kvtrail-seal";

/// The folder of seals inside a trace.
pub const SEALS_DIR: &str = "seals";

/// The largest seal read back.
pub const MAX_SEAL_BYTES: u64 = 64 << 20;

/// Parses a seal interval: a whole number with `ms`, `s`, `m` or `h`
/// (`500ms`, `10s`, `5m`), at least 100 ms and at most 24 h.
pub fn parse_every(s: &str) -> std::result::Result<std::time::Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 500ms, 10s, 5m)"))?;
    let ms = match unit {
        "ms" => Some(n),
        "s" | "" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => None,
    }
    .ok_or_else(|| format!("{s:?} is not a duration (e.g. 500ms, 10s, 5m)"))?;
    if !(100..=86_400_000).contains(&ms) {
        return Err(format!("{s:?}: a seal interval is between 100ms and 24h"));
    }
    Ok(std::time::Duration::from_millis(ms))
}

/// The file name of seal `index` (`000003.json`).
pub fn seal_name(index: u64) -> String {
    format!("{index:06}.json")
}

/// The sha256 of `bytes`, as lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(bytes))
}

pub(crate) fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// A new capture id: 128 random bits, as hex.
pub fn new_capture_id() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    let random = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok();
    if !random {
        let mut h = blake3::Hasher::new();
        h.update(&std::process::id().to_le_bytes());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        h.update(&now.to_le_bytes());
        b.copy_from_slice(&h.finalize().as_bytes()[..16]);
    }
    hex(&b)
}
