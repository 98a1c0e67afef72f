//! Progress reporting from the library without a UI dependency.
//!
//! Long library operations take a `&dyn Reporter`; the CLI implements it
//! with progress bars, tests and other callers pass [`NoReporter`]. Calls
//! are per file or per batch, never per event.

/// Receives progress of a long operation.
pub trait Reporter: Sync {
    /// A phase begins: `total` units of work (0 when unknown).
    fn start(&self, _what: &str, _total: u64) {}
    /// `n` more units are done.
    fn advance(&self, _n: u64) {}
    /// The phase is over.
    fn finish(&self) {}
}

/// A reporter that ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoReporter;

impl Reporter for NoReporter {}
