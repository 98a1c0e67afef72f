//! The integration tests, as one test binary (one link against arrow and
//! parquet instead of one per file): one module per area, shared helpers
//! in `support`. `cargo test --test it NAME` runs the tests whose path
//! contains NAME (a module such as `notify::`, or one test).

mod support;

mod absurd_numbers;
mod bad_input;
mod contract_conformance;
mod coverage_holes;
mod crash;
mod cuda_cli;
mod cuda_emu;
mod cuda_nvrtc;
mod evidence_claims;
mod export;
mod fleet_spark;
mod fuzz_regressions;
mod golden_v1;
mod hostile_capacity;
mod hostile_trace;
mod ingest_hostile;
mod ingest_inspect;
mod lookup_index;
mod notebooks;
mod notify;
mod notify_templates;
mod object_store;
mod other_writer;
mod outputs_hostile;
mod prefix_cache;
mod record_causal;
mod record_engine_copy;
mod record_hicache;
mod record_hostile;
mod record_live;
mod record_protocol;
mod record_sglang;
mod record_soak;
mod record_vllm;
mod record_wire_model;
mod roundtrip;
mod scope_cli;
mod scope_reference;
mod scope_semantics;
mod scope_shards;
mod scope_sim_truth;
mod scope_threads;
mod seals;
mod shell;
mod sim_admission;
mod sim_cli;
mod sim_committed_trace;
mod sim_determinism;
mod sim_incident;
mod sim_revision2;
mod sim_scope_crosscheck;
mod sim_sglang_fidelity;
mod sim_tiers;
mod sim_vllm;
mod sql_engines;
mod tidy;
mod tidy_layers;
mod whatif_audit;
mod whatif_counterfactual;
mod whatif_hostile;
mod whatif_replay;
