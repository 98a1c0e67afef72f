//! Where a trace lives, asked in one place for all of fleet: a local
//! folder (the executors must see it at the same absolute path, and write
//! their shards straight into a shared staging folder) or an object-store
//! URL (the executors read it there, their shards travel back as lines).
//! fleet asks `trace::TraceRoot` here, and nowhere else.

use std::path::Path;

use crate::error::{Error, Result};

/// Whether the trace is an object-store URL rather than a local folder.
pub fn is_remote(trace: &Path) -> bool {
    crate::trace::TraceRoot::names_url(trace)
}

/// The trace as the executors are given it: a URL as it is, a local
/// folder as an absolute path.
pub fn executor_arg(trace: &Path) -> Result<String> {
    if is_remote(trace) {
        return Ok(trace.display().to_string());
    }
    std::path::absolute(trace)
        .map(|p| p.display().to_string())
        .map_err(|e| Error::io(trace, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_travels_as_it_is_and_a_folder_as_an_absolute_path() {
        let url = Path::new("s3://bucket/trace");
        assert!(is_remote(url));
        assert_eq!(executor_arg(url).unwrap(), "s3://bucket/trace");
        let local = Path::new("some/trace");
        assert!(!is_remote(local));
        let abs = executor_arg(local).unwrap();
        assert!(Path::new(&abs).is_absolute(), "{abs}");
        assert!(abs.ends_with("some/trace"), "{abs}");
    }
}
