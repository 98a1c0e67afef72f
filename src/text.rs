//! Text for people, shared by the human-facing writers (the summary,
//! report.html, notification letters, look-up answers, every CLI message,
//! error messages): UTC times of Unix nanoseconds and durations (`jiff`,
//! the one time library: no clock, no time-zone database), Markdown
//! escaping of strings that come from a trace (the letters' auto-escape
//! callback; HTML is escaped by report.html's template engine), and `term` /
//! `term_message`, the escaping of such strings (and of error messages
//! quoting them) for terminals. CSV cells are `report::csv`.
//!
//! The bottom layer: it imports nothing of the crate, so `error` and every
//! layer above may use it.

use jiff::{RoundMode, SignedDuration, Span, SpanRound, Timestamp, Unit};

/// Unix epoch nanoseconds as a `jiff` timestamp. Every `i64` is in jiff's
/// range (years -9999 to 9999), so this never fails.
fn timestamp(ns: i64) -> Timestamp {
    Timestamp::from_nanosecond(i128::from(ns))
        .expect("every i64 of nanoseconds is a jiff timestamp")
}

/// Unix epoch nanoseconds as `YYYY-MM-DD HH:MM:SS.mmm UTC` (proleptic
/// Gregorian, milliseconds truncated): what people read in summaries,
/// report.html, letters and look-up answers.
pub fn utc(ns: i64) -> String {
    timestamp(ns)
        .strftime("%Y-%m-%d %H:%M:%S%.3f UTC")
        .to_string()
}

/// An optional time; `-` when absent.
pub fn utc_opt(ns: Option<i64>) -> String {
    ns.map(utc).unwrap_or_else(|| "-".into())
}

/// Unix epoch nanoseconds as RFC 3339 in UTC with all nine digits
/// (`YYYY-MM-DDTHH:MM:SS.nnnnnnnnnZ`): `inspect`, where the exact time of an
/// event matters.
pub fn rfc3339(ns: i64) -> String {
    format!("{:.9}", timestamp(ns))
}

/// A duration in nanoseconds for people (`3 days 4 h`, `12 min`, `850 ms`),
/// truncated to its largest unit (days of 24 hours: the span is elapsed
/// time, not calendar days).
pub fn duration(ns: i64) -> String {
    let d = SignedDuration::from_nanos(ns.max(0));
    let s = d.as_secs();
    if s < 1 {
        return format!("{} ms", d.as_millis());
    }
    match s {
        0..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", d.as_mins()),
        7200..=172_799 => format!("{} h", d.as_hours()),
        _ => {
            let span = Span::try_from(d)
                .and_then(|sp| {
                    sp.round(
                        SpanRound::new()
                            .largest(Unit::Day)
                            .smallest(Unit::Hour)
                            .mode(RoundMode::Trunc)
                            .days_are_24_hours(),
                    )
                })
                .expect("an i64 of nanoseconds fits a span of days and hours");
            format!("{} days {} h", span.get_days(), span.get_hours())
        }
    }
}

/// Escapes text for Markdown inline content and table cells: the ASCII
/// punctuation that Markdown reads as inline syntax or HTML anywhere in a
/// line gets a backslash (block syntax such as `#` or `-` only counts at
/// the start of a line, where trace strings never go), line breaks become
/// spaces.
pub fn md(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' | '`' | '*' | '_' | '[' | ']' | '<' | '>' | '|' | '~' | '&' => {
                o.push('\\');
                o.push(c);
            }
            '\n' | '\r' => o.push(' '),
            c if c.is_control() => o.push('\u{fffd}'),
            c => o.push(c),
        }
    }
    o
}

/// A Markdown code span holding `s` verbatim (a fence longer than any run
/// of backticks inside; `|` escaped so table cells stay intact).
pub fn code(s: &str) -> String {
    let s: String = s
        .chars()
        .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
        .collect();
    let s = s.replace('|', "\\|");
    let mut run = 0;
    let mut longest = 0;
    for c in s.chars() {
        run = if c == '`' { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    let fence = "`".repeat(longest + 1);
    if s.starts_with('`') || s.ends_with('`') || s.is_empty() {
        format!("{fence} {s} {fence}")
    } else {
        format!("{fence}{s}{fence}")
    }
}

/// Whether a character can rewrite or reorder what a terminal shows: C0
/// and C1 controls (escape sequences, carriage return, backspace, line
/// breaks), DEL, and the Unicode format characters that reorder or hide
/// text (bidi embeddings, overrides and isolates, zero-width characters,
/// line and paragraph separators, the byte-order mark).
fn spoofs(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{061c}' | '\u{00ad}' | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{206f}'
            | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}')
}

/// Text from a trace (tenant names, external ids, deployment names, file
/// paths) made safe for a terminal: every character that `spoofs` is
/// written as `\u{XX}`, so a name cannot move the cursor, clear the screen,
/// start a new line or reverse the text around it. The one helper for all
/// human output on stdout and stderr; JSON output stays exact JSON.
pub fn term(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(spoofs) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if spoofs(c) {
            o.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            o.push(c);
        }
    }
    std::borrow::Cow::Owned(o)
}

/// The one line break an error message may hold: before its hint.
pub const HINT_BREAK: &str = "\n  hint: ";

/// An error message made safe for a terminal: `term` on every part, so
/// that the only line breaks left are the tool's own `\n  hint: `
/// separators. Paths and values quoted in a message cannot start a line
/// of their own (`error::Location` and the structured errors escape theirs
/// with `term` already, so a forged separator there is escaped too).
pub fn term_message(s: &str) -> String {
    s.split(HINT_BREAK)
        .map(term)
        .collect::<Vec<_>>()
        .join(HINT_BREAK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_matches_known_dates() {
        for (ns, want) in [
            (0, "1970-01-01 00:00:00.000 UTC"),
            (1_788_480_000_123_000_000, "2026-09-04 00:00:00.123 UTC"),
            (951_782_400_000_000_000, "2000-02-29 00:00:00.000 UTC"),
            (-1_000_000, "1969-12-31 23:59:59.999 UTC"),
        ] {
            assert_eq!(utc(ns), want, "{ns}");
        }
    }

    #[test]
    fn times_at_the_ends_of_i64() {
        for (ns, want_utc, want_rfc) in [
            (
                0,
                "1970-01-01 00:00:00.000 UTC",
                "1970-01-01T00:00:00.000000000Z",
            ),
            (
                1_764_460_800_000_000_050,
                "2025-11-30 00:00:00.000 UTC",
                "2025-11-30T00:00:00.000000050Z",
            ),
            (
                951_782_400_123_456_789,
                "2000-02-29 00:00:00.123 UTC",
                "2000-02-29T00:00:00.123456789Z",
            ),
            (
                1_788_480_000_123_999_999,
                "2026-09-04 00:00:00.123 UTC",
                "2026-09-04T00:00:00.123999999Z",
            ),
            (
                -1,
                "1969-12-31 23:59:59.999 UTC",
                "1969-12-31T23:59:59.999999999Z",
            ),
            (
                i64::MIN,
                "1677-09-21 00:12:43.145 UTC",
                "1677-09-21T00:12:43.145224192Z",
            ),
            (
                i64::MAX,
                "2262-04-11 23:47:16.854 UTC",
                "2262-04-11T23:47:16.854775807Z",
            ),
        ] {
            assert_eq!(utc(ns), want_utc, "{ns}");
            assert_eq!(rfc3339(ns), want_rfc, "{ns}");
        }
        assert_eq!(utc_opt(None), "-");
    }

    #[test]
    fn durations_truncate_to_their_largest_unit() {
        const S: i64 = 1_000_000_000;
        for (ns, want) in [
            (-5, "0 ms"),
            (0, "0 ms"),
            (999_999_999, "999 ms"),
            (S, "1 s"),
            (119 * S + 999, "119 s"),
            (120 * S, "2 min"),
            (7199 * S, "119 min"),
            (7200 * S, "2 h"),
            (172_799 * S, "47 h"),
            (172_800 * S, "2 days 0 h"),
            ((3 * 86_400 + 4 * 3600 + 3599) * S, "3 days 4 h"),
            (i64::MAX, "106751 days 23 h"),
        ] {
            assert_eq!(duration(ns), want, "{ns}");
        }
    }

    #[test]
    fn term_escapes_what_can_spoof_a_terminal() {
        assert_eq!(term("acme-corp ünï"), "acme-corp ünï");
        assert_eq!(
            term("a\x1b[2J\rNOT AFFECTED\n\u{202e}x"),
            "a\\u{1b}[2J\\u{d}NOT AFFECTED\\u{a}\\u{202e}x"
        );
        assert_eq!(term("\u{9b}\u{7f}\u{200b}"), "\\u{9b}\\u{7f}\\u{200b}");
    }

    #[test]
    fn term_message_keeps_only_hint_breaks() {
        assert_eq!(
            term_message("a\nerror: b\r\n  hint: do x\x1b"),
            "a\\u{a}error: b\\u{d}\n  hint: do x\\u{1b}"
        );
    }

    #[test]
    fn escapes_neutralise_markup() {
        assert_eq!(
            md("a|b [x](y) acme-corp.eu"),
            "a\\|b \\[x\\](y) acme-corp.eu"
        );
    }
}
