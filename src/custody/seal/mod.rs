//! Seals: a capture sealed while it is written. Every interval the writer
//! of a trace writes `seals/NNNNNN.json` and its SSHSIG signature
//! `seals/NNNNNN.json.sig` (namespace [`NAMESPACE`]), which stock
//! `ssh-keygen -Y verify` checks. A seal lists what was written in its
//! window: each data file completed, with its sha256 and blake3, and each
//! part file still open, with the digests of its bytes so far (every row
//! group closed up to then; a prefix of the finished file). It also names
//! the capture, its own index and time window, the sha256 of the previous
//! seal (a chain), and the events, seq range, lost events and holes per
//! pool. Empty windows are sealed too, and a final seal closes the chain
//! and covers trace.json.
//!
//! - [`format`]: the seal as JSON.
//! - [`writer`]: the [`Sealer`], a thread beside the trace's writer that
//!   reads back what was written, hashes and signs it (the capture never
//!   waits for it), and [`seal_trace`] for offline writers (one final seal
//!   over a finished trace).
//! - [`verify`]: [`verify_seals`], the chain, signatures and files of a
//!   sealed trace.

pub mod format;
pub mod verify;
pub mod writer;

pub use format::{PoolSeal, Seal, SealedFile, SealedPart, Window};
pub use verify::{SealProblem, SealReport, verify_seals};
pub use writer::{PoolCounts, SealJob, Sealer, seal_trace};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn seal_intervals() {
        assert_eq!(parse_every("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_every("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_every("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_every("60"), Ok(Duration::from_secs(60)));
        for bad in [
            "",
            "ms",
            "10x",
            "-5s",
            "50ms",
            "25h",
            "1.5s",
            "99999999999999999999s",
        ] {
            assert!(parse_every(bad).is_err(), "{bad}");
        }
    }
}
