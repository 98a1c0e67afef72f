//! Fuzz target `trace`: a trace directory (trace.json + Parquet files, framed as in targets.rs) through verify, the readers, inspect and scope.
#![no_main]

#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::trace(data));
