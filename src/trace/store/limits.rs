//! The object-store client's limits: timeouts and retries from the
//! environment, the sizes kvtrail accepts, and the one runtime the
//! requests run on.

use std::sync::OnceLock;
use std::time::Duration;

use object_store::{ClientConfigKey, RetryConfig};

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

/// The most bytes of an answer kvtrail lets the object-store client hold
/// when it is not an object's bytes: a listing page (1,000 names of at most
/// 1,024 bytes, a few MB) or an error's text.
pub const MAX_ANSWER_BYTES: u64 = 32 << 20;
/// The most bytes of an error answer (its body is only read for a message).
pub(crate) const MAX_ERROR_ANSWER_BYTES: u64 = 64 << 10;

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

pub(crate) fn block_on<F: std::future::Future>(f: F) -> Result<F::Output> {
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
pub(crate) struct Limits {
    timeout: Duration,
    connect: Duration,
    retries: usize,
}

impl Limits {
    pub(crate) fn from_env() -> Result<Limits> {
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

    pub(crate) fn retry(&self) -> RetryConfig {
        RetryConfig {
            max_retries: self.retries,
            retry_timeout: self.timeout * (self.retries as u32 + 1),
            ..Default::default()
        }
    }

    pub(crate) fn client(&self) -> [(ClientConfigKey, String); 2] {
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

#[cfg(test)]
mod tests {
    use super::*;

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
