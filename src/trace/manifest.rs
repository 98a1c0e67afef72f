//! trace.json: the manifest of a trace (deployment, capture, file digests).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Location, Result};
use crate::schema::{FORMAT_NAME, FORMAT_VERSION};
use crate::trace::files;

/// The largest trace.json kvtrail reads: 16 MiB. A manifest lists the pools
/// (at most 65,536, about 120 bytes each) and one entry of about 150 bytes
/// per data file: 16 MiB holds some 100,000 part files, about 12 PiB of
/// trace at the Recorder's 128 MiB per part. Parsed JSON costs up to some
/// twenty times its size in memory (`[{},{},...]`), so the cap also bounds
/// what a hostile manifest can make kvtrail allocate. Nesting deeper than
/// 128 levels is refused by the JSON parser.
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// The text of trace.json (or a deployment file): UTF-8; a byte-order mark
/// (Windows editors, PowerShell) is no JSON, but says nothing about the
/// trace either, so it is skipped.
fn text(bytes: Vec<u8>, path: &Path) -> Result<String> {
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::invalid(
            Location::file(path),
            format!("not valid UTF-8: {e}"),
            "trace.json must be a UTF-8 JSON object (see docs/trace-format.md)",
        )
    })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

fn json(text: &str, path: &Path, hint: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| {
        Error::invalid(
            Location::file(path),
            format!("not valid JSON: {e}"),
            hint.to_string(),
        )
    })
}

/// Role of a KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Mixed,
    /// A tier that only holds copies (host memory, local disk, a remote KV
    /// store); the engine (request 0) moves KV in and out of it.
    Cache,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Mixed => "mixed",
            Role::Cache => "cache",
        }
    }
}

/// One KV pool of the deployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pool {
    pub id: u16,
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
    pub role: Role,
    pub capacity_tokens: u64,
    #[serde(default = "one")]
    pub page_size: u32,
    /// Keys we do not know, kept so a manifest round-trips.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

fn one() -> u32 {
    1
}

impl Pool {
    /// SGLang's admission limit for this pool under `context_window`:
    /// [`max_req_input_len`] of its `capacity_tokens`.
    pub fn max_req_input_len(&self, context_window: u64) -> u64 {
        max_req_input_len(context_window, self.capacity_tokens)
    }
}

impl Deployment {
    /// The prompt length at or over which the engine refuses a request
    /// landing on pool `p` (the anomaly and inspect limit): SGLang's
    /// [`max_req_input_len`] of the pool; vLLM refuses a prompt of
    /// `max_model_len` (the context window) tokens or more at its front
    /// end (`input_processor`), and will not start with a pool smaller
    /// than that, so its limit is the smaller of the two.
    pub fn prompt_limit(&self, p: &Pool) -> u64 {
        prompt_limit(&self.engine, self.context_window, p.capacity_tokens)
    }
}

/// [`Deployment::prompt_limit`] from its parts (engine name as trace.json
/// spells it, context window, the pool's tokens).
pub fn prompt_limit(engine: &str, context_window: u64, pool_tokens: u64) -> u64 {
    if crate::schema::is_vllm_engine(engine) {
        context_window.min(pool_tokens)
    } else {
        max_req_input_len(context_window, pool_tokens)
    }
}

/// SGLang's `max_req_input_len` of a pool of `pool_tokens` tokens:
/// `min(context_window - 1, pool_tokens - 1) - 5`, saturating at 0
/// (`tp_worker.get_worker_info`, 0.5.19-0.5.23). A prompt of this many
/// tokens or more is rejected (`validate_input_length`), or truncated to it
/// under `--allow-auto-truncate`. The one home of the formula: inspect,
/// scope's anomalies, report.html, audit and the simulator all call it.
pub fn max_req_input_len(context_window: u64, pool_tokens: u64) -> u64 {
    context_window
        .saturating_sub(1)
        .min(pool_tokens.saturating_sub(1))
        .saturating_sub(5)
}

/// A `files` path as the readers spell it: `/` separators, no `.` or empty
/// components (`./kv//pool=0\\a.parquet` is `kv/pool=0/a.parquet`).
fn normalize_rel(p: &str) -> String {
    p.split(['/', '\\'])
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// Optional keys written as JSON `null` by other writers (an unknown
/// `ended_ns` of a capture that did not close, a nameless pool) read as if
/// absent.
fn null_as_default<'de, D, T>(d: D) -> std::result::Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// The serving deployment the trace was captured on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deployment {
    #[serde(default, deserialize_with = "null_as_default")]
    pub name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub engine: String,
    pub context_window: u64,
    pub pools: Vec<Pool>,
    /// Who may hit whose cached prefixes: `global` (the default) or
    /// `tenant` (the operator promises per-tenant prefix caches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_cache_scope: Option<PrefixCacheScope>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// `deployment.prefix_cache_scope`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefixCacheScope {
    /// Any request may hit any cached prefix.
    Global,
    /// Prefix caches are isolated per tenant (e.g. a per-tenant cache
    /// salt): a hit on another tenant's KV is an isolation finding.
    Tenant,
}

impl PrefixCacheScope {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixCacheScope::Global => "global",
            PrefixCacheScope::Tenant => "tenant",
        }
    }
}

impl Deployment {
    /// Whether the operator promised per-tenant prefix caches.
    pub fn tenant_prefix_cache(&self) -> bool {
        self.prefix_cache_scope == Some(PrefixCacheScope::Tenant)
    }
}

/// The manifest keys the contract lets be JSON `null` (read as absent):
/// a pool's or the deployment's `name`, `engine`, the capture's `writer`,
/// `started_ns`, `ended_ns` and `complete` (docs/trace-format.md).
const NULLABLE_DEPLOYMENT: [&str; 2] = ["name", "engine"];
const NULLABLE_POOL: [&str; 1] = ["name"];
const NULLABLE_CAPTURE: [&str; 4] = ["writer", "started_ns", "ended_ns", "complete"];

/// The manifest keys kvtrail reads that are not in the nullable lists
/// above: a `null` there is an error naming the key, never read as
/// absent (`"prefix_cache_scope": null` is not `global`, nor
/// `"from_engine_start": null` "not said").
const DEPLOYMENT_KEYS: [&str; 3] = ["context_window", "pools", "prefix_cache_scope"];
const POOL_KEYS: [&str; 4] = ["id", "role", "capacity_tokens", "page_size"];
const CAPTURE_KEYS: [&str; 3] = ["from_engine_start", "skipped_lines", "no_kv_events"];
const TOP_KEYS: [&str; 5] = ["format", "version", "deployment", "capture", "files"];
const FILE_KEYS: [&str; 3] = ["path", "rows", "blake3"];

fn null_key(path: &Path, key: &str) -> Error {
    Error::invalid(
        Location::file(path).column(key),
        format!("{key} is null, and the contract does not let it be null"),
        "give the key a value or leave it out; only a pool's or the deployment's name, engine, and \
         the capture's writer, started_ns, ended_ns and complete may be null (docs/trace-format.md)",
    )
}

/// Refuses a `null` at a key the contract does not let be null, naming
/// the key (`prefix` is `deployment.` in trace.json, empty in a deployment
/// file). The nullable keys are not checked here: they read as absent.
fn check_deployment_nulls(dep: &serde_json::Value, path: &Path, prefix: &str) -> Result<()> {
    debug_assert!(
        NULLABLE_DEPLOYMENT
            .iter()
            .all(|k| !DEPLOYMENT_KEYS.contains(k))
    );
    for k in DEPLOYMENT_KEYS {
        if dep.get(k).is_some_and(|v| v.is_null()) {
            return Err(null_key(path, &format!("{prefix}{k}")));
        }
    }
    if let Some(pools) = dep.get("pools").and_then(|p| p.as_array()) {
        debug_assert!(NULLABLE_POOL.iter().all(|k| !POOL_KEYS.contains(k)));
        for (i, p) in pools.iter().enumerate() {
            if p.is_null() {
                return Err(null_key(path, &format!("{prefix}pools[{i}]")));
            }
            for k in POOL_KEYS {
                if p.get(k).is_some_and(|v| v.is_null()) {
                    return Err(null_key(path, &format!("{prefix}pools[{i}].{k}")));
                }
            }
        }
    }
    Ok(())
}

/// [`check_deployment_nulls`] for a whole trace.json.
fn check_nulls(value: &serde_json::Value, path: &Path) -> Result<()> {
    for k in TOP_KEYS {
        if value.get(k).is_some_and(|v| v.is_null()) {
            return Err(null_key(path, k));
        }
    }
    if let Some(dep) = value.get("deployment") {
        check_deployment_nulls(dep, path, "deployment.")?;
    }
    if let Some(c) = value.get("capture") {
        debug_assert!(NULLABLE_CAPTURE.iter().all(|k| !CAPTURE_KEYS.contains(k)));
        for k in CAPTURE_KEYS {
            if c.get(k).is_some_and(|v| v.is_null()) {
                return Err(null_key(path, &format!("capture.{k}")));
            }
        }
        // kvtrail's own keys, which lower what the capture is worth: a
        // value that cannot be read is never read as absent.
        if let Some(v) = c.get("skipped_lines")
            && !v.is_u64()
        {
            return Err(Error::invalid(
                Location::file(path).column("capture.skipped_lines"),
                format!("capture.skipped_lines is {v}, not a count"),
                "capture.skipped_lines counts the input lines dropped at import: a whole number \
                 of at least 0 (docs/trace-format.md)",
            ));
        }
        if let Some(v) = c.get("no_kv_events")
            && !v.is_boolean()
        {
            return Err(Error::invalid(
                Location::file(path).column("capture.no_kv_events"),
                format!("capture.no_kv_events is {v}, not true or false"),
                "capture.no_kv_events says the import found no KV events: true or false \
                 (docs/trace-format.md)",
            ));
        }
    }
    if let Some(files) = value.get("files").and_then(|f| f.as_array()) {
        for (i, f) in files.iter().enumerate() {
            if f.is_null() {
                return Err(null_key(path, &format!("files[{i}]")));
            }
            for k in FILE_KEYS {
                if f.get(k).is_some_and(|v| v.is_null()) {
                    return Err(null_key(path, &format!("files[{i}].{k}")));
                }
            }
        }
    }
    Ok(())
}

/// The closed sets of trace.json's deployment (pool roles, the prefix-cache
/// scope), checked before the full shape so that a wrong value is named by
/// its key, not by serde's position in the text.
fn check_enums(dep: &serde_json::Value, path: &Path, prefix: &str) -> Result<()> {
    const ROLES: [&str; 4] = ["prefill", "decode", "mixed", "cache"];
    if let Some(pools) = dep.get("pools").and_then(|p| p.as_array()) {
        for (i, p) in pools.iter().enumerate() {
            match p.get("role") {
                Some(serde_json::Value::String(r)) if ROLES.contains(&r.as_str()) => {}
                Some(v) => {
                    return Err(Error::invalid(
                        Location::file(path).column(&format!("{prefix}pools[{i}].role")),
                        format!("unknown pool role {v}"),
                        "a pool's role is one of prefill, decode, mixed, cache (docs/trace-format.md)",
                    ));
                }
                None => {}
            }
        }
    }
    match dep.get("prefix_cache_scope") {
        None => Ok(()),
        Some(serde_json::Value::String(s)) if s == "global" || s == "tenant" => Ok(()),
        Some(v) => Err(Error::invalid(
            Location::file(path).column(&format!("{prefix}prefix_cache_scope")),
            format!("prefix_cache_scope is {v}, expected \"global\" or \"tenant\""),
            "global: any request may hit any cached prefix (the default); tenant: prefix caches \
             are isolated per tenant (docs/trace-format.md)",
        )),
    }
}

impl Deployment {
    /// Reads a deployment file (`--deployment` of `ingest` and `record`):
    /// the `deployment` object of trace.json, or a whole trace.json (an
    /// object with a `deployment` key). Read by trace.json's rules: a
    /// regular file of at most [`MAX_MANIFEST_BYTES`], UTF-8 with an
    /// optional byte-order mark; a whole trace.json is checked as
    /// [`Manifest::load`] checks it (format, version, shape).
    pub fn load(path: &Path) -> Result<Deployment> {
        let bytes = files::read_limited(path, MAX_MANIFEST_BYTES, "a deployment file")?;
        let value = json(
            &text(bytes, path)?,
            path,
            "pass the `deployment` object of trace.json, or a whole trace.json",
        )?;
        if value.get("deployment").is_some() {
            return Ok(Manifest::from_value(value, path)?.deployment);
        }
        check_deployment_nulls(&value, path, "")?;
        check_enums(&value, path, "")?;
        let dep: Deployment = serde_json::from_value(value).map_err(|e| {
            Error::invalid(
                Location::file(path),
                format!("not a deployment: {e}"),
                "a deployment has context_window and pools [{id, role, capacity_tokens, page_size}] (docs/trace-format.md)",
            )
        })?;
        dep.validate(path)?;
        Ok(dep)
    }

    pub fn pool(&self, id: u16) -> Option<&Pool> {
        self.pools.iter().find(|p| p.id == id)
    }

    /// Checks the deployment's own consistency (unique pool ids, sizes).
    pub fn validate(&self, path: &Path) -> Result<()> {
        let loc = || Location::file(path).column("deployment.pools");
        if self.pools.is_empty() {
            return Err(Error::invalid(
                loc(),
                "the deployment lists no pools",
                "list every KV pool with id, role, capacity_tokens and page_size",
            ));
        }
        let mut ids: Vec<u16> = self.pools.iter().map(|p| p.id).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::invalid(
                loc(),
                format!("pool id {} appears twice", w[0]),
                "give every pool a unique id",
            ));
        }
        for p in &self.pools {
            if p.capacity_tokens == 0 || p.capacity_tokens > u32::MAX as u64 + 1 {
                return Err(Error::invalid(
                    loc(),
                    format!("pool {} has capacity_tokens {}", p.id, p.capacity_tokens),
                    "capacity_tokens must be between 1 and 2^32",
                ));
            }
            if p.page_size == 0 {
                return Err(Error::invalid(
                    loc(),
                    format!("pool {} has page_size 0", p.id),
                    "page_size must be at least 1",
                ));
            }
        }
        Ok(())
    }
}

/// How the trace was captured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Capture {
    #[serde(default, deserialize_with = "null_as_default")]
    pub writer: String,
    #[serde(default, deserialize_with = "null_as_default")]
    pub started_ns: i64,
    #[serde(default, deserialize_with = "null_as_default")]
    pub ended_ns: i64,
    #[serde(default, deserialize_with = "null_as_default")]
    pub complete: bool,
    /// True when capture began with the engine's pools empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_engine_start: Option<bool>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// One data file listed in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub rows: u64,
    pub blake3: String,
}

/// The whole of trace.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u64,
    pub deployment: Deployment,
    #[serde(default, deserialize_with = "null_as_default")]
    pub capture: Capture,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<Vec<FileEntry>>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Manifest {
    pub fn new(deployment: Deployment, capture: Capture) -> Self {
        Manifest {
            format: FORMAT_NAME.to_string(),
            version: FORMAT_VERSION,
            deployment,
            capture,
            files: None,
            extra: Default::default(),
        }
    }

    /// Reads and checks `<dir>/trace.json`: a regular file inside the trace
    /// (not a link out of it, never a FIFO) of at most [`MAX_MANIFEST_BYTES`].
    pub fn load(dir: &Path) -> Result<Manifest> {
        let path = dir.join("trace.json");
        if files::is_remote(dir) {
            // Lists the trace (once), so its objects are known.
            files::root(dir)?;
        }
        if !files::exists(&path)? {
            return Err(Error::invalid(
                Location::file(&path),
                "trace.json is missing",
                "a trace is a directory with trace.json, requests/ and kv/; point kvtrail at the trace directory",
            ));
        }
        files::inside(&files::root(dir)?, &path)?;
        let bytes = files::read_limited(&path, MAX_MANIFEST_BYTES, "trace.json")?;
        Self::parse(&text(bytes, &path)?, &path)
    }

    /// Parses manifest text; `path` is used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<Manifest> {
        Self::from_value(
            json(
                text,
                path,
                "trace.json must be a UTF-8 JSON object (see docs/trace-format.md)",
            )?,
            path,
        )
    }

    /// Checks a parsed trace.json: format and version, shape, deployment,
    /// `files` paths.
    fn from_value(value: serde_json::Value, path: &Path) -> Result<Manifest> {
        // Check format and version before the full shape, so an unknown
        // version gets the right message even if other keys changed too.
        match value.get("format").and_then(|v| v.as_str()) {
            Some(FORMAT_NAME) => {}
            other => {
                return Err(Error::invalid(
                    Location::file(path).column("format"),
                    format!("format is {other:?}, expected \"{FORMAT_NAME}\""),
                    "this is not a kvtrail trace manifest",
                ));
            }
        }
        match value.get("version").and_then(|v| v.as_u64()) {
            Some(FORMAT_VERSION) => {}
            other => {
                return Err(Error::invalid(
                    Location::file(path).column("version"),
                    format!(
                        "unknown trace format version {}",
                        other.map(|v| v.to_string()).unwrap_or_else(|| {
                            value
                                .get("version")
                                .map(|v| v.to_string())
                                .unwrap_or("(missing)".into())
                        })
                    ),
                    format!(
                        "this kvtrail reads version {FORMAT_VERSION}; use a kvtrail release that knows this version"
                    ),
                ));
            }
        }
        check_nulls(&value, path)?;
        if let Some(dep) = value.get("deployment") {
            check_enums(dep, path, "deployment.")?;
        }
        let mut m: Manifest = serde_json::from_value(value).map_err(|e| {
            Error::invalid(
                Location::file(path),
                format!("trace.json does not match the v1 manifest: {e}"),
                "see docs/trace-format.md for the required keys",
            )
        })?;
        m.deployment.validate(path)?;
        // `files` paths are relative to the trace root with `/`; writers
        // also spell them `./kv/...` or with Windows separators.
        for (i, f) in m.files.iter_mut().flatten().enumerate() {
            let raw = f.path.clone();
            f.path = normalize_rel(&raw);
            // A listed file lies inside the trace: `verify` must never be
            // led to read (and hash) files elsewhere.
            let outside = raw.starts_with(['/', '\\'])
                || raw.as_bytes().get(1) == Some(&b':')
                || f.path.split('/').any(|c| c == "..")
                || f.path.is_empty();
            if outside {
                return Err(Error::invalid(
                    Location::file(path),
                    format!("files[{i}].path {raw:?} does not name a file inside the trace"),
                    "list data files relative to the trace folder, e.g. kv/pool=0/part-00000.parquet",
                ));
            }
        }
        Ok(m)
    }

    /// Writes trace.json atomically (temp file + rename).
    pub fn store(&self, dir: &Path) -> Result<()> {
        let path = dir.join("trace.json");
        let tmp = dir.join(".trace.json.tmp");
        let mut text = serde_json::to_string_pretty(self).expect("manifest serializes");
        text.push('\n');
        std::fs::write(&tmp, text).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        Ok(())
    }

    /// Whether a slot never written in the trace is known to be blank.
    pub fn from_engine_start(&self) -> bool {
        self.capture.from_engine_start == Some(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_req_input_len_of_the_incident_and_at_the_edges() {
        for (ctx, pool, want) in [
            (1_048_576, 681_280, 681_274),
            (1_048_576, 2_097_152, 1_048_570),
            (1024, 64, 58),
            (2000, 1000, 994),
            (6, 1_000, 0),
            (1_000, 1, 0),
            (0, 0, 0),
            (u64::MAX, u64::MAX, u64::MAX - 6),
        ] {
            assert_eq!(max_req_input_len(ctx, pool), want, "{ctx} {pool}");
        }
        let pool = Pool {
            id: 0,
            name: String::new(),
            role: Role::Prefill,
            capacity_tokens: 681_280,
            page_size: 1,
            extra: Default::default(),
        };
        assert_eq!(pool.max_req_input_len(1_048_576), 681_274);
        // The engine decides the rule: vLLM refuses at max_model_len.
        let mut d = Deployment {
            name: String::new(),
            engine: "sglang-0.5.19".into(),
            context_window: 4096,
            pools: vec![pool.clone()],
            prefix_cache_scope: None,
            extra: Default::default(),
        };
        assert_eq!(d.prompt_limit(&pool), 4090);
        d.engine = "vllm-0.33.0".into();
        assert_eq!(d.prompt_limit(&pool), 4096);
        d.context_window = 1 << 40;
        assert_eq!(d.prompt_limit(&pool), 681_280);
    }
}
