//! traces/incident-mini is what traces/README.md says: regenerating it with
//! the documented command gives byte-identical files and truth.

use crate::support::sim;

use std::path::Path;

use kvtrail::sim::Truth;

#[test]
fn incident_mini_regenerates_byte_for_byte() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let run = sim::simulate("incident", Some(3000), 1, &[]);
    let regen = "regenerate with the command in traces/README.md and update its digests";
    for rel in [
        "trace.json",
        "kv/pool=0/part-00000.parquet",
        "kv/pool=1/part-00000.parquet",
        "requests/part-00000.parquet",
    ] {
        let shipped = std::fs::read(root.join("incident-mini").join(rel)).unwrap();
        let fresh = std::fs::read(run.trace.join(rel)).unwrap();
        assert!(
            shipped == fresh,
            "traces/incident-mini/{rel} differs from a fresh run: {regen}"
        );
    }
    let shipped = Truth::load(&root.join("incident-mini.truth.json")).unwrap();
    assert_eq!(shipped, run.truth, "truth differs: {regen}");
    assert_eq!(shipped.summary.affected_responses, 6);
    sim::assert_truth_matches_trace(&run);
}
