//! The script as it is written: statements, each preceded by its comment
//! lines and ended by `;` at the end of a line ([`SEPARATOR`]).

use std::fmt::Write as _;

use super::dialect::SEPARATOR;

/// The text of the script so far.
#[derive(Default)]
pub(super) struct Script(String);

impl Script {
    /// Appends one statement: each line of `comment` as a `--` line, then
    /// `body` (trailing whitespace dropped), `;`, and an empty line.
    pub fn stmt(&mut self, comment: &str, body: String) {
        for l in comment.trim().lines() {
            let _ = writeln!(self.0, "-- {}", l.trim());
        }
        self.0.push_str(body.trim_end());
        self.0.push_str(SEPARATOR);
        self.0.push('\n');
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl std::fmt::Write for Script {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.push_str(s);
        Ok(())
    }
}
