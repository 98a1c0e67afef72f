//! Where a trace's files are read from: a local folder, or a prefix in
//! object storage (`s3://`, `gs://`, `az://`, `http(s)://`) read with
//! ranged GETs through the `object_store` crate.
//!
//! A remote trace is named by its URL, and its files by the URL joined
//! with their path in the trace (`s3://bucket/t/kv/pool=0/part-00000.parquet`),
//! kept in the same `PathBuf`s as local paths, so every reader, check and
//! report of `trace` runs one code path for both: [`crate::trace::files`]
//! asks this module where a path lives and hands back a [`Source`], which
//! the Parquet reader, the digests and trace.json read alike.
//!
//! The objects of a remote trace are listed once, when it is first opened
//! ([`Remote::open`]); every later read of an object asks for the ETag
//! (or version) the listing saw (`If-Match`) and compares the answer's, so
//! an object replaced between listing and reading is an error naming it,
//! never a mix of two uploads. A store may ignore `If-Match`, so the first
//! read of a pinned object goes front to back and keeps the blake3 of each
//! block ([`Remote::seal`]); every later read asks for whole blocks and
//! checks them, so the bytes replayed are the bytes hashed.
//! An object listed without an ETag or version
//! (a bare static server) is read once into a temporary file, hashed on
//! the way, and served from there ([`Remote::spool`]). HTTP(S) servers
//! cannot list a folder: the
//! files of an `http(s)://` trace are the ones its trace.json lists, each
//! asked for with a HEAD.
//!
//! Memory stays bounded per open file: ranged reads go through a small
//! block cache ([`CACHE_BLOCKS`] blocks of [`BLOCK_BYTES`]); a digest reads
//! the object front to back in [`STREAM_BYTES`] ranges. The requests run on
//! one current-thread tokio runtime owned here; the rest of kvtrail stays
//! synchronous. Credentials come from the environment and the platforms'
//! usual files, never from flags (docs/object-storage.md).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::path::Path as ObjPath;
use object_store::{
    ClientConfigKey, GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt, RetryConfig,
};
use parquet::file::reader::{ChunkReader, Length};

use crate::error::{Error, Location, Result};

/// URL schemes read from object storage.
pub const SCHEMES: [&str; 10] = [
    "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https",
];

/// Bytes of one cached block of a remote file.
pub const BLOCK_BYTES: u64 = 512 << 10;
/// Blocks cached per open remote file (the Parquet reader reads a row
/// group's projected columns side by side).
pub const CACHE_BLOCKS: usize = 16;
/// Bytes of one ranged GET when a file is read front to back (digests).
pub const STREAM_BYTES: u64 = 8 << 20;
/// The most objects kvtrail lists under one trace prefix.
pub const MAX_OBJECTS: usize = 1_000_000;
/// The most bytes of object names (and ETags) a listing keeps: with long
/// names the listing is refused before [`MAX_OBJECTS`].
pub const MAX_LISTING_BYTES: usize = 256 << 20;
/// The most pages a listing may take (a store lists up to 1,000 objects
/// a page: 1,000 pages for [`MAX_OBJECTS`]); a page token seen before
/// ends it at once.
pub const MAX_LIST_PAGES: usize = 10_000;
/// Pages in a row that add no object before a listing is refused (a store
/// may send an empty page now and then, never a long run of them).
pub const MAX_EMPTY_PAGES: usize = 100;
/// The longest object name a listing may hold (S3, GCS and Azure allow
/// 1,024 bytes).
pub const MAX_NAME_BYTES: usize = 1024;
/// The largest object kvtrail reads (1 PiB): a larger size named by a
/// listing or a HEAD is no trace file.
pub const MAX_OBJECT_BYTES: u64 = 1 << 50;
/// The longest trace URL, and the longest URL of a file in it (object
/// stores name at most 1,024 bytes; HTTP servers refuse long request
/// lines).
pub const MAX_URL_BYTES: usize = 4096;

/// Seconds one request may take, unless `KVTRAIL_OBJECT_STORE_TIMEOUT` says.
pub const DEFAULT_TIMEOUT_S: f64 = 30.0;
/// Seconds to connect, unless `KVTRAIL_OBJECT_STORE_CONNECT_TIMEOUT` says.
pub const DEFAULT_CONNECT_TIMEOUT_S: f64 = 5.0;
/// Retries of a failed request, unless `KVTRAIL_OBJECT_STORE_RETRIES` says.
pub const DEFAULT_RETRIES: usize = 2;

/// Whether `path` names a trace or file in object storage
/// (`scheme://...` with a scheme of [`SCHEMES`]). A local folder whose
/// name starts so is reached as `./s3://...`.
pub fn is_remote(path: &Path) -> bool {
    path.to_str()
        .and_then(|s| s.split_once("://"))
        .is_some_and(|(scheme, _)| SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()))
}

fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| Error::Other(format!("cannot start the object-store client: {e}")))
}

fn block_on<F: std::future::Future>(f: F) -> Result<F::Output> {
    Ok(runtime()?.block_on(f))
}

fn env_secs(name: &str, default: f64) -> Result<Duration> {
    secs(name, std::env::var(name).ok(), default)
}

/// A number of seconds from variable `name` (unset: `default`).
fn secs(name: &str, value: Option<String>, default: f64) -> Result<Duration> {
    match value {
        None => Ok(Duration::from_secs_f64(default)),
        Some(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e6)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                Error::invalid(
                    Location::default(),
                    format!("{name}={v:?} is not a number of seconds"),
                    format!("set {name} to seconds above 0 (e.g. 30), or unset it"),
                )
            }),
    }
}

/// Timeouts and retries of every request, from the environment.
struct Limits {
    timeout: Duration,
    connect: Duration,
    retries: usize,
}

impl Limits {
    fn from_env() -> Result<Limits> {
        let retries = match std::env::var("KVTRAIL_OBJECT_STORE_RETRIES") {
            Err(_) => DEFAULT_RETRIES,
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n <= 100)
                .ok_or_else(|| {
                    Error::invalid(
                        Location::default(),
                        format!("KVTRAIL_OBJECT_STORE_RETRIES={v:?} is not a count of retries"),
                        "set it to a whole number from 0 to 100, or unset it",
                    )
                })?,
        };
        Ok(Limits {
            timeout: env_secs("KVTRAIL_OBJECT_STORE_TIMEOUT", DEFAULT_TIMEOUT_S)?,
            connect: env_secs(
                "KVTRAIL_OBJECT_STORE_CONNECT_TIMEOUT",
                DEFAULT_CONNECT_TIMEOUT_S,
            )?,
            retries,
        })
    }

    fn retry(&self) -> RetryConfig {
        RetryConfig {
            max_retries: self.retries,
            retry_timeout: self.timeout * (self.retries as u32 + 1),
            ..Default::default()
        }
    }

    fn client(&self) -> [(ClientConfigKey, String); 2] {
        [
            (
                ClientConfigKey::Timeout,
                format!("{}ms", self.timeout.as_millis()),
            ),
            (
                ClientConfigKey::ConnectTimeout,
                format!("{}ms", self.connect.as_millis()),
            ),
        ]
    }
}

const CREDENTIALS_HINT: &str = "give credentials through the environment: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or `eval \"$(aws configure export-credentials --format env)\"` for a profile), GOOGLE_APPLICATION_CREDENTIALS, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY; and read access to the objects (docs/object-storage.md)";

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
fn request_error(url: &str, e: object_store::Error) -> Error {
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
fn chain(e: &dyn std::error::Error) -> String {
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

fn changed(url: &str) -> Error {
    Error::invalid(
        Location::file(Path::new(url)),
        "changed while kvtrail read it: the object no longer has the ETag or version it had when the trace was listed",
        "do not modify a trace while kvtrail reads it: upload a changed trace to a new prefix, then run kvtrail again",
    )
}

/// A ranged read that sent other bytes than the object's first read.
fn changed_bytes(url: &str) -> Error {
    Error::invalid(
        Location::file(Path::new(url)),
        "changed while kvtrail read it: a ranged read sent other bytes than the object's first read (the object was replaced, and the store ignores If-Match)",
        "do not modify a trace while kvtrail reads it: upload a changed trace to a new prefix, then run kvtrail again; if nothing changed it, the store or a proxy in front of it is damaged",
    )
}

/// One remote trace: its object store, the prefix of its root, and the
/// objects listed under it when it was opened.
pub(crate) struct Remote {
    /// The trace's URL, without a trailing `/`.
    url: String,
    store: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    /// How its objects are listed, page by page; None for HTTP(S):
    /// objects are found by HEAD, not by listing.
    lister: Option<Arc<dyn PaginatedListStore>>,
    /// Path in the trace (`kv/pool=0/part-00000.parquet`) → what the
    /// listing (or HEAD) saw.
    objects: Mutex<BTreeMap<String, ObjectMeta>>,
    /// The first failed read of an object (a change, a lost connection):
    /// `verify` turns it into an error instead of a problem of one file.
    failure: Mutex<Option<Error>>,
    /// blake3 and length of objects hashed so far: an object is read at
    /// the ETag it was listed with, so its digest is computed once.
    digests: Mutex<HashMap<String, (String, u64)>>,
    /// Objects the store names no ETag or version for (HTTP servers that
    /// send no ETag): each is downloaded once into a temporary file,
    /// hashed on the way, and every read is served from that copy, so the
    /// bytes replayed are the bytes hashed. One slot per object, locked
    /// while it downloads: other objects download meanwhile.
    spools: Mutex<HashMap<String, Slot<Arc<File>>>>,
    /// Objects pinned to an ETag or version: what one front-to-back read
    /// of each saw ([`Sealed`]), against which every later ranged read is
    /// checked, so the bytes replayed are the bytes hashed even where the
    /// store ignores `If-Match`. One slot per object, as for `spools`.
    sealed: Mutex<HashMap<String, Slot<Arc<Sealed>>>>,
}

/// One object's slot in [`Remote::spools`] or [`Remote::sealed`], locked
/// while it is filled.
type Slot<T> = Arc<Mutex<Option<T>>>;

/// What one front-to-back read of a pinned object saw: its blake3, and
/// the blake3 of each of its [`BLOCK_BYTES`] blocks (32 bytes a block: 64
/// bytes of memory per MiB of the object).
struct Sealed {
    digest: String,
    size: u64,
    blocks: Vec<[u8; 32]>,
}

/// The filled slot of `rel` in `slots`, filling it with `fill` (once per
/// object; callers for the same object wait, other objects go on).
fn slot<T: Clone>(
    slots: &Mutex<HashMap<String, Slot<T>>>,
    rel: &str,
    url: &str,
    fill: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let poisoned = || Error::Other(format!("{url}: a reader thread failed"));
    let one = slots
        .lock()
        .map_err(|_| poisoned())?
        .entry(rel.to_string())
        .or_default()
        .clone();
    let mut one = one.lock().map_err(|_| poisoned())?;
    if let Some(v) = one.as_ref() {
        return Ok(v.clone());
    }
    let v = fill()?;
    *one = Some(v.clone());
    Ok(v)
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote").field("url", &self.url).finish()
    }
}

fn registry() -> &'static Mutex<HashMap<String, Arc<Remote>>> {
    static R: OnceLock<Mutex<HashMap<String, Arc<Remote>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn bad_url(url: &str, what: String) -> Error {
    Error::invalid(
        Location::file(Path::new(url)),
        what,
        "name the trace as s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX or http(s)://HOST/PATH (docs/object-storage.md)",
    )
}

/// The most bytes of an answer kvtrail lets the object-store client hold
/// when it is not an object's bytes: a listing page (1,000 names of at most
/// 1,024 bytes, a few MB) or an error's text.
pub const MAX_ANSWER_BYTES: u64 = 32 << 20;
/// The most bytes of an error answer (its body is only read for a message).
const MAX_ERROR_ANSWER_BYTES: u64 = 64 << 10;

/// The object-store client's HTTP service with every answer it would hold
/// whole bounded: a ranged GET to its range, an error to
/// [`MAX_ERROR_ANSWER_BYTES`], any other GET with a query (a listing page)
/// to [`MAX_ANSWER_BYTES`]. A whole-object GET (the copy of an object
/// without an ETag) is streamed and checked against the listed size.
#[derive(Debug)]
struct Bounded(object_store::client::HttpClient);

#[derive(Debug, Default)]
struct BoundedConnector;

impl object_store::client::HttpConnector for BoundedConnector {
    fn connect(
        &self,
        options: &object_store::ClientOptions,
    ) -> object_store::Result<object_store::client::HttpClient> {
        let inner = object_store::client::ReqwestConnector::default().connect(options)?;
        Ok(object_store::client::HttpClient::new(Bounded(inner)))
    }
}

/// A body longer than a [`Bounded`] answer may be.
#[derive(Debug)]
struct TooLong(u64);

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the answer is longer than the {} bytes kvtrail accepts for it",
            self.0
        )
    }
}

impl std::error::Error for TooLong {}

#[async_trait::async_trait]
impl object_store::client::HttpService for Bounded {
    async fn call(
        &self,
        req: object_store::client::HttpRequest,
    ) -> std::result::Result<object_store::client::HttpResponse, object_store::client::HttpError>
    {
        use http_body_util::BodyExt;
        let range = req
            .headers()
            .get(http::header::RANGE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("bytes="))
            .and_then(|v| v.split_once('-'))
            .and_then(|(a, b)| Some(b.parse::<u64>().ok()?.saturating_sub(a.parse().ok()?) + 1));
        let listing = req.method() == http::Method::GET && req.uri().query().is_some();
        let res = self.0.execute(req).await?;
        let cap = if res.status().is_client_error() || res.status().is_server_error() {
            MAX_ERROR_ANSWER_BYTES
        } else if let Some(n) = range {
            n
        } else if listing {
            MAX_ANSWER_BYTES
        } else {
            return Ok(res);
        };
        let (parts, body) = res.into_parts();
        let mut seen = 0u64;
        let body = http_body_util::StreamBody::new(body.into_data_stream().map(move |chunk| {
            let chunk = chunk?;
            seen += chunk.len() as u64;
            if seen > cap {
                return Err(object_store::client::HttpError::new(
                    object_store::client::HttpErrorKind::Decode,
                    TooLong(cap),
                ));
            }
            Ok(http_body::Frame::data(chunk))
        }));
        Ok(object_store::client::HttpResponse::from_parts(
            parts,
            object_store::client::HttpResponseBody::new(body),
        ))
    }
}

/// The store of `url`, and its lister (none for HTTP(S)).
type Built = (Arc<dyn ObjectStore>, Option<Arc<dyn PaginatedListStore>>);

fn build_store(url: &url::Url, limits: &Limits) -> object_store::Result<Built> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
    use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
    use object_store::http::HttpBuilder;
    let client = limits.client();
    Ok(match url.scheme() {
        "s3" | "s3a" => {
            let mut b = AmazonS3Builder::from_env()
                .with_http_connector(BoundedConnector)
                .with_url(url.as_str())
                .with_retry(limits.retry());
            for (k, v) in client {
                b = b.with_config(AmazonS3ConfigKey::Client(k), v);
            }
            let s = Arc::new(b.build()?);
            (s.clone(), Some(s))
        }
        "gs" => {
            let mut b = GoogleCloudStorageBuilder::from_env()
                .with_http_connector(BoundedConnector)
                .with_url(url.as_str())
                .with_retry(limits.retry());
            for (k, v) in client {
                b = b.with_config(GoogleConfigKey::Client(k), v);
            }
            let s = Arc::new(b.build()?);
            (s.clone(), Some(s))
        }
        "http" | "https" => {
            let origin = &url[..url::Position::BeforePath];
            let mut b = HttpBuilder::new()
                .with_http_connector(BoundedConnector)
                .with_url(origin)
                .with_retry(limits.retry())
                .with_config(ClientConfigKey::AllowHttp, "true");
            for (k, v) in client {
                b = b.with_config(k, v);
            }
            (Arc::new(b.build()?), None)
        }
        _ => {
            let mut b = MicrosoftAzureBuilder::from_env()
                .with_http_connector(BoundedConnector)
                .with_url(url.as_str())
                .with_retry(limits.retry());
            for (k, v) in client {
                b = b.with_config(AzureConfigKey::Client(k), v);
            }
            let s = Arc::new(b.build()?);
            (s.clone(), Some(s))
        }
    })
}

impl Remote {
    /// The remote trace at `dir` (a URL), listed on first use and then
    /// kept for the rest of the process, so every command reads one
    /// snapshot of the trace.
    pub(crate) fn open(dir: &Path) -> Result<Arc<Remote>> {
        let raw = dir.to_str().unwrap_or_default();
        let key = raw.trim_end_matches('/').to_string();
        if let Some(r) = registry().lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(r);
        }
        if key.len() > MAX_URL_BYTES {
            let shown: String = key.chars().take(80).collect();
            return Err(bad_url(
                &format!("{shown}..."),
                format!(
                    "is {} bytes long, over kvtrail's limit of {MAX_URL_BYTES} for a trace URL",
                    key.len()
                ),
            ));
        }
        // The URL parser drops tabs and line breaks, trims spaces and reads
        // `\` as `/`: the prefix read would not be the one reports name.
        if key
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || c == '\\')
        {
            return Err(bad_url(
                &key.escape_debug().to_string(),
                "holds a space, control character or backslash: percent-encode it as the store names the object".into(),
            ));
        }
        let url = url::Url::parse(&key).map_err(|e| bad_url(&key, format!("is not a URL: {e}")))?;
        if url.host_str().is_none_or(str::is_empty) {
            return Err(bad_url(&key, "names no bucket, container or host".into()));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(bad_url(&key, "has a query or fragment (`?`, `#`)".into()));
        }
        // The URL parser resolves `.` and `..`: the prefix read would not
        // be the one the reports name.
        let path = key.split_once("://").map_or("", |(_, rest)| rest);
        if path.split('/').skip(1).any(|seg| {
            let seg = seg.to_ascii_lowercase().replace("%2e", ".");
            seg == "." || seg == ".."
        }) {
            return Err(bad_url(
                &key,
                "has a `.` or `..` segment: name the trace's prefix as the store holds it".into(),
            ));
        }
        // abfs(s)://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH names its
        // container where other URLs name a user: that is no secret.
        let container_at = matches!(url.scheme(), "abfs" | "abfss") && url.password().is_none();
        if (!url.username().is_empty() && !container_at) || url.password().is_some() {
            // Not echoed: the URL holds a secret.
            let shown = format!("{}://{}", url.scheme(), url.host_str().unwrap_or_default());
            return Err(Error::invalid(
                Location::file(Path::new(&shown)),
                "names a user or password in the URL (`USER:PASSWORD@`): kvtrail takes credentials only from the environment, and would write the URL into its reports",
                CREDENTIALS_HINT,
            ));
        }
        let limits = Limits::from_env().map_err(|e| match e {
            Error::Invalid { what, hint, .. } => Error::Invalid {
                loc: Location::file(Path::new(&key)),
                what,
                hint,
            },
            other => other,
        })?;
        let (store, lister) = build_store(&url, &limits).map_err(|e| {
            Error::invalid(
                Location::file(Path::new(&key)),
                format!("cannot set up the object-store client: {}", chain(&e)),
                CREDENTIALS_HINT,
            )
        })?;
        let prefix = ObjPath::from_url_path(url.path())
            .map_err(|e| bad_url(&key, format!("has a path that is not an object path: {e}")))?;
        let remote = Remote {
            url: key.clone(),
            store,
            prefix,
            lister,
            objects: Mutex::default(),
            failure: Mutex::default(),
            digests: Mutex::default(),
            spools: Mutex::default(),
            sealed: Mutex::default(),
        };
        if remote.lister.is_some() {
            remote.list()?;
        }
        let remote = Arc::new(remote);
        if let Ok(mut m) = registry().lock() {
            m.entry(key).or_insert_with(|| remote.clone());
        }
        Ok(remote)
    }

    /// Lists the objects under the prefix, page by page. Every entry a
    /// page holds counts against the listing's limits, kept or not (outside
    /// the prefix), and so does every page; an object named twice or a
    /// page token given twice ends the listing at once: a store that lists
    /// endlessly is refused, never waited on.
    fn list(&self) -> Result<()> {
        let Some(lister) = self.lister.clone() else {
            return Ok(());
        };
        let prefix = self.prefix.clone();
        let url = self.url.clone();
        let too_many = |what: String| {
            Error::invalid(
                Location::file(Path::new(&url)),
                format!("holds more than {what}"),
                "point kvtrail at one trace's prefix (the one that holds trace.json), not at a bucket of many",
            )
        };
        let repeats = |what: String| {
            Error::invalid(
                Location::file(Path::new(&url)),
                format!("cannot be listed: the object store's listing {what}"),
                "the store or a proxy in front of it is damaged: list the prefix with the store's own tools, or copy the trace to a local folder",
            )
        };
        let listed = block_on(async {
            let mut out = BTreeMap::new();
            let mut kept = 0usize;
            let mut tokens = std::collections::HashSet::new();
            let mut token: Option<String> = None;
            // The last page that named a new object (0: none yet).
            let mut last_new = 0;
            let under = (!prefix.as_ref().is_empty()).then(|| format!("{}/", prefix.as_ref()));
            for page in 1.. {
                if page > MAX_LIST_PAGES {
                    return Err(too_many(format!("{MAX_LIST_PAGES} pages of objects")));
                }
                if page - last_new > MAX_EMPTY_PAGES {
                    return Err(repeats(format!(
                        "gave {MAX_EMPTY_PAGES} pages in a row that name no new object (pages {} to {})",
                        last_new + 1,
                        page - 1
                    )));
                }
                let before = out.len();
                let opts = PaginatedListOptions {
                    page_token: token.take(),
                    ..Default::default()
                };
                let got = lister
                    .list_paginated(under.as_deref(), opts)
                    .await
                    .map_err(|e| request_error(&url, e))?;
                for meta in got.result.objects {
                    if meta.location.as_ref().len() > MAX_NAME_BYTES {
                        return Err(repeats(format!(
                            "names an object of {} bytes, longer than any store allows ({MAX_NAME_BYTES})",
                            meta.location.as_ref().len()
                        )));
                    }
                    kept += meta.location.as_ref().len()
                        + meta.e_tag.as_ref().map_or(0, String::len)
                        + meta.version.as_ref().map_or(0, String::len)
                        + 128;
                    if out.len() >= MAX_OBJECTS {
                        return Err(too_many(format!("{MAX_OBJECTS} objects")));
                    }
                    if kept > MAX_LISTING_BYTES {
                        return Err(too_many(format!(
                            "{} MiB of object names ({} objects)",
                            MAX_LISTING_BYTES >> 20,
                            out.len()
                        )));
                    }
                    if let Some(rel) = rel_of(&prefix, &meta.location) {
                        kept += rel.len();
                        if out.insert(rel, meta).is_some() {
                            return Err(repeats(format!(
                                "named an object twice (page {page}), so it would never end"
                            )));
                        }
                    }
                }
                if out.len() > before {
                    last_new = page;
                }
                match got.page_token {
                    None => break,
                    Some(t) => {
                        if t.len() > MAX_URL_BYTES {
                            return Err(repeats(format!(
                                "gave a page token of {} bytes (page {page})",
                                t.len()
                            )));
                        }
                        kept += t.len();
                        if !tokens.insert(*blake3::hash(t.as_bytes()).as_bytes()) {
                            return Err(repeats(format!(
                                "came back to a page it had given (page {page}), so it would never end"
                            )));
                        }
                        token = Some(t);
                    }
                }
            }
            Ok(out)
        })??;
        if let Ok(mut o) = self.objects.lock() {
            *o = listed;
        }
        Ok(())
    }

    /// The trace's URL.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// What is known of the object at `rel`: from the listing, or (HTTP)
    /// from a HEAD asked once. `None`: no such object.
    pub(crate) fn meta(&self, rel: &str) -> Result<Option<ObjectMeta>> {
        if let Some(m) = self.objects.lock().ok().and_then(|o| o.get(rel).cloned()) {
            return Ok(Some(m));
        }
        if self.lister.is_some() {
            return Ok(None);
        }
        // Asked for by a path trace.json names: a request for an over-long
        // URL would fail inside the client, not with an error.
        if self.file_url(rel).len() > MAX_URL_BYTES {
            return Err(Error::invalid(
                Location::file(Path::new(&self.url)),
                format!(
                    "names a file whose URL is {} bytes long, over kvtrail's limit of {MAX_URL_BYTES}",
                    self.file_url(rel).len()
                ),
                "keep the trace's prefix and file paths short (the trace format's paths are kv/pool=N/part-NNNNN.parquet)",
            ));
        }
        let loc = self.location(rel);
        let store = self.store.clone();
        let url = self.file_url(rel);
        match block_on(async move { store.head(&loc).await })? {
            Ok(meta) => {
                if let Ok(mut o) = self.objects.lock() {
                    o.insert(rel.to_string(), meta.clone());
                }
                Ok(Some(meta))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(request_error(&url, e)),
        }
    }

    /// Asks for each path (HTTP(S) only: the files trace.json lists), so
    /// that [`Remote::files`] knows them.
    pub(crate) fn discover<'a>(&self, rels: impl Iterator<Item = &'a str>) -> Result<()> {
        if self.lister.is_some() {
            return Ok(());
        }
        for rel in rels {
            self.meta(rel)?;
        }
        Ok(())
    }

    /// Whether objects are found by listing (false: HTTP(S)).
    pub(crate) fn listable(&self) -> bool {
        self.lister.is_some()
    }

    /// Whether the listing found no object.
    pub(crate) fn is_empty(&self) -> bool {
        self.objects.lock().map(|o| o.is_empty()).unwrap_or(true)
    }

    /// Every known object below the folder `sub` of the trace, as paths
    /// in the trace.
    pub(crate) fn files(&self, sub: &str) -> Vec<String> {
        let dir = format!("{}/", sub.trim_end_matches('/'));
        self.objects
            .lock()
            .map(|o| o.keys().filter(|k| k.starts_with(&dir)).cloned().collect())
            .unwrap_or_default()
    }

    /// Where the object at `rel` lives: as the listing named it, else (a
    /// path trace.json lists, read over HTTP(S)) the prefix joined with
    /// `rel` as it is written, so that a name the store or server encodes
    /// is asked for once encoded, not twice.
    fn location(&self, rel: &str) -> ObjPath {
        if let Some(m) = self.objects.lock().ok().and_then(|o| o.get(rel).cloned()) {
            return m.location;
        }
        let joined = if self.prefix.as_ref().is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix.as_ref())
        };
        ObjPath::parse(&joined).unwrap_or_else(|_| {
            let mut loc = self.prefix.clone();
            for part in rel.split('/').filter(|p| !p.is_empty()) {
                loc = loc.clone().join(part);
            }
            loc
        })
    }

    /// The URL of a path in the trace.
    pub(crate) fn file_url(&self, rel: &str) -> String {
        format!("{}/{rel}", self.url)
    }

    /// Opens the object at `rel` for reading.
    pub(crate) fn open_file(self: &Arc<Self>, rel: &str) -> Result<RemoteFile> {
        let url = self.file_url(rel);
        let meta = self.meta(rel)?.ok_or_else(|| {
            Error::invalid(
                Location::file(Path::new(&url)),
                "does not exist in the object store",
                "check the URL (bucket or container, prefix, object name); a trace's prefix holds trace.json, requests/ and kv/",
            )
        })?;
        if meta.size > MAX_OBJECT_BYTES {
            return Err(Error::invalid(
                Location::file(Path::new(&url)),
                format!(
                    "is {} bytes long by the object store's answer, more than kvtrail reads ({MAX_OBJECT_BYTES})",
                    meta.size
                ),
                "no trace file is this large: the store or a proxy in front of it is damaged",
            ));
        }
        let pinned = meta.e_tag.is_some() || meta.version.is_some();
        let mut inner = Inner {
            remote: self.clone(),
            rel: rel.to_string(),
            url,
            location: meta.location.clone(),
            size: meta.size,
            e_tag: meta.e_tag,
            version: meta.version,
            cache: Mutex::default(),
            spool: None,
        };
        if !pinned {
            inner.spool = Some(self.spool(rel, &inner)?);
        }
        Ok(RemoteFile {
            inner: Arc::new(inner),
            pos: 0,
            buf: Bytes::new(),
        })
    }

    /// The local copy of an object that cannot be pinned to an ETag or
    /// version (see [`Remote::spools`]): downloaded in one GET on first
    /// use, its blake3 recorded as the object's digest. Callers for the
    /// same object wait for that download; other objects' go on.
    fn spool(&self, rel: &str, inner: &Inner) -> Result<Arc<File>> {
        slot(&self.spools, rel, &inner.url, || self.download(rel, inner))
    }

    /// Downloads an unpinned object into a temporary file (see
    /// [`Remote::spool`]).
    fn download(&self, rel: &str, inner: &Inner) -> Result<Arc<File>> {
        use std::io::Write;
        let tmp_err = |e: io::Error| {
            Error::invalid(
                Location::file(Path::new(&inner.url)),
                format!("cannot keep a local copy of the object: {e}"),
                "the server sends no ETag, so kvtrail reads each object once into a temporary file (TMPDIR): free space there, or serve the trace from object storage",
            )
        };
        let mut file = tempfile::tempfile().map_err(tmp_err)?;
        // One GET of the whole object, streamed to the file (a server that
        // sends no ETag often answers no Range request either).
        let store = self.store.clone();
        let loc = inner.location.clone();
        let url = inner.url.clone();
        let size = inner.size;
        let copied = block_on(async {
            let got = store
                .get_opts(&loc, GetOptions::default())
                .await
                .map_err(|e| request_error(&url, e))?;
            let mut stream = got.into_stream();
            let mut h = blake3::Hasher::new();
            let mut n = 0u64;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| request_error(&url, e))?;
                n += chunk.len() as u64;
                if n > size {
                    break;
                }
                h.update(&chunk);
                file.write_all(&chunk).map_err(tmp_err)?;
            }
            if n != size {
                return Err(Error::invalid(
                    Location::file(Path::new(&url)),
                    format!(
                        "the server sent {n}{} bytes of an object of {size}",
                        if n > size { " or more" } else { "" }
                    ),
                    "the object changed while kvtrail read it, or the server is damaged: do not modify a trace while kvtrail reads it",
                ));
            }
            Ok::<_, Error>(h)
        });
        let h = match copied {
            Ok(Ok(h)) => h,
            Ok(Err(e)) | Err(e) => {
                if let Ok(mut f) = self.failure.lock()
                    && f.is_none()
                {
                    *f = Some(copy(&e));
                }
                return Err(e);
            }
        };
        let d = (h.finalize().to_hex().to_string(), inner.size);
        if let Ok(mut m) = self.digests.lock() {
            m.insert(rel.to_string(), d);
        }
        Ok(Arc::new(file))
    }

    /// What one front-to-back read of the pinned object `inner` saw (see
    /// [`Remote::sealed`]), read in [`STREAM_BYTES`] ranges on first use.
    fn seal(&self, inner: &Inner) -> Result<Arc<Sealed>> {
        slot(&self.sealed, &inner.rel, &inner.url, || {
            let mut whole = blake3::Hasher::new();
            // Grown as blocks arrive, not from the size the store claims.
            let mut blocks = Vec::new();
            let mut pos = 0;
            while pos < inner.size {
                let end = (pos + STREAM_BYTES).min(inner.size);
                let bytes = inner.fetch_inner(pos, end)?;
                whole.update(&bytes);
                blocks.extend(
                    bytes
                        .chunks(BLOCK_BYTES as usize)
                        .map(|b| *blake3::hash(b).as_bytes()),
                );
                pos = end;
            }
            let sealed = Sealed {
                digest: whole.finalize().to_hex().to_string(),
                size: inner.size,
                blocks,
            };
            if let Ok(mut m) = self.digests.lock() {
                m.insert(inner.rel.clone(), (sealed.digest.clone(), sealed.size));
            }
            Ok(Arc::new(sealed))
        })
    }

    /// blake3 and length of the object at `rel`, streamed front to back
    /// in ranged reads (once per object and process).
    pub(crate) fn digest(self: &Arc<Self>, rel: &str) -> Result<(String, u64)> {
        if let Some(d) = self.digests.lock().ok().and_then(|m| m.get(rel).cloned()) {
            return Ok(d);
        }
        let file = self.open_file(rel)?;
        // An object without an ETag was hashed as it was copied.
        if let Some(d) = self.digests.lock().ok().and_then(|m| m.get(rel).cloned()) {
            return Ok(d);
        }
        let sealed = file.inner.sealed()?;
        Ok((sealed.digest.clone(), sealed.size))
    }

    /// The first failed read of any of its objects, if one failed.
    pub(crate) fn failure(&self) -> Option<Error> {
        self.failure.lock().ok().and_then(|f| f.as_ref().map(copy))
    }
}

/// The kvtrail error a Parquet error carries (a remote read that failed
/// inside the Parquet reader), as itself; None for any other error.
pub(crate) fn carried_by_parquet(e: &dyn std::any::Any) -> Option<Error> {
    match e.downcast_ref::<parquet::errors::ParquetError>()? {
        parquet::errors::ParquetError::External(inner) => inner.downcast_ref::<Error>().map(copy),
        _ => None,
    }
}

/// A copy of an error (errors are not `Clone`: an I/O error's source).
fn copy(e: &Error) -> Error {
    match e {
        Error::Invalid { loc, what, hint } => Error::Invalid {
            loc: loc.clone(),
            what: what.clone(),
            hint: hint.clone(),
        },
        other => Error::Other(other.to_string()),
    }
}

/// `location` relative to `prefix`, with `/` separators (None: not below).
fn rel_of(prefix: &ObjPath, location: &ObjPath) -> Option<String> {
    let parts: Vec<String> = location
        .prefix_match(prefix)?
        .map(|p| p.as_ref().to_string())
        .collect();
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// The remote trace `path` belongs to (opened before by
/// [`Remote::open`]), and its path in that trace. None for a local path.
pub(crate) fn locate(path: &Path) -> Result<Option<(Arc<Remote>, String)>> {
    if !is_remote(path) {
        return Ok(None);
    }
    let s = path.to_str().unwrap_or_default();
    let found = registry().lock().ok().and_then(|m| {
        m.iter()
            .filter_map(|(k, r)| {
                let rest = s.strip_prefix(k.as_str())?;
                let rel = if rest.is_empty() {
                    ""
                } else {
                    rest.strip_prefix('/')?
                };
                Some((k.len(), r.clone(), rel.trim_end_matches('/').to_string()))
            })
            .max_by_key(|(n, _, _)| *n)
    });
    match found {
        Some((_, r, rel)) => Ok(Some((r, rel))),
        None => Ok(Some((Remote::open(path)?, String::new()))),
    }
}

#[derive(Default)]
struct Cache {
    /// (block index, bytes, last use).
    blocks: Vec<(u64, Bytes, u64)>,
    clock: u64,
}

struct Inner {
    remote: Arc<Remote>,
    /// The object's path in the trace.
    rel: String,
    url: String,
    location: ObjPath,
    size: u64,
    e_tag: Option<String>,
    version: Option<String>,
    cache: Mutex<Cache>,
    /// The object's local copy, when it cannot be pinned.
    spool: Option<Arc<File>>,
}

impl Inner {
    /// Bytes `start..end`: from the local copy of an unpinned object; of
    /// a pinned one, in ranged GETs of whole blocks, each checked against
    /// what the object's first read saw ([`Remote::seal`]).
    fn fetch(&self, start: u64, end: u64) -> Result<Bytes> {
        if start >= end {
            return Ok(Bytes::new());
        }
        if let Some(f) = &self.spool {
            use std::os::unix::fs::FileExt;
            let mut buf = vec![0; (end - start) as usize];
            f.read_exact_at(&mut buf, start)
                .map_err(|e| Error::io(Path::new(&self.url), e))?;
            return Ok(Bytes::from(buf));
        }
        let res = self.fetch_sealed(start, end);
        if let Err(e) = &res
            && let Ok(mut f) = self.remote.failure.lock()
            && f.is_none()
        {
            *f = Some(copy(e));
        }
        res
    }

    /// The object's [`Sealed`] blocks, read now if not yet.
    fn sealed(&self) -> Result<Arc<Sealed>> {
        let res = self.remote.seal(self);
        if let Err(e) = &res
            && let Ok(mut f) = self.remote.failure.lock()
            && f.is_none()
        {
            *f = Some(copy(e));
        }
        res
    }

    /// Bytes `start..end` of a pinned object, in GETs of at most
    /// [`STREAM_BYTES`] of whole blocks, each block checked.
    fn fetch_sealed(&self, start: u64, end: u64) -> Result<Bytes> {
        let sealed = self.remote.seal(self)?;
        if sealed.size != self.size {
            return Err(changed(&self.url));
        }
        let per = STREAM_BYTES / BLOCK_BYTES;
        let (b0, b1) = (start / BLOCK_BYTES, (end - 1) / BLOCK_BYTES);
        let mut pieces = Vec::new();
        let mut b = b0;
        while b <= b1 {
            let n = (b1 - b + 1).min(per);
            let lo = b * BLOCK_BYTES;
            let hi = ((b + n) * BLOCK_BYTES).min(self.size);
            let bytes = self.fetch_inner(lo, hi)?;
            for (i, block) in bytes.chunks(BLOCK_BYTES as usize).enumerate() {
                if sealed.blocks.get((b + i as u64) as usize)
                    != Some(blake3::hash(block).as_bytes())
                {
                    return Err(changed_bytes(&self.url));
                }
            }
            let from = (start.max(lo) - lo) as usize;
            let to = (end.min(hi) - lo) as usize;
            pieces.push(bytes.slice(from..to));
            b += n;
        }
        if pieces.len() == 1 {
            return Ok(pieces.pop().unwrap_or_default());
        }
        let mut out = Vec::with_capacity((end - start) as usize);
        for p in pieces {
            out.extend_from_slice(&p);
        }
        Ok(Bytes::from(out))
    }

    /// One ranged GET of `start..end`, pinned to the listed ETag/version.
    fn fetch_inner(&self, start: u64, end: u64) -> Result<Bytes> {
        let opts = GetOptions {
            if_match: self.e_tag.clone(),
            version: self.version.clone(),
            range: Some(GetRange::Bounded(start..end)),
            ..Default::default()
        };
        let store = self.remote.store.clone();
        let loc = self.location.clone();
        let url = self.url.clone();
        let (meta, bytes) = block_on(async move {
            let got = store
                .get_opts(&loc, opts)
                .await
                .map_err(|e| request_error(&url, e))?;
            let meta = got.meta.clone();
            let bytes = got.bytes().await.map_err(|e| request_error(&url, e))?;
            Ok::<_, Error>((meta, bytes))
        })??;
        // A server that ignores If-Match may still name the ETag it
        // served; what it served is checked block by block in any case.
        if let (Some(want), Some(got)) = (&self.e_tag, &meta.e_tag)
            && want != got
        {
            return Err(changed(&self.url));
        }
        if meta.size != self.size {
            return Err(changed(&self.url));
        }
        if bytes.len() as u64 != end - start {
            return Err(Error::invalid(
                Location::file(Path::new(&self.url)),
                format!(
                    "the object store sent {} bytes for bytes {start}..{end}",
                    bytes.len()
                ),
                "the object or the server is damaged: check the object's size against trace.json",
            ));
        }
        Ok(bytes)
    }

    /// Bytes `start..end` through the block cache.
    fn read_range(&self, start: u64, end: u64) -> Result<Bytes> {
        let end = end.min(self.size);
        if start >= end {
            return Ok(Bytes::new());
        }
        let (b0, b1) = (start / BLOCK_BYTES, (end - 1) / BLOCK_BYTES);
        if b1 - b0 >= CACHE_BLOCKS as u64 / 2 {
            // A long range (a whole column chunk): uncached, in requests
            // of at most STREAM_BYTES.
            return self.fetch(start, end);
        }
        let mut out = Vec::with_capacity((end - start) as usize);
        for b in b0..=b1 {
            let block = self.block(b)?;
            let bs = b * BLOCK_BYTES;
            let lo = start.max(bs) - bs;
            let hi = end.min(bs + block.len() as u64) - bs;
            out.extend_from_slice(&block[lo as usize..hi as usize]);
        }
        Ok(Bytes::from(out))
    }

    fn block(&self, b: u64) -> Result<Bytes> {
        {
            let mut c = self.cache.lock().map_err(|_| self.poisoned())?;
            c.clock += 1;
            let now = c.clock;
            if let Some(e) = c.blocks.iter_mut().find(|e| e.0 == b) {
                e.2 = now;
                return Ok(e.1.clone());
            }
        }
        let start = b * BLOCK_BYTES;
        let bytes = self.fetch(start, (start + BLOCK_BYTES).min(self.size))?;
        let mut c = self.cache.lock().map_err(|_| self.poisoned())?;
        let now = c.clock;
        if c.blocks.len() >= CACHE_BLOCKS
            && let Some(i) = c
                .blocks
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.2)
                .map(|(i, _)| i)
        {
            c.blocks.swap_remove(i);
        }
        c.blocks.push((b, bytes.clone(), now));
        Ok(bytes)
    }

    fn poisoned(&self) -> Error {
        Error::Other(format!("{}: a reader thread failed", self.url))
    }
}

/// An object of a remote trace, opened for ranged reads. `Read` streams
/// it front to back.
pub struct RemoteFile {
    inner: Arc<Inner>,
    /// Where the next streamed range starts, and what is left of the last.
    pos: u64,
    buf: Bytes,
}

impl RemoteFile {
    pub fn len(&self) -> u64 {
        self.inner.size
    }

    pub fn is_empty(&self) -> bool {
        self.inner.size == 0
    }

    /// Bytes `start..start+len` (fewer at the end of the object).
    pub fn read_at(&self, start: u64, len: u64) -> Result<Bytes> {
        self.inner.read_range(start, start.saturating_add(len))
    }
}

fn io_err(e: Error) -> io::Error {
    io::Error::other(e)
}

impl Read for RemoteFile {
    /// Front to back in [`STREAM_BYTES`] ranges, whatever the caller's
    /// buffer (a digest reads 64 KiB at a time).
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.buf.is_empty() {
            if self.pos >= self.inner.size {
                return Ok(0);
            }
            let end = (self.pos + STREAM_BYTES).min(self.inner.size);
            self.buf = self.inner.fetch(self.pos, end).map_err(io_err)?;
            self.pos = end;
        }
        let n = buf.len().min(self.buf.len());
        buf[..n].copy_from_slice(&self.buf[..n]);
        let _ = self.buf.split_to(n);
        Ok(n)
    }
}

/// A reader over a remote file from an offset, through the block cache.
pub struct RangeReader {
    inner: Arc<Inner>,
    pos: u64,
}

impl Read for RangeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.pos >= self.inner.size {
            return Ok(0);
        }
        let b = self.pos / BLOCK_BYTES;
        let block = self.inner.block(b).map_err(io_err)?;
        let off = (self.pos - b * BLOCK_BYTES) as usize;
        let n = buf.len().min(block.len().saturating_sub(off));
        if n == 0 {
            return Ok(0);
        }
        buf[..n].copy_from_slice(&block[off..off + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

/// A data file or trace.json opened for reading, local or remote: what
/// the Parquet reader, the digests and the manifest reader take.
pub enum Source {
    Local(File),
    Remote(RemoteFile),
}

impl Source {
    /// The file's length in bytes.
    pub fn size(&self) -> io::Result<u64> {
        match self {
            Source::Local(f) => Ok(f.metadata()?.len()),
            Source::Remote(r) => Ok(r.len()),
        }
    }
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Source::Local(f) => f.read(buf),
            Source::Remote(r) => r.read(buf),
        }
    }
}

/// The reader [`Source`] hands the Parquet reader from an offset.
pub enum SourceRead {
    Local(BufReader<File>),
    Remote(RangeReader),
}

impl Read for SourceRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            SourceRead::Local(f) => f.read(buf),
            SourceRead::Remote(r) => r.read(buf),
        }
    }
}

impl Length for Source {
    fn len(&self) -> u64 {
        match self {
            Source::Local(f) => Length::len(f),
            Source::Remote(r) => r.len(),
        }
    }
}

impl ChunkReader for Source {
    type T = SourceRead;

    fn get_read(&self, start: u64) -> parquet::errors::Result<SourceRead> {
        match self {
            Source::Local(f) => f.get_read(start).map(SourceRead::Local),
            Source::Remote(r) => Ok(SourceRead::Remote(RangeReader {
                inner: r.inner.clone(),
                pos: start,
            })),
        }
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        match self {
            Source::Local(f) => f.get_bytes(start, length),
            Source::Remote(r) => {
                let bytes = r
                    .read_at(start, length as u64)
                    .map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))?;
                if bytes.len() < length {
                    return Err(parquet::errors::ParquetError::EOF(format!(
                        "expected to read {length} bytes at offset {start}, got {}",
                        bytes.len()
                    )));
                }
                Ok(bytes)
            }
        }
    }
}

/// A remote file's URL as a path (for [`crate::trace::Trace`]'s lists).
pub(crate) fn file_path(remote: &Remote, rel: &str) -> PathBuf {
    PathBuf::from(remote.file_url(rel))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_urls_are_told_from_local_paths() {
        for s in [
            "s3://b/t",
            "S3://b/t",
            "gs://b/t",
            "az://c/t",
            "https://h/t",
            "http://127.0.0.1:9/t",
        ] {
            assert!(is_remote(Path::new(s)), "{s}");
        }
        for s in [
            "./s3://b/t",
            "traces/t",
            "/tmp/s3:/b",
            "ftp://h/t",
            "s3:/b/t",
        ] {
            assert!(!is_remote(Path::new(s)), "{s}");
        }
    }

    #[test]
    fn relative_paths_below_a_prefix() {
        let p = ObjPath::from("t/x");
        assert_eq!(
            rel_of(&p, &ObjPath::from("t/x/kv/a.parquet")).as_deref(),
            Some("kv/a.parquet")
        );
        assert_eq!(rel_of(&p, &ObjPath::from("t/xy/a")), None);
        assert_eq!(
            rel_of(&ObjPath::from(""), &ObjPath::from("trace.json")).as_deref(),
            Some("trace.json")
        );
    }

    #[test]
    fn timeouts_are_seconds_above_zero() {
        assert_eq!(secs("T", None, 3.0).unwrap(), Duration::from_secs(3));
        assert_eq!(
            secs("T", Some(" 0.5".into()), 3.0).unwrap(),
            Duration::from_millis(500)
        );
        for bad in ["0", "-1", "soon", "inf", "NaN", ""] {
            let e = secs("T", Some(bad.into()), 3.0).unwrap_err().to_string();
            assert!(e.contains("T=") && e.contains("hint:"), "{bad}: {e}");
        }
    }
}
