//! Fuzz target `wire`: the record sidecar's wire parsers (`record::wire::parse_hello` / `parse_msg`).
#![no_main]

#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::wire(data));
