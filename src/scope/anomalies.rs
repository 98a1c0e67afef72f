//! Request-level anomalies visible without KV events: the error that looked
//! like success (prefilled_tokens < prompt_tokens with a 2xx status), and
//! prompts longer than the request's prefill pool can hold (SGLang:
//! max_req_input_len = min(context_window - 1, capacity - 1) - 5; the
//! prefill rejects when prompt_tokens >= max_req_input_len).

use super::model::Anomaly;
use crate::schema::RequestRecord;
use crate::trace::manifest::{Deployment, Role};

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
        let limits = d
            .pools
            .iter()
            .map(|p| (p.id, p.max_req_input_len(d.context_window)))
            .collect();
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
        let ok = (200..300).contains(&r.http_status);
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
            && ok
            && pf < r.prompt_tokens
        {
            out.push(base(
                "error_looks_like_success",
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
                "prompt_exceeds_prefill_pool",
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
