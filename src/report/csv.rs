//! CSV for the files kvtrail writes (responses.csv, tenants.csv,
//! requests.csv, register.csv) and reads back (requests.csv, for `lookup`,
//! `notify` and the exports): RFC 4180 through the `csv` crate, plus the one
//! encoding of text cells, which keeps spreadsheets from running them and
//! reads back exactly.
//!
//! Spreadsheet rule (OWASP "CSV injection"): a text cell that begins with
//! `=`, `+`, `-`, `@`, a tab or a carriage return would be run as a formula,
//! so it gets a leading `'`; so does a text cell that already begins with
//! `'` (`untext` strips one leading `'`).
//!
//! Exactly reversible: no two values are written as the same cell, so a
//! program reading a cell back compares what the trace held.
//! - A NUL (which spreadsheets and many CSV readers take for the end of the
//!   file, and which no command line can carry) is never written as itself:
//!   a value holding a NUL or U+FFFD (the character earlier versions wrote
//!   for a NUL) is written `'%` and the value percent-encoded (`%` as
//!   `%25`, NUL as `%00`, the rest as it is). No other value is written
//!   beginning `'%` (a value beginning with `'` is written `''...`).
//! - An absent value (an external id the trace does not have) is the empty
//!   cell; an empty value of an optional column is a lone `'` (`text_opt`).
//! - In a `;`-separated list of values (`text_list`) an item holding `;` is
//!   percent-encoded as above, `;` as `%3B`.
//!
//! A cell holding U+FFFD outside `'%` was written by an earlier kvtrail,
//! which wrote a NUL as U+FFFD, so that two values could read the same:
//! `read_text` refuses it (the folder is to be written again by `scope`).
//! Only text cells (tenants, external ids, lists of them, operator text) go
//! through the rule: numeric cells, negative ones included, stay numbers.
//!
//! `responses_csv` and `tenants_csv` are a scope report's two tables.

use std::borrow::Cow;
use std::io::{Read, Write};

use crate::scope::{ScopeReport, Tenant};

/// Characters that make a spreadsheet read a cell as a formula, plus `'`.
const LEADING: [char; 7] = ['=', '+', '-', '@', '\t', '\r', '\''];

/// The prefix of a percent-encoded cell.
const ENCODED: &str = "'%";

/// A text cell made safe for spreadsheets and reversible (see the module
/// docs). The empty value is the empty cell: for a column that is never
/// absent (an optional column uses `text_opt`).
pub fn text(s: &str) -> Cow<'_, str> {
    encode(s, &[], false)
}

/// An optional text value's cell: absent is the empty cell, the empty
/// value a lone `'`, any other value its `text` cell.
pub fn text_opt(v: Option<&str>) -> Cow<'_, str> {
    match v {
        None => Cow::Borrowed(""),
        Some("") => Cow::Borrowed("'"),
        Some(s) => text(s),
    }
}

/// `s` as a cell, with the characters in `also` percent-encoded as well
/// (a list's separator); with `force`, percent-encoded whatever it holds.
fn encode<'a>(s: &'a str, also: &[char], force: bool) -> Cow<'a, str> {
    if force || s.contains(['\0', '\u{fffd}']) || s.contains(also) {
        let mut o = String::with_capacity(s.len() + 8);
        o.push_str(ENCODED);
        for c in s.chars() {
            match c {
                '%' | '\0' => o.push_str(&format!("%{:02X}", c as u32)),
                c if also.contains(&c) => o.push_str(&format!("%{:02X}", c as u32)),
                c => o.push(c),
            }
        }
        return Cow::Owned(o);
    }
    if s.starts_with(LEADING) {
        return Cow::Owned(format!("'{s}"));
    }
    Cow::Borrowed(s)
}

/// The value of a text cell written by `text` (or a `text_opt` cell that
/// is not empty), or what is wrong with the cell: a `'%` cell that is not
/// percent-encoded UTF-8, or U+FFFD outside one (an earlier kvtrail's
/// cell, in which a NUL and U+FFFD read the same).
pub fn read_text(s: &str) -> Result<Cow<'_, str>, String> {
    if let Some(body) = s.strip_prefix(ENCODED) {
        return percent_decode(body).map(Cow::Owned);
    }
    if s.contains('\u{fffd}') {
        return Err(
            "holds U+FFFD outside a percent-encoded cell: it was written by an earlier kvtrail, which wrote a NUL as U+FFFD, so two different values may read the same here"
                .into(),
        );
    }
    Ok(Cow::Borrowed(s.strip_prefix('\'').unwrap_or(s)))
}

/// An optional text column's value: the empty cell is absent, any other
/// cell is read by `read_text` (a lone `'` is the empty value).
pub fn read_text_opt(s: &str) -> Result<Option<Cow<'_, str>>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    read_text(s).map(Some)
}

/// The value of a cell written by `text`, for a program that wrote it
/// itself (a cell `read_text` refuses is returned as it is).
pub fn untext(s: &str) -> Cow<'_, str> {
    read_text(s).unwrap_or(Cow::Borrowed(s))
}

fn percent_decode(body: &str) -> Result<String, String> {
    let b = body.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok());
            let Some(v) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) else {
                return Err(format!(
                    "a cell beginning `{ENCODED}` is percent-encoded, and `%` at character {} is not followed by two hex digits",
                    body[..i].chars().count() + 1
                ));
            };
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| format!("a cell beginning `{ENCODED}` does not decode to UTF-8"))
}

/// A list of text values in one cell, each made safe, `;`-separated (a
/// spreadsheet set to split on `;` then still sees no formula); an item
/// holding `;` is percent-encoded, an empty item is a lone `'`, so the
/// list reads back item by item (`read_text_list`).
pub fn text_list<'a>(items: impl IntoIterator<Item = &'a str>) -> String {
    items
        .into_iter()
        .map(|s| match s {
            "" => Cow::Borrowed("'"),
            s => encode(s, &[';'], false),
        })
        .collect::<Vec<_>>()
        .join(";")
}

/// A tenant's cell in responses.csv and tenants.csv: as people see it
/// (`Tenant`'s `Display`: `(engine)`, `(unknown)`, a customer's name, in
/// double quotes where it reads like one of those labels) through `text`.
/// A customer whose name is itself such a quoted label (`"(engine)"`),
/// which `Display` shows like the customer named `(engine)`, is
/// percent-encoded (`'%"(engine)"`), so that no two tenants share a cell.
pub fn tenant_cell(t: &Tenant) -> String {
    tenant_item(t, &[])
}

fn tenant_item(t: &Tenant, also: &[char]) -> String {
    let shown = t.to_string();
    let quoted_label = matches!(t, Tenant::Customer(s)
        if [Tenant::ENGINE_LABEL, Tenant::UNKNOWN_LABEL]
            .iter()
            .any(|l| s.strip_prefix('"').and_then(|r| r.strip_suffix('"')) == Some(*l)));
    match shown.as_str() {
        "" if !also.is_empty() => "'".into(),
        _ => encode(&shown, also, quoted_label).into_owned(),
    }
}

/// The distinct tenants of a response's sources as one `text_list` cell,
/// in the order people see them (`summary::source_tenants`), each as
/// its `tenant_cell`.
fn source_tenant_cell(a: &crate::scope::Response) -> String {
    let mut ts: Vec<&Tenant> = a.sources.iter().map(|x| &x.tenant).collect();
    ts.sort_by(|x, y| x.to_string().cmp(&y.to_string()).then(x.cmp(y)));
    ts.dedup();
    ts.iter()
        .map(|t| tenant_item(t, &[';']))
        .collect::<Vec<_>>()
        .join(";")
}

/// The items of a `text_list` cell.
pub fn read_text_list(s: &str) -> Result<Vec<String>, String> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(';')
        .map(|x| read_text(x).map(Cow::into_owned))
        .collect()
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
        let ids: Vec<String> = a.sources.iter().map(|x| x.request_id.to_string()).collect();
        [
            a.request_id.to_string(),
            text_opt(a.external_id.as_deref()).into_owned(),
            tenant_cell(&a.tenant),
            opt(&a.arrival_ns),
            opt(&a.http_status),
            opt(&a.output_hash),
            a.foreign_tokens.to_string(),
            a.unknown_tokens.to_string(),
            a.uncertain_tokens.to_string(),
            a.cross_tenant.to_string(),
            a.confidence.as_str().to_string(),
            text_list(a.reasons.iter().map(String::as_str)),
            source_tenant_cell(a),
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
            tenant_cell(&t.tenant),
            t.responses.to_string(),
            t.responses.to_string(),
            t.foreign_tokens.to_string(),
            String::new(),
        ]
    });
    let src = r.sources.iter().map(|t| {
        [
            "source".to_string(),
            tenant_cell(&t.tenant),
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
            "a\0b",
            "\0",
            "=\0",
            "a\u{fffd}",
            "'%00",
            "%00",
            "100%\0",
        ] {
            assert_eq!(read_text(&text(s)).unwrap(), s, "{s:?}");
            assert_eq!(untext(&text(s)), s, "{s:?}");
            assert!(!text(s).starts_with(['=', '+', '-', '@', '\t', '\r']));
            assert!(!text(s).contains('\0'), "{s:?}");
        }
        assert_eq!(text("=HYPERLINK(1)"), "'=HYPERLINK(1)");
        assert_eq!(text("a\0b"), "'%a%00b");
        assert_eq!(text("100%"), "100%");
        assert_eq!(text_list(["a", "=b"]), "a;'=b");
        let csv = to_string(&["n", "t"], [["-5".to_string(), text("-5").into_owned()]]);
        assert_eq!(csv, "n,t\n-5,'-5\n");
        let csv = to_string(&["t"], [[text("a,\"b\"\nc").into_owned()]]);
        assert_eq!(csv, "t\n\"a,\"\"b\"\"\nc\"\n");
    }

    #[test]
    fn defect4_no_two_values_share_a_cell() {
        let values = [
            "acme",
            "acme\0",
            "acme\u{fffd}",
            "acme\u{fffd}0",
            "acme\0\x30",
            "acme%00",
            "'acme",
            "''acme",
            "'",
            "",
            "a;b",
            "%",
            "%25",
        ];
        let mut cells = std::collections::BTreeMap::new();
        for v in values {
            if let Some(other) = cells.insert(text(v).into_owned(), v) {
                panic!("{v:?} and {other:?} are both written {:?}", text(v));
            }
        }
        // An earlier kvtrail's NUL (U+FFFD outside `'%`) is refused, not
        // read as one of two values.
        assert!(
            read_text("acme\u{fffd}")
                .unwrap_err()
                .contains("earlier kvtrail")
        );
        assert!(read_text("'%acme%0").is_err());
        assert!(read_text("'%%ff").is_err());
        // List items stay items.
        for items in [
            vec![],
            vec![""],
            vec!["", ""],
            vec!["a;b"],
            vec!["a", "b"],
            vec!["=x", "a\0", "'"],
        ] {
            let cell = text_list(items.iter().copied());
            assert_eq!(read_text_list(&cell).unwrap(), items, "{cell:?}");
        }
    }

    #[test]
    fn defect4_no_two_tenants_share_a_cell() {
        let c = |s: &str| Tenant::Customer(s.into());
        let tenants = [
            Tenant::Engine,
            Tenant::Unknown,
            c("(engine)"),
            c("\"(engine)\""),
            c("(unknown)"),
            c("\"(unknown)\""),
            c("acme"),
            c("acme\0"),
            c("acme\u{fffd}"),
            c("=x"),
        ];
        let mut cells = std::collections::BTreeMap::new();
        for t in &tenants {
            if let Some(other) = cells.insert(tenant_cell(t), t) {
                panic!("{t:?} and {other:?} share {:?}", tenant_cell(t));
            }
            let item = tenant_item(t, &[';']);
            assert_eq!(read_text_list(&item).unwrap().len(), 1, "{item:?}");
        }
        assert_eq!(tenant_cell(&c("(engine)")), "\"(engine)\"");
        assert_eq!(tenant_cell(&c("\"(engine)\"")), "'%\"(engine)\"");
        assert_eq!(tenant_cell(&c("acme")), "acme");
    }

    #[test]
    fn defect6_an_empty_value_is_not_an_absent_one() {
        assert_eq!(text_opt(None), "");
        assert_eq!(text_opt(Some("")), "'");
        assert_eq!(read_text_opt("").unwrap(), None);
        assert_eq!(read_text_opt("'").unwrap().as_deref(), Some(""));
        for v in ["x", "'", "=", "\0"] {
            assert_eq!(
                read_text_opt(&text_opt(Some(v))).unwrap().as_deref(),
                Some(v)
            );
        }
    }
}
