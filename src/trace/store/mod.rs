//! A trace in object storage (`s3://`, `gs://`, `az://`, `http(s)://`),
//! read with ranged GETs through the `object_store` crate.
//!
//! A remote trace is named by its URL, and its files by the URL joined
//! with their path in the trace (`s3://bucket/t/kv/pool=0/part-00000.parquet`),
//! kept in the same `PathBuf`s as local paths. Whether a trace is local or
//! remote is decided once, when it is opened ([`crate::trace::TraceRoot`]);
//! the root then hands back a [`Source`] for each file, which the Parquet
//! reader, the digests and trace.json read alike.
//!
//! - [`remote`]: the objects of a remote trace, listed once when it is
//!   opened ([`Remote::open`]).
//! - [`object`]: one object opened for reading. Every later read of an
//!   object asks for the ETag (or version) the listing saw (`If-Match`)
//!   and compares the answer's, so an object replaced between listing and
//!   reading is an error naming it, never a mix of two uploads. A store
//!   may ignore `If-Match`, so the first read of a pinned object goes front
//!   to back and keeps the blake3 of each block (`Remote::seal`); every
//!   later read asks for whole blocks and checks them, so the bytes
//!   replayed are the bytes hashed. An object listed without an ETag or
//!   version (a bare static server) is read once into a temporary file,
//!   hashed on the way, and served from there (`Remote::spool`).
//! - [`source`]: a file opened for reading, local or remote.
//! - [`client`]: the store per scheme, every answer it holds bounded.
//! - [`errors`]: failed requests as kvtrail errors.
//! - [`limits`]: sizes, timeouts and retries, and the runtime.
//!
//! Memory stays bounded per open file: ranged reads go through a small
//! block cache ([`CACHE_BLOCKS`] blocks of [`BLOCK_BYTES`]); a digest reads
//! the object front to back in [`STREAM_BYTES`] ranges. The requests run on
//! one current-thread tokio runtime owned here; the rest of kvtrail stays
//! synchronous. Credentials come from the environment and the platforms'
//! usual files, never from flags (docs/object-storage.md).

pub mod client;
pub mod errors;
pub mod limits;
pub mod object;
pub mod remote;
pub mod source;

pub use limits::{
    BLOCK_BYTES, CACHE_BLOCKS, DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_RETRIES, DEFAULT_TIMEOUT_S,
    MAX_ANSWER_BYTES, MAX_EMPTY_PAGES, MAX_LIST_PAGES, MAX_LISTING_BYTES, MAX_NAME_BYTES,
    MAX_OBJECT_BYTES, MAX_OBJECTS, MAX_URL_BYTES, SCHEMES, STREAM_BYTES,
};
pub use object::{RangeReader, RemoteFile};
pub use remote::Remote;
pub use source::{Source, SourceRead};
