//! The trace on disk: manifest (trace.json), Parquet tables, digests.
//!
//! Only this module knows Parquet. Readers stream; writers rotate part files
//! and hash them as they write.

pub mod check;
pub mod chunked;
pub mod files;
mod guard;
mod hive;
pub mod manifest;
mod parquet_error;
pub mod read;
pub mod request_keys;
pub mod root;
pub mod sorted;
pub mod store;
pub mod verify;
pub mod write;

/// What every command says of a trace without KV events (`verify`,
/// `inspect`, `scope`'s coverage): it is no evidence.
pub const NO_KV_EVENTS: &str = "the trace holds no KV events: it records nothing of what any request read, so it is no evidence of exposure or of its absence (a hook that wrote nothing, or the wrong file, looks like this)";

pub use manifest::{Capture, Deployment, FileEntry, Manifest, Pool, Role};
pub use read::{KvChunk, KvFileReader, KvScanBatch, KvScanReader, RequestFileReader, Trace};
pub use request_keys::{RequestKeys, scan_request_rows, scan_requests};
pub use root::TraceRoot;
