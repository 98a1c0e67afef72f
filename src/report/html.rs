//! report.html: the incident report for people who do not read JSON.
//! One self-contained file (inline CSS, inline SVG charts, one small inline
//! script for table sorting; a Content-Security-Policy that forbids any
//! network access): headline numbers, the exposure timeline against total
//! traffic, the customers on both sides, cross-tenant prefix-cache hits
//! (a section of their own, only when there are any), the mechanism seen
//! in the trace (prompt_tokens vs prefilled_tokens vs HTTP status),
//! coverage and confidence, and the evidence (command, tool version,
//! input digests).
//!
//! Every string that comes from a trace goes through `fmt::html`. Pure
//! function of its inputs: no clock, no absolute paths, same bytes for the
//! same trace and command.

use std::fmt::Write as _;

use crate::custody::Inputs;
use crate::report::fmt::{duration, html as h, utc, utc_opt};
use crate::report::index::Timeline;
use crate::scope::anomalies::{
    ERROR_LOOKS_LIKE_SUCCESS, PROMPT_EXCEEDS_PREFILL_POOL, error_looks_like_success,
};
use crate::scope::{Confidence, ScopeReport};
use crate::trace::manifest::max_req_input_len;

/// Most rows shown per table; the CSV files hold all of them.
pub const MAX_ROWS: usize = 500;

const CSS: &str = r#"
:root{--fg:#1d2433;--muted:#5b6475;--line:#d9dee7;--bad:#b42318;--warn:#b54708;--ok:#067647;--bg:#f7f8fa}
*{box-sizing:border-box}
body{margin:0;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:var(--fg);background:#fff}
main{max-width:1080px;margin:0 auto;padding:24px}
h1{font-size:26px;margin:0 0 4px}
h2{font-size:20px;margin:32px 0 8px;border-bottom:1px solid var(--line);padding-bottom:4px}
p.lead{color:var(--muted);margin:0 0 16px}
.verdict{padding:12px 16px;border-radius:6px;font-weight:600;margin:16px 0}
.verdict.bad{background:#fef3f2;color:var(--bad);border:1px solid #fecdca}
.verdict.warn{background:#fffaeb;color:var(--warn);border:1px solid #fedf89}
.verdict.ok{background:#ecfdf3;color:var(--ok);border:1px solid #abefc6}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(190px,1fr));gap:12px}
.card{background:var(--bg);border:1px solid var(--line);border-radius:6px;padding:10px 12px}
.card .n{font-size:26px;font-weight:700}
.card .l{color:var(--muted);font-size:13px}
table{border-collapse:collapse;width:100%;margin:8px 0;font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:4px 6px;text-align:left;vertical-align:top}
th{background:var(--bg);cursor:pointer;user-select:none;white-space:nowrap}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12px;word-break:break-all}
.muted{color:var(--muted)}
.tag{display:inline-block;border-radius:4px;padding:0 6px;font-size:12px;font-weight:600}
.tag.confirmed{background:#fef3f2;color:var(--bad)}
.tag.possible{background:#fffaeb;color:var(--warn)}
.tag.ok{background:#ecfdf3;color:var(--ok)}
svg text{font:11px system-ui,"DejaVu Sans",sans-serif;fill:#5b6475}
ul.notes li{margin:2px 0}
"#;

const JS: &str = r#"
(function () {
  var heads = document.querySelectorAll('table.sortable th');
  Array.prototype.forEach.call(heads, function (th) {
    th.addEventListener('click', function () {
      var table = th.closest('table');
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      var asc = th.getAttribute('data-dir') !== 'asc';
      th.setAttribute('data-dir', asc ? 'asc' : 'desc');
      var i = th.cellIndex;
      function key(r) {
        var c = r.cells[i];
        return c ? (c.getAttribute('data-v') || c.textContent) : '';
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b), nx = parseFloat(x), ny = parseFloat(y);
        var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
        return asc ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
  document.body.setAttribute('data-ok', '1');
})();
"#;

fn card(s: &mut String, n: impl std::fmt::Display, label: &str) {
    let _ = write!(
        s,
        "<div class=\"card\"><div class=\"n\">{n}</div><div class=\"l\">{}</div></div>",
        h(label)
    );
}

fn tag(c: Confidence) -> String {
    format!("<span class=\"tag {0}\">{0}</span>", c.as_str())
}

fn td_num(v: impl std::fmt::Display) -> String {
    format!("<td class=\"num\">{v}</td>")
}

fn td_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    match v {
        Some(v) => td_num(v),
        None => "<td class=\"num muted\">-</td>".into(),
    }
}

fn more(s: &mut String, shown: usize, total: usize, file: &str) {
    if total > shown {
        let _ = write!(
            s,
            "<p class=\"muted\">{shown} of {total} rows shown; all of them are in <code>{file}</code>.</p>"
        );
    }
}

/// The exposure timeline as inline SVG: all requests per bucket (top) and
/// affected responses per bucket (bottom), same time axis.
pub fn timeline_svg(tl: &Timeline) -> String {
    let n = tl.requests.len().max(1);
    let (w, left, right) = (960.0f64, 56.0f64, 12.0f64);
    let bw = (w - left - right) / n as f64;
    let (top_h, bot_h, gap) = (130.0f64, 90.0f64, 34.0f64);
    let y0 = 18.0f64;
    let y1 = y0 + top_h + gap;
    let total_h = y1 + bot_h + 40.0;
    let max_t = tl.requests.iter().copied().max().unwrap_or(0).max(1);
    let max_a = tl.affected.iter().copied().max().unwrap_or(0).max(1);
    let mut s = String::new();
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" role=\"img\" width=\"100%\" viewBox=\"0 0 {w} {total_h}\" aria-label=\"Affected responses over time against total traffic\">"
    );
    let _ = write!(
        s,
        "<text x=\"{left}\" y=\"12\">All requests per interval (max {max_t})</text>\
         <text x=\"{left}\" y=\"{}\">Affected responses per interval (max {max_a})</text>",
        y1 - 6.0
    );
    for (base, hgt) in [(y0, top_h), (y1, bot_h)] {
        let _ = write!(
            s,
            "<line x1=\"{left}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#d9dee7\"/>",
            base + hgt,
            w - right
        );
    }
    for i in 0..n {
        let x = left + i as f64 * bw;
        let from = tl.start_ns + i as i64 * tl.width_ns;
        let to = from + tl.width_ns;
        let t = tl.requests[i];
        let a = tl.affected[i];
        let c = tl.confirmed[i];
        let title = format!(
            "{} .. {}: {t} requests, {} with 2xx, {a} affected ({c} confirmed)",
            utc(from),
            utc(to),
            tl.ok_responses[i]
        );
        let th = top_h * t as f64 / max_t as f64;
        let _ = write!(
            s,
            "<rect x=\"{x:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{th:.2}\" fill=\"#98a2b3\"><title>{}</title></rect>",
            y0 + top_h - th,
            (bw - 1.0).max(0.5),
            h(&title)
        );
        if a > 0 {
            let ah = (bot_h * a as f64 / max_a as f64).max(2.0);
            let _ = write!(
                s,
                "<rect x=\"{x:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{ah:.2}\" fill=\"#d92d20\"><title>{}</title></rect>",
                y1 + bot_h - ah,
                (bw - 1.0).max(0.5),
                h(&title)
            );
        }
    }
    let _ = write!(
        s,
        "<text x=\"4\" y=\"{}\">{max_t}</text><text x=\"4\" y=\"{}\">0</text>\
         <text x=\"4\" y=\"{}\">{max_a}</text><text x=\"4\" y=\"{}\">0</text>",
        y0 + 10.0,
        y0 + top_h,
        y1 + 10.0,
        y1 + bot_h
    );
    let end = tl.start_ns + n as i64 * tl.width_ns;
    let ya = y1 + bot_h + 16.0;
    let _ = write!(
        s,
        "<text x=\"{left}\" y=\"{ya}\">{}</text><text x=\"{}\" y=\"{ya}\" text-anchor=\"end\">{}</text>\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">interval: {}</text></svg>",
        h(&utc(tl.start_ns)),
        w - right,
        h(&utc(end)),
        left + (w - left - right) / 2.0,
        ya + 16.0,
        h(&duration(tl.width_ns))
    );
    s
}

/// The whole report.html.
pub fn report_html(r: &ScopeReport, tl: &Timeline, inputs: &Inputs, command: &[String]) -> String {
    let c = &r.counts;
    let d = &r.deployment;
    let cov = &r.coverage;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>KV-cache isolation report: {}</title><style>{CSS}</style></head><body><main>",
        h(&d.name)
    );
    let _ = writeln!(
        s,
        "<h1>KV-cache isolation report</h1><p class=\"lead\">{} &middot; engine {} &middot; written by kvtrail {} from the recorded trace (no prompt or response content: lengths and hashes only)</p>",
        h(&d.name),
        h(&d.engine),
        env!("CARGO_PKG_VERSION")
    );
    let class = if r.any_exposure() {
        "bad"
    } else if !cov.complete {
        "warn"
    } else {
        "ok"
    };
    let _ = writeln!(
        s,
        "<div class=\"verdict {class}\" id=\"verdict\">{}</div>",
        h(&r.verdict)
    );

    // Headline numbers.
    s.push_str("<h2 id=\"headline\">Headline numbers</h2><div class=\"cards\">");
    card(&mut s, c.affected_responses, "affected responses");
    card(
        &mut s,
        format!("{} / {}", c.confirmed_responses, c.possible_responses),
        "confirmed / possible",
    );
    card(
        &mut s,
        c.cross_tenant_responses,
        "responses with another customer's data",
    );
    card(
        &mut s,
        c.recipient_tenants,
        "customers who received foreign data",
    );
    card(&mut s, c.source_tenants, "customers whose data leaked");
    card(&mut s, c.source_requests, "source requests");
    card(&mut s, c.foreign_tokens, "foreign tokens read");
    card(&mut s, c.requests, "requests in the trace");
    s.push_str("</div>\n");
    let w = &r.time_window;
    if w.first_exposure_ns.is_some() {
        let _ = writeln!(
            s,
            "<p>Exposure window (foreign reads): <b>{}</b> to <b>{}</b> ({}). Affected requests arrived between {} and {}.</p>",
            h(&utc_opt(w.first_exposure_ns)),
            h(&utc_opt(w.last_exposure_ns)),
            h(&duration(
                w.last_exposure_ns.unwrap_or(0) - w.first_exposure_ns.unwrap_or(0)
            )),
            h(&utc_opt(w.first_arrival_ns)),
            h(&utc_opt(w.last_arrival_ns))
        );
    }
    let _ = writeln!(
        s,
        "<p class=\"muted\">Capture: {} to {}; {} KV events replayed over {} pools.</p>",
        h(&utc(d.capture_started_ns)),
        h(&utc(d.capture_ended_ns)),
        c.kv_events,
        d.pools.len()
    );

    // Timeline.
    s.push_str("<h2 id=\"timeline\">Exposure timeline</h2><p>Grey: every request the service received, per interval. Red: responses that read KV cache holding another request's data, by arrival time. Hover a bar for its numbers.</p>\n");
    s.push_str(&timeline_svg(tl));
    s.push('\n');

    // Customers.
    s.push_str("<h2 id=\"customers\">Affected customers</h2>\n<h3>Recipients: their responses carried data that was not theirs</h3>\n");
    if r.recipients.is_empty() {
        s.push_str("<p class=\"muted\">None.</p>\n");
    } else {
        s.push_str("<table class=\"sortable\" id=\"recipients\"><thead><tr><th>customer</th><th class=\"num\">responses</th><th class=\"num\">with another customer's data</th><th class=\"num\">foreign tokens</th><th class=\"num\">confirmed</th><th class=\"num\">possible</th></tr></thead><tbody>");
        for t in r.recipients.iter().take(MAX_ROWS) {
            let _ = write!(
                s,
                "<tr><td>{}</td>{}{}{}{}{}</tr>",
                h(&t.tenant.to_string()),
                td_num(t.responses),
                td_num(t.cross_tenant_responses),
                td_num(t.foreign_tokens),
                td_num(t.confirmed),
                td_num(t.possible)
            );
        }
        s.push_str("</tbody></table>\n");
        more(&mut s, MAX_ROWS, r.recipients.len(), "tenants.csv");
    }
    s.push_str("<h3>Sources: their data appeared in responses to others</h3>\n");
    if r.sources.is_empty() {
        s.push_str("<p class=\"muted\">None.</p>\n");
    } else {
        s.push_str("<table class=\"sortable\" id=\"sources\"><thead><tr><th>customer</th><th class=\"num\">requests</th><th class=\"num\">tokens read by others</th><th class=\"num\">of which cross-customer</th><th class=\"num\">responses that read them</th><th class=\"num\">receiving customers</th></tr></thead><tbody>");
        for t in r.sources.iter().take(MAX_ROWS) {
            let _ = write!(
                s,
                "<tr><td>{}</td>{}{}{}{}{}</tr>",
                h(&t.tenant.to_string()),
                td_num(t.requests),
                td_num(t.tokens),
                td_num(t.cross_tenant_tokens),
                td_num(t.recipient_responses),
                td_num(t.recipient_tenants.len())
            );
        }
        s.push_str("</tbody></table>\n");
        more(&mut s, MAX_ROWS, r.sources.len(), "tenants.csv");
    }

    // Cross-tenant prefix-cache hits (none: no section at all).
    prefix_cache(&mut s, r);

    // Mechanism.
    mechanism(&mut s, r);

    // Coverage.
    let _ = write!(
        s,
        "<h2 id=\"coverage\">Coverage and confidence</h2><p>Evidence: <span class=\"tag {}\">{}</span>. \
         <b>confirmed</b> findings rest on complete evidence; <b>possible</b> ones depend on lost events, an unclean capture or KV written before the capture began. A missing finding is only a clean bill when the evidence is complete.</p><ul class=\"notes\">",
        if cov.complete { "ok" } else { "possible" },
        if cov.complete {
            "complete"
        } else {
            "INCOMPLETE"
        }
    );
    let _ = write!(
        s,
        "<li>capture closed cleanly: {}</li><li>capture began with the engine (pools empty): {}</li><li>lost KV events: {} in {} gaps</li><li>blank reads (integrity defects, not leaks): {} slots in {} responses</li>",
        if cov.capture_complete { "yes" } else { "NO" },
        match cov.from_engine_start {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "unknown",
        },
        cov.lost_events,
        cov.gaps.len(),
        r.blank_reads,
        r.blank_read_responses.len()
    );
    for n in &cov.notes {
        let _ = write!(s, "<li>{}</li>", h(n));
    }
    s.push_str("</ul>\n");

    // Evidence.
    evidence(&mut s, inputs, command);
    let _ = writeln!(s, "</main><script>{JS}</script></body></html>");
    s
}

/// The cross-tenant prefix-cache hits (`cross_tenant_shared`), one row per
/// reading response: isolation breaches where the deployment promised
/// per-tenant prefix caches, information otherwise. Nothing is written when
/// there are none.
fn prefix_cache(s: &mut String, r: &ScopeReport) {
    if r.cross_tenant_shared.is_empty() {
        return;
    }
    if r.deployment.tenant_prefix_cache() {
        let _ = write!(
            s,
            "<h2 id=\"prefix-cache\">Prefix-cache isolation breaches</h2><p>The deployment promises a prefix cache per customer (<code>prefix_cache_scope = \"tenant\"</code>), yet <b>{}</b> responses were served from a prefix another customer's request had cached. No other customer's KV entered these responses' attention and no prompt content was disclosed in them; but the cache hit itself (a faster first token) can tell the reader that another customer sent the same prompt prefix: the prefix-cache timing side channel. Each counts as an isolation breach.</p>",
            r.cross_tenant_shared.len()
        );
    } else {
        let _ = write!(
            s,
            "<h2 id=\"prefix-cache\">Cross-tenant prefix-cache hits (information)</h2><p><b>{}</b> responses were served from a prefix another customer's request had cached. The deployment shares its prefix cache across customers (no <code>prefix_cache_scope = \"tenant\"</code> in trace.json), so these are no isolation finding: no other customer's KV entered these responses' attention. Listed because the hit's timing can tell the reader that another customer sent the same prompt prefix.</p>",
            r.cross_tenant_shared.len()
        );
    }
    s.push_str("<table class=\"sortable\" id=\"prefix-cache-hits\"><thead><tr><th class=\"num\">request</th><th>external id</th><th>customer</th><th class=\"num\">shared tokens</th><th>sources (customer: tokens)</th></tr></thead><tbody>");
    for hit in r.cross_tenant_shared.iter().take(MAX_ROWS) {
        let sources: Vec<String> = hit
            .sources
            .iter()
            .map(|x| {
                format!(
                    "{}: {} (request {})",
                    h(&x.tenant.to_string()),
                    x.tokens,
                    x.request_id
                )
            })
            .collect();
        let _ = write!(
            s,
            "<tr><td class=\"num\">{}</td><td><code>{}</code></td><td>{}</td>{}<td>{}</td></tr>",
            hit.request_id,
            h(hit.external_id.as_deref().unwrap_or("-")),
            h(&hit.tenant.to_string()),
            td_num(hit.tokens),
            sources.join("<br>")
        );
    }
    s.push_str("</tbody></table>\n");
    more(s, MAX_ROWS, r.cross_tenant_shared.len(), "summary.json");
}

fn mechanism(s: &mut String, r: &ScopeReport) {
    let d = &r.deployment;
    s.push_str("<h2 id=\"mechanism\">What the trace shows happened</h2>\n");
    let short_ok = r
        .affected_responses
        .iter()
        .filter(|a| match (a.prompt_tokens, a.http_status) {
            (Some(p), Some(st)) => error_looks_like_success(p, a.prefilled_tokens, st),
            _ => false,
        })
        .count();
    let _ = write!(
        s,
        "<p>Context window advertised: <b>{}</b> tokens. Per pool, the largest prompt SGLang admits (max_req_input_len = min(context-1, capacity-1) - 5):</p><table><thead><tr><th>pool</th><th>role</th><th class=\"num\">capacity (tokens)</th><th class=\"num\">page size</th><th class=\"num\">max_req_input_len</th></tr></thead><tbody>",
        d.context_window
    );
    for p in &d.pools {
        let _ = write!(
            s,
            "<tr><td>{} <span class=\"muted\">#{}</span></td><td>{}</td>{}{}{}</tr>",
            h(&p.name),
            p.id,
            h(&p.role),
            td_num(p.capacity_tokens),
            td_num(p.page_size),
            td_num(max_req_input_len(d.context_window, p.capacity_tokens))
        );
    }
    s.push_str("</tbody></table>\n");
    if !r.affected_responses.is_empty() {
        let _ = write!(
            s,
            "<p><b>{short_ok}</b> of {} affected responses had fewer tokens prefilled than the customer sent, yet were answered with a success status: an error that looked like success. Each row below is one affected response.</p>",
            r.affected_responses.len()
        );
        s.push_str("<table class=\"sortable\" id=\"affected\"><thead><tr><th class=\"num\">request</th><th>external id</th><th>customer</th><th>arrived (UTC)</th><th class=\"num\">prompt tokens</th><th class=\"num\">prefilled</th><th class=\"num\">HTTP</th><th class=\"num\">foreign tokens</th><th class=\"num\">sources</th><th>confidence</th></tr></thead><tbody>");
        for a in r.affected_responses.iter().take(MAX_ROWS) {
            let _ = write!(
                s,
                "<tr><td class=\"num\">{}</td><td><code>{}</code></td><td>{}</td><td data-v=\"{}\">{}</td>{}{}{}{}{}<td>{}</td></tr>",
                a.request_id,
                h(a.external_id.as_deref().unwrap_or("-")),
                h(&a.tenant.to_string()),
                a.arrival_ns.unwrap_or(a.first_read_ns),
                h(&utc_opt(a.arrival_ns)),
                td_opt(a.prompt_tokens),
                td_opt(a.prefilled_tokens),
                td_opt(a.http_status),
                td_num(a.foreign_tokens),
                td_num(a.sources.len()),
                tag(a.confidence)
            );
        }
        s.push_str("</tbody></table>\n");
        more(s, MAX_ROWS, r.affected_responses.len(), "responses.csv");
    }
    let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
    for a in &r.anomalies {
        *kinds.entry(a.kind.as_str()).or_default() += 1;
    }
    if kinds.is_empty() {
        s.push_str("<p>No request-level anomalies (prompts over a pool's limit, short prefills answered with success).</p>\n");
    } else {
        s.push_str("<p>Request-level anomalies across the whole trace, affected or not:</p><ul>");
        for (k, n) in kinds {
            let what = match k {
                ERROR_LOOKS_LIKE_SUCCESS => {
                    "fewer tokens prefilled than sent, answered with a 2xx status"
                }
                PROMPT_EXCEEDS_PREFILL_POOL => {
                    "prompt at or over the prefill pool's max_req_input_len"
                }
                _ => "",
            };
            let _ = write!(s, "<li><code>{}</code>: {n} ({})</li>", h(k), h(what));
        }
        s.push_str("</ul>\n");
    }
}

fn evidence(s: &mut String, inputs: &Inputs, command: &[String]) {
    let _ = write!(
        s,
        "<h2 id=\"evidence\">Evidence</h2><p>Written by <b>kvtrail {}</b> with the command:</p><p><code>{}</code></p>\
         <p>Every figure above comes from the trace files below (blake3 digests, re-checked against the capture's own list in trace.json when this report was written). <code>evidence.json</code> next to this file records the same digests and the digest of every output file; <code>kvtrail verify</code> on this folder re-checks them all.</p>",
        env!("CARGO_PKG_VERSION"),
        h(&command.join(" "))
    );
    if inputs.problems.is_empty() {
        s.push_str("<p><span class=\"tag ok\">inputs intact</span> every data file matches trace.json.</p>");
    } else {
        s.push_str(
            "<p><span class=\"tag confirmed\">input problems</span></p><ul class=\"notes\">",
        );
        for p in &inputs.problems {
            let _ = write!(s, "<li>{}</li>", h(p));
        }
        s.push_str("</ul>");
    }
    s.push_str("<table class=\"sortable\" id=\"inputs\"><thead><tr><th>file</th><th class=\"num\">bytes</th><th>blake3</th><th>matches trace.json</th></tr></thead><tbody>");
    for f in inputs.files.iter().take(MAX_ROWS) {
        let _ = write!(
            s,
            "<tr><td><code>{}</code></td>{}<td><code>{}</code></td><td>{}</td></tr>",
            h(&f.path),
            td_num(f.bytes),
            h(&f.blake3),
            match f.matches_manifest {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            }
        );
    }
    s.push_str("</tbody></table>\n");
    more(s, MAX_ROWS, inputs.files.len(), "evidence.json");
}
