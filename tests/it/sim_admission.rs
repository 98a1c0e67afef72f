//! Admission at the incident's real sizes (context 1,048,576, prefill pool
//! 681,280, decode pool 2,097,152, page 64), driven through the library
//! entry point with a hand-made list of arrivals (the what-if replay path).

use kvtrail::progress::NoReporter;
use kvtrail::sim::config::{PoolConfig, SimConfig};
use kvtrail::sim::{self, Arrival, EngineVersion, RunLabel};

fn cfg(engine: EngineVersion) -> SimConfig {
    SimConfig {
        engine,
        context_window: 1_048_576,
        prefill: PoolConfig {
            capacity_tokens: 681_280,
            page_size: 64,
        },
        decode: PoolConfig {
            capacity_tokens: 2_097_152,
            page_size: 64,
        },
        prefix_cache: false,
        ..SimConfig::default()
    }
}

fn arrival(id: u64, prompt: u32) -> Arrival {
    Arrival {
        request_id: id,
        external_id: None,
        tenant: format!("t{id}"),
        arrival_ns: id as i64 * 1_000_000_000_000, // far apart: no queueing
        prompt_tokens: prompt,
        output_tokens: 2,
        prefix_group: None,
        prefix_tokens: 0,
        recorded_prompt_hash: None,
    }
}

/// (prompt, expected status, expected prefilled_tokens) per engine.
fn check(engine: EngineVersion, expect: &[(u32, u16, Option<u32>)]) {
    let c = cfg(engine);
    assert_eq!(c.prefill_limit(), 681_274);
    assert_eq!(c.decode_limit(), 1_048_570);
    let arrivals: Vec<Arrival> = expect
        .iter()
        .enumerate()
        .map(|(i, e)| arrival(i as u64 + 1, e.0))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let label = RunLabel {
        scenario: "admission".into(),
        seed: 0,
    };
    let out = sim::run(&c, arrivals, &dir.path().join("t"), &label, &NoReporter).unwrap();
    assert_eq!(out.stats.requests, expect.len() as u64);
    let t = kvtrail::trace::Trace::open(&dir.path().join("t")).unwrap();
    let mut rows: Vec<_> = t.requests().flat_map(|b| b.unwrap()).collect();
    rows.sort_by_key(|r| r.request_id);
    for (r, (prompt, status, prefilled)) in rows.iter().zip(expect) {
        assert_eq!(r.prompt_tokens, *prompt);
        assert_eq!(
            (r.http_status, r.prefilled_tokens),
            (*status, *prefilled),
            "{} prompt {prompt}",
            engine.name()
        );
    }
}

#[test]
fn thresholds_681_274_and_the_context_window_in_0_5_19() {
    check(
        EngineVersion::V0519,
        &[
            (681_273, 200, Some(681_273)), // below max_req_input_len: served
            (681_274, 200, Some(1)),       // prefill placeholder, decode answers 200
            (1_048_569, 200, Some(1)),
            (1_048_570, 400, Some(1)), // both roles stub it: decode's to_finish
            (1_048_576, 400, None),    // tokenizer: >= context window
        ],
    );
}

#[test]
fn thresholds_in_the_fixed_versions() {
    check(
        EngineVersion::V0520,
        &[
            (681_273, 200, Some(681_273)),
            (681_274, 500, Some(1)),
            (1_048_576, 400, None),
        ],
    );
    check(
        EngineVersion::V0521,
        &[
            (681_273, 200, Some(681_273)),
            (681_274, 500, Some(0)),   // prefill door; decode times out
            (1_048_570, 400, Some(0)), // decode door
            (1_048_576, 400, None),
        ],
    );
}
