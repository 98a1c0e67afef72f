//! Typed errors for everything below the CLI: `Error` (`Invalid { loc,
//! what, hint }`, `Io`, `Parquet`, `Other`) and `Location` (file, 0-based
//! row, column).
//!
//! Every error that comes from bad input says what is wrong, where (file, row,
//! column) and what to do about it. The CLI maps all of them to exit code 2;
//! findings are never errors.
//!
//! Messages quote paths and values taken from the input: their display
//! escapes control and spoofing characters (`text::term`), so a
//! file name, tenant or id cannot start a line of its own in error output;
//! the only line break is the one before `hint:`.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::text::{term, term_message};

/// Where in a trace a problem was found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Location {
    pub file: Option<PathBuf>,
    /// 0-based row within the file (printed 0-based, named "row").
    pub row: Option<u64>,
    pub column: Option<String>,
}

impl Location {
    pub fn file(path: &Path) -> Self {
        Location {
            file: Some(path.to_path_buf()),
            ..Default::default()
        }
    }
    pub fn row(mut self, row: u64) -> Self {
        self.row = Some(row);
        self
    }
    pub fn column(mut self, column: &str) -> Self {
        self.column = Some(column.to_string());
        self
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(file) = &self.file {
            parts.push(term(&file.display().to_string()).into_owned());
        }
        if let Some(row) = self.row {
            parts.push(format!("row {row}"));
        }
        if let Some(col) = &self.column {
            parts.push(format!("column `{}`", term(col)));
        }
        if parts.is_empty() {
            write!(f, "<trace>")
        } else {
            write!(f, "{}", parts.join(", "))
        }
    }
}

/// The hint of [`Error::Parquet`] (the one wording, also for the error
/// lines a child process writes for its parent).
pub const PARQUET_HINT: &str = "the file is truncated, corrupt or not Parquet; run `kvtrail verify` on the trace and re-export the file";

/// An error in a trace or in the tool's input.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The input violates the trace contract (or another input format).
    #[error("{loc}: {}\n  hint: {}", term(what), term(hint))]
    Invalid {
        loc: Location,
        what: String,
        hint: String,
    },
    /// Reading or writing a file failed.
    #[error("{}: {}", term(&path.display().to_string()), term(&source.to_string()))]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The Parquet or Arrow layer failed on a file.
    #[error("{loc}: cannot read Parquet: {}\n  hint: {PARQUET_HINT}", term(msg))]
    Parquet { loc: Location, msg: String },
    /// Anything else that stops the tool (configuration, usage).
    #[error("{}", term_message(.0))]
    Other(String),
}

impl Error {
    pub fn invalid(loc: Location, what: impl Into<String>, hint: impl Into<String>) -> Self {
        Error::Invalid {
            loc,
            what: what.into(),
            hint: hint.into(),
        }
    }
    /// A failed read or write of `path`; a kvtrail error carried through
    /// `io::Read` (a remote object's read) comes back as itself.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        match source.downcast::<Error>() {
            Ok(inner) => inner,
            Err(source) => Error::Io {
                path: path.to_path_buf(),
                source,
            },
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
