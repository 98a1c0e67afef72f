//! The trace on disk: manifest (trace.json), Parquet tables, digests.
//!
//! Only this module knows Parquet. Readers stream; writers rotate part files
//! and hash them as they write.

pub mod check;
pub mod chunked;
pub mod files;
mod guard;
mod hive;
pub mod index;
pub mod manifest;
pub mod read;
pub mod sorted;
pub mod store;
pub mod verify;
pub mod write;

pub use index::{RequestKeys, scan_requests};
pub use manifest::{Capture, Deployment, FileEntry, Manifest, Pool, Role};
pub use read::{KvChunk, KvFileReader, KvIndexBatch, KvIndexReader, RequestFileReader, Trace};
