//! The pure step of notify: from a scope report to one pack per customer,
//! with no file read or written. `Customers::of` gathers each customer's
//! facts from the summary (both sides of every exposure, and of
//! cross-tenant prefix-cache hits where the deployment promised per-tenant
//! prefix caches); `Customers::fill` completes source requests' arrival
//! time and output hash from the rows of requests.csv the caller reads
//! (`wants` says whether any are needed); `Customers::into_packs` names the
//! folders and returns the packs, sorted by customer.
//!
//! Isolation: a pack holds only its customer's identifiers; other
//! customers appear as counts. Folder names come from the customer's own
//! name (`folder_names`), never another's.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::notice::{
    ExposedRequest, Pack, PrefixCacheRevealed, PrefixCacheServed, ReceivedResponse,
    RegisterPrefixCache,
};
use crate::error::{Error, Result};
use crate::report::csv;
use crate::report::lookup_files::IndexRow;
use crate::schema::ENGINE_REQUEST;
use crate::scope::{Confidence, Crossing, ScopeReport};
use crate::text::utc;

/// Every customer's facts, by tenant, and what the register counts.
#[derive(Debug, Default)]
pub struct Customers {
    received: BTreeMap<String, Vec<ReceivedResponse>>,
    /// tenant -> request id -> accumulated exposure
    exposed: BTreeMap<String, BTreeMap<u64, ExposedRequest>>,
    served: BTreeMap<String, BTreeMap<u64, PrefixCacheServed>>,
    revealed: BTreeMap<String, BTreeMap<u64, PrefixCacheRevealed>>,
    /// Source requests to complete from requests.csv: (tenant, the tenant
    /// as requests.csv holds it: no NUL).
    want: HashMap<u64, (String, String)>,
    /// Affected responses whose customer is not known.
    pub unattributed_responses: u64,
    /// Source requests whose customer is not known.
    pub unattributed_sources: BTreeSet<u64>,
    /// The register's figures on cross-tenant prefix-cache hits (`None`
    /// when there are none).
    pub prefix_cache: Option<RegisterPrefixCache>,
}

impl Customers {
    /// Each customer's facts from the summary.
    pub fn of(sum: &ScopeReport) -> Self {
        let mut c = Customers::default();
        c.exposures(sum);
        // Cross-tenant prefix-cache hits: notified (both sides) only where
        // the deployment promised per-tenant prefix caches; counted in the
        // register either way.
        let breach = sum.deployment.tenant_prefix_cache();
        c.prefix_cache = register_prefix_cache(sum, breach);
        if breach {
            c.prefix_cache_hits(sum);
        }
        c.want_sources();
        c
    }

    /// Affected responses (the recipient side) and their sources.
    fn exposures(&mut self, sum: &ScopeReport) {
        for a in &sum.affected_responses {
            if let Some(t) = a.tenant.customer() {
                self.received
                    .entry(t.to_string())
                    .or_default()
                    .push(ReceivedResponse {
                        request_id: a.request_id,
                        external_id: a.external_id.clone(),
                        arrival_ns: a.arrival_ns,
                        arrival_utc: a.arrival_ns.map(utc),
                        finish_ns: a.finish_ns,
                        http_status: a.http_status,
                        prompt_tokens: a.prompt_tokens,
                        prefilled_tokens: a.prefilled_tokens,
                        output_hash: a.output_hash.clone(),
                        foreign_tokens: a.foreign_tokens,
                        exposed_tokens: a.exposed_tokens,
                        other_customer_data: a.crossing().known(),
                        confidence: a.confidence,
                        first_exposure_ns: a.first_read_ns,
                        last_exposure_ns: a.last_read_ns,
                    });
            } else {
                self.unattributed_responses += 1;
            }
            for s in &a.sources {
                if s.request_id == ENGINE_REQUEST {
                    continue;
                }
                let Some(t) = s.tenant.customer() else {
                    self.unattributed_sources.insert(s.request_id);
                    continue;
                };
                let e = self
                    .exposed
                    .entry(t.to_string())
                    .or_default()
                    .entry(s.request_id)
                    .or_insert_with(|| ExposedRequest {
                        request_id: s.request_id,
                        external_id: s.external_id.clone(),
                        arrival_ns: None,
                        arrival_utc: None,
                        output_hash: None,
                        tokens: 0,
                        responses: 0,
                        reached_other_customers: Some(false),
                        confidence: s.confidence,
                        first_exposure_ns: s.first_ts_ns,
                        last_exposure_ns: s.last_ts_ns,
                    });
                e.tokens += s.tokens;
                e.responses += 1;
                e.reached_other_customers = Crossing::from_known(e.reached_other_customers)
                    .max(s.crossing(&a.tenant))
                    .known();
                // Confirmed when any reading is (Confirmed sorts first).
                e.confidence = e.confidence.min(s.confidence);
                e.first_exposure_ns = e.first_exposure_ns.min(s.first_ts_ns);
                e.last_exposure_ns = e.last_exposure_ns.max(s.last_ts_ns);
            }
        }
    }

    /// Both sides of every cross-tenant prefix-cache hit (a breach here).
    fn prefix_cache_hits(&mut self, sum: &ScopeReport) {
        for hit in &sum.cross_tenant_shared {
            if let Some(t) = hit.tenant.customer() {
                self.served.entry(t.to_string()).or_default().insert(
                    hit.request_id,
                    PrefixCacheServed {
                        request_id: hit.request_id,
                        external_id: hit.external_id.clone(),
                        arrival_ns: None,
                        arrival_utc: None,
                        output_hash: None,
                        tokens: hit.tokens,
                        source_requests: hit.sources.len() as u64,
                        confidence: Confidence::Confirmed,
                    },
                );
            }
            for x in &hit.sources {
                if x.request_id == ENGINE_REQUEST {
                    continue;
                }
                let Some(t) = x.tenant.customer() else {
                    continue;
                };
                let e = self
                    .revealed
                    .entry(t.to_string())
                    .or_default()
                    .entry(x.request_id)
                    .or_insert_with(|| PrefixCacheRevealed {
                        request_id: x.request_id,
                        external_id: None,
                        arrival_ns: None,
                        arrival_utc: None,
                        output_hash: None,
                        tokens: 0,
                        responses: 0,
                        confidence: Confidence::Confirmed,
                    });
                e.tokens = e.tokens.saturating_add(x.tokens);
                e.responses += 1;
            }
        }
    }

    /// The source requests whose own arrival time and output hash come
    /// from requests.csv.
    fn want_sources(&mut self) {
        for (t, m) in &self.exposed {
            for id in m.keys() {
                let in_csv = csv::untext(&csv::text(t)).to_string();
                self.want.insert(*id, (t.clone(), in_csv));
            }
        }
        for (t, ids) in self
            .served
            .iter()
            .map(|(t, m)| (t, m.keys().copied().collect::<Vec<_>>()))
            .chain(
                self.revealed
                    .iter()
                    .map(|(t, m)| (t, m.keys().copied().collect::<Vec<_>>())),
            )
        {
            for id in ids {
                let in_csv = csv::untext(&csv::text(t)).to_string();
                self.want.insert(id, (t.clone(), in_csv));
            }
        }
    }

    /// Whether any row of requests.csv is wanted ([`Customers::fill`]).
    pub fn wants(&self) -> bool {
        !self.want.is_empty()
    }

    /// Completes the facts from one row of requests.csv (a row of another
    /// tenant under the same request id changes nothing).
    pub fn fill(&mut self, row: &IndexRow) {
        let Some((t, in_csv)) = self.want.get(&row.request_id) else {
            return;
        };
        if *in_csv != row.tenant {
            return;
        }
        if let Some(e) = self
            .exposed
            .get_mut(t)
            .and_then(|m| m.get_mut(&row.request_id))
        {
            e.arrival_ns = Some(row.arrival_ns);
            e.arrival_utc = Some(utc(row.arrival_ns));
            e.output_hash = row.output_hash.clone();
        }
        if let Some(e) = self
            .served
            .get_mut(t)
            .and_then(|m| m.get_mut(&row.request_id))
        {
            e.arrival_ns = Some(row.arrival_ns);
            e.arrival_utc = Some(utc(row.arrival_ns));
            e.output_hash = row.output_hash.clone();
            if e.external_id.is_none() {
                e.external_id = row.external_id.clone();
            }
        }
        if let Some(e) = self
            .revealed
            .get_mut(t)
            .and_then(|m| m.get_mut(&row.request_id))
        {
            e.arrival_ns = Some(row.arrival_ns);
            e.arrival_utc = Some(utc(row.arrival_ns));
            e.output_hash = row.output_hash.clone();
            e.external_id = row.external_id.clone();
        }
    }

    /// One pack per customer, sorted by customer, each in its own folder
    /// (`customers/<folder_names>`). Refused when two customers would share
    /// a folder, whatever `folder_names` returns: a pack is never written
    /// over another customer's.
    pub fn into_packs(mut self) -> Result<Vec<Pack>> {
        let tenants: BTreeSet<String> = self
            .received
            .keys()
            .chain(self.exposed.keys())
            .chain(self.served.keys())
            .chain(self.revealed.keys())
            .cloned()
            .collect();
        let folders = folder_names(&tenants);
        let mut taken = BTreeSet::new();
        if let Some(f) = folders
            .values()
            .find(|f| !taken.insert(f.to_ascii_lowercase()))
        {
            return Err(Error::Other(format!(
                "notify: two customers would share the pack folder customers/{f}; nothing was written"
            )));
        }
        Ok(tenants
            .iter()
            .map(|t| Pack {
                tenant: t.clone(),
                folder: format!("customers/{}", folders[t]),
                received: self.received.remove(t).unwrap_or_default(),
                exposed: take(&mut self.exposed, t),
                served: take(&mut self.served, t),
                revealed: take(&mut self.revealed, t),
            })
            .collect())
    }
}

/// The entries of tenant `t` in `m`, by request id, taken out.
fn take<V>(m: &mut BTreeMap<String, BTreeMap<u64, V>>, t: &str) -> Vec<V> {
    m.remove(t)
        .map(|m| m.into_values().collect())
        .unwrap_or_default()
}

/// The register's figures on cross-tenant prefix-cache hits (`None` when
/// there are none); `breach`: the deployment promised per-tenant caches.
fn register_prefix_cache(sum: &ScopeReport, breach: bool) -> Option<RegisterPrefixCache> {
    if sum.cross_tenant_shared.is_empty() {
        return None;
    }
    let mut readers = BTreeSet::new();
    let mut sources = BTreeSet::new();
    let mut source_requests = BTreeSet::new();
    let mut unattributed = BTreeSet::new();
    let mut tokens = 0u64;
    for hit in &sum.cross_tenant_shared {
        match hit.tenant.customer() {
            Some(t) => {
                readers.insert(t.to_string());
            }
            None => {
                unattributed.insert(hit.request_id);
            }
        }
        for x in &hit.sources {
            source_requests.insert(x.request_id);
            tokens = tokens.saturating_add(x.tokens);
            match x.tenant.customer() {
                Some(t) => {
                    sources.insert(t.to_string());
                }
                None => {
                    unattributed.insert(x.request_id);
                }
            }
        }
    }
    Some(RegisterPrefixCache {
        scope: if breach { "tenant" } else { "global" }.into(),
        isolation_breach: breach,
        responses: sum.cross_tenant_shared.len() as u64,
        source_requests: source_requests.len() as u64,
        tokens,
        reader_customers: readers.len() as u64,
        source_customers: sources.len() as u64,
        unattributed: unattributed.len() as u64,
    })
}

/// Whether Windows (and so any share, archive or mail client a pack may
/// travel through) reserves a file name: CON, PRN, AUX, NUL, COM0-9 and
/// LPT0-9 (also with superscript digits), with or without an extension,
/// any case; and names that end in a dot or a space.
fn reserved_on_windows(name: &str) -> bool {
    let stem = name.split('.').next().unwrap_or("").to_ascii_uppercase();
    let stem = stem.trim_end_matches(' ');
    let device = matches!(stem, "CON" | "PRN" | "AUX" | "NUL")
        || ((stem.starts_with("COM") || stem.starts_with("LPT"))
            && stem.len() > 3
            && stem[3..]
                .chars()
                .all(|c| c.is_ascii_digit() || matches!(c, '¹' | '²' | '³'))
            && stem[3..].chars().count() == 1);
    device || name.ends_with(['.', ' '])
}

/// Folder names for tenants: the tenant's own name when it is a safe file
/// name (ASCII letters, digits, `-`, `_`, `.`; not starting with `.`; not a
/// name Windows reserves) and unique ignoring case; otherwise a sanitised
/// name plus hex digits of blake3(tenant) (8, more if that is taken).
/// Deterministic; unique ignoring case; never another tenant's name.
pub fn folder_names(tenants: &BTreeSet<String>) -> BTreeMap<String, String> {
    let safe = |t: &str| -> String {
        let s: String = t
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '_'
                }
            })
            .take(64)
            .collect();
        s.trim_start_matches('.').to_string()
    };
    let mut by_lower: HashMap<String, usize> = HashMap::new();
    for t in tenants {
        *by_lower.entry(safe(t).to_ascii_lowercase()).or_default() += 1;
    }
    let clean = |t: &str| {
        let s = safe(t);
        !s.is_empty()
            && s == *t
            && !reserved_on_windows(&s)
            && by_lower[&s.to_ascii_lowercase()] == 1
    };
    // Clean names first, so a hashed name never takes one.
    let mut used: BTreeSet<String> = tenants
        .iter()
        .filter(|t| clean(t.as_str()))
        .map(|t| t.to_ascii_lowercase())
        .collect();
    tenants
        .iter()
        .map(|t| {
            if clean(t) {
                return (t.clone(), t.clone());
            }
            // Dots become `_` so no extension is left for Windows to read
            // a device name (`aux.txt`) from.
            let s = safe(t).replace('.', "_");
            let hx = blake3::hash(t.as_bytes()).to_hex();
            let mut name = String::new();
            for n in [8, 16, 32, 64] {
                name = if s.is_empty() {
                    format!("customer-{}", &hx[..n])
                } else {
                    format!("{s}-{}", &hx[..n])
                };
                if !used.contains(&name.to_ascii_lowercase()) {
                    break;
                }
            }
            used.insert(name.to_ascii_lowercase());
            (t.clone(), name)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::{
        Counts, Coverage, DeploymentInfo, Response, SharedHit, SharedSource, Source, Tenant,
        TimeWindow,
    };
    use crate::trace::manifest::PrefixCacheScope;

    fn customer(t: &str) -> Tenant {
        Tenant::Customer(t.into())
    }

    fn source(id: u64, tenant: Tenant, tokens: u64, confidence: Confidence) -> Source {
        Source {
            request_id: id,
            external_id: Some(format!("ext-{id}")),
            tenant,
            tokens,
            first_seq: 0,
            last_seq: 0,
            first_ts_ns: 100 + id as i64,
            last_ts_ns: 200 + id as i64,
            pools: vec![0],
            cross_tenant: true,
            confidence,
        }
    }

    fn response(id: u64, tenant: Tenant, confidence: Confidence, sources: Vec<Source>) -> Response {
        Response {
            request_id: id,
            external_id: Some(format!("ext-{id}")),
            tenant,
            in_requests_table: true,
            arrival_ns: Some(50),
            finish_ns: None,
            http_status: Some(200),
            finish_reason: None,
            prompt_tokens: None,
            prefilled_tokens: None,
            output_tokens: None,
            output_hash: None,
            foreign_tokens: sources.iter().map(|s| s.tokens).sum(),
            unknown_tokens: 0,
            uncertain_tokens: 0,
            exposed_tokens: sources.iter().map(|s| s.tokens).sum(),
            cross_tenant: true,
            confidence,
            reasons: vec!["foreign".into()],
            first_read_ns: 10,
            last_read_ns: 20,
            sources,
        }
    }

    fn report(
        affected: Vec<Response>,
        hits: Vec<SharedHit>,
        scope: Option<PrefixCacheScope>,
    ) -> ScopeReport {
        ScopeReport {
            format: "kvtrail-scope".into(),
            version: 1,
            verdict: String::new(),
            deployment: DeploymentInfo {
                name: "d".into(),
                engine: "sglang".into(),
                context_window: 0,
                pools: vec![],
                capture_writer: String::new(),
                capture_started_ns: 0,
                capture_ended_ns: 0,
                prefix_cache_scope: scope,
            },
            time_window: TimeWindow::default(),
            counts: Counts::default(),
            affected_responses: affected,
            recipients: vec![],
            sources: vec![],
            blank_reads: 0,
            blank_read_responses: vec![],
            cross_tenant_shared: hits,
            anomalies: vec![],
            coverage: Coverage::default(),
        }
    }

    fn row(id: u64, tenant: &str) -> IndexRow {
        IndexRow {
            request_id: id,
            external_id: Some(format!("row-{id}")),
            tenant: tenant.into(),
            arrival_ns: 7_000 + id as i64,
            finish_ns: None,
            http_status: 200,
            prompt_tokens: 1,
            prefilled_tokens: None,
            output_tokens: 1,
            output_hash: Some(format!("{id:064x}")),
        }
    }

    /// acme's response 2 read globex's request 1 (possible) and initech's
    /// request 3 (confirmed); globex's response 4 read request 1 again
    /// (its own customer's, confirmed); an unknown reader (5) read
    /// request 3; request 6 of an unknown tenant was read by response 2.
    fn incident() -> ScopeReport {
        use Confidence::{Confirmed, Possible};
        report(
            vec![
                response(
                    2,
                    customer("acme"),
                    Possible,
                    vec![
                        source(1, customer("globex"), 4, Possible),
                        source(3, customer("initech"), 2, Confirmed),
                        source(6, Tenant::Unknown, 1, Possible),
                    ],
                ),
                response(
                    4,
                    customer("globex"),
                    Confirmed,
                    vec![source(1, customer("globex"), 5, Confirmed)],
                ),
                response(
                    5,
                    Tenant::Unknown,
                    Possible,
                    vec![source(3, customer("initech"), 1, Possible)],
                ),
            ],
            vec![],
            None,
        )
    }

    #[test]
    fn one_pack_per_customer_with_only_its_own_requests() {
        let packs = Customers::of(&incident()).into_packs().unwrap();
        let names: Vec<&str> = packs.iter().map(|p| p.tenant.as_str()).collect();
        assert_eq!(names, ["acme", "globex", "initech"]);
        let folders: Vec<&str> = packs.iter().map(|p| p.folder.as_str()).collect();
        assert_eq!(
            folders,
            ["customers/acme", "customers/globex", "customers/initech"]
        );
        let (acme, globex, initech) = (&packs[0], &packs[1], &packs[2]);
        assert_eq!(
            acme.received
                .iter()
                .map(|r| r.request_id)
                .collect::<Vec<_>>(),
            [2]
        );
        assert!(acme.exposed.is_empty());
        assert_eq!(
            globex
                .received
                .iter()
                .map(|r| r.request_id)
                .collect::<Vec<_>>(),
            [4]
        );
        // Request 1 was read by two responses: one entry, summed, and
        // confirmed because one of the readings is.
        assert_eq!(globex.exposed.len(), 1);
        let e = &globex.exposed[0];
        assert_eq!((e.request_id, e.tokens, e.responses), (1, 9, 2));
        assert_eq!(e.confidence, Confidence::Confirmed);
        assert_eq!((e.first_exposure_ns, e.last_exposure_ns), (101, 201));
        // acme is another customer: the exposure reached one.
        assert_eq!(e.reached_other_customers, Some(true));
        // Request 3 was read by acme and by an unknown reader.
        let e = &initech.exposed[0];
        assert_eq!((e.request_id, e.tokens, e.responses), (3, 3, 2));
        assert_eq!(e.reached_other_customers, Some(true));
        assert!(initech.received.is_empty());
        // No pack names another customer's request.
        for p in &packs {
            for id in p.received.iter().map(|r| r.request_id) {
                assert!(p.exposed.iter().all(|e| e.request_id != id));
            }
        }
    }

    #[test]
    fn unattributed_sides_are_counted_not_notified() {
        let c = Customers::of(&incident());
        assert_eq!(c.unattributed_responses, 1);
        assert_eq!(
            c.unattributed_sources.iter().copied().collect::<Vec<_>>(),
            [6]
        );
        assert!(c.prefix_cache.is_none());
    }

    #[test]
    fn rows_of_requests_csv_complete_only_their_own_tenants_requests() {
        let mut c = Customers::of(&incident());
        assert!(c.wants());
        // Request 1 under another tenant's name changes nothing.
        c.fill(&row(1, "acme"));
        c.fill(&row(3, "initech"));
        let packs = c.into_packs().unwrap();
        let e = &packs[1].exposed[0];
        assert_eq!((e.arrival_ns, e.output_hash.clone()), (None, None));
        let e = &packs[2].exposed[0];
        assert_eq!(e.arrival_ns, Some(7_003));
        assert_eq!(e.arrival_utc, Some(utc(7_003)));
        assert_eq!(e.output_hash, Some(format!("{:064x}", 3)));
        // The external id is the summary's, not the row's.
        assert_eq!(e.external_id.as_deref(), Some("ext-3"));
    }

    fn hits(scope: Option<PrefixCacheScope>) -> ScopeReport {
        report(
            vec![],
            vec![SharedHit {
                request_id: 8,
                external_id: None,
                tenant: customer("acme"),
                tokens: 16,
                sources: vec![
                    SharedSource {
                        request_id: 9,
                        tenant: customer("globex"),
                        tokens: 16,
                    },
                    SharedSource {
                        request_id: 10,
                        tenant: Tenant::Unknown,
                        tokens: 4,
                    },
                ],
            }],
            scope,
        )
    }

    #[test]
    fn prefix_cache_hits_are_notified_only_under_tenant_caches() {
        for scope in [None, Some(PrefixCacheScope::Global)] {
            let c = Customers::of(&hits(scope));
            let pc = c.prefix_cache.clone().unwrap();
            assert_eq!((pc.scope.as_str(), pc.isolation_breach), ("global", false));
            assert_eq!((pc.responses, pc.source_requests, pc.tokens), (1, 2, 20));
            assert_eq!(pc.unattributed, 1);
            assert!(!c.wants());
            assert!(c.into_packs().unwrap().is_empty());
        }
        let mut c = Customers::of(&hits(Some(PrefixCacheScope::Tenant)));
        let pc = c.prefix_cache.clone().unwrap();
        assert_eq!((pc.scope.as_str(), pc.isolation_breach), ("tenant", true));
        assert_eq!((pc.reader_customers, pc.source_customers), (1, 1));
        c.fill(&row(8, "acme"));
        c.fill(&row(9, "globex"));
        let packs = c.into_packs().unwrap();
        assert_eq!(packs.len(), 2);
        let served = &packs[0].served[0];
        assert_eq!(
            (served.request_id, served.tokens, served.source_requests),
            (8, 16, 2)
        );
        assert_eq!(served.external_id.as_deref(), Some("row-8"));
        assert_eq!(served.confidence, Confidence::Confirmed);
        let revealed = &packs[1].revealed[0];
        assert_eq!(
            (revealed.request_id, revealed.tokens, revealed.responses),
            (9, 16, 1)
        );
        assert_eq!(revealed.arrival_ns, Some(7_009));
        assert!(packs[0].received.is_empty() && packs[1].exposed.is_empty());
    }

    #[test]
    fn folder_names_are_the_customers_own_or_hashed() {
        let tenants: BTreeSet<String> = ["acme", "ACME", "con", "a/b", ".hidden"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let f = folder_names(&tenants);
        assert!(f["acme"].starts_with("acme-") && f["ACME"].starts_with("ACME-"));
        assert!(f["con"].starts_with("con-"));
        assert!(f["a/b"].starts_with("a_b-"));
        assert!(f[".hidden"].starts_with("hidden-"));
        let lower: BTreeSet<String> = f.values().map(|v| v.to_ascii_lowercase()).collect();
        assert_eq!(lower.len(), tenants.len());
    }
}
