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

/// Stock `ssh-keygen -Y verify` of one seal (`seal` and `seal.sig`) for
/// the signer `id` in the namespace `kvtrail-seal`: success, and what it
/// printed.
pub fn openssh_verify(allowed: &Path, id: &str, seal: &Path) -> (bool, String) {
    use std::io::Write;
    use std::process::Stdio;
    let sig = PathBuf::from(format!("{}.sig", seal.display()));
    let mut child = Command::new("ssh-keygen")
        .args(["-Y", "verify", "-f"])
        .arg(allowed)
        .args(["-I", id, "-n", "kvtrail-seal", "-s"])
        .arg(&sig)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ssh-keygen (OpenSSH) is installed");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&std::fs::read(seal).unwrap())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    (
        o.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}
