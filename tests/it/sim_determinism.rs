//! Same scenario and seed: byte-identical trace and truth; another seed:
//! another trace. Simulated time only, never the wall clock.

use crate::support::files;
use crate::support::sim::simulate;

#[test]
fn same_seed_gives_a_byte_identical_trace_and_truth() {
    for name in kvtrail::sim::scenario::SCENARIOS {
        let a = simulate(name, Some(600), 42, &[]);
        let b = simulate(name, Some(600), 42, &[]);
        let (fa, fb) = (files::contents(&a.trace), files::contents(&b.trace));
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
    assert_ne!(
        files::contents(&a.trace)["trace.json"],
        files::contents(&b.trace)["trace.json"]
    );
}
