//! `--signing-key FILE` of every command that signs what it writes: the
//! key loaded (and refused when unsafe: `custody::keys::SigningKey::load`)
//! before anything is written. Not a command of its own; a file of its own
//! so that the commands that sign import neither `verify` nor each other.

use std::path::Path;
use std::sync::Arc;

use kvtrail::custody::keys::SigningKey;

/// The key at `path`, when one is given.
pub fn load_key(path: Option<&Path>) -> anyhow::Result<Option<Arc<SigningKey>>> {
    Ok(match path {
        Some(p) => Some(Arc::new(SigningKey::load(p)?)),
        None => None,
    })
}
