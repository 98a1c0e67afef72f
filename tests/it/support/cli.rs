//! Running the real `kvtrail` binary: one builder for every test that does
//! (options for the working directory, environment, stdin, umask, a time
//! limit, an address-space cap, another build, the exit codes expected),
//! one result (exit code or signal, stdout, stderr, peak RSS, wall time),
//! and `kvtrail simulate` into a folder.
//!
//! stdout and stderr go to files, so a child never stalls on a full pipe;
//! the child is reaped with wait4, which also gives its own peak RSS.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_kvtrail")
}

/// A path as a `&str` argument.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `kvtrail ARGS`, to be configured and then [`Kvtrail::run`].
pub fn kvtrail<I, A>(args: I) -> Kvtrail
where
    I: IntoIterator<Item = A>,
    A: AsRef<OsStr>,
{
    Kvtrail {
        bin: PathBuf::from(bin()),
        args: args.into_iter().map(|a| a.as_ref().to_owned()).collect(),
        cwd: None,
        env: Vec::new(),
        stdin: None,
        umask: None,
        timeout: None,
        memory: None,
        expect: None,
    }
}

/// One run of the binary, being configured.
#[must_use = "a Kvtrail does nothing until run"]
pub struct Kvtrail {
    bin: PathBuf,
    args: Vec<OsString>,
    cwd: Option<PathBuf>,
    env: Vec<(OsString, OsString)>,
    stdin: Option<Vec<u8>>,
    umask: Option<u32>,
    timeout: Option<Duration>,
    memory: Option<u64>,
    expect: Option<Vec<i32>>,
}

impl Kvtrail {
    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.args.push(a.as_ref().to_owned());
        self
    }

    pub fn args<I, A>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = A>,
        A: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Runs in `dir` (the test's working directory otherwise).
    pub fn cwd(mut self, dir: impl AsRef<Path>) -> Self {
        self.cwd = Some(dir.as_ref().to_path_buf());
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env
            .push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// These bytes on stdin (nothing, at end of file, otherwise).
    pub fn stdin(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.stdin = Some(bytes.into());
        self
    }

    /// Starts the child under this umask.
    pub fn umask(mut self, mask: u32) -> Self {
        self.umask = Some(mask);
        self
    }

    /// Kills the child after `limit`; the result then says `timed_out`.
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
        self
    }

    /// Caps the child's address space (RLIMIT_AS) at `bytes`, so an
    /// allocation sized by hostile input fails instead of swapping.
    pub fn memory_limit(mut self, bytes: u64) -> Self {
        self.memory = Some(bytes);
        self
    }

    /// Runs the build named by environment variable `var` when it is set
    /// (another build, an older release) instead of this one.
    pub fn bin_from_env(mut self, var: &str) -> Self {
        if let Some(b) = std::env::var_os(var) {
            self.bin = PathBuf::from(b);
        }
        self
    }

    /// Fails the test (with both outputs) unless the exit code is one of
    /// `codes`.
    pub fn expect(mut self, codes: &[i32]) -> Self {
        self.expect = Some(codes.to_vec());
        self
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(&self.args).env("KVTRAIL_NO_PROGRESS", "1");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        if let Some(d) = &self.cwd {
            cmd.current_dir(d);
        }
        let (memory, umask) = (self.memory, self.umask);
        if memory.is_some() || umask.is_some() {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit and umask are async-signal-safe; nothing
            // else runs in the hook.
            unsafe {
                cmd.pre_exec(move || {
                    if let Some(m) = memory {
                        let lim = libc::rlimit {
                            rlim_cur: m,
                            rlim_max: m,
                        };
                        if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    if let Some(u) = umask {
                        libc::umask(u as libc::mode_t);
                    }
                    Ok(())
                });
            }
        }
        cmd
    }

    /// Starts the child with piped stdout and stderr and returns it (for a
    /// long-running `kvtrail record` the test talks to).
    pub fn spawn(self) -> Child {
        assert!(
            self.stdin.is_none() && self.timeout.is_none() && self.expect.is_none(),
            "spawn: stdin, timeout and expect apply to run only"
        );
        self.command()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()))
    }

    /// Runs the child to its end (or the time limit).
    #[allow(clippy::zombie_processes)] // reaped with wait4, not Child::wait
    pub fn run(self) -> Ran {
        let tmp = tempfile::tempdir().unwrap();
        let (o, e, i) = (
            tmp.path().join("stdout"),
            tmp.path().join("stderr"),
            tmp.path().join("stdin"),
        );
        let stdin = match &self.stdin {
            Some(bytes) => {
                std::fs::write(&i, bytes).unwrap();
                Stdio::from(std::fs::File::open(&i).unwrap())
            }
            None => Stdio::null(),
        };
        let t0 = Instant::now();
        let mut child = self
            .command()
            .stdin(stdin)
            .stdout(std::fs::File::create(&o).unwrap())
            .stderr(std::fs::File::create(&e).unwrap())
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start {}: {err}", self.bin.display()));
        let pid = child.id() as libc::pid_t;
        let mut status = 0;
        // SAFETY: plain wait4 on our own child; rusage is written by the kernel.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        let mut timed_out = false;
        loop {
            let flags = if self.timeout.is_some() {
                libc::WNOHANG
            } else {
                0
            };
            // SAFETY: as above.
            let r = unsafe { libc::wait4(pid, &mut status, flags, &mut ru) };
            if r == pid {
                break;
            }
            if r == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
            {
                continue;
            }
            assert_eq!(r, 0, "wait4: {}", std::io::Error::last_os_error());
            if self.timeout.is_some_and(|limit| t0.elapsed() > limit) && !timed_out {
                timed_out = true;
                let _ = child.kill();
                continue;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let wall = t0.elapsed();
        let signal = (!libc::WIFEXITED(status)).then(|| libc::WTERMSIG(status));
        let stdout_bytes = std::fs::read(&o).unwrap_or_default();
        let ran = Ran {
            code: signal.map_or_else(|| libc::WEXITSTATUS(status), |sig| -sig),
            signal,
            timed_out,
            stdout: String::from_utf8_lossy(&stdout_bytes).into_owned(),
            stdout_bytes,
            stderr: String::from_utf8_lossy(&std::fs::read(&e).unwrap_or_default()).into_owned(),
            peak_mib: ru.ru_maxrss as u64 / 1024,
            cpu: tv(ru.ru_utime) + tv(ru.ru_stime),
            wall,
        };
        if let Some(codes) = &self.expect {
            assert!(
                codes.contains(&ran.code),
                "kvtrail {:?} exited {} (expected one of {codes:?})\nstdout:\n{}\nstderr:\n{}",
                self.args,
                ran.code,
                ran.stdout,
                ran.stderr
            );
        }
        ran
    }
}

/// What one run of the binary did.
pub struct Ran {
    /// The exit code; minus the signal's number when a signal ended it.
    pub code: i32,
    pub signal: Option<i32>,
    /// The time limit killed it.
    pub timed_out: bool,
    /// stdout and stderr, invalid UTF-8 replaced.
    pub stdout: String,
    pub stderr: String,
    /// stdout as written.
    pub stdout_bytes: Vec<u8>,
    /// Peak resident set of the child, in MiB.
    pub peak_mib: u64,
    /// The child's CPU time (user + system): unlike `wall`, it does not
    /// grow when other processes load the machine.
    pub cpu: Duration,
    pub wall: Duration,
}

fn tv(t: libc::timeval) -> Duration {
    Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
}

impl Ran {
    /// Asserts exit 0; returns stdout, which must be UTF-8.
    pub fn ok(&self) -> String {
        assert_eq!(
            self.code, 0,
            "stdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        String::from_utf8(self.stdout_bytes.clone()).unwrap()
    }

    /// Asserts a refusal: exit 2, `want` and a hint on stderr; returns
    /// stderr.
    pub fn refused(&self, want: &str) -> String {
        assert_eq!(self.code, 2, "{}", self.stderr);
        assert!(
            self.stderr.contains(want) && self.stderr.contains("hint:"),
            "{}",
            self.stderr
        );
        self.stderr.clone()
    }

    /// (exit code, stdout, stderr).
    pub fn into_parts(self) -> (i32, String, String) {
        (self.code, self.stdout, self.stderr)
    }
}

/// `kvtrail simulate --out OUT ARGS`, which must succeed; returns OUT.
pub fn simulate(out: &Path, args: &[&str]) -> PathBuf {
    let r = kvtrail(["simulate", "--out", s(out)]).args(args).run();
    assert_eq!(r.code, 0, "simulate {args:?} failed: {}", r.stderr);
    out.to_path_buf()
}
