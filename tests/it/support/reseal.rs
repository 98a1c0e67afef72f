//! Sealing edited files again, as someone who edits a trace or an output
//! folder by hand and covers their tracks would: the digests then match,
//! and only the content checks remain.

use std::path::Path;

/// Rewrites trace.json's `files` from what is on disk (paths, rows,
/// digests), so `verify` judges the content, not a stale digest.
pub fn reseal_trace(t: &Path) {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let mut files = Vec::new();
    for sub in ["requests", "kv"] {
        let mut stack = vec![t.join(sub)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "parquet") {
                    let bytes = std::fs::read(&p).unwrap();
                    let r = SerializedFileReader::new(std::fs::File::open(&p).unwrap()).unwrap();
                    files.push(serde_json::json!({
                        "path": p.strip_prefix(t).unwrap().to_str().unwrap(),
                        "rows": r.metadata().file_metadata().num_rows(),
                        "blake3": blake3::hash(&bytes).to_hex().to_string(),
                    }));
                }
            }
        }
    }
    let p = t.join("trace.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    m["files"] = serde_json::Value::Array(files);
    std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

/// Like [`reseal_trace`] for files whose footer cannot be read: the listed
/// files' digests are recomputed, paths and row counts kept.
pub fn reseal_trace_digests(t: &Path) {
    let p = t.join("trace.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    for f in m["files"].as_array_mut().unwrap() {
        let bytes = std::fs::read(t.join(f["path"].as_str().unwrap())).unwrap();
        f["blake3"] = blake3::hash(&bytes).to_hex().to_string().into();
    }
    std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

/// Rewrites a folder's evidence.json over its edited outputs, as someone
/// who edits a folder by hand and covers their tracks would: the chain of
/// custody then holds, and only the content checks remain.
pub fn reseal_evidence(dir: &Path) {
    let p = dir.join("evidence.json");
    let mut ev: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    for f in ev["outputs"].as_array_mut().unwrap() {
        let bytes = std::fs::read(dir.join(f["path"].as_str().unwrap())).unwrap();
        f["blake3"] = blake3::hash(&bytes).to_hex().to_string().into();
        f["bytes"] = (bytes.len() as u64).into();
    }
    std::fs::write(&p, serde_json::to_string_pretty(&ev).unwrap()).unwrap();
}
