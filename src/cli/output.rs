//! The one printer of a command's result on stdout: pretty JSON with
//! `--json` (serde, one trailing newline), else the command's human text;
//! and the broken-pipe rule (`kvtrail ... | head` is success), which
//! `cli::run` applies to whatever error a command returns.
//!
//! The JSON is rendered to a string before anything is written, so a write
//! error is the `std::io::Error` itself (serde_json's writer would hide
//! its kind from `is_broken_pipe`), and stdout is flushed here, so a late
//! failure is an error of the command, not lost at exit.

use std::io::Write;

use serde::Serialize;

/// Prints `value` as pretty JSON when `json` is set, else calls `human`
/// with stdout to write the human text.
pub fn print<T: Serialize + ?Sized>(
    json: bool,
    value: &T,
    human: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    emit(&mut std::io::stdout().lock(), json, value, human)
}

/// Prints human text only (commands without `--json`).
pub fn print_human(
    human: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    emit(&mut std::io::stdout().lock(), false, &(), human)
}

/// `print` on any writer.
fn emit<T: Serialize + ?Sized>(
    out: &mut dyn Write,
    json: bool,
    value: &T,
    human: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    if json {
        let mut text = serde_json::to_string_pretty(value)?;
        text.push('\n');
        out.write_all(text.as_bytes())?;
    } else {
        human(out)?;
    }
    out.flush()?;
    Ok(())
}

/// Whether an error is a write to a closed pipe (the reader went away):
/// the process then exits 0, not 2.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The command line as given, for evidence.json: the program as its file
/// name (`kvtrail`), every argument verbatim.
pub fn command_line() -> Vec<String> {
    let mut args = std::env::args_os().map(|a| a.to_string_lossy().into_owned());
    let prog = args
        .next()
        .map(|p| {
            std::path::Path::new(&p)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or(p)
        })
        .unwrap_or_else(|| "kvtrail".into());
    std::iter::once(prog).chain(args).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that keeps `room` bytes, then fails with `kind`.
    struct Pipe {
        got: Vec<u8>,
        room: usize,
        kind: std::io::ErrorKind,
    }

    impl Write for Pipe {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            if self.got.len() >= self.room {
                return Err(self.kind.into());
            }
            let n = b.len().min(self.room - self.got.len());
            self.got.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[derive(Serialize)]
    struct Value {
        name: &'static str,
        rows: Vec<u32>,
    }

    fn value() -> Value {
        Value {
            name: "a\"b",
            rows: vec![1, 2],
        }
    }

    fn human(w: &mut dyn Write) -> std::io::Result<()> {
        for i in 0..3 {
            writeln!(w, "line {i}")?;
        }
        Ok(())
    }

    fn check(json: bool, room: usize, kind: std::io::ErrorKind) -> (Vec<u8>, Option<bool>) {
        let mut p = Pipe {
            got: Vec::new(),
            room,
            kind,
        };
        let r = emit(&mut p, json, &value(), human);
        (p.got, r.err().map(|e| is_broken_pipe(&e)))
    }

    #[test]
    fn json_is_pretty_with_one_newline_and_text_is_the_commands() {
        let want_json = serde_json::to_string_pretty(&value()).unwrap() + "\n";
        assert_eq!(
            check(true, usize::MAX, std::io::ErrorKind::BrokenPipe),
            (want_json.into_bytes(), None)
        );
        assert_eq!(
            check(false, usize::MAX, std::io::ErrorKind::BrokenPipe),
            (b"line 0\nline 1\nline 2\n".to_vec(), None)
        );
    }

    #[test]
    fn a_closed_pipe_is_recognised_in_both_forms_and_other_errors_are_not() {
        for json in [true, false] {
            for room in [0, 5] {
                let (_, broken) = check(json, room, std::io::ErrorKind::BrokenPipe);
                assert_eq!(broken, Some(true), "json {json}, room {room}");
                let (_, broken) = check(json, room, std::io::ErrorKind::PermissionDenied);
                assert_eq!(broken, Some(false), "json {json}, room {room}");
            }
        }
    }
}
