//! Same scenario and seed: byte-identical trace and truth; another seed:
//! another trace. Simulated time only, never the wall clock.

use crate::support::sim as sim_common;

use std::collections::BTreeMap;
use std::path::Path;

use sim_common::simulate;

fn files(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn same_seed_gives_a_byte_identical_trace_and_truth() {
    for name in kvtrail::sim::scenario::SCENARIOS {
        let a = simulate(name, Some(600), 42, &[]);
        let b = simulate(name, Some(600), 42, &[]);
        let (fa, fb) = (files(&a.trace), files(&b.trace));
        assert!(
            fa.contains_key("trace.json") && fa.len() >= 3,
            "{name}: {:?}",
            fa.keys()
        );
        assert_eq!(
            fa.keys().collect::<Vec<_>>(),
            fb.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (k, v) in &fa {
            assert!(v == &fb[k], "{name}: {k} differs between two runs");
        }
        assert_eq!(a.truth, b.truth);
        let verify = kvtrail::trace::verify::verify(&a.trace).unwrap();
        assert!(
            verify.ok && verify.complete,
            "{name}: {:?}",
            verify.problems
        );
    }
}

#[test]
fn another_seed_gives_another_trace() {
    let a = simulate("steady", Some(300), 1, &[]);
    let b = simulate("steady", Some(300), 2, &[]);
    assert_ne!(files(&a.trace)["trace.json"], files(&b.trace)["trace.json"]);
}
