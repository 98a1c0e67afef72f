//! The kvtrail errors of failed object-store requests: what went wrong
//! with which URL, and what to do.

use std::path::Path;

use crate::error::{Error, Location};

pub(crate) const CREDENTIALS_HINT: &str = "give credentials through the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or `eval \"$(aws configure export-credentials --format env)\"` for a profile), GOOGLE_APPLICATION_CREDENTIALS, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY; and read access to the objects (docs/object-storage.md)";

/// What to do when access is refused: HTTP(S) is read without
/// credentials.
fn credentials_hint(url: &str) -> &'static str {
    if url.starts_with("http://") || url.starts_with("https://") {
        "kvtrail sends no credentials over HTTP(S): serve the trace without access control to the machine that runs kvtrail, or put it in object storage (s3://, gs://, az://) and give credentials through the environment (docs/object-storage.md)"
    } else {
        CREDENTIALS_HINT
    }
}

/// A kvtrail error for a failed request on `url`.
pub(crate) fn request_error(url: &str, e: object_store::Error) -> Error {
    let loc = Location::file(Path::new(url));
    match e {
        object_store::Error::NotFound { .. } => Error::invalid(
            loc,
            "does not exist in the object store",
            "check the URL (bucket or container, prefix, object name); a trace's prefix holds trace.json, requests/ and kv/",
        ),
        object_store::Error::Precondition { .. } | object_store::Error::NotModified { .. } => {
            changed(url)
        }
        object_store::Error::PermissionDenied { source, .. }
        | object_store::Error::Unauthenticated { source, .. } => Error::invalid(
            loc,
            format!("access was refused: {}", clip(source.to_string())),
            credentials_hint(url),
        ),
        other => {
            let text = chain(&other);
            let lower = text.to_ascii_lowercase();
            if [
                "credential",
                "signature",
                "accessdenied",
                "access denied",
                "invalidaccesskeyid",
                "token",
            ]
            .iter()
            .any(|w| lower.contains(w))
            {
                Error::invalid(loc, format!("access failed: {text}"), credentials_hint(url))
            } else if lower.contains("invalid path") {
                Error::invalid(
                    loc,
                    format!("the listing holds an object whose name is not an object path: {text}"),
                    "remove or rename the object under the trace's prefix whose name has an empty, `.` or `..` segment or a control character (a trace's objects are trace.json, requests/*.parquet and kv/pool=N/*.parquet), or copy the trace to a clean prefix",
                )
            } else if lower.contains("range request not supported") {
                Error::invalid(
                    loc,
                    format!("the server ignores Range requests: {text}"),
                    "serve the trace from object storage (s3://, gs://, az://) or from an HTTP server that answers Range requests (206) and sends ETags, or copy it to a local folder",
                )
            } else if lower.contains("bytes kvtrail accepts for it") {
                Error::invalid(
                    loc,
                    format!("the object store sent an answer too long to be one: {text}"),
                    "a listing page or an error answer is never this long: check that the URL and endpoint point at an object store, and that no proxy in between rewrites its answers",
                )
            } else if lower.contains("nosuchbucket") || lower.contains("containernotfound") {
                Error::invalid(
                    loc,
                    format!("the bucket does not exist: {text}"),
                    "check the bucket (or container) name in the URL",
                )
            } else {
                Error::invalid(
                    loc,
                    format!("the object store did not answer: {text}"),
                    "check the endpoint (AWS_ENDPOINT for S3-compatible stores) and the network; requests time out after KVTRAIL_OBJECT_STORE_TIMEOUT seconds (default 30), connections after KVTRAIL_OBJECT_STORE_CONNECT_TIMEOUT (default 5), with KVTRAIL_OBJECT_STORE_RETRIES retries (default 2)",
                )
            }
        }
    }
}

/// An error's message with its sources, one line.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = clip(e.to_string());
    let mut src = e.source();
    while let Some(s) = src {
        let t = clip(s.to_string());
        if !out.contains(&t) {
            out.push_str(": ");
            out.push_str(&t);
        }
        src = s.source();
    }
    out.replace('\n', " ")
}

/// Bytes of one error's text kept in a message: a server's error answer
/// may be any size.
const MAX_ERROR_TEXT: usize = 2048;

/// `t` cut to [`MAX_ERROR_TEXT`] bytes (at a character boundary).
fn clip(t: String) -> String {
    if t.len() <= MAX_ERROR_TEXT {
        return t;
    }
    let mut end = MAX_ERROR_TEXT;
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &t[..end], t.len())
}

pub(crate) fn changed(url: &str) -> Error {
    Error::invalid(
        Location::file(Path::new(url)),
        "changed while kvtrail read it: the object no longer has the ETag or version it had when the trace was listed",
        "do not modify a trace while kvtrail reads it: upload a changed trace to a new prefix, then run kvtrail again",
    )
}

/// A ranged read that sent other bytes than the object's first read.
pub(crate) fn changed_bytes(url: &str) -> Error {
    Error::invalid(
        Location::file(Path::new(url)),
        "changed while kvtrail read it: a ranged read sent other bytes than the object's first read (the object was replaced, and the store ignores If-Match)",
        "do not modify a trace while kvtrail reads it: upload a changed trace to a new prefix, then run kvtrail again; if nothing changed it, the store or a proxy in front of it is damaged",
    )
}

pub(crate) fn bad_url(url: &str, what: String) -> Error {
    Error::invalid(
        Location::file(Path::new(url)),
        what,
        "name the trace as s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX or http(s)://HOST/PATH (docs/object-storage.md)",
    )
}
