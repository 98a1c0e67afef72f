//! `kvtrail simulate` through the real binary: a run with --config and
//! --set, and bad input (exit 2 with a message naming what to fix).

use crate::support::cli::{Ran, kvtrail};

/// The exit code, and stderr then stdout.
fn code_and_text(r: Ran) -> (i32, String) {
    (r.code, r.stderr + &r.stdout)
}

#[test]
fn simulate_with_a_config_file_and_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    let truth = dir.path().join("truth.json");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/sim/deployment.toml"
    );
    let (code, text) = code_and_text(
        kvtrail([
            "simulate",
            "--scenario",
            "incident",
            "--requests",
            "800",
            "--seed",
            "3",
            "--config",
            config,
            "--set",
            "allow_auto_truncate=true",
            "--out",
            out.to_str().unwrap(),
            "--truth",
            truth.to_str().unwrap(),
        ])
        .run(),
    );
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("sglang-0.5.21"), "{text}");
    let t = kvtrail::sim::Truth::load(&truth).unwrap();
    assert_eq!(t.engine, "sglang-0.5.21");
    assert_eq!(t.summary.requests, 800);
    let m = kvtrail::trace::Trace::open(&out).unwrap().manifest;
    assert!(m.capture.complete);
    assert_eq!(m.deployment.name, "glm-5.3 / workers-ai (scaled 1/64)");
    assert_eq!(m.deployment.extra["simulator"]["allow_auto_truncate"], true);
    let (code, text) = code_and_text(kvtrail(["verify", out.to_str().unwrap()]).run());
    assert_eq!(code, 0, "{text}");
}

#[test]
fn bad_input_exits_2_with_a_hint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t");
    let o = out.to_str().unwrap();
    let bad_config = dir.path().join("bad.toml");
    std::fs::write(&bad_config, "engine = \"sglang-0.4.0\"\n").unwrap();
    for (args, expect) in [
        (
            vec!["simulate", "--scenario", "nope", "--out", o],
            "choose one of",
        ),
        (
            vec![
                "simulate",
                "--scenario",
                "incident",
                "--engine",
                "vllm",
                "--out",
                o,
            ],
            "unknown engine",
        ),
        (
            vec![
                "simulate",
                "--scenario",
                "incident",
                "--set",
                "nokey=1",
                "--out",
                o,
            ],
            "unknown key",
        ),
        (
            vec![
                "simulate",
                "--scenario",
                "incident",
                "--set",
                "kv_checksum=true",
                "--out",
                o,
            ],
            "sglang-0.5.21 or later",
        ),
        (
            vec![
                "simulate",
                "--scenario",
                "incident",
                "--set",
                "decode.capacity_tokens=1000",
                "--out",
                o,
            ],
            "multiple of page_size",
        ),
        (
            vec![
                "simulate",
                "--scenario",
                "incident",
                "--config",
                bad_config.to_str().unwrap(),
                "--out",
                o,
            ],
            "bad.toml",
        ),
    ] {
        let (code, text) = code_and_text(kvtrail(&args).run());
        assert_eq!(code, 2, "{args:?}: {text}");
        assert!(
            text.contains(expect),
            "{args:?}: expected `{expect}` in: {text}"
        );
        assert!(!text.contains("panicked"), "{text}");
    }
}

/// The help of `simulate` (and of `replay`, which shares its engine flag)
/// lists every scenario and every engine that the commands accept, from
/// the tables that accept them; and every name listed is accepted.
#[test]
fn simulate_help_lists_every_scenario_and_engine_accepted() {
    let help = kvtrail(["simulate", "--help"]).run();
    assert_eq!(help.code, 0, "{}", help.stderr);
    let text = help.stdout.as_str();
    for sc in kvtrail::sim::scenario::SCENARIOS {
        assert!(
            text.contains(sc),
            "simulate --help lacks scenario {sc}:\n{text}"
        );
        assert!(
            kvtrail::sim::scenario::scenario(sc, Some(10), 1).is_ok(),
            "{sc} listed but refused"
        );
    }
    for e in kvtrail::sim::EngineVersion::ALL {
        assert!(
            text.contains(e.name()),
            "simulate --help lacks engine {}:\n{text}",
            e.name()
        );
    }
    let replay = kvtrail(["replay", "--help"]).run();
    assert_eq!(replay.code, 0, "{}", replay.stderr);
    for e in kvtrail::sim::EngineVersion::ALL {
        assert!(
            replay.stdout.contains(e.name()),
            "replay --help lacks engine {}:\n{}",
            e.name(),
            replay.stdout
        );
    }
    // What the help does not list is refused, naming what is accepted.
    let bad = kvtrail(["simulate", "--scenario", "no-such", "--out", "x"]).run();
    assert_eq!(bad.code, 2);
    for sc in kvtrail::sim::scenario::SCENARIOS {
        assert!(bad.stderr.contains(sc), "{}", bad.stderr);
    }
}
