//! Streaming readers for the requests and kv tables.
//!
//! Files are found at any depth under `requests/` and `kv/` (Hive folders
//! included), read batch by batch (never a whole trace at once), with any
//! compression, plain or dictionary strings and extra columns ignored. Every
//! row is checked against the contract; a violation is an error naming the
//! file, the row (0-based within the file) and the column. Integer
//! columns are taken at any width that fits; strings plain, large, view
//! or dictionary; one batch of [`READ_BATCH_ROWS`] rows per open file.
//!
//! - [`open`]: a trace opened ([`Trace`]): its root, trace.json, the data
//!   files found.
//! - [`parquet_file`]: a data file opened within the limits, projected, walked.
//! - [`column`]: typed, checked extraction of one column.
//! - [`kv`], [`requests`], [`kv_scan`]: the readers of the tables.
//! - [`values`]: the limits on request ids and seqs.

pub mod column;
pub mod kv;
pub mod kv_scan;
pub mod open;
pub mod parquet_file;
pub mod requests;
pub mod values;

pub use kv::{KvChunk, KvFileReader};
pub use kv_scan::{KvScanBatch, KvScanReader};
pub use open::{Trace, list_parquet, rel_path};
pub use parquet_file::{MAX_FOOTER_BYTES, MAX_ROW_GROUPS, READ_BATCH_ROWS, footer_rows};
pub use requests::{RequestFileReader, RequestRows};
pub use values::{
    Capacities, Extent, MAX_REQUEST_ID, MAX_SEQ, SAME_POOL_COPY_HINT, check_extent,
    check_request_id, check_same_pool_copy, check_seq,
};
