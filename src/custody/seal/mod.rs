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

pub use format::{
    MAX_SEAL_BYTES, NAMESPACE, PoolSeal, SEALS_DIR, Seal, SealedFile, SealedPart, Window,
    new_capture_id, parse_every, seal_name, sha256_hex,
};
pub use verify::{SealProblem, SealReport, verify_seals};
pub use writer::{PoolCounts, SealJob, Sealed, Sealer, seal_trace, thread_cpu_s};

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
