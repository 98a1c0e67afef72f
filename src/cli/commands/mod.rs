//! One module per subcommand.

pub mod audit;
pub mod completions;
pub mod counterfactual;
pub mod demo;
pub mod diff;
pub mod export;
pub mod fleet;
pub mod ingest;
pub mod inspect;
pub mod lookup;
pub mod man;
pub mod merge;
pub mod notify;
pub mod record;
pub mod replay;
pub mod reproduce;
pub mod scope;
pub mod signing;
pub mod simulate;
pub mod sql;
pub mod verify;
