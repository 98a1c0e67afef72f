//! CSV for the files kvtrail writes (responses.csv, tenants.csv,
//! requests.csv, register.csv) and reads back (requests.csv, for `lookup`
//! and `notify`): RFC 4180 through the `csv` crate, plus the one rule for
//! text cells that people open in spreadsheets.
//!
//! Spreadsheet rule (OWASP "CSV injection"): a text cell that begins with
//! `=`, `+`, `-`, `@`, a tab or a carriage return would be run as a formula,
//! so it gets a leading `'`; so does a text cell that already begins with
//! `'`, which makes the rule exactly reversible (`untext` strips one leading
//! `'`). A NUL (which spreadsheets and many CSV readers treat as the end of
//! the file, and which no command line can carry) becomes U+FFFD. Only text
//! cells (tenants, external ids, lists of them, operator text) go through
//! the rule: numeric cells, negative ones included, stay numbers.

use std::borrow::Cow;
use std::io::Write;

/// Characters that make a spreadsheet read a cell as a formula, plus `'`.
const LEADING: [char; 7] = ['=', '+', '-', '@', '\t', '\r', '\''];

/// A text cell made safe for spreadsheets (see the module docs).
pub fn text(s: &str) -> Cow<'_, str> {
    let lead = s.starts_with(LEADING);
    if !lead && !s.contains('\0') {
        return Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 1);
    if lead {
        o.push('\'');
    }
    o.extend(s.chars().map(|c| if c == '\0' { '\u{fffd}' } else { c }));
    Cow::Owned(o)
}

/// The value of a text cell written by `text` (one leading `'` removed).
pub fn untext(s: &str) -> &str {
    s.strip_prefix('\'').unwrap_or(s)
}

/// A list of text values in one cell, each made safe, `;`-separated (a
/// spreadsheet set to split on `;` then still sees no formula).
pub fn text_list<'a>(items: impl IntoIterator<Item = &'a str>) -> String {
    items.into_iter().map(text).collect::<Vec<_>>().join(";")
}

/// A CSV writer: `\n` line ends, quotes only where RFC 4180 needs them.
pub fn writer<W: Write>(w: W) -> csv::Writer<W> {
    csv::WriterBuilder::new()
        .terminator(csv::Terminator::Any(b'\n'))
        .quote_style(csv::QuoteStyle::Necessary)
        .from_writer(w)
}

/// Header plus rows as CSV text (cells already made safe by the caller).
pub fn to_string<I, R, C>(header: &[&str], rows: I) -> String
where
    I: IntoIterator<Item = R>,
    R: IntoIterator<Item = C>,
    C: AsRef<[u8]>,
{
    let mut w = writer(Vec::new());
    w.write_record(header).expect("writing to memory");
    for r in rows {
        w.write_record(r).expect("writing to memory");
    }
    let bytes = w.into_inner().expect("writing to memory");
    String::from_utf8(bytes).expect("CSV of UTF-8 cells is UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_cells_round_trip_and_numbers_are_untouched() {
        for s in [
            "plain",
            "=1+1",
            "+x",
            "-x",
            "@x",
            "\tx",
            "\rx",
            "'x",
            "''=x",
            "",
            "a,b",
            "say \"hi\"",
        ] {
            assert_eq!(untext(&text(s)), s, "{s:?}");
            assert!(!text(s).starts_with(['=', '+', '-', '@', '\t', '\r']));
        }
        assert_eq!(text("=HYPERLINK(1)"), "'=HYPERLINK(1)");
        assert_eq!(text("a\0b"), "a\u{fffd}b");
        assert_eq!(text_list(["a", "=b"]), "a;'=b");
        let csv = to_string(&["n", "t"], [["-5".to_string(), text("-5").into_owned()]]);
        assert_eq!(csv, "n,t\n-5,'-5\n");
        let csv = to_string(&["t"], [[text("a,\"b\"\nc").into_owned()]]);
        assert_eq!(csv, "t\n\"a,\"\"b\"\"\nc\"\n");
    }
}
