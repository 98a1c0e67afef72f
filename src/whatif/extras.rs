//! trace.json's `deployment` extras (the keys the trace contract leaves
//! to the engine), read strictly: a key that is present but cannot be read
//! is an error naming it, never "the deployment does not say". `VllmView`
//! is a vLLM deployment's P/D settings (`kv_load_failure_policy`,
//! `kv_lease_duration`, top level or nested as vLLM's own config has
//! them): replay builds the recorded deployment's config from it
//! (`workload::recorded_config`) and audit checks it (`audit_vllm`);
//! `boolean`, `shown` and `unreadable` are audit's readers of the other
//! keys.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::{Error, Location, Result};

/// A vLLM deployment's P/D settings as audit and replay read them; None
/// where the source does not say.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VllmView {
    /// `fail` or `recompute`.
    pub kv_load_failure_policy: Option<String>,
    /// Seconds.
    pub kv_lease_duration: Option<i64>,
    /// Decode's heartbeats reach the producer (false: the simulator's
    /// `bug_lease_expiry`).
    pub heartbeats: Option<bool>,
    /// The slowest transfer the deployment expects, milliseconds (the
    /// simulator's timing model; None for a recorded deployment).
    pub slowest_transfer_ms: Option<u64>,
    /// The simulator's `reference_check` mitigation.
    pub reference_check: Option<bool>,
}

/// A short JSON rendering of a value for messages.
pub fn shown(v: &Value) -> String {
    let s = serde_json::to_string(v).unwrap_or_default();
    if s.chars().count() > 40 {
        format!("{}...", s.chars().take(40).collect::<String>())
    } else {
        s
    }
}

/// A key that is present but cannot be read: an error naming it, never
/// "the deployment does not say".
pub fn unreadable(loc: &Location, key: &str, v: &Value, want: &str) -> Error {
    Error::invalid(
        loc.clone().column(key),
        format!("`{key}` is {}, which is not {want}", shown(v)),
        format!("write {key} as {want}, or leave the key out when the deployment does not say"),
    )
}

/// An object-valued key (absent: None).
fn object<'a>(
    v: Option<&'a Value>,
    loc: &Location,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>> {
    match v {
        None => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o)),
        Some(v) => Err(unreadable(loc, key, v, "an object")),
    }
}

/// A boolean key (absent: None; null, strings and numbers are errors).
pub fn boolean(v: Option<&Value>, loc: &Location, key: &str) -> Result<Option<bool>> {
    match v {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(unreadable(loc, key, v, "true or false")),
    }
}

/// A whole number of seconds (absent: None; a string, a fraction, a
/// boolean or a number outside i64 is an error).
fn whole_seconds(v: Option<&Value>, loc: &Location, key: &str) -> Result<Option<i64>> {
    match v {
        None => Ok(None),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => match n.as_i64() {
            Some(i) => Ok(Some(i)),
            None => Err(unreadable(
                loc,
                key,
                v.expect("present"),
                "a whole number of seconds within range",
            )),
        },
        Some(v) => Err(unreadable(
            loc,
            key,
            v,
            "a whole number of seconds (an integer, e.g. 30)",
        )),
    }
}

/// A string key (absent: None).
fn string(v: Option<&Value>, loc: &Location, key: &str) -> Result<Option<String>> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(unreadable(loc, key, v, "a string")),
    }
}

/// One setting written in two places (top level and vLLM's nesting): the
/// one given, or an error when both are given and disagree.
fn one_of<T: PartialEq>(
    loc: &Location,
    a: (&str, Option<T>),
    b: (&str, Option<T>),
) -> Result<Option<T>> {
    match (a.1, b.1) {
        (Some(x), Some(y)) if x != y => Err(Error::invalid(
            loc.clone().column(a.0),
            format!("`{}` and `{}` disagree", a.0, b.0),
            "write the setting once (vLLM reads kv_transfer_config), or give both the same value",
        )),
        (Some(x), _) => Ok(Some(x)),
        (None, y) => Ok(y),
    }
}

impl VllmView {
    /// Reads vLLM's keys from a manifest's `deployment` extras: top level
    /// (`kv_load_failure_policy`, `kv_lease_duration`) or nested as vLLM's
    /// own config has them (`kv_transfer_config.kv_load_failure_policy`,
    /// `kv_transfer_config.kv_connector_extra_config.kv_lease_duration`).
    /// A key that is present but cannot be read is an error naming it
    /// (`loc` is the manifest), never "the deployment does not say".
    pub fn from_extra(extra: &Map<String, Value>, loc: &Location) -> Result<VllmView> {
        const KTC: &str = "deployment.kv_transfer_config";
        const KCE: &str = "deployment.kv_transfer_config.kv_connector_extra_config";
        let ktc = object(extra.get("kv_transfer_config"), loc, KTC)?;
        let kce = object(
            ktc.and_then(|k| k.get("kv_connector_extra_config")),
            loc,
            KCE,
        )?;
        let policy = one_of(
            loc,
            (
                "deployment.kv_load_failure_policy",
                string(
                    extra.get("kv_load_failure_policy"),
                    loc,
                    "deployment.kv_load_failure_policy",
                )?,
            ),
            (
                "deployment.kv_transfer_config.kv_load_failure_policy",
                string(
                    ktc.and_then(|k| k.get("kv_load_failure_policy")),
                    loc,
                    "deployment.kv_transfer_config.kv_load_failure_policy",
                )?,
            ),
        )?;
        let lease = one_of(
            loc,
            (
                "deployment.kv_lease_duration",
                whole_seconds(
                    extra.get("kv_lease_duration"),
                    loc,
                    "deployment.kv_lease_duration",
                )?,
            ),
            (
                "deployment.kv_transfer_config.kv_connector_extra_config.kv_lease_duration",
                whole_seconds(
                    kce.and_then(|k| k.get("kv_lease_duration")),
                    loc,
                    "deployment.kv_transfer_config.kv_connector_extra_config.kv_lease_duration",
                )?,
            ),
        )?;
        Ok(VllmView {
            kv_load_failure_policy: policy,
            kv_lease_duration: lease,
            heartbeats: None,
            slowest_transfer_ms: None,
            reference_check: None,
        })
    }
}
