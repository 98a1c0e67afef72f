//! Local object stores for the tests that read traces remotely
//! (object_store.rs, fleet_spark.rs): tests/objstore/server.py (moto's S3
//! server, or a static HTTP server with Range) started from the venv of
//! .ci/setup.d/56-moto.sh on 127.0.0.1, ended when the test binary ends
//! (its stdin closes), and `kvtrail` pointed at it.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::cli::Kvtrail;
use super::venv;

pub const SERVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/objstore/server.py");

/// The moto venv's python; a missing venv fails the test, naming the
/// set-up script.
pub fn python() -> PathBuf {
    venv::MOTO.python().unwrap_or_else(|| {
        panic!(
            "the moto venv is missing: run .ci/setup.d/56-moto.sh (an S3 server for these tests)"
        )
    })
}

/// A server process, ended when the test binary ends (its stdin closes).
pub struct Server {
    _child: Child,
    pub endpoint: String,
    pub key_id: String,
    pub secret: String,
}

/// Starts `server.py ARGS` and waits for its ready line.
pub fn start(args: &[&str]) -> Server {
    let mut child = Command::new(python())
        .arg(SERVER)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start tests/objstore/server.py");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the test object store did not start within 120 s");
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("server said {line:?}: {e}"));
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    Server {
        endpoint: s("endpoint"),
        key_id: s("key_id"),
        secret: s("secret"),
        _child: child,
    }
}

/// `k` with the S3 server's endpoint and credentials (never the host's:
/// the instance-metadata endpoint points at a closed local port), no
/// retries, a 300 s limit.
pub fn on_s3(s: &Server, k: Kvtrail) -> Kvtrail {
    k.env("AWS_ENDPOINT", &s.endpoint)
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", &s.key_id)
        .env("AWS_SECRET_ACCESS_KEY", &s.secret)
        .env("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
        .env("KVTRAIL_OBJECT_STORE_RETRIES", "0")
        .timeout(Duration::from_secs(300))
}
