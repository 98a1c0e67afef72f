//! Event and request types, the two Arrow schemas and the format version.
//!
//! This module is pure data: no IO. It is the in-memory face of
//! `docs/trace-format.md` (trace format v1); `trace` maps it to Parquet.

use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema, SchemaRef};

/// Value of `format` in trace.json.
pub const FORMAT_NAME: &str = "kvtrail-trace";
/// The trace format version this build writes and reads.
pub const FORMAT_VERSION: u64 = 1;
/// request_id 0 is the engine itself.
pub const ENGINE_REQUEST: u64 = 0;

/// What happened to an extent of KV slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Op {
    Alloc = 0,
    Write = 1,
    Read = 2,
    Free = 3,
    Share = 4,
    Scrub = 5,
}

impl Op {
    pub const ALL: [Op; 6] = [
        Op::Alloc,
        Op::Write,
        Op::Read,
        Op::Free,
        Op::Share,
        Op::Scrub,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Alloc => "alloc",
            Op::Write => "write",
            Op::Read => "read",
            Op::Free => "free",
            Op::Share => "share",
            Op::Scrub => "scrub",
        }
    }

    /// Parses the exact lower-case op names of the contract.
    pub fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "alloc" => Op::Alloc,
            "write" => Op::Write,
            "read" => Op::Read,
            "free" => Op::Free,
            "share" => Op::Share,
            "scrub" => Op::Scrub,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The source of a copy (`write` with src): `src_pool`'s slots starting at
/// `slot_start`, as they were just after event `seq` of that pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopySrc {
    pub pool: u16,
    pub slot_start: u32,
    pub seq: u64,
}

/// One row of the kv table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvEvent {
    pub pool: u16,
    pub seq: u64,
    pub ts_ns: i64,
    pub request_id: u64,
    pub op: Op,
    pub slot_start: u32,
    pub slot_count: u32,
    pub token_pos: Option<u32>,
    pub src: Option<CopySrc>,
}

impl KvEvent {
    /// The event a KV line without `seq` or a copy gives: seq 0 until the
    /// recorder assigns the pool's next, no source.
    pub fn unsequenced(
        pool: u16,
        ts_ns: i64,
        request_id: u64,
        op: Op,
        slot_start: u32,
        slot_count: u32,
        token_pos: Option<u32>,
    ) -> KvEvent {
        KvEvent {
            pool,
            seq: 0,
            ts_ns,
            request_id,
            op,
            slot_start,
            slot_count,
            token_pos,
            src: None,
        }
    }

    /// One past the last slot of the extent.
    pub fn slot_end(&self) -> u64 {
        self.slot_start as u64 + self.slot_count as u64
    }
}

/// One row of the requests table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestRecord {
    pub request_id: u64,
    pub external_id: Option<String>,
    pub tenant: String,
    pub arrival_ns: i64,
    pub finish_ns: Option<i64>,
    pub prompt_tokens: u32,
    pub prefilled_tokens: Option<u32>,
    pub output_tokens: u32,
    pub http_status: u16,
    pub finish_reason: Option<String>,
    pub prefill_pool: Option<u16>,
    pub decode_pool: Option<u16>,
    pub prompt_hash: Option<[u8; 32]>,
    pub output_hash: Option<[u8; 32]>,
}

/// Column names of the kv table, in contract order.
pub mod kv_col {
    pub const POOL: &str = "pool";
    pub const SEQ: &str = "seq";
    pub const TS_NS: &str = "ts_ns";
    pub const REQUEST_ID: &str = "request_id";
    pub const OP: &str = "op";
    pub const SLOT_START: &str = "slot_start";
    pub const SLOT_COUNT: &str = "slot_count";
    pub const TOKEN_POS: &str = "token_pos";
    pub const SRC_POOL: &str = "src_pool";
    pub const SRC_SLOT_START: &str = "src_slot_start";
    pub const SRC_SEQ: &str = "src_seq";
}

/// Column names of the requests table, in contract order.
pub mod req_col {
    pub const REQUEST_ID: &str = "request_id";
    pub const EXTERNAL_ID: &str = "external_id";
    pub const TENANT: &str = "tenant";
    pub const ARRIVAL_NS: &str = "arrival_ns";
    pub const FINISH_NS: &str = "finish_ns";
    pub const PROMPT_TOKENS: &str = "prompt_tokens";
    pub const PREFILLED_TOKENS: &str = "prefilled_tokens";
    pub const OUTPUT_TOKENS: &str = "output_tokens";
    pub const HTTP_STATUS: &str = "http_status";
    pub const FINISH_REASON: &str = "finish_reason";
    pub const PREFILL_POOL: &str = "prefill_pool";
    pub const DECODE_POOL: &str = "decode_pool";
    pub const PROMPT_HASH: &str = "prompt_hash";
    pub const OUTPUT_HASH: &str = "output_hash";
}

/// Arrow schema of the kv table (v1).
pub fn kv_schema() -> SchemaRef {
    use kv_col::*;
    Arc::new(Schema::new(vec![
        Field::new(POOL, DataType::UInt16, false),
        Field::new(SEQ, DataType::UInt64, false),
        Field::new(TS_NS, DataType::Int64, false),
        Field::new(REQUEST_ID, DataType::UInt64, false),
        Field::new(OP, DataType::Utf8, false),
        Field::new(SLOT_START, DataType::UInt32, false),
        Field::new(SLOT_COUNT, DataType::UInt32, false),
        Field::new(TOKEN_POS, DataType::UInt32, true),
        Field::new(SRC_POOL, DataType::UInt16, true),
        Field::new(SRC_SLOT_START, DataType::UInt32, true),
        Field::new(SRC_SEQ, DataType::UInt64, true),
    ]))
}

/// Arrow schema of the requests table (v1).
pub fn requests_schema() -> SchemaRef {
    use req_col::*;
    Arc::new(Schema::new(vec![
        Field::new(REQUEST_ID, DataType::UInt64, false),
        Field::new(EXTERNAL_ID, DataType::Utf8, true),
        Field::new(TENANT, DataType::Utf8, false),
        Field::new(ARRIVAL_NS, DataType::Int64, false),
        Field::new(FINISH_NS, DataType::Int64, true),
        Field::new(PROMPT_TOKENS, DataType::UInt32, false),
        Field::new(PREFILLED_TOKENS, DataType::UInt32, true),
        Field::new(OUTPUT_TOKENS, DataType::UInt32, false),
        Field::new(HTTP_STATUS, DataType::UInt16, false),
        Field::new(FINISH_REASON, DataType::Utf8, true),
        Field::new(PREFILL_POOL, DataType::UInt16, true),
        Field::new(DECODE_POOL, DataType::UInt16, true),
        Field::new(PROMPT_HASH, DataType::FixedSizeBinary(32), true),
        Field::new(OUTPUT_HASH, DataType::FixedSizeBinary(32), true),
    ]))
}

/// blake3 of token ids, each as little-endian u32 (prompt_hash, output_hash).
pub fn hash_tokens(tokens: &[u32]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    *h.finalize().as_bytes()
}

/// Lower-case hex of a 32-byte digest.
pub fn hex32(b: &[u8; 32]) -> String {
    let mut s = String::with_capacity(64);
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// Parses 64 hex digits into a digest.
pub fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}
