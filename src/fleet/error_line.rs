//! Errors across a process boundary: a child kvtrail (a shard's `scope
//! --pools` under `fleet task`) whose parent sets `KVTRAIL_ERRORS=json`
//! ends with one JSON line on stderr instead of the human `error: ...`
//! lines:
//!
//! `{"type":"error","message":M,"hint":H,"location":L}`
//!
//! `message` and `hint` are exactly the human text's two parts (escaped for
//! a terminal as it is: `error: M`, then `  hint: H`), `hint` and
//! `location` (file, row, column as the message names them) are null when
//! the error has none. The parent reads the line back (`ErrorLine::parse`)
//! and renders it (`human`) where it shows the child's stderr; it never
//! takes an error apart from its human text. Without the variable,
//! people's output is unchanged.

use serde::{Deserialize, Serialize};

use super::{FleetError, HINT};
use crate::error::{Error, PARQUET_HINT};
use crate::text::{term, term_message};

/// The variable a parent sets, to `json`, for a child's error line.
pub const ERRORS_ENV: &str = "KVTRAIL_ERRORS";

/// The `type` of an error line.
const ERROR_TYPE: &str = "error";

/// One error, as a child writes it for its parent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorLine {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    pub hint: Option<String>,
    pub location: Option<String>,
}

/// Whether this process was asked for error lines (`KVTRAIL_ERRORS=json`).
pub fn wanted() -> bool {
    std::env::var_os(ERRORS_ENV).is_some_and(|v| v == "json")
}

impl ErrorLine {
    /// The error line of an error chain (outermost first, each cause
    /// after it, as `anyhow::Error::chain` gives it): the messages joined
    /// by `: `, as `{:#}` shows them, the hint and location taken from the
    /// kvtrail error that carries them.
    pub fn of_chain<'a>(
        chain: impl IntoIterator<Item = &'a (dyn std::error::Error + 'static)>,
    ) -> Self {
        let mut parts = Vec::new();
        let (mut hint, mut location) = (None, None);
        for e in chain {
            let kv = match e.downcast_ref::<FleetError>() {
                Some(FleetError::Failed(f)) => {
                    parts.push(f.what.clone());
                    hint = Some(f.hint.clone());
                    break;
                }
                Some(FleetError::Kvtrail(k)) => Some(k),
                None => e.downcast_ref::<Error>(),
            };
            match kv {
                Some(Error::Invalid { loc, what, hint: h }) => {
                    parts.push(format!("{loc}: {}", term(what)));
                    hint = Some(term(h).into_owned());
                    location = Some(loc.to_string());
                    break;
                }
                Some(Error::Parquet { loc, msg }) => {
                    parts.push(format!("{loc}: cannot read Parquet: {}", term(msg)));
                    hint = Some(PARQUET_HINT.to_string());
                    location = Some(loc.to_string());
                    break;
                }
                Some(Error::Io { path, .. }) => {
                    location.get_or_insert_with(|| term(&path.display().to_string()).into_owned());
                    parts.push(e.to_string());
                }
                _ => parts.push(e.to_string()),
            }
        }
        ErrorLine {
            kind: ERROR_TYPE.into(),
            message: term_message(&parts.join(": ")),
            hint: hint.map(|h| term_message(&h)),
            location,
        }
    }

    /// The line (JSON, no line break).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an error line serializes")
    }

    /// An error line read back; `None` for any other line.
    pub fn parse(line: &str) -> Option<Self> {
        let l: ErrorLine = serde_json::from_str(line.trim_end()).ok()?;
        (l.kind == ERROR_TYPE).then_some(l)
    }

    /// The error as a person sees it without the variable: `error: M`,
    /// then `  hint: H` on its own line (no final line break).
    pub fn human(&self) -> String {
        match &self.hint {
            Some(h) => format!("error: {}{HINT}{h}", self.message),
            None => format!("error: {}", self.message),
        }
    }
}

/// A child's stderr with its error line rendered for people (byte for
/// byte what it would have printed without the variable), and the error
/// line itself when there is one.
pub fn split_stderr(stderr: &[u8]) -> (String, Option<ErrorLine>) {
    let text = String::from_utf8_lossy(stderr);
    let mut human = String::with_capacity(text.len());
    let mut error = None;
    for line in text.split_inclusive('\n') {
        match ErrorLine::parse(line) {
            Some(l) if error.is_none() => {
                human.push_str(&l.human());
                if line.ends_with('\n') {
                    human.push('\n');
                }
                error = Some(l);
            }
            _ => human.push_str(line),
        }
    }
    (human, error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Location;
    use std::path::Path;

    /// What the CLI prints without the variable: `error: {e:#}` escaped.
    fn printed(e: &anyhow::Error) -> String {
        format!("error: {}", term_message(&format!("{e:#}")))
    }

    fn line(e: &anyhow::Error) -> ErrorLine {
        ErrorLine::of_chain(e.chain())
    }

    #[test]
    fn the_line_renders_as_the_human_text_for_every_kind_of_error() {
        let loc = Location::file(Path::new("kv/pool=0/p.parquet"))
            .row(7)
            .column("slot");
        let cases: Vec<anyhow::Error> = vec![
            Error::invalid(loc.clone(), "slot 9 past capacity", "re-record the trace").into(),
            anyhow::Error::from(Error::invalid(
                Location::file(Path::new("evil\n  hint: x\u{1b}")),
                "what\nnext",
                "do\u{1b}[2J this",
            ))
            .context("reading the trace"),
            Error::Parquet {
                loc: loc.clone(),
                msg: "bad footer".into(),
            }
            .into(),
            Error::Io {
                path: "trace.json".into(),
                source: std::io::Error::other("denied"),
            }
            .into(),
            Error::Other("no shard given".into()).into(),
            FleetError::failed("--conf x: not KEY=VALUE", "pass a Spark setting").into(),
            anyhow::anyhow!("plain"),
        ];
        for e in &cases {
            let l = line(e);
            assert_eq!(l.human(), printed(e), "{e:?}");
            let back = ErrorLine::parse(&l.to_json()).unwrap();
            assert_eq!(back, l);
            assert!(!l.to_json().contains('\n'));
        }
        let l = line(&cases[0]);
        assert_eq!(l.hint.as_deref(), Some("re-record the trace"));
        assert_eq!(
            l.location.as_deref(),
            Some("kv/pool=0/p.parquet, row 7, column `slot`")
        );
        assert!(l.message.ends_with("slot 9 past capacity"), "{}", l.message);
        let l = line(&cases[1]);
        assert!(
            l.message.starts_with("reading the trace: "),
            "{}",
            l.message
        );
        assert!(!l.message.contains('\n') && !l.hint.as_ref().unwrap().contains('\u{1b}'));
        assert_eq!(line(&cases[2]).hint.as_deref(), Some(PARQUET_HINT));
        assert_eq!(line(&cases[3]).location.as_deref(), Some("trace.json"));
        assert_eq!(line(&cases[4]).hint, None);
        assert_eq!(
            line(&cases[5]).hint.as_deref(),
            Some("pass a Spark setting")
        );
    }

    #[test]
    fn a_child_stderr_gets_its_human_text_back_and_its_error_apart() {
        let e: anyhow::Error = Error::invalid(
            Location::file(Path::new("requests/r.parquet")),
            "request_id 2 appears twice",
            "remove the duplicate",
        )
        .into();
        let json = line(&e).to_json();
        let with = format!("kvtrail: replay backend: CPU\n{json}\n");
        let (human, got) = split_stderr(with.as_bytes());
        assert_eq!(
            human,
            format!("kvtrail: replay backend: CPU\n{}\n", printed(&e))
        );
        assert_eq!(got.unwrap().hint.as_deref(), Some("remove the duplicate"));
        // No error line (a crash): the text as it is, no error.
        let (human, got) = split_stderr(b"thread 'main' panicked\n{\"type\":\"other\"}\n");
        assert_eq!(human, "thread 'main' panicked\n{\"type\":\"other\"}\n");
        assert!(got.is_none());
        assert!(ErrorLine::parse("error: x").is_none());
    }
}
