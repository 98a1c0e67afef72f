//! Signing keys for the evidence tests, made by stock OpenSSH.

use std::path::{Path, PathBuf};
use std::process::Command;

/// An ed25519 key made by stock ssh-keygen (`dir/name`, no passphrase),
/// and an allowed_signers file (`dir/name.allowed`) naming it as `id`.
pub fn keygen(dir: &Path, name: &str, id: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(name);
    let st = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "test", "-f"])
        .arg(&key)
        .status()
        .expect("ssh-keygen (OpenSSH) is installed");
    assert!(st.success());
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    let two: Vec<&str> = public.split_whitespace().take(2).collect();
    let allowed = dir.join(format!("{name}.allowed"));
    std::fs::write(&allowed, format!("{id} {}\n", two.join(" "))).unwrap();
    (key, allowed)
}
