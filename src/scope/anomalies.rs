//! Request-level anomalies visible without KV events: the error that looked
//! like success (prefilled_tokens < prompt_tokens with a 2xx status), and
//! prompts longer than the request's prefill pool can hold (SGLang:
//! max_req_input_len = min(context_window - 1, capacity - 1) - 5; the
//! prefill rejects when prompt_tokens >= max_req_input_len).

use super::model::Anomaly;
use crate::schema::RequestRecord;
use crate::trace::manifest::{Deployment, Role};
use crate::trace::read::RequestRows;

/// `kind` of a request that prefilled fewer tokens than its prompt yet was
/// answered 2xx ([`error_looks_like_success`]).
pub const ERROR_LOOKS_LIKE_SUCCESS: &str = "error_looks_like_success";
/// `kind` of a prompt at or over its prefill pool's `max_req_input_len`.
pub const PROMPT_EXCEEDS_PREFILL_POOL: &str = "prompt_exceeds_prefill_pool";

/// A 2xx status: the customer was told the request succeeded.
pub fn answered_ok(http_status: u16) -> bool {
    (200..300).contains(&http_status)
}

/// The prefill computed fewer tokens than the prompt held.
pub fn short_prefill(prompt_tokens: u32, prefilled_tokens: Option<u32>) -> bool {
    prefilled_tokens.is_some_and(|pf| pf < prompt_tokens)
}

/// The error that looked like success: a short prefill answered 2xx (the
/// one rule for scope's anomaly, report.html and the letters).
pub fn error_looks_like_success(
    prompt_tokens: u32,
    prefilled_tokens: Option<u32>,
    http_status: u16,
) -> bool {
    short_prefill(prompt_tokens, prefilled_tokens) && answered_ok(http_status)
}

/// Checks requests against the deployment.
pub struct Checker {
    /// (pool id, max_req_input_len)
    limits: Vec<(u16, u64)>,
    /// The pool used when a request names no prefill pool: the only
    /// prefill (or mixed) pool, if there is exactly one.
    default_pool: Option<u16>,
}

impl Checker {
    pub fn new(d: &Deployment) -> Self {
        let limits = d.pools.iter().map(|p| (p.id, d.prompt_limit(p))).collect();
        let prefill: Vec<u16> = d
            .pools
            .iter()
            .filter(|p| matches!(p.role, Role::Prefill | Role::Mixed))
            .map(|p| p.id)
            .collect();
        Checker {
            limits,
            default_pool: (prefill.len() == 1).then(|| prefill[0]),
        }
    }

    /// The anomalies of a request of these fields: (kind, prefill pool,
    /// limit, detail). The one home of both rules; most requests have none.
    fn found(
        &self,
        prompt_tokens: u32,
        prefilled_tokens: Option<u32>,
        http_status: u16,
        prefill_pool: Option<u16>,
    ) -> Vec<(&'static str, Option<u16>, Option<u64>, String)> {
        let mut out = Vec::new();
        if let Some(pf) = prefilled_tokens
            && error_looks_like_success(prompt_tokens, prefilled_tokens, http_status)
        {
            out.push((
                ERROR_LOOKS_LIKE_SUCCESS,
                prefill_pool,
                None,
                format!(
                    "prefill computed {pf} of {prompt_tokens} prompt tokens, yet the customer got HTTP {http_status}"
                ),
            ));
        }
        let pool = prefill_pool.or(self.default_pool);
        if let Some(p) = pool
            && let Some(&(_, limit)) = self.limits.iter().find(|l| l.0 == p)
            && prompt_tokens as u64 >= limit
        {
            out.push((
                PROMPT_EXCEEDS_PREFILL_POOL,
                Some(p),
                Some(limit),
                format!(
                    "prompt of {prompt_tokens} tokens >= max_req_input_len {limit} of pool {p}: the prefill must reject it (HTTP {http_status} returned)"
                ),
            ));
        }
        out
    }

    pub fn check(&self, r: &RequestRecord, out: &mut Vec<Anomaly>) {
        let found = self.found(
            r.prompt_tokens,
            r.prefilled_tokens,
            r.http_status,
            r.prefill_pool,
        );
        push(r, found, out);
    }

    /// Row `i` of `rows` checked in place: its anomalies go to `out`, and
    /// its record is built only when it has any (or `keep` asks for it; the
    /// record is returned then).
    pub fn check_row(
        &self,
        rows: &RequestRows<'_>,
        i: usize,
        keep: bool,
        out: &mut Vec<Anomaly>,
    ) -> Option<RequestRecord> {
        let found = self.found(
            rows.prompt_tokens(i),
            rows.prefilled_tokens(i),
            rows.http_status(i),
            rows.prefill_pool(i),
        );
        if found.is_empty() && !keep {
            return None;
        }
        let r = rows.record(i);
        push(&r, found, out);
        keep.then_some(r)
    }
}

/// The anomalies `found` of request `r`, as reported.
fn push(
    r: &RequestRecord,
    found: Vec<(&'static str, Option<u16>, Option<u64>, String)>,
    out: &mut Vec<Anomaly>,
) {
    for (kind, pool, limit, detail) in found {
        out.push(Anomaly {
            request_id: r.request_id,
            external_id: r.external_id.clone(),
            tenant: r.tenant.clone(),
            kind: kind.to_string(),
            prompt_tokens: r.prompt_tokens,
            prefilled_tokens: r.prefilled_tokens,
            http_status: r.http_status,
            prefill_pool: pool,
            limit,
            detail,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_looks_like_success_needs_a_short_prefill_and_a_2xx() {
        for (prompt, prefilled, status, short, want) in [
            (100, Some(1), 200, true, true),
            (100, Some(99), 299, true, true),
            (100, Some(100), 200, false, false),
            (100, Some(1), 500, true, false),
            (100, Some(1), 199, true, false),
            (100, Some(1), 300, true, false),
            (100, None, 200, false, false),
            (0, Some(0), 200, false, false),
        ] {
            assert_eq!(
                short_prefill(prompt, prefilled),
                short,
                "{prompt} {prefilled:?}"
            );
            assert_eq!(
                error_looks_like_success(prompt, prefilled, status),
                want,
                "{prompt} {prefilled:?} {status}"
            );
        }
    }
}
