//! `lookup` at scale: a scope folder of N requests (default 10 million)
//! built directly through the library (the golden v1 trace's findings,
//! then a synthetic requests.csv of N rows, its look-up index and
//! evidence.json), and in the same run one look-up through the index
//! against the same look-up answered by the scan of requests.csv (the
//! folder with its index set aside), as ratios. Each time is the median of
//! `--reps` look-ups (default 5) of different external ids, after a
//! warm-up that fills the page cache; the index's part (row groups plus
//! rows) is also timed alone, and the same look-ups with `--full-check`
//! (every file re-hashed first, as `ScopeFolder::open` does) against the
//! default, which checks the bytes it reads (chunk digests).
//!
//! Run: `cargo run --release --example bench_lookup -- [--requests N] [--reps R] [--dir DIR]`
//! (DIR: where the folder goes, default a temporary folder; about 160
//! bytes per request on disk).

use std::path::{Path, PathBuf};
use std::time::Instant;

use kvtrail::lineage::BackendChoice;
use kvtrail::lookup::{Query, lookup, lookup_checked};
use kvtrail::progress::NoReporter;
use kvtrail::report::lookup_files::{self, KeyKind, LOOKUP_INDEX, REQUESTS_CSV, REQUESTS_HEADER};
use kvtrail::scope::run::ScopeRun;

const TENANTS: [&str; 8] = [
    "acme-corp",
    "globex",
    "initech",
    "umbrella",
    "hooli",
    "stark",
    "wayne",
    "tyrell",
];

fn ext(i: u64) -> String {
    format!(
        "chatcmpl-{}",
        &blake3::hash(&i.to_le_bytes()).to_hex()[..24]
    )
}

/// VmHWM of this process in MiB (after `reset_peak`, the peak since then).
fn peak_mib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        / 1024
}

fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn build(dir: &Path, n: u64) {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1");
    let s = ScopeRun::open(&golden, BackendChoice::Cpu)
        .unwrap()
        .run(None, &NoReporter)
        .unwrap();
    kvtrail::report::write_out(&s.report, dir).unwrap();
    let cmd = ["kvtrail".to_string(), "scope".to_string()];
    kvtrail::report::bundle::write_scope_extras(&s.trace, &s.report, dir, &cmd).unwrap();
    std::fs::remove_file(dir.join(kvtrail::custody::EVIDENCE_JSON)).unwrap();
    // requests.csv of n rows, through the same CSV writer scope uses.
    let t0 = Instant::now();
    let f = std::fs::File::create(dir.join(REQUESTS_CSV)).unwrap();
    let mut w = kvtrail::report::csv::writer(std::io::BufWriter::new(f));
    w.write_record(REQUESTS_HEADER.split(',')).unwrap();
    for i in 0..n {
        let arrival = 1_788_220_800_000_000_000i64 + i as i64 * 1_000_000;
        w.write_record([
            i.to_string(),
            ext(i),
            TENANTS[(i % 8) as usize].to_string(),
            arrival.to_string(),
            (arrival + 2_000_000_000).to_string(),
            "200".into(),
            "812".into(),
            "812".into(),
            "64".into(),
            blake3::hash(&(i ^ 0x5555).to_le_bytes())
                .to_hex()
                .to_string(),
        ])
        .unwrap();
    }
    w.flush().unwrap();
    drop(w);
    let csv_s = t0.elapsed().as_secs_f64();
    reset_peak();
    let t0 = Instant::now();
    lookup_files::write_lookup_index(dir).unwrap();
    let ix_s = t0.elapsed().as_secs_f64();
    let ix_peak = peak_mib();
    kvtrail::custody::write_evidence(dir, "scope", &cmd, Vec::new()).unwrap();
    let mb = |p: &str| std::fs::metadata(dir.join(p)).unwrap().len() as f64 / 1e6;
    println!(
        "built {n} requests: requests.csv {:.0} MB in {csv_s:.1} s; index {:.0} MB in {ix_s:.1} s (peak RSS while building {ix_peak} MiB)",
        mb(REQUESTS_CSV),
        mb(LOOKUP_INDEX)
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut n = 10_000_000u64;
    let mut reps = 5usize;
    let mut dir: Option<PathBuf> = None;
    let mut a = std::env::args().skip(1);
    while let Some(x) = a.next() {
        match x.as_str() {
            "--requests" => n = a.next().unwrap().parse().unwrap(),
            "--reps" => reps = a.next().unwrap().parse().unwrap(),
            "--dir" => dir = Some(a.next().unwrap().into()),
            _ => panic!("usage: bench_lookup [--requests N] [--reps R] [--dir DIR]"),
        }
    }
    let tmp = tempfile::tempdir_in(dir.as_deref().unwrap_or(Path::new("."))).unwrap();
    let d = tmp.path().join("scope");
    build(&d, n);
    let ids: Vec<String> = (0..=reps as u64)
        .map(|k| ext(k * (n / (reps as u64 + 1)) + 7))
        .collect();

    // Through the index: the whole look-up, and the index's part alone.
    let mut whole = Vec::new();
    let mut part = Vec::new();
    let mut answers = Vec::new();
    let mut peak_index = 0;
    for (k, id) in ids.iter().enumerate() {
        reset_peak();
        let t0 = Instant::now();
        let a = lookup(&d, &Query::ExternalId(id.clone()), None).unwrap();
        let s = t0.elapsed().as_secs_f64();
        peak_index = peak_index.max(peak_mib());
        assert!(a.notes.is_empty(), "index not used: {:?}", a.notes);
        assert_eq!(a.matches.len(), 1);
        let f = kvtrail::report::folder::ScopeFolder::open(&d).unwrap();
        let ix = f.lookup_index().unwrap();
        let t0 = Instant::now();
        let offs = ix.candidates(KeyKind::ExternalId, id).unwrap();
        let mut rows = 0;
        ix.rows_at(&offs, |_| rows += 1).unwrap();
        let p = t0.elapsed().as_secs_f64();
        assert_eq!(rows, 1);
        if k > 0 {
            whole.push(s);
            part.push(p);
        }
        answers.push(a);
    }
    // The same look-ups after the whole check (`lookup --full-check`),
    // and the whole check alone.
    let mut full = Vec::new();
    for (k, id) in ids.iter().enumerate() {
        let t0 = Instant::now();
        let a = lookup_checked(&d, &Query::ExternalId(id.clone()), None, true).unwrap();
        let s = t0.elapsed().as_secs_f64();
        assert_eq!(a.evidence_check, "whole_folder");
        assert_eq!(a.matches, answers[k].matches, "{id}");
        if k > 0 {
            full.push(s);
        }
    }
    assert!(
        answers
            .iter()
            .all(|a| a.evidence_check == "bytes_read" && a.evidence_intact)
    );
    let mut check = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        kvtrail::report::folder::ScopeFolder::open(&d).unwrap();
        check.push(t0.elapsed().as_secs_f64());
    }
    // The scan: the same look-ups with the index set aside.
    let aside = tmp.path().join("index.aside");
    std::fs::rename(d.join(LOOKUP_INDEX), &aside).unwrap();
    let mut scan = Vec::new();
    let mut scan_part = Vec::new();
    let mut peak_scan = 0;
    for (k, id) in ids.iter().enumerate().take(3.min(ids.len())) {
        reset_peak();
        let t0 = Instant::now();
        let b = lookup(&d, &Query::ExternalId(id.clone()), None).unwrap();
        let s = t0.elapsed().as_secs_f64();
        peak_scan = peak_scan.max(peak_mib());
        assert!(!b.notes.is_empty());
        assert_eq!(b.matches, answers[k].matches, "{id}");
        assert_eq!(b.status, answers[k].status, "{id}");
        let t0 = Instant::now();
        let mut hit = 0;
        lookup_files::read_index(&d, |r| {
            hit += (r.external_id.as_deref() == Some(id.as_str())) as u32;
            true
        })
        .unwrap();
        let p = t0.elapsed().as_secs_f64();
        if k > 0 {
            scan.push(s);
            scan_part.push(p);
        }
    }
    std::fs::rename(&aside, d.join(LOOKUP_INDEX)).unwrap();
    let (w, p, c, fw) = (median(whole), median(part), median(check), median(full));
    let (sw, sp) = (median(scan), median(scan_part));
    println!(
        "{n} requests, medians of {reps} index look-ups, {} scans:",
        2
    );
    println!(
        "  lookup through the index:     {w:8.3} s (peak RSS {peak_index} MiB; bytes read checked)"
    );
    println!("    of which row groups + rows  {p:8.4} s");
    println!("  lookup --full-check:          {fw:8.3} s");
    println!("    of which the whole check    {c:8.3} s (every file re-hashed)");
    println!("  ratio full-check/default: {:.0}x", fw / w);
    println!("  lookup scanning requests.csv: {sw:8.3} s (peak RSS {peak_scan} MiB)");
    println!("    of which the scan           {sp:8.3} s");
    println!(
        "  ratio scan/index: whole look-up {:.1}x, finding the rows {:.0}x",
        sw / w,
        sp / p
    );
}
