//! Signing keys and the signers a verifier trusts, in OpenSSH's own formats,
//! through the RustCrypto `ssh-key` crate (no hand-written cryptography).
//!
//! - [`SigningKey::load`] reads an OpenSSH ed25519 private key and refuses,
//!   as ssh does, one that group or others may read; an encrypted key and
//!   any other algorithm are refused too. The key material is never
//!   printed: errors name the file and what is wrong with it only.
//! - [`SigningKey::sign`] makes an SSHSIG signature (armored, SHA-512) in a
//!   namespace, which stock `ssh-keygen -Y verify` checks.
//! - [`AllowedSigners`] reads OpenSSH's allowed_signers file (the crate has
//!   no reader for it): `principals [options] keytype base64 [comment]`,
//!   with the `namespaces=` option honoured.
//! - [`check_signature`] checks an armored signature of a message against
//!   the allowed signers and names the signer.

use std::io::Read;
use std::path::Path;

use ssh_key::{HashAlg, LineEnding, PrivateKey, PublicKey, SshSig};

use crate::error::{Error, Location, Result};

/// The largest key, allowed_signers or signature file read.
const MAX_KEY_FILE_BYTES: u64 = 1 << 20;

/// An ed25519 private key, loaded for signing.
pub struct SigningKey {
    key: PrivateKey,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key material: the public fingerprint only.
        write!(f, "SigningKey({})", self.fingerprint())
    }
}

fn bad_key(path: &Path, what: impl Into<String>, hint: &str) -> Error {
    Error::invalid(Location::file(path), what, hint)
}

/// Reads a small file whole (at most `MAX_KEY_FILE_BYTES`), as text.
fn read_small(path: &Path, what: &str) -> Result<(String, std::fs::Metadata)> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let md = f.metadata().map_err(|e| Error::io(path, e))?;
    if !md.is_file() {
        return Err(bad_key(
            path,
            format!("not a regular file ({what} expected)"),
            "name the file itself",
        ));
    }
    let mut bytes = Vec::new();
    f.take(MAX_KEY_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(bad_key(
            path,
            format!("larger than {MAX_KEY_FILE_BYTES} bytes: not {what}"),
            "name the right file",
        ));
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| bad_key(path, format!("not text: not {what}"), "name the right file"))?;
    Ok((text, md))
}

impl SigningKey {
    /// Loads an OpenSSH ed25519 private key (`ssh-keygen -t ed25519`).
    pub fn load(path: &Path) -> Result<SigningKey> {
        let (text, md) = read_small(path, "an OpenSSH private key")?;
        let text = zeroize::Zeroizing::new(text);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = md.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(bad_key(
                    path,
                    format!(
                        "the private key is readable by others (permissions {mode:04o}); it is refused, as ssh refuses it"
                    ),
                    "make it owner-only: chmod 600 FILE",
                ));
            }
        }
        #[cfg(not(unix))]
        let _ = md;
        let key = PrivateKey::from_openssh(text.as_bytes()).map_err(|e| {
            let what = match key_algorithm(&text) {
                Some(alg) if alg != "ssh-ed25519" => {
                    format!("the key is {alg}; kvtrail signs with ed25519 only")
                }
                _ => format!("not an OpenSSH private key ({e})"),
            };
            bad_key(
                path,
                what,
                "create one with `ssh-keygen -t ed25519 -N '' -f FILE`",
            )
        })?;
        if key.is_encrypted() {
            return Err(bad_key(
                path,
                "the private key is encrypted with a passphrase, which kvtrail cannot prompt for",
                "use a key without a passphrase kept owner-only (`ssh-keygen -t ed25519 -N '' -f FILE`), or remove it from a copy with `ssh-keygen -p`",
            ));
        }
        if !key.key_data().is_ed25519() {
            return Err(bad_key(
                path,
                format!(
                    "the key is {}; kvtrail signs with ed25519 only",
                    key.algorithm()
                ),
                "create one with `ssh-keygen -t ed25519 -N '' -f FILE`",
            ));
        }
        Ok(SigningKey { key })
    }

    /// The public key, as one OpenSSH line (`ssh-ed25519 AAAA...`), without
    /// the comment.
    pub fn public_openssh(&self) -> String {
        let mut k = self.key.public_key().clone();
        k.set_comment("");
        k.to_openssh().unwrap_or_default()
    }

    /// The public key's `SHA256:...` fingerprint.
    pub fn fingerprint(&self) -> String {
        self.key.fingerprint(HashAlg::Sha256).to_string()
    }

    /// The raw 32-byte ed25519 public key.
    pub fn public_bytes(&self) -> [u8; 32] {
        self.key
            .public_key()
            .key_data()
            .ed25519()
            .map(|k| k.0)
            .unwrap_or_default()
    }

    /// An armored SSHSIG signature of `msg` in `namespace`.
    pub fn sign(&self, namespace: &str, msg: &[u8]) -> Result<String> {
        let sig = self
            .key
            .sign(namespace, HashAlg::Sha512, msg)
            .map_err(|e| Error::Other(format!("signing failed: {e}")))?;
        sig.to_pem(LineEnding::LF)
            .map_err(|e| Error::Other(format!("signing failed: {e}")))
    }

    /// A raw ed25519 signature of `msg` (for DSSE envelopes).
    pub fn sign_raw(&self, msg: &[u8]) -> Result<Vec<u8>> {
        use signature::Signer;
        let sig: ssh_key::Signature = self
            .key
            .try_sign(msg)
            .map_err(|e| Error::Other(format!("signing failed: {e}")))?;
        Ok(sig.as_bytes().to_vec())
    }
}

/// The algorithm an OpenSSH private key file names in its clear part (the
/// public key), for a key the crate cannot load: `openssh-key-v1\0`, then
/// cipher, KDF and KDF options (strings), the key count (u32) and the first
/// public key, whose first string is its algorithm.
fn key_algorithm(text: &str) -> Option<String> {
    use base64::Engine;
    let body: String = text
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .map(str::trim)
        .collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(body)
        .ok()?;
    let mut rest = bytes.strip_prefix(b"openssh-key-v1\0")?;
    fn string<'a>(b: &mut &'a [u8]) -> Option<&'a [u8]> {
        let n = u32::from_be_bytes(b.get(..4)?.try_into().ok()?) as usize;
        let s = b.get(4..4 + n)?;
        *b = &b[4 + n..];
        Some(s)
    }
    for _ in 0..3 {
        string(&mut rest)?;
    }
    rest = rest.get(4..)?;
    let mut public = string(&mut rest)?;
    let alg = string(&mut public)?;
    let alg = std::str::from_utf8(alg).ok()?;
    (alg.len() <= 64 && alg.bytes().all(|b| b.is_ascii_graphic())).then(|| alg.to_string())
}

/// One line of an allowed_signers file.
#[derive(Debug, Clone)]
pub struct AllowedSigner {
    /// The principals (identities) the line names, e.g. `capture@example`.
    pub principals: Vec<String>,
    /// `namespaces="..."`: the namespaces this key may sign in (all when
    /// absent).
    pub namespaces: Option<Vec<String>>,
    pub key: PublicKey,
    /// 1-based line number in the file.
    pub line: usize,
}

/// OpenSSH's allowed_signers file: who may sign what.
#[derive(Debug, Clone, Default)]
pub struct AllowedSigners {
    pub signers: Vec<AllowedSigner>,
}

/// Splits one token off `s` at the first unquoted blank: a token may hold
/// `"..."` quoted parts (principals, option values).
fn take_token(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    if s.is_empty() {
        return None;
    }
    let mut quoted = false;
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ' ' | '\t' if !quoted => return Some((&s[..i], &s[i..])),
            _ => {}
        }
    }
    if quoted { None } else { Some((s, "")) }
}

/// Splits at commas outside quotes.
fn split_commas(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut quoted = false;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn unquote(s: &str) -> &str {
    s.strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(s)
}

/// Whether a token is a public key's algorithm name.
fn is_key_type(s: &str) -> bool {
    s.starts_with("ssh-") || s.starts_with("ecdsa-") || s.starts_with("sk-")
}

impl AllowedSigners {
    /// Reads an allowed_signers file.
    pub fn load(path: &Path) -> Result<AllowedSigners> {
        let (text, _) = read_small(path, "an allowed_signers file")?;
        AllowedSigners::parse(&text, path)
    }

    /// Parses allowed_signers text; errors name the line (`path` for the
    /// message only).
    pub fn parse(text: &str, path: &Path) -> Result<AllowedSigners> {
        let mut signers = Vec::new();
        for (n, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |what: String| {
                Error::invalid(
                    Location::file(path).row(n as u64).column("allowed_signers"),
                    format!("line {}: {what}", n + 1),
                    "each line is `PRINCIPALS [OPTIONS] KEYTYPE BASE64KEY [COMMENT]` (see ssh-keygen(1), ALLOWED SIGNERS)",
                )
            };
            let (principals, rest) =
                take_token(line).ok_or_else(|| bad("unbalanced quotes".into()))?;
            let principals: Vec<String> = split_commas(unquote(principals))
                .into_iter()
                .map(|p| unquote(p.trim()).to_string())
                .filter(|p| !p.is_empty())
                .collect();
            if principals.is_empty() {
                return Err(bad("no principal".into()));
            }
            let (mut tok, mut rest) =
                take_token(rest).ok_or_else(|| bad("no public key".into()))?;
            let mut namespaces = None;
            if !is_key_type(tok) {
                for opt in split_commas(tok) {
                    let (k, v) = opt.split_once('=').unwrap_or((opt, ""));
                    match k.to_ascii_lowercase().as_str() {
                        "namespaces" => {
                            namespaces = Some(
                                unquote(v)
                                    .split(',')
                                    .map(|s| s.trim().to_string())
                                    .collect(),
                            )
                        }
                        other => {
                            return Err(bad(format!(
                                "option {other:?} is not supported (kvtrail honours `namespaces=` only; certificates and validity periods are not checked)"
                            )));
                        }
                    }
                }
                (tok, rest) = take_token(rest).ok_or_else(|| bad("no public key".into()))?;
            }
            let (b64, _comment) =
                take_token(rest).ok_or_else(|| bad("no base64 key after the key type".into()))?;
            let key = PublicKey::from_openssh(&format!("{tok} {b64}"))
                .map_err(|e| bad(format!("not a public key ({e})")))?;
            signers.push(AllowedSigner {
                principals,
                namespaces,
                key,
                line: n + 1,
            });
        }
        Ok(AllowedSigners { signers })
    }

    /// The principals allowed to sign in `namespace` with `key`.
    pub(crate) fn principals_for(
        &self,
        key: &ssh_key::public::KeyData,
        namespace: &str,
    ) -> Vec<String> {
        self.signers
            .iter()
            .filter(|s| s.key.key_data() == key)
            .filter(|s| {
                s.namespaces
                    .as_ref()
                    .is_none_or(|ns| ns.iter().any(|n| n == namespace || n == "*"))
            })
            .flat_map(|s| s.principals.iter().cloned())
            .collect()
    }
}

/// What checking one signature found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignatureCheck {
    /// Valid, by a key the allowed signers name: its principals and the
    /// key's fingerprint.
    Good {
        principals: Vec<String>,
        fingerprint: String,
    },
    /// A well-formed signature that does not verify (the message or the
    /// signature was altered): evidence fails.
    Bad(String),
    /// A valid signature by a key the allowed signers do not name (for
    /// this namespace): evidence fails.
    UnknownSigner(String),
}

/// Parses an armored SSHSIG signature; errors (exit 2: cannot check) name
/// the file.
pub fn parse_signature(armored: &str, path: &Path, namespace: &str) -> Result<SshSig> {
    let sig = SshSig::from_pem(armored.as_bytes()).map_err(|e| {
        Error::invalid(
            Location::file(path),
            format!("not an SSH signature: truncated, re-armored or not SSHSIG ({e})"),
            "a signature is checked exactly as written; restore the file from the original copy",
        )
    })?;
    if sig.namespace() != namespace {
        return Err(Error::invalid(
            Location::file(path),
            format!(
                "signed in namespace {:?}, expected {namespace:?}",
                sig.namespace()
            ),
            "a signature made for another purpose is never accepted; restore the file from the original copy",
        ));
    }
    Ok(sig)
}

/// Checks `sig` over `msg` in `namespace`, and its signer against `allowed`.
pub fn check_signature(
    sig: &SshSig,
    msg: &[u8],
    namespace: &str,
    allowed: &AllowedSigners,
) -> SignatureCheck {
    let key = PublicKey::new(sig.public_key().clone(), "");
    let fingerprint = key.fingerprint(HashAlg::Sha256).to_string();
    if let Err(e) = key.verify(namespace, msg, sig) {
        return SignatureCheck::Bad(format!(
            "the signature does not match the file ({e}): it was altered after signing"
        ));
    }
    let principals = allowed.principals_for(sig.public_key(), namespace);
    if principals.is_empty() {
        return SignatureCheck::UnknownSigner(format!(
            "signed by {fingerprint}, which the allowed signers do not name for namespace {namespace:?}"
        ));
    }
    SignatureCheck::Good {
        principals,
        fingerprint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PUB: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOxL1Ys0mqEzA3vJkzs0UJ6c4NwJhQ3TjA8Z5sNqYF6x";

    #[test]
    fn allowed_signers_lines() {
        let text = format!(
            "# comment\n\ncapture@example,\"ops team\" {PUB} a comment\nother namespaces=\"kvtrail-seal,file\" {PUB}\n"
        );
        let a = AllowedSigners::parse(&text, Path::new("as")).unwrap();
        assert_eq!(a.signers.len(), 2);
        assert_eq!(a.signers[0].principals, vec!["capture@example", "ops team"]);
        assert_eq!(a.signers[0].namespaces, None);
        assert_eq!(a.signers[1].principals, vec!["other"]);
        assert_eq!(
            a.signers[1].namespaces.as_deref(),
            Some(&["kvtrail-seal".to_string(), "file".to_string()][..])
        );
        assert_eq!(a.signers[1].line, 4);
        let kd = a.signers[0].key.key_data().clone();
        assert_eq!(
            a.principals_for(&kd, "kvtrail-seal"),
            vec!["capture@example", "ops team", "other"]
        );
        assert_eq!(
            a.principals_for(&kd, "git"),
            vec!["capture@example", "ops team"]
        );
    }

    #[test]
    fn bad_allowed_signers_name_the_line() {
        for (text, needle) in [
            ("x cert-authority ssh-ed25519 AAAA\n", "cert-authority"),
            ("onlyprincipal\n", "no public key"),
            ("p ssh-ed25519 !!notbase64\n", "not a public key"),
            ("\"p ssh-ed25519 AAAA\n", "unbalanced"),
            (
                &format!("p {}\n", PUB.split(' ').next().unwrap()),
                "no base64",
            ),
        ] {
            let e = AllowedSigners::parse(text, Path::new("as"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
            assert!(e.contains("line 1"), "{e}");
        }
    }
}
