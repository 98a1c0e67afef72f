//! Helpers shared by the integration tests.

pub mod record;
pub mod sim;
pub mod small_trace;
pub mod trace_builder;
pub mod venv;
pub mod whatif;
