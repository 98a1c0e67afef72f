//! One module per subcommand.

pub mod demo;
pub mod ingest;
pub mod inspect;
pub mod lookup;
pub mod notify;
pub mod record;
pub mod scope;
pub mod simulate;
pub mod verify;
