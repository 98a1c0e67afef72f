//! One module per subcommand.

pub mod demo;
pub mod scope;
pub mod simulate;
pub mod verify;
