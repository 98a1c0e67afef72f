//! Rendering of notification packs: the per-customer `Notice` (notice.json),
//! the Markdown letter, the Art. 33(2) processor-to-controller notice, and
//! the register entry (JSON and CSV). Text is built only from the notice
//! itself (the customer's own facts plus incident-wide counts), so a letter
//! cannot mention another customer: the data is not there to mention.

use std::fmt::Write as _;

use super::config::{NotifyConfig, marker};
use super::{
    Contact, EvidenceRef, IncidentTotals, Notice, Pack, Records, RegisterEntry,
    RegisterPrefixCache, Window,
};
use crate::report::csv;
use crate::report::fmt::{code, md, utc_opt};
use crate::scope::ScopeReport;
use crate::scope::anomalies::error_looks_like_success;

/// Operator settings and incident-wide facts shared by every pack.
pub(super) struct Ctx {
    /// Cross-tenant prefix-cache hits are isolation breaches here.
    breach: bool,
    incident_id: String,
    contact: Contact,
    became_aware: String,
    service: String,
    engine: String,
    nature: String,
    measures: Vec<String>,
    totals: IncidentTotals,
}

const DATA_SUBJECTS: &str = "end users and other persons whose personal data the customer's API requests contained (the operator does not see prompt or response content: the trace holds only lengths and hashes)";

const RECORD_CATEGORIES: [&str; 3] = [
    "API requests (prompt content)",
    "API responses (generated output)",
    "KV-cache tokens (the model's stored intermediate state of a prompt)",
];

impl Ctx {
    pub(super) fn new(cfg: &NotifyConfig, sum: &ScopeReport, packs: u64) -> Self {
        let get = |v: &Option<String>, f: &str| v.clone().unwrap_or_else(|| marker(f));
        let dpo = get(&cfg.dpo_contact, "dpo_contact");
        let w = &sum.time_window;
        let c = &sum.counts;
        let short_ok = sum
            .affected_responses
            .iter()
            .filter(|a| match (a.prompt_tokens, a.http_status) {
                (Some(p), Some(st)) => error_looks_like_success(p, a.prefilled_tokens, st),
                _ => false,
            })
            .count();
        let mut nature = format!(
            "Between {} and {}, {} responses of the service {} were generated while the model read KV cache (the engine's stored intermediate state of earlier prompts) that held data of other requests; in {} of them that data belonged to another customer. A response generated this way can reproduce fragments of the other request's prompt. The serving engine ({}) reused cache memory that had not been cleared; in {} of the affected responses it had processed fewer prompt tokens than were sent and still answered with a success status, so the failure looked like a normal answer.",
            utc_opt(w.first_exposure_ns),
            utc_opt(w.last_exposure_ns),
            c.affected_responses,
            sum.deployment.name,
            c.cross_tenant_responses,
            sum.deployment.engine,
            short_ok
        );
        let breach = sum.deployment.tenant_prefix_cache();
        let hits = sum.cross_tenant_shared.len() as u64;
        if breach && hits > 0 {
            let pc = format!(
                "{} responses of the service {} were served from a prompt prefix that another customer's request had placed in the engine's prefix cache, although the service promises a prefix cache per customer: a prefix-cache isolation breach. No other customer's data entered those responses and no prompt content was disclosed in them; but the faster answer of a cache hit can reveal to whoever sent a request that another customer had sent the same prompt prefix.",
                hits, sum.deployment.name
            );
            if c.affected_responses == 0 {
                nature = pc;
            } else {
                nature.push_str(" In addition, ");
                nature.push_str(&pc);
            }
        }
        if let Some(n) = &cfg.nature {
            nature.push(' ');
            nature.push_str(n);
        }
        let mut measures = vec![
            "The affected responses and requests were identified by replaying the service's recorded KV-cache events (kvtrail); the evidence digest in this notice pins that analysis and its input files.".to_string(),
        ];
        if cfg.measures.is_empty() {
            measures.push(marker("measures"));
        } else {
            measures.extend(cfg.measures.iter().cloned());
        }
        Ctx {
            breach,
            incident_id: get(&cfg.incident_id, "incident_id"),
            contact: Contact {
                operator_name: get(&cfg.operator_name, "operator_name"),
                contact_point: cfg.contact_point.clone().unwrap_or_else(|| dpo.clone()),
                dpo_contact: dpo,
            },
            became_aware: get(&cfg.became_aware, "became_aware"),
            service: sum.deployment.name.clone(),
            engine: sum.deployment.engine.clone(),
            nature,
            measures,
            totals: IncidentTotals {
                service: sum.deployment.name.clone(),
                affected_responses: c.affected_responses,
                confirmed_responses: c.confirmed_responses,
                possible_responses: c.possible_responses,
                customers_notified: packs,
                prefix_cache_breach_responses: if breach { hits } else { 0 },
                window: Window::new(w.first_exposure_ns, w.last_exposure_ns),
            },
        }
    }

    pub(super) fn notice(&self, p: &Pack, ev: &EvidenceRef) -> Notice {
        let (tenant, received, exposed) = (&p.tenant, &p.received, &p.exposed);
        let (served, revealed) = (&p.served, &p.revealed);
        let mut roles = Vec::new();
        let mut consequences = Vec::new();
        if !received.is_empty() {
            roles.push("recipient".to_string());
            consequences.push("The responses listed under \"responses you received\" may contain fragments of another customer's prompts. Wherever your systems or users stored, displayed or forwarded them, that data may have travelled further.".to_string());
            consequences.push("Those responses were computed partly from data that was not yours: their content may be wrong or incoherent and should not be relied on.".to_string());
        }
        if !exposed.is_empty() {
            roles.push("source".to_string());
            consequences.push("Fragments of the prompts of the requests listed under \"your requests whose data was read\" may have been disclosed in responses to other requests, including other customers' where marked. Confidentiality of that content, and of any personal data in it, cannot be assured for those fragments.".to_string());
        }
        if !served.is_empty() {
            roles.push("prefix_cache_reader".to_string());
            consequences.push("The requests listed under \"your requests served from another customer's cached prefix\" were answered from a prompt prefix that another customer's request had placed in the prefix cache, although the service promises a prefix cache per customer (a prefix-cache isolation breach). No data of another customer entered your responses and their content is not affected by it; but the faster answer of a cache hit can have revealed to whoever sent those requests that another customer had sent the same prompt prefix.".to_string());
        }
        if !revealed.is_empty() {
            roles.push("prefix_cache_source".to_string());
            consequences.push("The cached prompt prefix of the requests listed under \"your requests whose cached prefix served another customer\" was used to answer requests of another customer that began with the same prefix, although the service promises a prefix cache per customer (a prefix-cache isolation breach). The content of your prompts was not disclosed in any response; but the faster answer of a cache hit can have revealed to the other customer that a request of yours had sent that same prompt prefix, which matters where the fact that a prompt began that way is itself confidential.".to_string());
        }
        // Prefix-cache entries carry no read times: their requests' arrival.
        let pc_times = served
            .iter()
            .filter_map(|x| x.arrival_ns)
            .chain(revealed.iter().filter_map(|x| x.arrival_ns));
        let first = received
            .iter()
            .map(|r| r.first_exposure_ns)
            .chain(exposed.iter().map(|e| e.first_exposure_ns))
            .chain(pc_times.clone())
            .min();
        let last = received
            .iter()
            .map(|r| r.last_exposure_ns)
            .chain(exposed.iter().map(|e| e.last_exposure_ns))
            .chain(pc_times)
            .max();
        let confirmed = received
            .iter()
            .map(|r| &r.confidence)
            .chain(exposed.iter().map(|e| &e.confidence))
            .chain(served.iter().map(|e| &e.confidence))
            .chain(revealed.iter().map(|e| &e.confidence))
            .filter(|c| *c == "confirmed")
            .count() as u64;
        let total = (received.len() + exposed.len() + served.len() + revealed.len()) as u64;
        let approx = match (received.is_empty(), exposed.is_empty()) {
            (true, true) => format!(
                "not determinable from the trace; at most the persons whose personal data was contained in the prompt prefixes of the {} listed",
                count(served.len() + revealed.len(), "request", "requests")
            ),
            (false, true) => format!(
                "not determinable from the trace; the {} listed may contain personal data of persons connected with another customer",
                count(received.len(), "response", "responses")
            ),
            (true, false) => format!(
                "not determinable from the trace; at most the persons whose personal data was contained in the {} listed",
                count(exposed.len(), "request", "requests")
            ),
            _ => format!(
                "not determinable from the trace; at most the persons whose personal data was contained in the {} listed, and the {} listed may contain personal data of persons connected with another customer",
                count(exposed.len(), "request", "requests"),
                count(received.len(), "response", "responses")
            ),
        };
        Notice {
            format: "kvtrail-notice".into(),
            version: 1,
            incident_id: self.incident_id.clone(),
            customer: tenant.to_string(),
            roles,
            nature: self.nature.clone(),
            data_subject_categories: vec![DATA_SUBJECTS.to_string()],
            data_subjects_approximate: approx,
            record_categories: RECORD_CATEGORIES.iter().map(|s| s.to_string()).collect(),
            records: Records {
                responses: (received.len() + served.len()) as u64,
                requests: (exposed.len() + revealed.len()) as u64,
                tokens: received.iter().map(|r| r.foreign_tokens).sum::<u64>()
                    + exposed.iter().map(|e| e.tokens).sum::<u64>()
                    + served.iter().map(|e| e.tokens).sum::<u64>()
                    + revealed.iter().map(|e| e.tokens).sum::<u64>(),
            },
            time_window: Window::new(first, last),
            likely_consequences: consequences,
            measures_taken: self.measures.clone(),
            contact: self.contact.clone(),
            became_aware: self.became_aware.clone(),
            confirmed,
            possible: total - confirmed,
            received_responses: received.to_vec(),
            exposed_requests: exposed.to_vec(),
            prefix_cache_served: served.to_vec(),
            prefix_cache_revealed: revealed.to_vec(),
            incident: self.totals.clone(),
            evidence: ev.clone(),
            documents: vec![
                "letter.md".into(),
                "processor-notice.md".into(),
                "notice.json".into(),
            ],
        }
    }

    pub(super) fn register(
        &self,
        sum: &ScopeReport,
        ev: &EvidenceRef,
        packs: Vec<String>,
        unattributed_responses: u64,
        unattributed_source_requests: u64,
        prefix_cache: Option<RegisterPrefixCache>,
    ) -> RegisterEntry {
        let c = &sum.counts;
        let mut nature = self.nature.clone();
        let mut consequences: Vec<String> = vec![
            "responses delivered to customers may contain fragments of other customers' prompts, including personal data".into(),
            "prompts of the source requests may have been disclosed to other customers".into(),
            "the affected responses may be wrong or incoherent".into(),
        ];
        if let Some(pc) = &prefix_cache {
            if self.breach {
                consequences.push("responses served from another customer's cached prompt prefix (prefix-cache isolation breach) can reveal through their timing that another customer sent the same prefix; no prompt content was disclosed".into());
            } else {
                nature.push_str(&format!(
                    " Information: {} responses were served from a prompt prefix another customer's request had cached; the deployment shares its prefix cache across customers, so these are no isolation breach and no customer is notified for them.",
                    pc.responses
                ));
            }
        }
        RegisterEntry {
            format: "kvtrail-breach-register".into(),
            version: 1,
            incident_id: self.incident_id.clone(),
            operator_name: self.contact.operator_name.clone(),
            dpo_contact: self.contact.dpo_contact.clone(),
            became_aware: self.became_aware.clone(),
            service: self.service.clone(),
            engine: self.engine.clone(),
            nature,
            time_window: self.totals.window.clone(),
            affected_responses: c.affected_responses,
            confirmed_responses: c.confirmed_responses,
            possible_responses: c.possible_responses,
            cross_customer_responses: c.cross_tenant_responses,
            source_requests: c.source_requests,
            foreign_tokens: c.foreign_tokens,
            recipient_customers: c.recipient_tenants,
            source_customers: c.source_tenants,
            unattributed_responses,
            unattributed_source_requests,
            notification_packs: packs,
            prefix_cache,
            likely_consequences: consequences,
            measures_taken: self.measures.clone(),
            evidence: ev.clone(),
        }
    }
}

/// `n thing` / `n things`.
fn count(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn opt_code(v: &Option<String>) -> String {
    v.as_deref().map(code).unwrap_or_else(|| "-".into())
}

fn opt_num<T: ToString>(v: Option<T>) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| "-".into())
}

fn common_sections(s: &mut String, n: &Notice) {
    let _ = writeln!(s, "## What happened\n\n{}\n", md(&n.nature));
    let _ = writeln!(
        s,
        "Time window of the exposure concerning you: {} to {}.\n",
        utc_opt(n.time_window.first_ns),
        utc_opt(n.time_window.last_ns)
    );
    let _ = writeln!(
        s,
        "## Data subjects and records concerned\n\n- Categories of data subjects: {}.\n- Approximate number of data subjects: {}.\n- Categories of records: {}.\n- Records concerning you: {}, {}, {} of KV cache.\n",
        md(&n.data_subject_categories.join("; ")),
        md(&n.data_subjects_approximate),
        md(&n.record_categories.join("; ")),
        count(n.records.responses as usize, "response", "responses"),
        count(n.records.requests as usize, "request", "requests"),
        count(n.records.tokens as usize, "token", "tokens")
    );
}

fn facts_sections(s: &mut String, n: &Notice) {
    if !n.received_responses.is_empty() {
        let _ = writeln!(
            s,
            "## Responses you received that carried data not yours\n\nListed below: {} of yours, generated while reading KV cache that held other requests' data (\"other customer\" = yes: the data belonged to another customer). Check these ids, times and output hashes against your own logs.\n",
            count(n.received_responses.len(), "response", "responses")
        );
        s.push_str("| external id | request id | arrived (UTC) | HTTP | output hash (blake3) | foreign tokens | other customer | confidence |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
        for r in &n.received_responses {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                opt_code(&r.external_id),
                r.request_id,
                md(r.arrival_utc.as_deref().unwrap_or("-")),
                opt_num(r.http_status),
                opt_code(&r.output_hash),
                r.foreign_tokens,
                if r.other_customer_data { "yes" } else { "no" },
                r.confidence
            );
        }
        s.push('\n');
    }
    if !n.exposed_requests.is_empty() {
        let _ = writeln!(
            s,
            "## Your requests whose data was read by other responses\n\nListed below: {} of yours, whose KV cache was read while other responses were generated (\"other customer\" = yes: at least one of them went to another customer).\n",
            count(n.exposed_requests.len(), "request", "requests")
        );
        s.push_str("| external id | request id | arrived (UTC) | output hash (blake3) | tokens read | responses | other customer | confidence |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
        for e in &n.exposed_requests {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                opt_code(&e.external_id),
                e.request_id,
                md(e.arrival_utc.as_deref().unwrap_or("-")),
                opt_code(&e.output_hash),
                e.tokens,
                e.responses,
                if e.reached_other_customers {
                    "yes"
                } else {
                    "no"
                },
                e.confidence
            );
        }
        s.push('\n');
    }
    if !n.prefix_cache_served.is_empty() {
        let _ = writeln!(
            s,
            "## Your requests served from another customer's cached prefix\n\nListed below: {} of yours, answered from a prompt prefix that another customer's request had placed in the prefix cache, although the service promises a prefix cache per customer (a prefix-cache isolation breach). No data of another customer entered these responses. \"other requests\" counts the other customer's cached requests involved.\n",
            count(n.prefix_cache_served.len(), "request", "requests")
        );
        s.push_str("| external id | request id | arrived (UTC) | output hash (blake3) | tokens from the cache | other requests | confidence |\n| --- | --- | --- | --- | --- | --- | --- |\n");
        for e in &n.prefix_cache_served {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                opt_code(&e.external_id),
                e.request_id,
                md(e.arrival_utc.as_deref().unwrap_or("-")),
                opt_code(&e.output_hash),
                e.tokens,
                e.source_requests,
                e.confidence
            );
        }
        s.push('\n');
    }
    if !n.prefix_cache_revealed.is_empty() {
        let _ = writeln!(
            s,
            "## Your requests whose cached prefix served another customer\n\nListed below: {} of yours, whose cached prompt prefix was used to answer another customer's requests that began with the same prefix, although the service promises a prefix cache per customer (a prefix-cache isolation breach). The content of your prompts was not disclosed in any response; the timing of a cache hit can reveal that the prefix had been sent.\n",
            count(n.prefix_cache_revealed.len(), "request", "requests")
        );
        s.push_str("| external id | request id | arrived (UTC) | output hash (blake3) | tokens served | responses | confidence |\n| --- | --- | --- | --- | --- | --- | --- |\n");
        for e in &n.prefix_cache_revealed {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                opt_code(&e.external_id),
                e.request_id,
                md(e.arrival_utc.as_deref().unwrap_or("-")),
                opt_code(&e.output_hash),
                e.tokens,
                e.responses,
                e.confidence
            );
        }
        s.push('\n');
    }
}

fn tail_sections(s: &mut String, n: &Notice) {
    s.push_str("## Likely consequences\n\n");
    for c in &n.likely_consequences {
        let _ = writeln!(s, "- {}", md(c));
    }
    s.push_str("\n## Measures taken\n\n");
    for m in &n.measures_taken {
        let _ = writeln!(s, "- {}", md(m));
    }
    let _ = writeln!(
        s,
        "\n## How sure we are\n\n{} of the {} entries above are confirmed by complete evidence; {} are possible (they depend on lost events or on data written before recording began). The evidence of the analysis as a whole is {}.",
        n.confirmed,
        n.confirmed + n.possible,
        n.possible,
        if n.evidence.evidence_complete {
            "complete"
        } else {
            "INCOMPLETE: further responses may be affected that the recording cannot show"
        }
    );
    for note in &n.evidence.coverage_notes {
        let _ = writeln!(s, "- {}", md(note));
    }
    let pc = match n.incident.prefix_cache_breach_responses {
        0 => String::new(),
        k => format!(
            "; {} with a prefix-cache isolation breach",
            count(k as usize, "response", "responses")
        ),
    };
    let _ = writeln!(
        s,
        "\nIncident-wide: {} ({} confirmed, {} possible){pc}; {} being notified.\n",
        count(
            n.incident.affected_responses as usize,
            "affected response",
            "affected responses"
        ),
        n.incident.confirmed_responses,
        n.incident.possible_responses,
        count(
            n.incident.customers_notified as usize,
            "customer is",
            "customers are"
        )
    );
    let _ = writeln!(
        s,
        "## Contact\n\n- Operator: {}\n- Data protection officer: {}\n- Contact point for questions: {}\n",
        md(&n.contact.operator_name),
        md(&n.contact.dpo_contact),
        md(&n.contact.contact_point)
    );
    let _ = writeln!(
        s,
        "## Evidence\n\nThis notice was produced by {} from a scope analysis whose chain-of-custody record has blake3 {} (summary {}). The machine-readable version is notice.json in this folder.",
        md(&n.evidence.tool),
        code(&n.evidence.scope_evidence_blake3),
        code(&n.evidence.scope_summary_blake3)
    );
}

/// How the breach concerns the customer, after "concerns your account".
fn intro(roles: &[String]) -> String {
    let has = |r: &str| roles.iter().any(|x| x == r);
    let foreign = match (has("recipient"), has("source")) {
        (true, true) => Some(
            " on both sides: responses you received carried data that was not yours, and your requests' data was read while other responses were generated",
        ),
        (true, false) => Some(": responses you received carried data that was not yours"),
        (false, true) => {
            Some(": your requests' data was read while other responses were generated")
        }
        (false, false) => None,
    };
    let pc = match (has("prefix_cache_reader"), has("prefix_cache_source")) {
        (false, false) => None,
        (reader, source) => Some(format!(
            "the service's prefix cache, which it promises to keep separate for each customer, was shared between your account and another customer's ({}): a prefix-cache isolation breach, in which no prompt content was disclosed",
            match (reader, source) {
                (true, true) => {
                    "some of your requests were served from another customer's cached prompt prefix, and your cached prompt prefixes served another customer's requests"
                }
                (true, false) =>
                    "some of your requests were served from another customer's cached prompt prefix",
                _ => "your cached prompt prefixes served another customer's requests",
            }
        )),
    };
    match (foreign, pc) {
        (Some(f), None) => f.to_string(),
        (Some(f), Some(p)) => format!("{f}; in addition, {p}"),
        (None, Some(p)) => format!(": {p}"),
        (None, None) => String::new(),
    }
}

/// letter.md: the customer letter with the Art. 33(3) content.
pub(super) fn letter_md(n: &Notice) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Notification of a personal data breach\n\n- To: {}\n- From: {}\n- Incident: {}\n- Operator aware since: {}\n",
        md(&n.customer),
        md(&n.contact.operator_name),
        md(&n.incident_id),
        md(&n.became_aware)
    );
    let _ = writeln!(
        s,
        "We are writing to inform you of a personal data breach in the service {} that concerns your account{}. This letter gives the information of Article 33(3) GDPR and the identifiers you need to check your own records.\n",
        md(&n.incident.service),
        intro(&n.roles)
    );
    common_sections(&mut s, n);
    facts_sections(&mut s, n);
    s.push_str("## What you can do\n\n");
    if n.roles.iter().any(|r| r == "recipient") {
        s.push_str("- Find the responses listed above in your systems (external id, time, output hash), stop using them and delete them and any copies.\n");
    }
    if n.roles.iter().any(|r| r == "source") {
        s.push_str("- Find the requests listed above in your systems and assess whether their prompts contained personal data; you may have to notify your supervisory authority and the persons concerned.\n");
    }
    if n.roles.iter().any(|r| r == "prefix_cache_reader") {
        s.push_str("- The responses to your requests that were served from another customer's cached prefix are not affected in content; nothing needs deleting for them.\n");
    }
    if n.roles.iter().any(|r| r == "prefix_cache_source") {
        s.push_str("- Find the requests whose cached prefix served another customer in your systems and assess whether the fact that a prompt began with that prefix is itself personal or confidential data; you may have to notify your supervisory authority.\n");
    }
    s.push_str("- Contact us with any question; we will keep you informed as the investigation continues.\n\n");
    tail_sections(&mut s, n);
    s
}

/// processor-notice.md: the Art. 33(2) notice from the processor to the
/// controller (the customer), who may have to notify within 72 hours.
pub(super) fn processor_md(n: &Notice) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# Notice of a personal data breach: processor to controller (Article 33(2) GDPR)\n\n- To (controller): {}\n- From (processor): {}\n- Incident: {}\n- Processor aware since: {}\n",
        md(&n.customer),
        md(&n.contact.operator_name),
        md(&n.incident_id),
        md(&n.became_aware)
    );
    let _ = writeln!(
        s,
        "As your processor for the service {}, we notify you without undue delay of a personal data breach affecting personal data we process on your behalf. As controller you may have to notify your supervisory authority within 72 hours of becoming aware of it (Article 33(1)) and, where the risk is high, the persons concerned (Article 34). The information below is what Article 33(3) asks for; the letter and notice.json in this folder hold the same facts.\n",
        md(&n.incident.service)
    );
    common_sections(&mut s, n);
    facts_sections(&mut s, n);
    tail_sections(&mut s, n);
    s
}

/// register.csv: header and one row for the incident. Every cell goes
/// through the spreadsheet rule (`csv::text`): numbers here never start
/// with a sign, so only operator and trace text can change.
pub(super) fn register_csv(r: &RegisterEntry) -> String {
    let mut cols: Vec<(&str, String)> = vec![
        ("incident_id", r.incident_id.clone()),
        ("operator_name", r.operator_name.clone()),
        ("dpo_contact", r.dpo_contact.clone()),
        ("became_aware", r.became_aware.clone()),
        ("service", r.service.clone()),
        ("engine", r.engine.clone()),
        (
            "first_exposure_utc",
            r.time_window.first_utc.clone().unwrap_or_default(),
        ),
        (
            "last_exposure_utc",
            r.time_window.last_utc.clone().unwrap_or_default(),
        ),
        ("affected_responses", r.affected_responses.to_string()),
        ("confirmed_responses", r.confirmed_responses.to_string()),
        ("possible_responses", r.possible_responses.to_string()),
        (
            "cross_customer_responses",
            r.cross_customer_responses.to_string(),
        ),
        ("source_requests", r.source_requests.to_string()),
        ("foreign_tokens", r.foreign_tokens.to_string()),
        ("recipient_customers", r.recipient_customers.to_string()),
        ("source_customers", r.source_customers.to_string()),
        (
            "unattributed_responses",
            r.unattributed_responses.to_string(),
        ),
        (
            "unattributed_source_requests",
            r.unattributed_source_requests.to_string(),
        ),
        ("notification_packs", r.notification_packs.len().to_string()),
        (
            "evidence_complete",
            r.evidence.evidence_complete.to_string(),
        ),
        (
            "scope_evidence_blake3",
            r.evidence.scope_evidence_blake3.clone(),
        ),
        ("nature", r.nature.clone()),
        ("measures_taken", r.measures_taken.join(" / ")),
    ];
    // Only when the trace has cross-tenant prefix-cache hits, after the
    // columns every register has.
    if let Some(pc) = &r.prefix_cache {
        cols.extend([
            ("prefix_cache_scope", pc.scope.clone()),
            (
                "prefix_cache_isolation_breach",
                pc.isolation_breach.to_string(),
            ),
            ("prefix_cache_responses", pc.responses.to_string()),
            (
                "prefix_cache_source_requests",
                pc.source_requests.to_string(),
            ),
            ("prefix_cache_tokens", pc.tokens.to_string()),
            (
                "prefix_cache_reader_customers",
                pc.reader_customers.to_string(),
            ),
            (
                "prefix_cache_source_customers",
                pc.source_customers.to_string(),
            ),
            ("prefix_cache_unattributed", pc.unattributed.to_string()),
        ]);
    }
    let head: Vec<&str> = cols.iter().map(|c| c.0).collect();
    let row: Vec<String> = cols.iter().map(|c| csv::text(&c.1).into_owned()).collect();
    csv::to_string(&head, [row])
}
