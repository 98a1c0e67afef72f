//! The facts of notification packs: the per-customer `Notice`
//! (notice.json) with its sentences in the language chosen (English or
//! German), the register entry (JSON and CSV), and the context each
//! template render receives. The letter and the processor notice are laid
//! out by the templates (`notify::templates`) from one customer's notice
//! only (the customer's own facts plus incident-wide counts), so a letter
//! cannot mention another customer: the data is not there to mention.

use super::config::{NotifyConfig, marker};
use super::notice::{
    Contact, EvidenceRef, IncidentTotals, Notice, Pack, Records, RegisterEntry,
    RegisterPrefixCache, Window,
};
use super::templates::Lang;
use crate::report::csv;
use crate::scope::anomalies::error_looks_like_success;
use crate::scope::{Confidence, ScopeReport};
use crate::text::utc_opt;

/// Operator settings and incident-wide facts shared by every pack.
pub(super) struct Ctx {
    lang: Lang,
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

fn data_subjects(lang: Lang) -> &'static str {
    match lang {
        Lang::En => {
            "end users and other persons whose personal data the customer's API requests contained (the operator does not see prompt or response content: the trace holds only lengths and hashes)"
        }
        Lang::De => {
            "Endnutzer und andere Personen, deren personenbezogene Daten in den API-Anfragen des Kunden enthalten waren (der Betreiber sieht weder Prompt- noch Antwortinhalte: der Mitschnitt enthält nur Längen und Hashwerte)"
        }
    }
}

fn record_categories(lang: Lang) -> [&'static str; 3] {
    match lang {
        Lang::En => [
            "API requests (prompt content)",
            "API responses (generated output)",
            "KV-cache tokens (the model's stored intermediate state of a prompt)",
        ],
        Lang::De => [
            "API-Anfragen (Prompt-Inhalte)",
            "API-Antworten (erzeugte Ausgaben)",
            "KV-Cache-Token (der im Modell gespeicherte Zwischenzustand eines Prompts)",
        ],
    }
}

impl Ctx {
    pub(super) fn new(cfg: &NotifyConfig, sum: &ScopeReport, packs: u64, lang: Lang) -> Self {
        let get = |v: &Option<String>, f: &str| v.clone().unwrap_or_else(|| marker(f, lang));
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
        let (first, last) = (utc_opt(w.first_exposure_ns), utc_opt(w.last_exposure_ns));
        let (service, engine) = (&sum.deployment.name, &sum.deployment.engine);
        // Certainly another customer's data; where a customer on either
        // side is not known, it is said apart, never counted as certain.
        let unknown = c
            .cross_tenant_unknown_responses
            .min(c.cross_tenant_responses);
        let (affected, cross) = (c.affected_responses, c.cross_tenant_responses - unknown);
        let unknown_en = if unknown == 0 {
            String::new()
        } else {
            format!(
                ", and in {unknown} more it may have (a customer on one side is not in the recorded requests, so it cannot be told)"
            )
        };
        let unknown_de = if unknown == 0 {
            String::new()
        } else {
            format!(
                ", und bei {unknown} weiteren ist das möglich (ein Kunde auf einer Seite fehlt in den aufgezeichneten Anfragen, daher lässt es sich nicht feststellen)"
            )
        };
        let affected_en = crate::words::count(affected, "response", "responses");
        let affected_de = crate::words::count(affected, "Antwort", "Antworten");
        let were = crate::words::noun(affected, "was", "were");
        let wurden = crate::words::noun(affected, "wurde", "wurden");
        let mut nature = match lang {
            Lang::En => format!(
                "Between {first} and {last}, {affected_en} of the service {service} {were} generated while the model read KV cache (the engine's stored intermediate state of earlier prompts) that held data of other requests; in {cross} of them that data belonged to another customer{unknown_en}. A response generated this way can reproduce fragments of the other request's prompt. The serving engine ({engine}) reused cache memory that had not been cleared; in {short_ok} of the affected responses it had processed fewer prompt tokens than were sent and still answered with a success status, so the failure looked like a normal answer."
            ),
            Lang::De => format!(
                "Zwischen {first} und {last} {wurden} {affected_de} des Dienstes {service} erzeugt, während das Modell KV-Cache (den gespeicherten Zwischenzustand früherer Prompts in der Inferenz-Engine) las, der Daten anderer Anfragen enthielt; bei {cross} davon gehörten diese Daten einem anderen Kunden{unknown_de}. Eine so erzeugte Antwort kann Bruchstücke des Prompts der anderen Anfrage wiedergeben. Die Inferenz-Engine ({engine}) hat Cache-Speicher wiederverwendet, der nicht gelöscht worden war; bei {short_ok} der betroffenen Antworten hatte sie weniger Prompt-Token verarbeitet, als gesendet worden waren, und dennoch mit einem Erfolgsstatus geantwortet, sodass der Fehler wie eine normale Antwort aussah."
            ),
        };
        let breach = sum.deployment.tenant_prefix_cache();
        let hits = sum.cross_tenant_shared.len() as u64;
        if breach && hits > 0 {
            let hits_en = crate::words::count(hits, "response", "responses");
            let hits_de = crate::words::count(hits, "Antwort", "Antworten");
            let hits_were = crate::words::noun(hits, "was", "were");
            let hits_wurden = crate::words::noun(hits, "wurde", "wurden");
            let pc = match lang {
                Lang::En => format!(
                    "{hits_en} of the service {service} {hits_were} served from a prompt prefix that another customer's request had placed in the engine's prefix cache, although the service promises a prefix cache per customer: a prefix-cache isolation breach. No other customer's data entered those responses and no prompt content was disclosed in them; but the faster answer of a cache hit can reveal to whoever sent a request that another customer had sent the same prompt prefix."
                ),
                Lang::De => format!(
                    "{hits_de} des Dienstes {service} {hits_wurden} aus einem Prompt-Präfix bedient, das die Anfrage eines anderen Kunden im Präfix-Cache der Engine abgelegt hatte, obwohl der Dienst einen eigenen Präfix-Cache je Kunde zusagt: eine Verletzung der Trennung des Präfix-Caches. In diese Antworten sind keine Daten eines anderen Kunden eingeflossen, und es wurden darin keine Prompt-Inhalte offengelegt; die schnellere Antwort bei einem Cache-Treffer kann dem Absender einer Anfrage jedoch verraten, dass ein anderer Kunde dasselbe Prompt-Präfix gesendet hatte."
                ),
            };
            if c.affected_responses == 0 {
                nature = pc;
            } else {
                nature.push_str(match lang {
                    Lang::En => " In addition, ",
                    Lang::De => " Außerdem: ",
                });
                nature.push_str(&pc);
            }
        }
        if let Some(n) = &cfg.nature {
            nature.push(' ');
            nature.push_str(n);
        }
        let mut measures = vec![match lang {
            Lang::En => "The affected responses and requests were identified by replaying the service's recorded KV-cache events (kvtrail); the evidence digest in this notice pins that analysis and its input files.",
            Lang::De => "Die betroffenen Antworten und Anfragen wurden durch Wiedergabe der aufgezeichneten KV-Cache-Ereignisse des Dienstes ermittelt (kvtrail); der Evidenz-Hashwert in dieser Mitteilung legt diese Analyse und ihre Eingabedateien fest.",
        }
        .to_string()];
        if cfg.measures.is_empty() {
            measures.push(marker("measures", lang));
        } else {
            measures.extend(cfg.measures.iter().cloned());
        }
        Ctx {
            lang,
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
        let de = self.lang == Lang::De;
        let mut roles = Vec::new();
        let mut consequences: Vec<String> = Vec::new();
        if !received.is_empty() {
            roles.push("recipient".to_string());
            if de {
                consequences.push("Die unter „Antworten an Sie, die fremde Daten enthielten“ aufgeführten Antworten können Bruchstücke der Prompts eines anderen Kunden enthalten. Wo Ihre Systeme oder Nutzer sie gespeichert, angezeigt oder weitergeleitet haben, können diese Daten weitergelangt sein.".into());
                consequences.push("Diese Antworten wurden teilweise aus Daten berechnet, die nicht Ihre waren: Ihr Inhalt kann falsch oder unzusammenhängend sein, und sie sollten nicht verwendet werden.".into());
            } else {
                consequences.push("The responses listed under \"responses you received\" may contain fragments of another customer's prompts. Wherever your systems or users stored, displayed or forwarded them, that data may have travelled further.".into());
                consequences.push("Those responses were computed partly from data that was not yours: their content may be wrong or incoherent and should not be relied on.".into());
            }
        }
        if !exposed.is_empty() {
            roles.push("source".to_string());
            consequences.push(if de {
                "Bruchstücke der Prompts der unter „Ihre Anfragen, deren Daten von anderen Antworten gelesen wurden“ aufgeführten Anfragen können in Antworten auf andere Anfragen offengelegt worden sein, wo markiert auch in Antworten an andere Kunden. Die Vertraulichkeit dieser Inhalte und der darin enthaltenen personenbezogenen Daten kann für diese Bruchstücke nicht gewährleistet werden.".into()
            } else {
                "Fragments of the prompts of the requests listed under \"your requests whose data was read\" may have been disclosed in responses to other requests, including other customers' where marked. Confidentiality of that content, and of any personal data in it, cannot be assured for those fragments.".into()
            });
        }
        if !served.is_empty() {
            roles.push("prefix_cache_reader".to_string());
            consequences.push(if de {
                "Die unter „Ihre Anfragen, die aus dem zwischengespeicherten Präfix eines anderen Kunden bedient wurden“ aufgeführten Anfragen wurden aus einem Prompt-Präfix beantwortet, das die Anfrage eines anderen Kunden im Präfix-Cache abgelegt hatte, obwohl der Dienst einen eigenen Präfix-Cache je Kunde zusagt (eine Verletzung der Trennung des Präfix-Caches). In Ihre Antworten sind keine Daten eines anderen Kunden eingeflossen, und ihr Inhalt ist davon nicht betroffen; die schnellere Antwort bei einem Cache-Treffer kann dem Absender dieser Anfragen jedoch verraten haben, dass ein anderer Kunde dasselbe Prompt-Präfix gesendet hatte.".into()
            } else {
                "The requests listed under \"your requests served from another customer's cached prefix\" were answered from a prompt prefix that another customer's request had placed in the prefix cache, although the service promises a prefix cache per customer (a prefix-cache isolation breach). No data of another customer entered your responses and their content is not affected by it; but the faster answer of a cache hit can have revealed to whoever sent those requests that another customer had sent the same prompt prefix.".into()
            });
        }
        if !revealed.is_empty() {
            roles.push("prefix_cache_source".to_string());
            consequences.push(if de {
                "Das zwischengespeicherte Prompt-Präfix der unter „Ihre Anfragen, deren zwischengespeichertes Präfix einen anderen Kunden bediente“ aufgeführten Anfragen wurde verwendet, um Anfragen eines anderen Kunden zu beantworten, die mit demselben Präfix begannen, obwohl der Dienst einen eigenen Präfix-Cache je Kunde zusagt (eine Verletzung der Trennung des Präfix-Caches). Der Inhalt Ihrer Prompts wurde in keiner Antwort offengelegt; die schnellere Antwort bei einem Cache-Treffer kann dem anderen Kunden jedoch verraten haben, dass eine Ihrer Anfragen dasselbe Prompt-Präfix gesendet hatte. Das ist von Bedeutung, wo schon die Tatsache, dass ein Prompt so begann, vertraulich ist.".into()
            } else {
                "The cached prompt prefix of the requests listed under \"your requests whose cached prefix served another customer\" was used to answer requests of another customer that began with the same prefix, although the service promises a prefix cache per customer (a prefix-cache isolation breach). The content of your prompts was not disclosed in any response; but the faster answer of a cache hit can have revealed to the other customer that a request of yours had sent that same prompt prefix, which matters where the fact that a prompt began that way is itself confidential.".into()
            });
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
            .filter(|c| **c == Confidence::Confirmed)
            .count() as u64;
        let total = (received.len() + exposed.len() + served.len() + revealed.len()) as u64;
        let approx = approximate(
            self.lang,
            received.len(),
            exposed.len(),
            served.len() + revealed.len(),
        );
        Notice {
            format: "kvtrail-notice".into(),
            version: 1,
            incident_id: self.incident_id.clone(),
            customer: tenant.to_string(),
            roles,
            nature: self.nature.clone(),
            data_subject_categories: vec![data_subjects(self.lang).to_string()],
            data_subjects_approximate: approx,
            record_categories: record_categories(self.lang)
                .iter()
                .map(|s| s.to_string())
                .collect(),
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
        let de = self.lang == Lang::De;
        let mut nature = self.nature.clone();
        let mut consequences: Vec<String> = if de {
            vec![
                "an Kunden ausgelieferte Antworten können Bruchstücke der Prompts anderer Kunden enthalten, einschließlich personenbezogener Daten".into(),
                "Prompts der Quellanfragen können anderen Kunden offengelegt worden sein".into(),
                "die betroffenen Antworten können falsch oder unzusammenhängend sein".into(),
            ]
        } else {
            vec![
                "responses delivered to customers may contain fragments of other customers' prompts, including personal data".into(),
                "prompts of the source requests may have been disclosed to other customers".into(),
                "the affected responses may be wrong or incoherent".into(),
            ]
        };
        if let Some(pc) = &prefix_cache {
            if self.breach {
                consequences.push(if de {
                    "Antworten, die aus dem zwischengespeicherten Prompt-Präfix eines anderen Kunden bedient wurden (Verletzung der Trennung des Präfix-Caches), können durch ihr Zeitverhalten verraten, dass ein anderer Kunde dasselbe Präfix gesendet hat; Prompt-Inhalte wurden nicht offengelegt".into()
                } else {
                    "responses served from another customer's cached prompt prefix (prefix-cache isolation breach) can reveal through their timing that another customer sent the same prefix; no prompt content was disclosed".into()
                });
            } else if de {
                nature.push_str(&format!(
                    " Zur Information: {} {} aus einem Prompt-Präfix bedient, das die Anfrage eines anderen Kunden zwischengespeichert hatte; der Dienst nutzt seinen Präfix-Cache für alle Kunden gemeinsam, daher ist das keine Verletzung der Trennung, und deswegen wird kein Kunde benachrichtigt.",
                    crate::words::count(pc.responses, "Antwort", "Antworten"),
                    crate::words::noun(pc.responses, "wurde", "wurden")
                ));
            } else {
                nature.push_str(&format!(
                    " Information: {} served from a prompt prefix another customer's request had cached; the deployment shares its prefix cache across customers, so these are no isolation breach and no customer is notified for them.",
                    crate::words::count(pc.responses, "response was", "responses were")
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
            cross_customer_responses: c.cross_tenant_responses
                - c.cross_tenant_unknown_responses
                    .min(c.cross_tenant_responses),
            cross_customer_unknown_responses: c
                .cross_tenant_unknown_responses
                .min(c.cross_tenant_responses),
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

/// The approximate number of data subjects (Art. 33(3)(a)): not
/// determinable from a trace, bounded by what the notice lists.
fn approximate(lang: Lang, responses: usize, requests: usize, prefix_cache: usize) -> String {
    match lang {
        Lang::En => match (responses, requests) {
            (0, 0) => format!(
                "not determinable from the trace; at most the persons whose personal data was contained in the prompt prefixes of the {} listed",
                count(prefix_cache, "request", "requests")
            ),
            (r, 0) => format!(
                "not determinable from the trace; the {} listed may contain personal data of persons connected with another customer",
                count(r, "response", "responses")
            ),
            (0, q) => format!(
                "not determinable from the trace; at most the persons whose personal data was contained in the {} listed",
                count(q, "request", "requests")
            ),
            (r, q) => format!(
                "not determinable from the trace; at most the persons whose personal data was contained in the {} listed, and the {} listed may contain personal data of persons connected with another customer",
                count(q, "request", "requests"),
                count(r, "response", "responses")
            ),
        },
        Lang::De => {
            let requests_in = |q: usize| {
                if q == 1 {
                    "der 1 aufgeführten Anfrage".to_string()
                } else {
                    format!("den {q} aufgeführten Anfragen")
                }
            };
            let responses_may = |r: usize| {
                if r == 1 {
                    "die 1 aufgeführte Antwort kann".to_string()
                } else {
                    format!("die {r} aufgeführten Antworten können")
                }
            };
            let others = "personenbezogene Daten von Personen enthalten, die mit einem anderen Kunden in Verbindung stehen";
            match (responses, requests) {
                (0, 0) => format!(
                    "aus dem Mitschnitt nicht bestimmbar; höchstens die Personen, deren personenbezogene Daten in den Prompt-Präfixen der {} enthalten waren",
                    count(
                        prefix_cache,
                        "aufgeführten Anfrage",
                        "aufgeführten Anfragen"
                    )
                ),
                (r, 0) => format!(
                    "aus dem Mitschnitt nicht bestimmbar; {} {others}",
                    responses_may(r)
                ),
                (0, q) => format!(
                    "aus dem Mitschnitt nicht bestimmbar; höchstens die Personen, deren personenbezogene Daten in {} enthalten waren",
                    requests_in(q)
                ),
                (r, q) => format!(
                    "aus dem Mitschnitt nicht bestimmbar; höchstens die Personen, deren personenbezogene Daten in {} enthalten waren, und {} {others}",
                    requests_in(q),
                    responses_may(r)
                ),
            }
        }
    }
}

/// What a template render receives: this one customer's notice (as
/// notice.json holds it, with the lists and counts notice.json leaves out
/// when empty or zero present, so every documented variable is defined)
/// and the language. Nothing else: no other customer's notice, no list of
/// customers.
pub(super) fn template_context(n: &Notice, lang: Lang) -> minijinja::Value {
    let mut v = serde_json::to_value(n).expect("notice serializes");
    if let Some(m) = v.as_object_mut() {
        for k in ["prefix_cache_served", "prefix_cache_revealed"] {
            m.entry(k).or_insert_with(|| serde_json::json!([]));
        }
        if let Some(i) = m.get_mut("incident").and_then(|i| i.as_object_mut()) {
            i.entry("prefix_cache_breach_responses")
                .or_insert_with(|| serde_json::json!(0));
        }
    }
    minijinja::context! { notice => minijinja::Value::from_serialize(&v), lang => lang.code() }
}

/// What the register template (register.md.j2) receives: `register`
/// (register.json's content, with `prefix_cache` null where the entry has
/// none, so a template can test for it) and `lang`.
pub(super) fn register_context(r: &RegisterEntry, lang: Lang) -> minijinja::Value {
    let mut v = serde_json::to_value(r).expect("register serializes");
    if let Some(m) = v.as_object_mut() {
        m.entry("prefix_cache").or_insert(serde_json::Value::Null);
        m.entry("cross_customer_unknown_responses")
            .or_insert(serde_json::Value::from(0));
    }
    minijinja::context! { register => minijinja::Value::from_serialize(&v), lang => lang.code() }
}

/// `n thing` / `n things` ([`crate::words::count`]).
fn count(n: usize, one: &str, many: &str) -> String {
    crate::words::count(n as u64, one, many)
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
