//! Collecting the job: its result file read back (`JobResult`, written
//! last by fleet/spark_scope.py), and refused unless every planned shard
//! came back as the folder `shard-NNNN` in the staging folder. A job
//! without a result shows the end of Spark's log; failed shards show
//! their stderr, and the error names the first one, with the message and
//! hint its kvtrail wrote as a JSON error line (`error_line`).

use std::path::Path;
use std::process::ExitStatus;

use serde::Deserialize;

use super::error_line::ErrorLine;
use super::{Failure, FleetError, Result, pools_list};
use crate::text::term;

/// The job's result file.
#[derive(Debug, Clone, Deserialize)]
pub struct JobResult {
    format: String,
    /// Seconds of the job, from its SparkContext to the last shard written.
    pub secs: f64,
    pub shards: Vec<JobDone>,
    pub errors: Vec<JobError>,
}

/// A shard written into the staging folder.
#[derive(Debug, Clone, Deserialize)]
pub struct JobDone {
    pub index: usize,
    pub dir: String,
}

/// A shard that failed.
#[derive(Debug, Clone, Deserialize)]
pub struct JobError {
    pub pools: Vec<u16>,
    /// kvtrail's exit code on the executor; `None`: the task itself failed.
    pub exit: Option<i32>,
    /// The end of its stderr, as people read it.
    pub stderr: String,
    /// Its kvtrail's error line, when it wrote one.
    #[serde(default)]
    pub error: Option<ErrorLine>,
}

impl JobResult {
    pub const FORMAT: &'static str = "kvtrail-fleet-spark-result";

    /// The result file, if the job wrote one of this format.
    pub fn read(path: &Path) -> Option<JobResult> {
        std::fs::read(path)
            .ok()
            .and_then(|b| serde_json::from_slice::<JobResult>(&b).ok())
            .filter(|r| r.format == Self::FORMAT)
    }
}

/// Lines of Spark's log shown when the job gives no result.
const LOG_LINES: usize = 40;

/// The result of a job that exited with `status`, its output in `log`;
/// an error showing the end of the log when there is none.
pub fn result_of(
    result: &Path,
    log: &Path,
    submit: &Path,
    status: ExitStatus,
) -> Result<JobResult> {
    if let Some(r) = JobResult::read(result) {
        return Ok(r);
    }
    let text = std::fs::read(log)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    Err(FleetError::Failed(Failure {
        what: format!(
            "{} exited with {status} before the job finished (its last lines are above)",
            submit.display()
        ),
        hint: "check the Spark installation and master, and that PYSPARK_PYTHON names a python with pyspark".into(),
        shown: lines[lines.len().saturating_sub(LOG_LINES)..]
            .iter()
            .map(|l| format!("spark: {}", term(l)))
            .collect(),
    }))
}

/// What a failed shard says, for the error: its kvtrail's message and hint
/// (line breaks made spaces); without an error line (a crash, a task that
/// failed), its stderr as the message and a general hint.
fn shard_says(e: &JobError) -> (String, String) {
    let hint = "fix what the shard's error names (its full stderr is above), then run again";
    match &e.error {
        Some(l) => (
            l.message.replace('\n', " "),
            l.hint
                .as_deref()
                .map_or(hint.to_string(), |h| h.replace('\n', " ")),
        ),
        None => {
            let text = e
                .stderr
                .lines()
                .filter(|l| !l.starts_with("kvtrail: "))
                .collect::<Vec<_>>()
                .join("\n");
            (text.trim().replace('\n', " "), hint.into())
        }
    }
}

/// Refuses a result with failed shards (their stderr shown, the first
/// named) or one that does not hold every one of `planned` shards, each in
/// its folder under `staging`.
pub fn check(result: &JobResult, planned: usize, staging: &Path) -> Result<()> {
    if let Some(first) = result.errors.first() {
        let shown = result
            .errors
            .iter()
            .flat_map(|e| {
                let pools = pools_list(&e.pools);
                e.stderr
                    .lines()
                    .map(move |l| format!("shard --pools {pools}: {}", term(l)))
            })
            .collect();
        let (what, hint) = shard_says(first);
        return Err(FleetError::Failed(Failure {
            what: format!(
                "{} of {} shards failed; the first, --pools {} ({}): {what}",
                result.errors.len(),
                planned,
                pools_list(&first.pools),
                match first.exit {
                    Some(c) => format!("kvtrail scope exited {c} on an executor"),
                    None => "the Spark task itself failed".into(),
                },
            ),
            hint,
            shown,
        }));
    }
    let mut got: Vec<usize> = result.shards.iter().map(|s| s.index).collect();
    got.sort_unstable();
    if got != (0..planned).collect::<Vec<_>>()
        || result
            .shards
            .iter()
            .any(|s| s.dir != shard_dir(s.index) || !staging.join(&s.dir).is_dir())
    {
        return Err(FleetError::failed(
            format!("the Spark job reported shards {got:?} of 0..{planned}"),
            "run it again; a shard lost on the way is never merged",
        ));
    }
    Ok(())
}

/// The folder of shard `index`: `shard-NNNN`.
pub fn shard_dir(index: usize) -> String {
    format!("shard-{index:04}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(json: serde_json::Value) -> JobResult {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_complete_result_passes_and_a_short_or_strange_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        for i in 0..2 {
            std::fs::create_dir(tmp.path().join(shard_dir(i))).unwrap();
        }
        let ok = result(serde_json::json!({"format": JobResult::FORMAT, "secs": 1.5,
            "shards": [{"index": 1, "pools": [2], "dir": "shard-0001"},
                       {"index": 0, "pools": [0, 1], "dir": "shard-0000"}],
            "errors": []}));
        check(&ok, 2, tmp.path()).unwrap();
        let e = check(&ok, 3, tmp.path()).unwrap_err().to_string();
        assert_eq!(
            e,
            "the Spark job reported shards [0, 1] of 0..3\n  hint: run it again; a shard lost on the way is never merged"
        );
        let odd = result(serde_json::json!({"format": JobResult::FORMAT, "secs": 1.0,
            "shards": [{"index": 0, "dir": "../x"}, {"index": 1, "dir": "shard-0001"}],
            "errors": []}));
        assert!(check(&odd, 2, tmp.path()).is_err());
        std::fs::remove_dir(tmp.path().join(shard_dir(1))).unwrap();
        assert!(check(&ok, 2, tmp.path()).is_err());
    }

    #[test]
    fn a_failed_shard_is_named_with_its_error_line_and_its_stderr_shown() {
        let line = ErrorLine {
            kind: "error".into(),
            message: "requests/r.parquet: request_id 2 appears twice".into(),
            hint: Some("remove the duplicate".into()),
            location: Some("requests/r.parquet".into()),
        };
        let stderr = format!("kvtrail: replay backend: CPU\n{}\n", line.human());
        let r = result(serde_json::json!({"format": JobResult::FORMAT, "secs": 1.0,
            "shards": [],
            "errors": [{"index": 0, "pools": [0, 1], "exit": 2, "stderr": stderr, "error": line},
                       {"index": 1, "pools": [4], "exit": null, "stderr": "lost\nexecutor"}]}));
        let tmp = tempfile::tempdir().unwrap();
        let e = check(&r, 3, tmp.path()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "2 of 3 shards failed; the first, --pools 0,1 (kvtrail scope exited 2 on an executor): requests/r.parquet: request_id 2 appears twice\n  hint: remove the duplicate"
        );
        assert_eq!(
            e.shown(),
            [
                "shard --pools 0,1: kvtrail: replay backend: CPU",
                "shard --pools 0,1: error: requests/r.parquet: request_id 2 appears twice",
                "shard --pools 0,1:   hint: remove the duplicate",
                "shard --pools 4: lost",
                "shard --pools 4: executor",
            ]
        );
        // Without an error line: the text itself, a general hint.
        let (what, hint) = shard_says(&r.errors[1]);
        assert_eq!(what, "lost executor");
        assert!(
            hint.starts_with("fix what the shard's error names"),
            "{hint}"
        );
        let r1 = JobError {
            exit: None,
            ..r.errors[1].clone()
        };
        let only = JobResult {
            errors: vec![r1],
            ..r
        };
        let e = check(&only, 1, tmp.path()).unwrap_err().to_string();
        assert!(
            e.contains("(the Spark task itself failed): lost executor"),
            "{e}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn no_result_shows_the_end_of_the_log() {
        use std::os::unix::process::ExitStatusExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("spark.log");
        let text: String = (0..50).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&log, text).unwrap();
        let result = tmp.path().join("result.json");
        std::fs::write(&result, r#"{"format": "other"}"#).unwrap();
        let e = result_of(
            &result,
            &log,
            Path::new("spark-submit"),
            ExitStatus::from_raw(256),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("spark-submit exited with exit status: 1 before the job finished"),
            "{e}"
        );
        assert_eq!(e.shown().len(), LOG_LINES);
        assert_eq!(e.shown()[0], "spark: line 10");
        assert_eq!(e.shown()[LOG_LINES - 1], "spark: line 49");
        std::fs::write(
            &result,
            serde_json::json!({"format": JobResult::FORMAT, "secs": 2.0, "shards": [], "errors": []})
                .to_string(),
        )
        .unwrap();
        let r = result_of(&result, &log, Path::new("x"), ExitStatus::from_raw(0)).unwrap();
        assert_eq!(r.secs, 2.0);
    }
}
