//! The property test of the engine against the naive reference model
//! (support/reference.rs): random valid traces give exactly the same
//! findings from the engine as from the reference; where copies wait on
//! each other, both refuse the trace. examples/error_rate.rs runs the same
//! comparison at scale and prints the error rate's bound.

use proptest::prelude::*;

use crate::support::reference::{Outcome, compare};
use crate::support::regressions_beside_source;

fn check_seed(seed: u64) -> Outcome {
    compare(seed).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn reference_agrees_on_fixed_seeds() {
    let mut seen = std::collections::BTreeMap::new();
    for seed in 0..60 {
        *seen.entry(check_seed(seed)).or_insert(0) += 1;
    }
    // The fixed seeds cover every shape: pool DAGs, tiers, and refusals.
    for o in [
        Outcome::Scoped(false),
        Outcome::Scoped(true),
        Outcome::Refused,
    ] {
        assert!(seen.contains_key(&o), "no seed gave {o:?}: {seen:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        failure_persistence: regressions_beside_source(),
        ..ProptestConfig::with_cases(48)
    })]
    #[test]
    fn engine_matches_reference_on_random_traces(seed in any::<u64>()) {
        let _ = check_seed(seed);
    }
}
