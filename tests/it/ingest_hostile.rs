//! `kvtrail ingest` (the line parser the record sidecar shares) against
//! hostile input: every line it accepts gives a trace every reader opens,
//! duplicate keys, bytes that are not UTF-8, a byte-order mark, lines of
//! any length.

use std::io::Cursor;
use std::path::Path;

use kvtrail::capture::jsonl::{
    IngestOptions, IngestReport, MAX_LINE_BYTES, ingest, load_deployment,
};
use kvtrail::trace::Trace;

const REQ1: &str = r#"{"type":"request","request_id":1,"tenant":"acme","arrival_ns":1,"prompt_tokens":4,"output_tokens":1,"http_status":200}"#;
const KV1: &str = r#"{"type":"kv","pool":0,"ts_ns":2,"request_id":1,"op":"write","slot_start":0,"slot_count":4,"token_pos":0}"#;

fn run(input: &[u8], skip: bool) -> (tempfile::TempDir, kvtrail::Result<IngestReport>) {
    let dir = tempfile::tempdir().unwrap();
    let dep = load_deployment(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/jsonl/deploy.json"),
    )
    .unwrap();
    let out = dir.path().join("t");
    let r = ingest(
        Cursor::new(input.to_vec()),
        Path::new("in.jsonl"),
        dep,
        &out,
        IngestOptions {
            skip_bad_lines: skip,
            ..Default::default()
        },
    );
    (dir, r)
}

/// Every row of the trace, read back through the checking readers.
fn read_back(dir: &tempfile::TempDir) -> (Vec<kvtrail::schema::RequestRecord>, usize) {
    let t = Trace::open(&dir.path().join("t")).expect("the trace opens");
    let mut reqs = Vec::new();
    for b in t.requests() {
        reqs.extend(b.expect("every request row reads"));
    }
    let mut kv = 0;
    for c in t.kv_chunks() {
        kv += c.expect("every kv row reads").events.len();
    }
    (reqs, kv)
}

fn lines(ls: &[&str]) -> Vec<u8> {
    let mut s = ls.join("\n");
    s.push('\n');
    s.into_bytes()
}

#[test]
fn ingest_refuses_reserved_request_ids_and_seqs_the_readers_refuse() {
    let reserved = [
        r#"{"type":"request","request_id":18446744073709551614,"tenant":"x","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}"#,
        r#"{"type":"request","request_id":18446744073709551615,"tenant":"x","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}"#,
        r#"{"type":"kv","pool":0,"ts_ns":2,"request_id":18446744073709551614,"op":"read","slot_start":0,"slot_count":4}"#,
        r#"{"type":"kv","pool":0,"ts_ns":2,"request_id":18446744073709551615,"op":"read","slot_start":0,"slot_count":4,"token_pos":0}"#,
        r#"{"type":"kv","pool":1,"seq":18446744073709551615,"ts_ns":2,"request_id":1,"op":"read","slot_start":0,"slot_count":4}"#,
        r#"{"type":"kv","pool":1,"ts_ns":2,"request_id":1,"op":"write","slot_start":0,"slot_count":4,"src_pool":0,"src_slot_start":0,"src_seq":18446744073709551615}"#,
    ];
    for bad in reserved {
        // Without --skip-bad-lines: an error naming the line.
        let (_d, r) = run(&lines(&[REQ1, KV1, bad]), false);
        let e = r.expect_err(bad).to_string();
        assert!(e.contains("in.jsonl:3"), "{e}");
        assert!(e.contains("reserve"), "{e}");
        // With it: skipped, counted, and the trace reads.
        let (d, r) = run(&lines(&[REQ1, KV1, bad]), true);
        let r = r.expect(bad);
        assert_eq!(r.skipped_lines, 1, "{bad}");
        assert!(!r.complete);
        let (reqs, kv) = read_back(&d);
        assert_eq!((reqs.len(), kv), (1, 1), "{bad}");
    }
}

#[test]
fn ingest_refuses_duplicate_keys() {
    for (bad, key) in [
        (
            r#"{"type":"request","request_id":5,"tenant":"acme","tenant":"globex","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200}"#,
            "tenant",
        ),
        (
            r#"{"type":"request","type":"kv","pool":0,"ts_ns":2,"request_id":1,"op":"read","slot_start":0,"slot_count":4}"#,
            "type",
        ),
        (
            r#"{"type":"kv","pool":0,"ts_ns":2,"request_id":1,"op":"read","slot_start":0,"slot_count":4,"x_a":1,"x_a":2}"#,
            "x_a",
        ),
    ] {
        let (_d, r) = run(&lines(&[REQ1, bad]), false);
        let e = r.expect_err(bad).to_string();
        assert!(e.contains("in.jsonl:2"), "{e}");
        assert!(
            e.contains(&format!("`{key}`")) && e.contains("duplicate"),
            "{e}"
        );
        let (d, r) = run(&lines(&[REQ1, bad]), true);
        assert_eq!(r.unwrap().skipped_lines, 1);
        let (reqs, _) = read_back(&d);
        assert_eq!(reqs.len(), 1);
        assert_eq!(reqs[0].tenant, "acme");
    }
}

#[test]
fn ingest_invalid_utf8_names_the_line_and_is_skippable() {
    let bad = b"{\"type\":\"request\",\"request_id\":9,\"tenant\":\"a\xff\",\"arrival_ns\":1,\"prompt_tokens\":1,\"output_tokens\":1,\"http_status\":200}";
    let mut input = lines(&[REQ1]);
    input.extend_from_slice(bad);
    input.push(b'\n');
    input.extend_from_slice(&lines(&[KV1]));
    let (_d, r) = run(&input, false);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("in.jsonl:2"), "{e}");
    assert!(e.contains("UTF-8"), "{e}");
    assert_eq!(e.matches("UTF-8").count(), 1, "said once: {e}");
    let (d, r) = run(&input, true);
    let r = r.unwrap();
    assert_eq!((r.skipped_lines, r.requests, r.kv_events), (1, 1, 1));
    assert_eq!(read_back(&d).0.len(), 1);
}

#[test]
fn ingest_tolerates_a_bom_before_line_1_only() {
    let mut input = b"\xef\xbb\xbf".to_vec();
    input.extend_from_slice(&lines(&[REQ1, KV1]));
    let (d, r) = run(&input, false);
    let r = r.expect("a BOM before line 1 is tolerated");
    assert!(r.complete);
    assert_eq!((r.requests, r.kv_events), (1, 1));
    assert_eq!(read_back(&d).0.len(), 1);
    // Anywhere else it is a bad line.
    let mut input = lines(&[REQ1]);
    input.extend_from_slice(b"\xef\xbb\xbf");
    input.extend_from_slice(&lines(&[KV1]));
    let (_d, r) = run(&input, false);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("in.jsonl:2"), "{e}");
}

#[test]
fn ingest_line_longer_than_the_limit_is_a_bad_line() {
    let long = format!(
        r#"{{"type":"request","request_id":7,"tenant":"a","arrival_ns":1,"prompt_tokens":1,"output_tokens":1,"http_status":200,"x_pad":"{}"}}"#,
        "p".repeat(MAX_LINE_BYTES)
    );
    let input = lines(&[REQ1, &long, KV1]);
    let (_d, r) = run(&input, false);
    let e = r.unwrap_err().to_string();
    assert!(e.contains("in.jsonl:2"), "{e}");
    assert!(e.contains(&MAX_LINE_BYTES.to_string()), "{e}");
    let (d, r) = run(&input, true);
    let r = r.unwrap();
    assert_eq!((r.skipped_lines, r.requests, r.kv_events), (1, 1, 1));
    assert_eq!(read_back(&d).0.len(), 1);
    // A line of exactly the limit (newline not counted) is read.
    let pad = MAX_LINE_BYTES - (REQ1.len() - 1 + r#","x_pad":"""#.len() + 1);
    let exact = format!(
        r#"{},"x_pad":"{}"}}"#,
        &REQ1[..REQ1.len() - 1],
        "p".repeat(pad)
    );
    assert_eq!(exact.len(), MAX_LINE_BYTES);
    let (_d, r) = run(&lines(&[&exact, KV1]), false);
    assert_eq!(r.unwrap().requests, 1);
    // An unterminated last line over the limit too.
    let mut input = lines(&[REQ1]);
    input.extend_from_slice(long.as_bytes());
    let (_d, r) = run(&input, true);
    assert_eq!(r.unwrap().skipped_lines, 1);
}
