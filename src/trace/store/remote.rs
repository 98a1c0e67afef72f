//! One remote trace: its object store, the prefix of its root and the
//! objects listed under it, listed once when the trace is opened
//! ([`Remote::open`]) and kept by the [`crate::trace::TraceRoot`] that
//! opened it, so every command reads one snapshot of the trace.
//!
//! The listing is bounded: [`MAX_OBJECTS`] objects, [`MAX_LISTING_BYTES`]
//! of names, [`MAX_LIST_PAGES`] pages, and a page token or object named
//! twice ends it at once. HTTP(S) servers cannot list a folder: the files
//! of an `http(s)://` trace are the ones its trace.json lists, each asked
//! for with a HEAD ([`Remote::discover`]).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::Path;
use std::sync::{Arc, Mutex};

use object_store::list::{PaginatedListOptions, PaginatedListStore};
use object_store::path::Path as ObjPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};

use crate::error::{Error, Location, Result};
use crate::trace::parquet_error::copy;
use crate::trace::store::client::build_store;
use crate::trace::store::errors::{CREDENTIALS_HINT, bad_url, chain, request_error};
use crate::trace::store::limits::{
    Limits, MAX_EMPTY_PAGES, MAX_LIST_PAGES, MAX_LISTING_BYTES, MAX_NAME_BYTES, MAX_OBJECTS,
    MAX_URL_BYTES, block_on,
};

/// One remote trace: its object store, the prefix of its root, and the
/// objects listed under it when it was opened.
pub struct Remote {
    /// The trace's URL, without a trailing `/`.
    pub(super) url: String,
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) prefix: ObjPath,
    /// How its objects are listed, page by page; None for HTTP(S):
    /// objects are found by HEAD, not by listing.
    pub(super) lister: Option<Arc<dyn PaginatedListStore>>,
    /// Path in the trace (`kv/pool=0/part-00000.parquet`) → what the
    /// listing (or HEAD) saw.
    pub(super) objects: Mutex<BTreeMap<String, ObjectMeta>>,
    /// The first failed read of an object (a change, a lost connection):
    /// `verify` turns it into an error instead of a problem of one file.
    pub(super) failure: Mutex<Option<Error>>,
    /// blake3 and length of objects hashed so far: an object is read at
    /// the ETag it was listed with, so its digest is computed once.
    pub(super) digests: Mutex<HashMap<String, (String, u64)>>,
    /// Objects the store names no ETag or version for (HTTP servers that
    /// send no ETag): each is downloaded once into a temporary file,
    /// hashed on the way, and every read is served from that copy, so the
    /// bytes replayed are the bytes hashed. One slot per object, locked
    /// while it downloads: other objects download meanwhile.
    pub(super) spools: Mutex<HashMap<String, Slot<Arc<File>>>>,
    /// Objects pinned to an ETag or version: what one front-to-back read
    /// of each saw ([`Sealed`]), against which every later ranged read is
    /// checked, so the bytes replayed are the bytes hashed even where the
    /// store ignores `If-Match`. One slot per object, as for `spools`.
    pub(super) sealed: Mutex<HashMap<String, Slot<Arc<Sealed>>>>,
}

/// One object's slot in [`Remote::spools`] or [`Remote::sealed`], locked
/// while it is filled.
pub(super) type Slot<T> = Arc<Mutex<Option<T>>>;

/// What one front-to-back read of a pinned object saw: its blake3, and
/// the blake3 of each of its [`BLOCK_BYTES`] blocks (32 bytes a block: 64
/// bytes of memory per MiB of the object).
pub(super) struct Sealed {
    pub(super) digest: String,
    pub(super) size: u64,
    pub(super) blocks: Vec<[u8; 32]>,
}

/// The filled slot of `rel` in `slots`, filling it with `fill` (once per
/// object; callers for the same object wait, other objects go on).
pub(super) fn slot<T: Clone>(
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

impl Remote {
    /// The remote trace at `dir` (a URL), listed on first use and then
    /// kept for the rest of the process, so every command reads one
    /// snapshot of the trace.
    pub(crate) fn open(dir: &Path) -> Result<Arc<Remote>> {
        let raw = dir.to_str().unwrap_or_default();
        let key = raw.trim_end_matches('/').to_string();
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
        Ok(Arc::new(remote))
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
    pub(super) fn location(&self, rel: &str) -> ObjPath {
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

    /// The first failed read of any of its objects, if one failed: the
    /// readers return it in place of the Parquet reader's error it caused
    /// (which keeps only its text), and `verify` fails on it instead of
    /// calling the file damaged.
    pub(crate) fn failure(&self) -> Option<Error> {
        self.failure.lock().ok().and_then(|f| f.as_ref().map(copy))
    }

    /// Keeps `e` as the trace's failed read, unless one came before.
    pub(super) fn failed(&self, e: &Error) {
        if let Ok(mut f) = self.failure.lock()
            && f.is_none()
        {
            *f = Some(copy(e));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
