//! Errors of the Parquet and Arrow layers as kvtrail errors.
//!
//! A read of a remote object that fails inside the Parquet reader comes
//! back through it boxed in a `ParquetError::External`;
//! [`parquet_error`] hands such an error back as itself (naming the object
//! and what to do), and anything else as `Error::Parquet` for the file.

use std::fmt;

use crate::error::{Error, Location};

/// A Parquet decoding error at `loc`; a kvtrail error carried through the
/// Parquet reader (a remote object's read) comes back as itself.
pub fn parquet_error(loc: Location, e: impl fmt::Display + 'static) -> Error {
    if let Some(inner) = carried_by_parquet(&e) {
        return inner;
    }
    Error::Parquet {
        loc,
        msg: e.to_string(),
    }
}

/// The kvtrail error a Parquet error carries (a remote read that failed
/// inside the Parquet reader), as itself; None for any other error.
fn carried_by_parquet(e: &dyn std::any::Any) -> Option<Error> {
    match e.downcast_ref::<parquet::errors::ParquetError>()? {
        parquet::errors::ParquetError::External(inner) => inner.downcast_ref::<Error>().map(copy),
        _ => None,
    }
}

/// A copy of an error (errors are not `Clone`: an I/O error's source).
pub(crate) fn copy(e: &Error) -> Error {
    match e {
        Error::Invalid { loc, what, hint } => Error::Invalid {
            loc: loc.clone(),
            what: what.clone(),
            hint: hint.clone(),
        },
        other => Error::Other(other.to_string()),
    }
}
