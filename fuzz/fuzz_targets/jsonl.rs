//! Fuzz target `jsonl`: `kvtrail ingest`'s JSON-lines parser (`capture::jsonl::parse_line`).
#![no_main]

#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::jsonl(data));
