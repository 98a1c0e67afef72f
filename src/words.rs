//! Counted nouns for people: `1 response`, `2 responses`. The one rule
//! for singular and plural in every sentence kvtrail writes (verdicts,
//! coverage notes, summaries, report.html, letters, CLI messages); it
//! imports nothing, so every layer may use it.

/// `n` and the noun that agrees with it: `one` for exactly 1, `many`
/// otherwise (0 included: "0 responses").
pub fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", noun(n, one, many))
}

/// The form of a noun (or verb) that agrees with `n`, without the number:
/// `one` for exactly 1, `many` otherwise.
pub fn noun<'a>(n: u64, one: &'a str, many: &'a str) -> &'a str {
    if n == 1 { one } else { many }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_is_singular_everything_else_plural() {
        assert_eq!(count(1, "response", "responses"), "1 response");
        assert_eq!(count(0, "response", "responses"), "0 responses");
        assert_eq!(count(2, "entry", "entries"), "2 entries");
        assert_eq!(
            count(u64::MAX, "slot", "slots"),
            format!("{} slots", u64::MAX)
        );
        assert_eq!(noun(1, "was", "were"), "was");
        assert_eq!(noun(3, "was", "were"), "were");
    }
}
