//! The engines kvtrail knows, by the names trace.json and the command
//! line give them: the released SGLang versions whose PD request path the
//! simulator follows ([`EngineVersion`]), and the engine family of any
//! recorded engine string (`sglang-0.5.19`, `vllm 0.33.0+cu128`, ...). The
//! one home of that parsing: the trace's admission limit, the simulator,
//! what-if and audit all call it.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Location, Result};

/// The released SGLang version whose PD request path the engine follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum EngineVersion {
    /// Placeholder bug: 1-token forward, 1 page + Success, decode generates
    /// over its whole preallocation, HTTP 200.
    #[serde(rename = "sglang-0.5.19")]
    V0519,
    /// Prefill forwards the placeholder, then retires it with 400; decode
    /// waits out its timeout (500) and frees the preallocation unread.
    #[serde(rename = "sglang-0.5.20")]
    V0520,
    /// Rejected at the queue door (no forward); deferred release on;
    /// opt-in KV checksum.
    #[serde(rename = "sglang-0.5.21")]
    V0521,
    /// As 0.5.21, plus the prefill_complete decode allocation policy.
    #[serde(rename = "sglang-0.5.22")]
    V0522,
    /// As 0.5.22 on this path.
    #[serde(rename = "sglang-0.5.23")]
    V0523,
    /// vLLM 0.33.0 with the NixlConnector (pull): block pool with prefix
    /// caching scoped by `cache_salt`, the producer's lease on the blocks
    /// it holds for decode, `kv_load_failure_policy`; no release fixes
    /// vllm-project/vllm#52234 (docs/engine-vllm.md).
    #[serde(rename = "vllm-0.33.0")]
    Vllm0330,
}

impl EngineVersion {
    pub const ALL: [EngineVersion; 6] = [
        EngineVersion::V0519,
        EngineVersion::V0520,
        EngineVersion::V0521,
        EngineVersion::V0522,
        EngineVersion::V0523,
        EngineVersion::Vllm0330,
    ];

    /// Every engine name, for messages: `a, b, ... or z`, from [`Self::ALL`].
    pub fn names() -> String {
        let n: Vec<&str> = Self::ALL.iter().map(|v| v.name()).collect();
        match n.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => n.join(""),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EngineVersion::V0519 => "sglang-0.5.19",
            EngineVersion::V0520 => "sglang-0.5.20",
            EngineVersion::V0521 => "sglang-0.5.21",
            EngineVersion::V0522 => "sglang-0.5.22",
            EngineVersion::V0523 => "sglang-0.5.23",
            EngineVersion::Vllm0330 => "vllm-0.33.0",
        }
    }

    /// Parses an `--engine` argument; an unknown name is an error naming
    /// the flag and the engines modelled.
    pub fn parse_arg(s: &str) -> Result<EngineVersion> {
        EngineVersion::parse(s).ok_or_else(|| {
            let hint = if is_vllm_engine(s) {
                "the vLLM version modelled is vllm-0.33.0; no vLLM release fixes vllm-project/vllm#52234, so a fix is named with --set (e.g. --set reference_check=true, --set kv_load_failure_policy=recompute; docs/engine-vllm.md)".to_string()
            } else {
                format!("choose {}", EngineVersion::names())
            };
            Error::invalid(
                Location::default().column("--engine"),
                format!("unknown engine `{s}`"),
                hint,
            )
        })
    }

    /// A vLLM engine (the vLLM request path and keys).
    pub fn is_vllm(self) -> bool {
        matches!(self, EngineVersion::Vllm0330)
    }

    /// The one parser of engine strings, for every caller (`--engine`,
    /// trace.json's `deployment.engine`, audit, replay): the modelled
    /// release an engine string names, or None when it names none.
    ///
    /// Accepted: the names above, `sglang 0.5.19`, `sglang==0.5.19`,
    /// `sglang v0.5.19`, `SGLang-0.5.19 (PD)`, a bare `0.5.19` (SGLang),
    /// `vllm 0.33.0`, and post releases and local builds of a modelled
    /// release (`sglang-0.5.19.post1`, `0.5.19+cu128`), which behave as
    /// the release. A pre-release (`0.5.20rc1`, `0.5.20.dev3`), a fourth
    /// version number or another release is None: its behaviour is not
    /// known.
    pub fn parse(s: &str) -> Option<EngineVersion> {
        let (family, rest) = engine_family_and_rest(s);
        let version = release_version(rest)?;
        let name = match family {
            Some(EngineFamily::Vllm) => format!("vllm-{version}"),
            Some(EngineFamily::Sglang) | None => format!("sglang-{version}"),
        };
        EngineVersion::ALL.into_iter().find(|v| v.name() == name)
    }

    /// SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE default.
    pub fn deferred_release_default(self) -> bool {
        self >= EngineVersion::V0521 && !self.is_vllm()
    }
}

/// The engine family an engine string names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFamily {
    Sglang,
    Vllm,
}

/// The family an engine string names (`vllm-0.33.0`, `vLLM`, ` sglang
/// 0.5.19`: case and surrounding blanks do not matter) and the text after
/// the family's name; None for a string that names neither (a bare
/// version reads as SGLang, see [`EngineVersion::parse`]).
fn engine_family_and_rest(s: &str) -> (Option<EngineFamily>, String) {
    let t = s.trim().to_ascii_lowercase();
    for (prefix, family) in [
        ("vllm", EngineFamily::Vllm),
        ("sglang", EngineFamily::Sglang),
    ] {
        if let Some(rest) = t.strip_prefix(prefix) {
            return (Some(family), rest.to_string());
        }
    }
    (None, t)
}

/// The family of an engine string ([`EngineVersion::parse`] for the
/// release): every reader that decides "is this vLLM" calls this.
pub fn engine_family(s: &str) -> Option<EngineFamily> {
    engine_family_and_rest(s).0
}

/// Whether an engine string names vLLM (`vllm-0.33.0`, `vLLM 0.33.0`).
pub fn is_vllm_engine(s: &str) -> bool {
    engine_family(s) == Some(EngineFamily::Vllm)
}

/// `N.N.N` at the start of `rest` (after separators and a `v`), when what
/// follows it keeps the release's behaviour: nothing, a post release
/// (`.post1`, `-post1`, `post1`), a local build (`+cu128`) or a blank or
/// bracket before a comment (`(PD)`). None for a pre-release, a fourth
/// number or anything else attached to the version.
fn release_version(rest: String) -> Option<String> {
    let r = rest.trim_start_matches(['-', '_', ' ', '=', ':', '@', '/']);
    let r = r.strip_prefix('v').unwrap_or(r);
    let mut parts = Vec::new();
    let mut i = 0;
    let b = r.as_bytes();
    for k in 0..3 {
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start || i - start > 9 {
            return None;
        }
        parts.push(&r[start..i]);
        if k < 2 {
            if i >= b.len() || b[i] != b'.' {
                return None;
            }
            i += 1;
        }
    }
    let mut tail = &r[i..];
    for post in [".post", "-post", "_post", "post"] {
        if let Some(t) = tail.strip_prefix(post) {
            let digits = t.bytes().take_while(u8::is_ascii_digit).count();
            tail = &t[digits..];
            break;
        }
    }
    let clean = match tail.chars().next() {
        None => true,
        Some(c) => c == '+' || c == '(' || c == ',' || c == ';' || c.is_whitespace(),
    };
    clean.then(|| {
        parts
            .iter()
            .map(|p| p.trim_start_matches('0'))
            .map(|p| if p.is_empty() { "0" } else { p })
            .collect::<Vec<_>>()
            .join(".")
    })
}
