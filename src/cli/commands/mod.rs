//! One module per subcommand.

pub mod demo;
pub mod lookup;
pub mod notify;
pub mod scope;
pub mod verify;
