//! One module per subcommand.

pub mod ingest;
pub mod inspect;
pub mod record;
pub mod verify;
