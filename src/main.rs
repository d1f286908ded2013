//! The `foxedge` command line (see `foxedge --help`).

mod cli;

fn main() {
    let code = cli::run(std::env::args().collect());
    std::process::exit(code);
}
