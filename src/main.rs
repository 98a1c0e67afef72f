//! The `kvtrail` binary: a thin shell over the library; `cli` holds one
//! module per subcommand.

mod cli;

fn main() {
    std::process::exit(cli::run());
}
