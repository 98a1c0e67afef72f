//! Owner-only folders and files (folders 0700, files 0600) whatever the
//! umask.

use std::path::Path;

use crate::error::{Error, Result};

/// Creates `dir` (and missing parents) and makes it owner-only (0700).
pub fn create_private_dir(dir: &Path) -> Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    b.create(dir).map_err(|e| Error::io(dir, e))?;
    set_mode(dir, 0o700)
}

/// Writes a file owner-only (0600), replacing any earlier one.
pub fn write_private(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    use std::io::Write as _;
    let mut f = create_private(path)?;
    f.write_all(bytes.as_ref())
        .and_then(|_| f.flush())
        .map_err(|e| Error::io(path, e))
}

/// Creates (or truncates) a file owner-only (0600) for streaming writes.
pub fn create_private(path: &Path) -> Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    let f = o.open(path).map_err(|e| Error::io(path, e))?;
    set_mode(path, 0o600)?;
    Ok(f)
}

/// Writes a file owner-only (0600) all at once: a temporary file in the
/// same folder, renamed over `path` only when every byte is written, so a
/// failure leaves no half-written file.
pub fn write_private_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write as _;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // tempfile creates the file 0600.
    let mut t = tempfile::Builder::new()
        .prefix(".kvtrail-")
        .suffix(".tmp")
        .tempfile_in(parent)
        .map_err(|e| Error::io(path, e))?;
    t.write_all(bytes)
        .and_then(|_| t.flush())
        .map_err(|e| Error::io(path, e))?;
    t.persist(path).map_err(|e| Error::io(path, e.error))?;
    set_mode(path, 0o600)
}

/// Makes a file written by another writer (Parquet) owner-only (0600).
pub fn make_private(path: &Path) -> Result<()> {
    set_mode(path, 0o600)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| Error::io(path, e))?;
    }
    let _ = (path, mode);
    Ok(())
}
