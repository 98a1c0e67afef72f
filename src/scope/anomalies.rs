//! Request-level anomalies visible without KV events: the error that looked
//! like success (prefilled_tokens < prompt_tokens with a 2xx status), and
//! prompts longer than the request's prefill pool can hold (SGLang:
//! max_req_input_len = min(context_window - 1, capacity - 1) - 5; the
//! prefill rejects when prompt_tokens >= max_req_input_len).

use super::model::Anomaly;
use crate::schema::RequestRecord;
use crate::trace::manifest::{Deployment, Role};

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

    pub fn check(&self, r: &RequestRecord, out: &mut Vec<Anomaly>) {
        let base = |kind: &str, pool: Option<u16>, limit: Option<u64>, detail: String| Anomaly {
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
        };
        if let Some(pf) = r.prefilled_tokens
            && error_looks_like_success(r.prompt_tokens, r.prefilled_tokens, r.http_status)
        {
            out.push(base(
                ERROR_LOOKS_LIKE_SUCCESS,
                r.prefill_pool,
                None,
                format!(
                    "prefill computed {pf} of {} prompt tokens, yet the customer got HTTP {}",
                    r.prompt_tokens, r.http_status
                ),
            ));
        }
        let pool = r.prefill_pool.or(self.default_pool);
        if let Some(p) = pool
            && let Some(&(_, limit)) = self.limits.iter().find(|l| l.0 == p)
            && r.prompt_tokens as u64 >= limit
        {
            out.push(base(
                PROMPT_EXCEEDS_PREFILL_POOL,
                Some(p),
                Some(limit),
                format!(
                    "prompt of {} tokens >= max_req_input_len {limit} of pool {p}: the prefill must reject it (HTTP {} returned)",
                    r.prompt_tokens, r.http_status
                ),
            ));
        }
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
