//! The merge-validity rule of `fleet spark`: shards read on the executors
//! (later, perhaps from another copy at the same path) must have read the
//! trace the driver planned from, or their merge would be another trace's
//! answer. `TraceView` is what the driver saw when it planned (the blake3
//! of trace.json and the data files present); `check` refuses shards whose
//! evidence.json records another trace.json or other data files.

use std::collections::BTreeSet;
use std::path::Path;

use super::{FleetError, Result};
use crate::custody;
use crate::text::term;

/// What the driver saw of the trace when it planned the shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceView {
    trace_json: String,
    files: BTreeSet<String>,
}

impl TraceView {
    /// The view of `trace` now: trace.json's digest, the data files listed.
    pub fn of(trace: &Path) -> Result<TraceView> {
        let t = crate::trace::read::Trace::open(trace)?;
        let (trace_json, _) = t.root.hash(&t.dir.join("trace.json"))?;
        let mut files = BTreeSet::new();
        for sub in ["requests", "kv"] {
            let mut walk = t.root.walk(&t.dir.join(sub));
            if !walk.refused.is_empty() {
                return Err(walk.refused.swap_remove(0).into());
            }
            for p in walk.data_files() {
                let rel = p
                    .strip_prefix(&t.dir)
                    .map(|r| r.to_string_lossy().replace('\\', "/"))
                    .unwrap_or_else(|_| p.display().to_string());
                files.insert(rel);
            }
        }
        Ok(TraceView { trace_json, files })
    }

    /// Refuses shards whose evidence records (`read`: the trace inputs of
    /// a shard's evidence.json) another trace.json, or other data files,
    /// than this view.
    pub fn check(&self, trace: &Path, read: &custody::Inputs) -> Result<()> {
        let json = read.files.iter().find(|f| f.path == "trace.json");
        let data: BTreeSet<String> = read
            .files
            .iter()
            .filter(|f| f.path != "trace.json")
            .map(|f| f.path.clone())
            .collect();
        let what = if json.is_none_or(|f| !f.blake3.eq_ignore_ascii_case(&self.trace_json)) {
            "trace.json".to_string()
        } else if data != self.files {
            let differs = data
                .symmetric_difference(&self.files)
                .next()
                .cloned()
                .unwrap_or_default();
            format!("the data files ({differs})")
        } else {
            return Ok(());
        };
        Err(FleetError::failed(
            format!(
                "{}: the shards read other {what} than this command planned from: the trace changed while the job ran, or the executors see another copy at this path; nothing was merged",
                term(&trace.display().to_string())
            ),
            "do not modify a trace while kvtrail reads it (upload a changed trace to a new prefix), give the executors the same trace (an object-store URL, or a shared folder), then run kvtrail again",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1")
    }

    #[test]
    fn shards_of_the_planned_trace_pass_and_of_another_are_refused() {
        let view = TraceView::of(&golden()).unwrap();
        let read =
            custody::trace_inputs(&crate::trace::read::Trace::open(&golden()).unwrap()).unwrap();
        view.check(&golden(), &read).unwrap();

        let mut other = read.clone();
        let json = other
            .files
            .iter_mut()
            .find(|f| f.path == "trace.json")
            .unwrap();
        json.blake3 = "00".repeat(32);
        let e = view.check(&golden(), &other).unwrap_err().to_string();
        assert!(e.contains("the shards read other trace.json"), "{e}");
        assert!(e.contains("nothing was merged\n  hint: "), "{e}");

        let mut fewer = read.clone();
        let i = fewer
            .files
            .iter()
            .position(|f| f.path != "trace.json")
            .unwrap();
        let gone = fewer.files.remove(i).path;
        let e = view.check(&golden(), &fewer).unwrap_err().to_string();
        assert!(e.contains(&format!("other the data files ({gone})")), "{e}");

        let mut none = read;
        none.files.retain(|f| f.path != "trace.json");
        let e = view.check(&golden(), &none).unwrap_err().to_string();
        assert!(e.contains("other trace.json"), "{e}");
    }
}
