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
//!
//! `responses_csv` and `tenants_csv` are a scope report's two tables.

use std::borrow::Cow;
use std::io::{Read, Write};

use crate::report::fmt::source_tenants;
use crate::scope::ScopeReport;

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

/// A CSV reader for the files kvtrail reads back (requests.csv): no header
/// handling (the caller checks it), rows of any length (the caller counts
/// fields and names the row).
pub fn reader<R: Read>(r: R) -> ::csv::Reader<R> {
    ::csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .from_reader(r)
}

/// A CSV reader for single rows read at known byte offsets (the look-up
/// index's rows of requests.csv, `Reader::seek`): as `reader`, with a small
/// buffer, since each seek discards it.
pub fn row_reader<R: Read>(r: R) -> ::csv::Reader<R> {
    ::csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .buffer_capacity(4096)
        .from_reader(r)
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

fn opt<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map(|x| x.to_string()).unwrap_or_default()
}

/// responses.csv: one row per affected response (text cells made safe for
/// spreadsheets by `text`).
pub fn responses_csv(r: &ScopeReport) -> String {
    let rows = r.affected_responses.iter().map(|a| {
        let st = source_tenants(a);
        let ids: Vec<String> = a.sources.iter().map(|x| x.request_id.to_string()).collect();
        [
            a.request_id.to_string(),
            text(a.external_id.as_deref().unwrap_or("")).into_owned(),
            text(&a.tenant.to_string()).into_owned(),
            opt(&a.arrival_ns),
            opt(&a.http_status),
            opt(&a.output_hash),
            a.foreign_tokens.to_string(),
            a.unknown_tokens.to_string(),
            a.uncertain_tokens.to_string(),
            a.cross_tenant.to_string(),
            a.confidence.as_str().to_string(),
            text_list(a.reasons.iter().map(String::as_str)),
            text_list(st.iter().map(String::as_str)),
            ids.join(";"),
        ]
    });
    to_string(
        &[
            "request_id",
            "external_id",
            "tenant",
            "arrival_ns",
            "http_status",
            "output_hash",
            "foreign_tokens",
            "unknown_tokens",
            "uncertain_tokens",
            "cross_tenant",
            "confidence",
            "reasons",
            "source_tenants",
            "source_request_ids",
        ],
        rows,
    )
}

/// tenants.csv: one row per (role, tenant); role is recipient or source.
pub fn tenants_csv(r: &ScopeReport) -> String {
    let rec = r.recipients.iter().map(|t| {
        [
            "recipient".to_string(),
            text(&t.tenant.to_string()).into_owned(),
            t.responses.to_string(),
            t.responses.to_string(),
            t.foreign_tokens.to_string(),
            String::new(),
        ]
    });
    let src = r.sources.iter().map(|t| {
        [
            "source".to_string(),
            text(&t.tenant.to_string()).into_owned(),
            t.recipient_responses.to_string(),
            t.requests.to_string(),
            t.tokens.to_string(),
            t.cross_tenant_tokens.to_string(),
        ]
    });
    to_string(
        &[
            "role",
            "tenant",
            "responses",
            "requests",
            "tokens",
            "cross_tenant_tokens",
        ],
        rec.chain(src),
    )
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
