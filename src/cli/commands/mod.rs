//! One module per subcommand.

pub mod demo;
pub mod ingest;
pub mod inspect;
pub mod merge;
pub mod scope;
pub mod simulate;
pub mod sql;
pub mod verify;
