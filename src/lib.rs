//! kvtrail: record-and-replay forensics for KV-cache isolation failures in
//! LLM serving engines.
//!
//! Data flows one way: capture (engine hooks, simulator, JSONL import) →
//! `schema` → `trace` → `lineage` → `scope` → `report`; the binary's `cli`
//! sits on top and nothing depends on it. See ARCHITECTURE.md.

pub mod audit;
pub mod capture;
pub mod custody;
pub mod engines;
pub mod error;
pub mod fleet;
pub mod inspect;
pub mod lineage;
pub mod lookup;
pub mod notify;
pub mod progress;
pub mod record;
pub mod report;
pub mod schema;
pub mod scope;
pub mod sim;
pub mod spill;
pub mod sql;
pub mod text;
pub mod trace;
pub mod whatif;
pub mod words;

pub use error::{Error, Result};
