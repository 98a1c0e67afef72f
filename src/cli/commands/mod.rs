//! One module per subcommand.

pub mod ingest;
pub mod inspect;
pub mod simulate;
pub mod verify;
