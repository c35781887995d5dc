//! `aqueduct`: command-line client for the Aqueduct broker (pub, sub, hold, bench).

fn main() -> std::process::ExitCode {
    aqueduct_cli::client_cmd::main_with(std::env::args_os().collect())
}
