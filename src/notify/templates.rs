//! The letter templates: kvtrail's defaults in English and German (the
//! files under templates/notify/, built into the binary), an operator's
//! own folder of templates overriding any of them by file name, and the
//! one place where Markdown escaping happens.
//!
//! Every template runs in a `minijinja` environment with strict undefined
//! behaviour (an unknown variable is an error), a fuel limit and a cap on
//! the size of what it writes (both growing with the rows of the notice),
//! so a template cannot hang or exhaust memory.
//! Templates whose name ends in `.md.j2` are auto-escaped for Markdown: a
//! value printed with `{{ ... }}` goes through `text::md` unless it
//! is already markup (the output of a macro or of the `code` filter, which
//! makes a Markdown code span). A template cannot forget to escape a
//! tenant name or an external id: it would have to mark it safe on purpose.
//!
//! Nothing is registered globally: a render sees only the context it is
//! given (one customer's notice), the built-in filters and tests, and the
//! `code` filter.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use minijinja::{AutoEscape, Environment, ErrorKind, UndefinedBehavior, Value};

use crate::error::{Error, Location, Result};
use crate::text::{code, md};

/// The language of the default templates and of the sentences kvtrail
/// writes into notice.json and the register.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lang {
    #[default]
    En,
    De,
}

impl Lang {
    pub const ALL: [Lang; 2] = [Lang::En, Lang::De];

    /// `en` or `de`.
    pub fn code(self) -> &'static str {
        match self {
            Lang::En => "en",
            Lang::De => "de",
        }
    }

    /// `en` or `de`; anything else is none.
    pub fn parse(s: &str) -> Option<Lang> {
        Lang::ALL.into_iter().find(|l| l.code() == s)
    }
}

/// The customer letter.
pub const LETTER: &str = "letter.md.j2";
/// The processor-to-controller notice (Art. 33(2)).
pub const PROCESSOR_NOTICE: &str = "processor-notice.md.j2";
/// The sections both documents share, as macros.
pub const SECTIONS: &str = "sections.md.j2";
/// The breach register entry (Art. 33(5)), register.md.
pub const REGISTER: &str = "register.md.j2";

/// Every template file name, in the order they are written out.
pub const NAMES: [&str; 4] = [LETTER, PROCESSOR_NOTICE, SECTIONS, REGISTER];

/// The built-in template `name` in `lang`.
pub fn default_source(lang: Lang, name: &str) -> Option<&'static str> {
    Some(match (lang, name) {
        (Lang::En, LETTER) => include_str!("../../templates/notify/en/letter.md.j2"),
        (Lang::En, PROCESSOR_NOTICE) => {
            include_str!("../../templates/notify/en/processor-notice.md.j2")
        }
        (Lang::En, SECTIONS) => include_str!("../../templates/notify/en/sections.md.j2"),
        (Lang::De, LETTER) => include_str!("../../templates/notify/de/letter.md.j2"),
        (Lang::De, PROCESSOR_NOTICE) => {
            include_str!("../../templates/notify/de/processor-notice.md.j2")
        }
        (Lang::De, SECTIONS) => include_str!("../../templates/notify/de/sections.md.j2"),
        (Lang::En, REGISTER) => include_str!("../../templates/notify/en/register.md.j2"),
        (Lang::De, REGISTER) => include_str!("../../templates/notify/de/register.md.j2"),
        _ => return None,
    })
}

/// The auto-escape format of Markdown templates.
const MARKDOWN: &str = "markdown";

/// Largest template file read from `--templates`.
const MAX_TEMPLATE_BYTES: u64 = 1 << 20;

/// What one render may write: a base plus a share per row of the notice
/// (a listed response or request), far above what a letter needs.
const OUTPUT_BASE: usize = 16 << 20;
const OUTPUT_PER_ROW: usize = 16 << 10;

/// Instructions one render may run: a base plus a share per row, some
/// twenty times what the built-in letters use, far below what a template
/// that loops for ever would run (it stops within seconds).
const FUEL_BASE: u64 = 20_000_000;
const FUEL_PER_ROW: u64 = 4_000;

/// A loaded, compiled set of templates.
pub struct Templates {
    lang: Lang,
    env: Environment<'static>,
    /// Where each template came from, as a person reads it.
    origin: BTreeMap<&'static str, Origin>,
}

#[derive(Debug, Clone)]
enum Origin {
    Builtin,
    File(PathBuf),
}

impl Templates {
    /// The defaults of `lang`, each overridden by the file of the same name
    /// in `dir` when there is one. Any template that does not compile, an
    /// unreadable folder or file, and a `*.j2` file in `dir` that is no
    /// template's name are errors.
    pub fn load(lang: Lang, dir: Option<&Path>) -> Result<Templates> {
        let mut sources: BTreeMap<&'static str, (String, Origin)> = NAMES
            .iter()
            .map(|n| {
                let src = default_source(lang, n).expect("every name has a default");
                (*n, (src.to_string(), Origin::Builtin))
            })
            .collect();
        if let Some(dir) = dir {
            for (name, path) in read_dir(dir)? {
                let text = read_template(&path)?;
                sources.insert(name, (text, Origin::File(path)));
            }
        }
        let mut env = Environment::new();
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        env.set_keep_trailing_newline(true);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|name| {
            if name.ends_with(".md.j2") {
                AutoEscape::Custom(MARKDOWN)
            } else {
                AutoEscape::None
            }
        });
        env.set_formatter(|out, state, value| {
            if state.auto_escape() == AutoEscape::Custom(MARKDOWN) && !value.is_safe() {
                return out
                    .write_str(&md(&value.to_string()))
                    .map_err(minijinja::Error::from);
            }
            minijinja::escape_formatter(out, state, value)
        });
        env.add_filter("code", |s: String| Value::from_safe_string(code(&s)));
        let mut origin = BTreeMap::new();
        for (name, (text, from)) in sources {
            if let Err(e) = env.add_template_owned(name, text) {
                return Err(template_error(name, &from, lang, &e));
            }
            origin.insert(name, from);
        }
        Ok(Templates { lang, env, origin })
    }

    /// The language of the defaults in use.
    pub fn lang(&self) -> Lang {
        self.lang
    }

    /// Renders template `name` with `ctx` (only ever one customer's data),
    /// whose lists hold `rows` rows in all (the limits grow with them).
    pub fn render(&self, name: &'static str, ctx: &Value, rows: usize) -> Result<String> {
        let mut env = self.env.clone();
        env.set_fuel(Some(
            FUEL_BASE.saturating_add(FUEL_PER_ROW.saturating_mul(rows as u64)),
        ));
        let t = env.get_template(name).map_err(|e| self.error(name, &e))?;
        let mut out = Capped {
            buf: Vec::new(),
            over: false,
            cap: OUTPUT_BASE.saturating_add(OUTPUT_PER_ROW.saturating_mul(rows)),
        };
        let done = t.render_captured_to(ctx, &mut out);
        if out.over {
            return Err(self.too_much(name, out.cap));
        }
        done.map_err(|e| self.error(name, &e))?;
        String::from_utf8(out.buf).map_err(|_| {
            Error::Other(format!(
                "template {name} wrote text that is not UTF-8; nothing was written"
            ))
        })
    }

    fn too_much(&self, name: &str, cap: usize) -> Error {
        let loc = match self.origin.get(name) {
            Some(Origin::File(p)) => Location::file(p),
            _ => Location::file(Path::new(&format!(
                "{name} (built-in, {})",
                self.lang.code()
            ))),
        };
        Error::invalid(
            loc,
            format!("the template wrote more than {} MiB", cap >> 20),
            "a letter is far smaller: a loop that does not end? fix the template",
        )
    }

    fn error(&self, name: &str, e: &minijinja::Error) -> Error {
        // The template the error happened in (an include or an import may
        // have led elsewhere).
        let at = e.name().unwrap_or(name);
        let from = NAMES
            .iter()
            .find(|n| **n == at)
            .and_then(|n| self.origin.get(n))
            .cloned()
            .unwrap_or(Origin::Builtin);
        template_error(at, &from, self.lang, e)
    }
}

/// The template files of `dir`, by template name. Files not ending in
/// `.j2` are left alone (a README beside the templates is fine).
fn read_dir(dir: &Path) -> Result<Vec<(&'static str, PathBuf)>> {
    let hint = "pass a folder holding some of letter.md.j2, processor-notice.md.j2, sections.md.j2, register.md.j2 (`kvtrail notify --write-default-templates DIR` writes the defaults to start from)";
    let rd = std::fs::read_dir(dir).map_err(|e| {
        Error::invalid(
            Location::file(dir),
            format!("cannot read the templates folder: {e}"),
            hint,
        )
    })?;
    let mut found = Vec::new();
    for e in rd {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let file = e.file_name();
        let Some(file) = file.to_str() else {
            continue;
        };
        if !file.ends_with(".j2") {
            continue;
        }
        let path = e.path();
        let Some(name) = NAMES.iter().find(|n| **n == file) else {
            return Err(Error::invalid(
                Location::file(&path),
                "no template has this name (a misspelt name would silently leave the default in use)",
                format!(
                    "template files are {}; rename or remove it",
                    NAMES.join(", ")
                ),
            ));
        };
        found.push((*name, path));
    }
    found.sort();
    Ok(found)
}

/// One template file: a regular file, at most `MAX_TEMPLATE_BYTES`, UTF-8.
fn read_template(path: &Path) -> Result<String> {
    let bad = |what: String| {
        Error::invalid(
            Location::file(path),
            what,
            "a template is a UTF-8 text file of at most 1 MiB",
        )
    };
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    if meta.len() > MAX_TEMPLATE_BYTES {
        return Err(bad(format!("{} bytes is too large", meta.len())));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| bad(format!("not UTF-8: {e}")))
}

/// A minijinja error as kvtrail's: the template file, line and column,
/// what went wrong, and what to do.
fn template_error(name: &str, from: &Origin, lang: Lang, e: &minijinja::Error) -> Error {
    let mut what = String::new();
    let _ = write!(what, "template error");
    if let Some(line) = e.line() {
        let _ = write!(what, " at line {line}");
        let col = e
            .range()
            .zip(e.template_source())
            .and_then(|(r, src)| src.get(..r.start))
            .map(|before| before.rsplit('\n').next().unwrap_or("").chars().count() + 1);
        if let Some(col) = col {
            let _ = write!(what, ", column {col}");
        }
    }
    let _ = write!(what, ": {}", e.kind());
    if let Some(d) = e.detail() {
        let _ = write!(what, ": {d}");
    }
    let hint = match e.kind() {
        ErrorKind::UndefinedError => {
            "a template may use only the variables docs/notify.md lists (`notice`, `lang`); fix the template"
        }
        ErrorKind::SyntaxError | ErrorKind::BadEscape => "fix the template's syntax",
        ErrorKind::OutOfFuel => "the template ran too long (a loop that does not end?); fix it",
        _ => "fix the template; docs/notify.md lists its variables",
    };
    let loc = match from {
        Origin::File(p) => Location::file(p),
        Origin::Builtin => {
            Location::file(Path::new(&format!("{name} (built-in, {})", lang.code())))
        }
    };
    Error::invalid(loc, what, hint)
}

/// Refuses output past `cap` bytes.
struct Capped {
    buf: Vec<u8>,
    cap: usize,
    /// Whether a write was refused.
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + buf.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other(format!(
                "the document would exceed {} MiB",
                self.cap >> 20
            )));
        }
        self.buf.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes the default templates of `lang` into `dir` (created if needed;
/// existing template files are never overwritten). Returns the files.
pub fn write_defaults(lang: Lang, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let paths: Vec<PathBuf> = NAMES.iter().map(|n| dir.join(n)).collect();
    if let Some(p) = paths.iter().find(|p| p.exists()) {
        return Err(Error::invalid(
            Location::file(p),
            "a template file already exists here; nothing was written",
            "pass a new or empty folder",
        ));
    }
    for (n, p) in NAMES.iter().zip(&paths) {
        let src = default_source(lang, n).expect("every name has a default");
        std::fs::write(p, src).map_err(|e| Error::io(p, e))?;
    }
    Ok(paths)
}
