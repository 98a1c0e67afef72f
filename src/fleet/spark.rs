//! `fleet spark` end to end, in two steps so that the caller can say what
//! was planned before the job runs: `Spark::prepare` checks the arguments
//! and the output folders and plans the shards here, natively (a trace
//! that cannot be read or replayed is refused before Spark starts);
//! `Prepared::run` submits the job (`submit`), collects its shards
//! (`collect`), checks that they read the planned trace (`view`) and merges
//! them (`scope::merge`) into the single-run folder `out`. The shard
//! folders go to `OUT.shards/` (the merged evidence.json cites them). Both
//! folders are put in place whole (`report::writer::write_atomically`): on
//! any failure, or a stop, neither is left.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::collect::{self, JobResult};
use super::plan::{JobPlan, plan};
use super::submit::{JobFiles, Submit};
use super::view::TraceView;
use super::{FleetError, Result};
use crate::custody::keys::SigningKey;
use crate::custody::statement::{self, Predicate};
use crate::error::Error;
use crate::lineage::BackendChoice;
use crate::lineage::shard::ShardGroup;
use crate::report::writer::{
    Signing, Written, one_line, write_atomically, write_merged_folder_signed,
};
use crate::scope::ScopeReport;
use crate::scope::merge::merge;
use crate::scope::shard::load_shards;

/// What `fleet spark` is asked to do.
#[derive(Debug, Clone)]
pub struct Spark {
    /// Trace URL, or a folder every executor sees at this path.
    pub trace: PathBuf,
    /// The merged scope folder (new or empty); shards go to `OUT.shards`.
    pub out: PathBuf,
    pub submit: Submit,
    /// The kvtrail binary shipped to the executors (`None`: this one).
    pub binary: Option<PathBuf>,
    pub backend: BackendChoice,
    /// `--signing-key`: every shard folder (once it came back, before it is
    /// put in place) and the merged folder get a signed statement. The key
    /// stays with the driver: executors never see it.
    pub signing_key: Option<Arc<SigningKey>>,
}

/// A run checked and planned, ready to submit.
#[derive(Debug)]
pub struct Prepared {
    spark: Spark,
    shards_dir: PathBuf,
    parent: PathBuf,
    binary: PathBuf,
    planned: TraceView,
    /// The shards, as planned.
    pub shards: Vec<ShardGroup>,
}

/// What a run made.
#[derive(Debug)]
pub struct Merged {
    pub report: ScopeReport,
    /// The merged folder's files and evidence digest.
    pub written: Written,
    /// Where the shard folders are.
    pub shards_dir: PathBuf,
    /// Seconds of the Spark job (its own measure) and of the merge.
    pub job_secs: f64,
    pub merge_secs: f64,
}

impl Spark {
    /// Checks the output folders, the settings and the binary, and plans
    /// the shards. A link at `out` is written through, as `scope --out`
    /// does: the merged folder replaces its target, the shards go beside it.
    pub fn prepare(mut self) -> Result<Prepared> {
        if self.out.is_symlink() {
            self.out = std::fs::canonicalize(&self.out).map_err(|e| {
                Error::Other(format!(
                    "--out {}: a link to nothing: {e}",
                    self.out.display()
                ))
            })?;
        }
        let name = self
            .out
            .file_name()
            .filter(|n| *n != "..")
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| {
                FleetError::failed(
                    format!("--out {}: not a folder name", self.out.display()),
                    "pass the merged folder's path, e.g. out/incident",
                )
            })?;
        let parent = match self.out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let shards_dir = parent.join(format!("{name}.shards"));
        if shards_dir.is_symlink() {
            return Err(FleetError::failed(
                format!(
                    "{}: a link; the shard folders go beside --out, where the merged evidence.json cites them",
                    shards_dir.display()
                ),
                "remove the link, or pass another --out",
            ));
        }
        self.submit.check()?;
        let inputs = [self.trace.as_path()];
        crate::custody::prepare_out(&self.out, "scope", &inputs, false)?;
        crate::custody::prepare_out(&shards_dir, "scope", &inputs, false)?;
        let binary = match &self.binary {
            Some(b) => b.clone(),
            None => std::env::current_exe().map_err(|e| {
                Error::Other(format!(
                    "cannot find this kvtrail binary (pass --binary): {e}"
                ))
            })?,
        };
        let binary = std::path::absolute(&binary).map_err(|e| Error::io(&binary, e))?;
        if !binary.is_file() {
            return Err(FleetError::failed(
                format!("--binary {}: not a file", binary.display()),
                "pass the kvtrail binary the executors run",
            ));
        }
        // The executors' view of the trace is checked here too.
        super::place::executor_arg(&self.trace)?;
        let shards = plan(&self.trace)?;
        let planned = TraceView::of(&self.trace)?;
        Ok(Prepared {
            spark: self,
            shards_dir,
            parent,
            binary,
            planned,
            shards,
        })
    }
}

impl Prepared {
    /// The merged folder (a link at `--out` resolved).
    pub fn out(&self) -> &Path {
        &self.spark.out
    }

    /// Runs the job and merges its shards; `stop` (raised by a signal)
    /// stops the job, or the merge before its folder is put in place, and
    /// leaves nothing. `command` is the command line, for the merged
    /// report.html and evidence.json.
    pub fn run(self, stop: &AtomicBool, command: &[String]) -> Result<Merged> {
        std::fs::create_dir_all(&self.parent).map_err(|e| {
            FleetError::failed(
                format!("{}: cannot create the folder: {e}", self.parent.display()),
                "pass --out inside a folder you can write",
            )
        })?;
        let work = tempfile::Builder::new()
            .prefix("kvtrail-fleet-")
            .tempdir()
            .map_err(|e| Error::Other(format!("cannot create a temporary folder: {e}")))?;
        // The shards are staged in a sibling of OUT.shards and put in
        // place once every one came back.
        let result = write_atomically(&self.shards_dir, |staging| {
            self.job(staging, work.path(), stop)
        })?;
        // From here on, the shard folders go again on failure.
        let placed =
            std::path::absolute(&self.shards_dir).map_err(|e| Error::io(&self.shards_dir, e))?;
        let guard = RemoveOnDrop(Some(placed));
        let merge_start = Instant::now();
        let (report, written) = self.merge(stop, command)?;
        guard.disarm();
        Ok(Merged {
            report,
            written,
            shards_dir: self.shards_dir,
            job_secs: result.secs,
            merge_secs: merge_start.elapsed().as_secs_f64(),
        })
    }

    /// The job, its shards written into `staging`; its checked result.
    fn job(&self, staging: &Path, work: &Path, stop: &AtomicBool) -> Result<JobResult> {
        let staging = std::path::absolute(staging).map_err(|e| Error::io(staging, e))?;
        let files = JobFiles::create(work)?;
        JobPlan::new(
            &self.spark.trace,
            &self.binary,
            self.spark.backend,
            &staging,
            &self.shards,
        )?
        .write(&files.plan)?;
        let status = self.spark.submit.run(&self.binary, &files, stop)?;
        let result = collect::result_of(
            &files.result,
            &files.log,
            &self.spark.submit.program(),
            status,
        )?;
        collect::check(&result, self.shards.len(), &staging)?;
        if let Some(key) = &self.spark.signing_key {
            for i in 0..self.shards.len() {
                sign_shard(&staging.join(collect::shard_dir(i)), key)?;
            }
        }
        Ok(result)
    }

    /// The shards in place merged beside them (the merged evidence.json
    /// names them relative to itself, as they lie).
    fn merge(&self, stop: &AtomicBool, command: &[String]) -> Result<(ScopeReport, Written)> {
        let dirs: Vec<PathBuf> = (0..self.shards.len())
            .map(|i| self.shards_dir.join(collect::shard_dir(i)))
            .collect();
        let loaded = load_shards(&dirs)?;
        if let Some(first) = loaded.first() {
            self.planned.check(&self.spark.trace, &first.trace)?;
        }
        let parts: Vec<_> = loaded
            .iter()
            .map(|s| (s.report.clone(), s.info.clone()))
            .collect();
        let r = merge(&parts)?;
        let sign = self.spark.signing_key.as_deref().map(|key| Signing {
            key,
            predicate: Predicate::new("fleet spark", command),
        });
        let written =
            write_merged_folder_signed(&self.spark.out, &loaded, &r, command, sign, || {
                if stop.load(Ordering::Relaxed) {
                    Err(Error::Other("interrupted".into()))
                } else {
                    Ok(())
                }
            });
        match written {
            Ok(w) => Ok((r, w)),
            // A signal during the merge: nothing is put in place either.
            Err(_) if stop.load(Ordering::Relaxed) => Err(FleetError::failed(
                "interrupted: nothing was written",
                "run kvtrail fleet spark again",
            )),
            Err(e) => Err(e.into()),
        }
    }
}

/// Signs a shard folder as it came back from its executor (checked by
/// `collect::check`): its statement names the trace its evidence.json
/// records and the shard's own verdict.
fn sign_shard(dir: &Path, key: &SigningKey) -> Result<()> {
    let ev = crate::custody::load_evidence(dir)?.0;
    let mut p = Predicate::new("fleet spark", &ev.command);
    p.inputs = statement::evidence_inputs(dir)?;
    let summary = dir.join("summary.json");
    let text = crate::trace::files::read_limited(&summary, 1 << 30, "a scope summary")?;
    let v: serde_json::Value = serde_json::from_slice(&text).unwrap_or_default();
    p.verdict = one_line(v["verdict"].as_str().unwrap_or("(no verdict)"));
    statement::sign_folder(dir, key, p)?;
    Ok(())
}

/// Removes a folder when dropped, unless disarmed.
struct RemoveOnDrop(Option<PathBuf>);

impl RemoveOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/golden-v1")
    }

    fn spark(out: &Path) -> Spark {
        Spark {
            trace: golden(),
            out: out.to_path_buf(),
            submit: Submit::default(),
            binary: Some(std::env::current_exe().unwrap()),
            backend: BackendChoice::Cpu,
            signing_key: None,
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn bad_arguments_are_refused_before_anything_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        let e = spark(&tmp.path().join(".."))
            .prepare()
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a folder name\n  hint: "), "{e}");
        let mut s = spark(&tmp.path().join("out"));
        s.submit.conf = vec!["x".into()];
        let e = s.prepare().unwrap_err().to_string();
        assert!(e.starts_with("--conf x: not KEY=VALUE"), "{e}");
        let mut s = spark(&tmp.path().join("out"));
        s.binary = Some(tmp.path().join("none"));
        let e = s.prepare().unwrap_err().to_string();
        assert!(
            e.contains(": not a file\n  hint: pass the kvtrail binary"),
            "{e}"
        );
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("x", tmp.path().join("out.shards")).unwrap();
            let e = spark(&tmp.path().join("out"))
                .prepare()
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("a link; the shard folders go beside --out"),
                "{e}"
            );
            std::fs::remove_file(tmp.path().join("out.shards")).unwrap();
        }
        let p = spark(&tmp.path().join("out")).prepare().unwrap();
        assert!(!p.shards.is_empty());
        assert!(names(tmp.path()).is_empty(), "{:?}", names(tmp.path()));
    }

    /// A job that ends without a result, and one stopped by a signal:
    /// an error, and nothing left beside --out or in the temporary folder.
    #[cfg(unix)]
    #[test]
    fn a_failed_or_stopped_job_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().join("work");
        std::fs::create_dir(&work).unwrap();
        let submit = tmp.path().join("spark-submit");
        std::fs::write(&submit, "#!/bin/sh\necho 'no spark here'\nexit 3\n").unwrap();
        let mut perm = std::fs::metadata(&submit).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&submit, perm).unwrap();
        let mut s = spark(&work.join("out"));
        s.submit.spark_submit = Some(submit.clone());
        let e = s
            .clone()
            .prepare()
            .unwrap()
            .run(&AtomicBool::new(false), &[])
            .unwrap_err();
        assert!(e.to_string().contains("exited with exit status: 3"), "{e}");
        assert_eq!(e.shown(), ["spark: no spark here"]);
        assert!(names(&work).is_empty(), "{:?}", names(&work));
        // A job that would run on: stopped at once.
        std::fs::write(&submit, "#!/bin/sh\nexec sleep 30\n").unwrap();
        let t = std::time::Instant::now();
        let e = s
            .prepare()
            .unwrap()
            .run(&AtomicBool::new(true), &[])
            .unwrap_err();
        assert!(t.elapsed() < std::time::Duration::from_secs(20));
        assert!(e.to_string().starts_with("interrupted: "), "{e}");
        assert!(names(&work).is_empty(), "{:?}", names(&work));
    }
}
