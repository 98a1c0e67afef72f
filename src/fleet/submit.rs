//! Submitting the Spark job: spark-submit of the PySpark job
//! fleet/spark_scope.py (built into the binary, `SPARK_JOB`), with the
//! kvtrail binary shipped to the executors (`--files`), the plan file and
//! the result file as its arguments, its output into a log file. `wait`
//! stops spark-submit when the stop flag is raised (`stop_on_signals`:
//! SIGTERM or SIGINT), so nothing of the run is left behind.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{FleetError, Result};
use crate::error::Error;

/// The PySpark job `fleet spark` submits.
pub const SPARK_JOB: &str = include_str!("../../fleet/spark_scope.py");

/// How the job is submitted.
#[derive(Debug, Clone, Default)]
pub struct Submit {
    /// The spark-submit to run; `None`: $SPARK_HOME/bin/spark-submit, else
    /// spark-submit on PATH.
    pub spark_submit: Option<PathBuf>,
    /// spark-submit --master.
    pub master: Option<String>,
    /// spark-submit --conf, each KEY=VALUE.
    pub conf: Vec<String>,
}

/// The files of one submission, in the job's temporary folder.
#[derive(Debug, Clone)]
pub struct JobFiles {
    pub job: PathBuf,
    pub plan: PathBuf,
    pub result: PathBuf,
    pub log: PathBuf,
}

impl JobFiles {
    /// The job's files under `work`; writes the job script there.
    pub fn create(work: &Path) -> Result<JobFiles> {
        let job = work.join("spark_scope.py");
        std::fs::write(&job, SPARK_JOB).map_err(|e| Error::io(&job, e))?;
        Ok(JobFiles {
            job,
            plan: work.join("plan.json"),
            result: work.join("result.json"),
            log: work.join("spark.log"),
        })
    }
}

impl Submit {
    /// Refuses a `--conf` that is not KEY=VALUE.
    pub fn check(&self) -> Result<()> {
        match self.conf.iter().find(|c| !c.contains('=')) {
            Some(c) => Err(FleetError::failed(
                format!("--conf {c}: not KEY=VALUE"),
                "pass a Spark setting such as spark.executor.memory=4g",
            )),
            None => Ok(()),
        }
    }

    /// The spark-submit that runs.
    pub fn program(&self) -> PathBuf {
        self.spark_submit.clone().unwrap_or_else(|| {
            std::env::var_os("SPARK_HOME")
                .map(|h| PathBuf::from(h).join("bin/spark-submit"))
                .unwrap_or_else(|| PathBuf::from("spark-submit"))
        })
    }

    /// The spark-submit command line of the job, `binary` shipped.
    pub fn command(&self, binary: &Path, files: &JobFiles) -> Command {
        let mut cmd = Command::new(self.program());
        if let Some(m) = &self.master {
            cmd.args(["--master", m]);
        }
        for c in &self.conf {
            cmd.args(["--conf", c]);
        }
        cmd.arg("--name")
            .arg("kvtrail fleet spark")
            .arg("--files")
            .arg(binary)
            .arg(&files.job)
            .arg(&files.plan)
            .arg(&files.result)
            .env("KVTRAIL_NO_PROGRESS", "1")
            .stdin(Stdio::null());
        cmd
    }

    /// Runs the job, its output into the log file, until it ends or `stop`
    /// is raised (then spark-submit is killed: an "interrupted" error).
    pub fn run(&self, binary: &Path, files: &JobFiles, stop: &AtomicBool) -> Result<ExitStatus> {
        let mut cmd = self.command(binary, files);
        let log = std::fs::File::create(&files.log).map_err(|e| Error::io(&files.log, e))?;
        cmd.stdout(log.try_clone()?).stderr(log);
        let child = cmd.spawn().map_err(|e| {
            FleetError::failed(
                format!("cannot run {}: {e}", self.program().display()),
                "install Spark (pip install pyspark gives spark-submit) and set SPARK_HOME or pass --spark-submit",
            )
        })?;
        wait(child, stop)
    }
}

/// The error of a run stopped by a signal while the job ran.
pub fn interrupted_job() -> FleetError {
    FleetError::failed(
        "interrupted: the Spark job was stopped and nothing was written",
        "run kvtrail fleet spark again",
    )
}

/// Waits for `child`, killing it when `stop` is raised.
pub fn wait(mut child: std::process::Child, stop: &AtomicBool) -> Result<ExitStatus> {
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        if stop.load(Ordering::Relaxed) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(interrupted_job());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A flag raised by SIGTERM or SIGINT (which then no longer end the
/// process: the caller stops what runs and cleans up).
pub fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn the_command_ships_the_binary_and_passes_master_and_settings() {
        let s = Submit {
            spark_submit: Some("/opt/spark/bin/spark-submit".into()),
            master: Some("local[2]".into()),
            conf: vec!["spark.ui.enabled=false".into()],
        };
        s.check().unwrap();
        let files = JobFiles {
            job: "/w/spark_scope.py".into(),
            plan: "/w/plan.json".into(),
            result: "/w/result.json".into(),
            log: "/w/spark.log".into(),
        };
        let cmd = s.command(Path::new("/bin/kvtrail"), &files);
        assert_eq!(cmd.get_program(), "/opt/spark/bin/spark-submit");
        assert_eq!(
            args(&cmd),
            [
                "--master",
                "local[2]",
                "--conf",
                "spark.ui.enabled=false",
                "--name",
                "kvtrail fleet spark",
                "--files",
                "/bin/kvtrail",
                "/w/spark_scope.py",
                "/w/plan.json",
                "/w/result.json"
            ]
        );
        let bad = Submit {
            conf: vec!["spark.executor.memory".into()],
            ..Submit::default()
        };
        let e = bad.check().unwrap_err().to_string();
        assert_eq!(
            e,
            "--conf spark.executor.memory: not KEY=VALUE\n  hint: pass a Spark setting such as spark.executor.memory=4g"
        );
    }

    #[test]
    fn the_job_script_is_built_in_and_a_missing_spark_submit_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let files = JobFiles::create(tmp.path()).unwrap();
        assert_eq!(std::fs::read_to_string(&files.job).unwrap(), SPARK_JOB);
        assert!(SPARK_JOB.contains("kvtrail-fleet-spark-plan"));
        let s = Submit {
            spark_submit: Some(tmp.path().join("no-spark-submit")),
            ..Submit::default()
        };
        let e = s
            .run(Path::new("kvtrail"), &files, &AtomicBool::new(false))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cannot run ") && e.contains("hint: install Spark"),
            "{e}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn a_raised_stop_kills_the_job() {
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let t = std::time::Instant::now();
        let e = wait(child, &AtomicBool::new(true)).unwrap_err().to_string();
        assert!(e.starts_with("interrupted: "), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(10));
        let done = Command::new("true").spawn().unwrap();
        assert!(wait(done, &AtomicBool::new(false)).unwrap().success());
    }
}
