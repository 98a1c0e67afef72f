//! notify.toml: what only the operator knows (its name, the DPO contact,
//! the incident id, when it became aware, the measures it took). Unknown
//! keys are an error (a typo must not silently leave a letter unfilled).
//! A field left out is rendered as a visible `[to fill in: ...]` marker
//! (`[bitte ergänzen: ...]` in German) and
//! listed by `NotifyConfig::unfilled` so the CLI can warn.

use std::path::Path;

use serde::Deserialize;

use super::templates::Lang;
use crate::error::{Error, Location, Result};

/// The operator's settings for notification packs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotifyConfig {
    /// The operator (data processor or controller) sending the notices.
    pub operator_name: Option<String>,
    /// Name and contact details of the data protection officer (Art. 33(3)(b)).
    pub dpo_contact: Option<String>,
    /// The operator's own incident reference.
    pub incident_id: Option<String>,
    /// Where customers send questions (defaults to the DPO contact).
    pub contact_point: Option<String>,
    /// When the operator became aware of the breach (as it should be quoted).
    pub became_aware: Option<String>,
    /// Measures taken or proposed (Art. 33(3)(d)), one sentence each.
    #[serde(default)]
    pub measures: Vec<String>,
    /// Extra sentences on the nature of the breach, appended to the facts
    /// kvtrail derives from the trace.
    pub nature: Option<String>,
}

impl NotifyConfig {
    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<NotifyConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        toml::from_str(&text).map_err(|e| {
            // Where the parser stopped, as a person counts (1-based line and
            // column in characters).
            let at = e
                .span()
                .and_then(|s| text.get(..s.start))
                .map(|before| {
                    let line = before.matches('\n').count() + 1;
                    let col = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
                    format!(" at line {line}, column {col}")
                })
                .unwrap_or_default();
            Error::invalid(
                Location::file(path),
                format!("bad notify config{at}: {}", e.message()),
                "keys: operator_name, dpo_contact, incident_id, contact_point, became_aware, measures (list), nature; see docs/notify.md",
            )
        })
    }

    /// Fields that are left out and show up as markers in the letters.
    pub fn unfilled(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        for (name, set) in [
            ("operator_name", self.operator_name.is_some()),
            ("dpo_contact", self.dpo_contact.is_some()),
            ("incident_id", self.incident_id.is_some()),
            ("became_aware", self.became_aware.is_some()),
            ("measures", !self.measures.is_empty()),
        ] {
            if !set {
                v.push(name);
            }
        }
        v
    }
}

/// The marker shown for a missing config field: `[to fill in: FIELD in
/// notify.toml]`, in German `[bitte ergänzen: FIELD in notify.toml]`.
pub fn marker(field: &str, lang: Lang) -> String {
    match lang {
        Lang::En => format!("[to fill in: {field} in notify.toml]"),
        Lang::De => format!("[bitte ergänzen: {field} in notify.toml]"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_config_error_names_line_and_column() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("notify.toml");
        std::fs::write(&p, "operator_name = \"x\"\n\n\nincident_id = 5\n").unwrap();
        let e = NotifyConfig::load(&p).unwrap_err().to_string();
        assert!(e.contains("line 4, column 15"), "{e}");
        assert!(e.contains("notify.toml"), "{e}");
    }
}
