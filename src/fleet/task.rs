//! `fleet task` (hidden): the Spark task's side of the job's pipe. Spark
//! writes the task's shards on stdin, one "INDEX POOLS" line each, and
//! collects what it prints: JSON lines (`TaskLine`), read by
//! fleet/spark_scope.py. Each shard is this binary's own `scope TRACE
//! --pools POOLS --out DIR`, in a child process whose exit code, stderr
//! and JSON error line (`error_line`, asked for with `KVTRAIL_ERRORS`) are
//! reported. With a staging folder (one every executor sees) the shard is
//! written there; without, into a temporary folder whose files then
//! travel back as base64 chunks. A shard that fails is not retried (its
//! errors are bad input, the same on every attempt); the task itself fails
//! only when its own input or output does, which fails the Spark task.

use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Serialize;

use super::error_line::{ERRORS_ENV, ErrorLine, split_stderr};
use super::{Result, pools_list};
use crate::error::Error;
use crate::lineage::BackendChoice;
use crate::text::term;

/// One line a task prints (JSON): a chunk of a shard folder's file, a
/// shard done, or a shard failed.
#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum TaskLine<'a> {
    Chunk {
        index: usize,
        rel: &'a str,
        n: u64,
        data: String,
    },
    Done {
        index: usize,
        pools: &'a [u16],
        dir: &'a str,
    },
    Error {
        index: usize,
        pools: &'a [u16],
        exit: Option<i32>,
        stderr: String,
        error: Option<ErrorLine>,
    },
}

/// Bytes of a shard file a chunk line carries (4 MiB, base64 in the line).
const TASK_CHUNK: usize = 4 << 20;
/// What a failed shard's stderr keeps (its end).
const TASK_STDERR: usize = 8000;
/// The longest "INDEX POOLS" line a task reads (a shard of every one of
/// the 65,536 pool ids is under 400 KiB).
const TASK_LINE_MAX: u64 = 1 << 20;

/// What a task runs.
#[derive(Debug, Clone)]
pub struct Task {
    /// The kvtrail binary run for each shard (this one).
    pub exe: PathBuf,
    /// The trace, as the job's plan gives it.
    pub trace: String,
    pub backend: BackendChoice,
    /// Where shard folders are written; `None`: they travel as lines.
    pub staging: Option<PathBuf>,
}

impl Task {
    /// Reads shard lines from `input` until its end, runs each, and writes
    /// the JSON lines to `out`.
    pub fn run(&self, mut input: impl BufRead, out: impl Write) -> Result<()> {
        let mut out = std::io::BufWriter::new(out);
        let mut emit = |line: &TaskLine| -> Result<()> {
            serde_json::to_writer(&mut out, line)
                .map_err(|e| Error::Other(format!("writing the task's lines: {e}")))?;
            out.write_all(b"\n")?;
            out.flush()?;
            Ok(())
        };
        let mut buf = Vec::new();
        for number in 1.. {
            buf.clear();
            let n = (&mut input)
                .take(TASK_LINE_MAX + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|e| Error::Other(format!("reading the task's shards on stdin: {e}")))?;
            if n == 0 {
                break;
            }
            if buf.len() as u64 > TASK_LINE_MAX {
                return Err(Error::Other(format!(
                    "task line {number} is longer than {TASK_LINE_MAX} bytes: not \"INDEX POOLS\""
                ))
                .into());
            }
            let line = String::from_utf8_lossy(&buf);
            if line.trim().is_empty() {
                continue;
            }
            let Some((index, pools)) = parse_task_line(&line) else {
                return Err(Error::Other(format!(
                    "task line {number} {:?}: not \"INDEX POOLS\"",
                    term(&line)
                ))
                .into());
            };
            self.shard(index, &pools, &mut emit)?;
        }
        Ok(())
    }

    /// Runs one shard and emits its lines.
    fn shard(
        &self,
        index: usize,
        pools: &[u16],
        emit: &mut impl FnMut(&TaskLine) -> Result<()>,
    ) -> Result<()> {
        let name = super::collect::shard_dir(index);
        // Without staging the shard is written to a temporary folder of
        // the executor's, removed once its lines are out.
        let (_tmp, dir) = match &self.staging {
            Some(s) => (None, s.join(&name)),
            None => {
                let t = tempfile::Builder::new()
                    .prefix("kvtrail-shard-")
                    .tempdir()
                    .map_err(|e| Error::Other(format!("cannot create a temporary folder: {e}")))?;
                let d = t.path().join(&name);
                (Some(t), d)
            }
        };
        let ran = Command::new(&self.exe)
            .arg("scope")
            .arg(&self.trace)
            .arg("--pools")
            .arg(pools_list(pools))
            .arg("--backend")
            .arg(self.backend.name())
            .arg("--out")
            .arg(&dir)
            .env("KVTRAIL_NO_PROGRESS", "1")
            .env(ERRORS_ENV, "json")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        let failed = match ran {
            Ok(o) if o.status.success() => None,
            Ok(o) => {
                let (human, error) = split_stderr(&o.stderr);
                Some((o.status.code(), tail(&human), error))
            }
            Err(e) => Some((
                None,
                format!("cannot run {}: {e}", self.exe.display()),
                None,
            )),
        };
        if let Some((exit, stderr, error)) = failed {
            return emit(&TaskLine::Error {
                index,
                pools,
                exit,
                stderr,
                error,
            });
        }
        if self.staging.is_none() {
            let sent = send_folder(&dir, |rel, n, data| {
                emit(&TaskLine::Chunk {
                    index,
                    rel,
                    n,
                    data,
                })
            });
            if let Err(e) = sent {
                let error =
                    ErrorLine::of_chain(std::iter::once(&e as &(dyn std::error::Error + 'static)));
                return emit(&TaskLine::Error {
                    index,
                    pools,
                    exit: None,
                    stderr: e.to_string(),
                    error: Some(error),
                });
            }
        }
        emit(&TaskLine::Done {
            index,
            pools,
            dir: &name,
        })
    }
}

/// "INDEX P,P,..." as the job writes it.
fn parse_task_line(line: &str) -> Option<(usize, Vec<u16>)> {
    let (index, pools) = line.trim().split_once(' ')?;
    let pools = pools
        .split(',')
        .map(|p| p.parse().ok())
        .collect::<Option<Vec<u16>>>()?;
    Some((index.parse().ok()?, pools))
}

/// The end of a child's stderr.
fn tail(text: &str) -> String {
    let mut start = text.len().saturating_sub(TASK_STDERR);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_string()
}

/// Every file under `dir` (sorted, "/"-separated relative paths), in
/// chunks of [`TASK_CHUNK`] bytes, base64 (an empty file is one empty
/// chunk).
fn send_folder(dir: &Path, mut send: impl FnMut(&str, u64, String) -> Result<()>) -> Result<()> {
    use base64::Engine;
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).map_err(|e| Error::io(&d, e))? {
            let e = e.map_err(|e| Error::io(&d, e))?;
            let ty = e.file_type().map_err(|x| Error::io(&e.path(), x))?;
            if ty.is_dir() {
                stack.push(e.path());
            } else if ty.is_file() {
                files.push(e.path());
            }
        }
    }
    let mut rels: Vec<(String, PathBuf)> = files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(dir).unwrap_or(&f);
            let rel = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            (rel, f)
        })
        .collect();
    rels.sort();
    let mut buf = Vec::with_capacity(TASK_CHUNK);
    for (rel, path) in &rels {
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let mut n = 0u64;
        loop {
            buf.clear();
            (&mut f)
                .take(TASK_CHUNK as u64)
                .read_to_end(&mut buf)
                .map_err(|e| Error::io(path, e))?;
            send(
                rel,
                n,
                base64::engine::general_purpose::STANDARD.encode(&buf),
            )?;
            n += 1;
            if buf.len() < TASK_CHUNK {
                break;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_lines_are_index_and_pools() {
        assert_eq!(parse_task_line("7 2,3\n"), Some((7, vec![2, 3])));
        assert_eq!(parse_task_line(" 0 4 "), Some((0, vec![4])));
        for bad in ["x 1", "0", "0 1,,2", "0 70000", "-1 2", ""] {
            assert_eq!(parse_task_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_tail_keeps_the_end_on_a_character_boundary() {
        assert_eq!(tail("short"), "short");
        let long = format!("é{}", "x".repeat(TASK_STDERR - 1));
        let t = tail(&long);
        assert_eq!(t.len(), TASK_STDERR - 1);
        assert!(t.chars().all(|c| c == 'x'));
    }

    #[test]
    fn a_folder_travels_as_sorted_chunks_that_rebuild_it() {
        use base64::Engine;
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().join("shard-0000");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("b.csv"), "b").unwrap();
        std::fs::write(d.join("a.json"), "").unwrap();
        let big = vec![7u8; TASK_CHUNK + 3];
        std::fs::write(d.join("sub/big.parquet"), &big).unwrap();
        let mut got: Vec<(String, u64, Vec<u8>)> = Vec::new();
        send_folder(&d, |rel, n, data| {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(data)
                .unwrap();
            got.push((rel.to_string(), n, bytes));
            Ok(())
        })
        .unwrap();
        let names: Vec<(&str, u64, usize)> = got
            .iter()
            .map(|(r, n, b)| (r.as_str(), *n, b.len()))
            .collect();
        assert_eq!(
            names,
            [
                ("a.json", 0, 0),
                ("b.csv", 0, 1),
                ("sub/big.parquet", 0, TASK_CHUNK),
                ("sub/big.parquet", 1, 3)
            ]
        );
    }

    /// A task whose kvtrail is a stand-in script: a shard that succeeds is
    /// `done`, one that fails is `error` with its error line apart and its
    /// stderr as people read it; a line that is no shard fails the task.
    #[cfg(unix)]
    #[test]
    fn a_task_reports_each_shard_and_refuses_a_bad_line() {
        let tmp = tempfile::tempdir().unwrap();
        let exe = tmp.path().join("kvtrail");
        let line = ErrorLine {
            kind: "error".into(),
            message: "t: bad".into(),
            hint: Some("fix it".into()),
            location: Some("t".into()),
        };
        // Pools "4": fail with an error line (when asked for one).
        let script = format!(
            "#!/bin/sh\nfor a; do last=$a; done\ncase \"$4\" in\n4) echo 'kvtrail: note' >&2; [ \"${ERRORS_ENV}\" = json ] && echo '{}' >&2; exit 2;;\n*) mkdir -p \"$last\"; echo x > \"$last/summary.json\";;\nesac\n",
            line.to_json()
        );
        std::fs::write(&exe, script).unwrap();
        let mut perm = std::fs::metadata(&exe).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&exe, perm).unwrap();
        let staging = tmp.path().join("staging");
        let task = Task {
            exe,
            trace: "/t".into(),
            backend: BackendChoice::Cpu,
            staging: Some(staging.clone()),
        };
        let mut out = Vec::new();
        task.run(&b"0 0,1\n\n1 4\n"[..], &mut out).unwrap();
        let lines: Vec<serde_json::Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["kind"], "done");
        assert_eq!(lines[0]["dir"], "shard-0000");
        assert!(staging.join("shard-0000/summary.json").is_file());
        assert_eq!(lines[1]["kind"], "error");
        assert_eq!(lines[1]["exit"], 2);
        assert_eq!(lines[1]["pools"], serde_json::json!([4]));
        assert_eq!(
            lines[1]["stderr"],
            "kvtrail: note\nerror: t: bad\n  hint: fix it\n"
        );
        assert_eq!(lines[1]["error"]["hint"], "fix it");

        for bad in ["x 1\n", "0 70000\n"] {
            let e = task
                .run(bad.as_bytes(), Vec::new())
                .unwrap_err()
                .to_string();
            assert!(e.contains("not \"INDEX POOLS\""), "{e}");
        }
        let long = format!("0 {}", "1,".repeat(600_000));
        let e = task
            .run(long.as_bytes(), Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("longer than"), "{e}");
    }
}
