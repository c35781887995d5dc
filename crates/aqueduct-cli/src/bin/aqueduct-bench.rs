//! `aqueduct-bench`: the seed's load-test command, an alias of `aqueduct bench`. The seed's
//! command line works as written:
//! `aqueduct-bench -addr 127.0.0.1:4242 -streams 10 -messages 100000 -payload-size 128`.

fn main() -> std::process::ExitCode {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // `aqueduct-bench ARGS` is `aqueduct bench ARGS` (and its help and errors say so).
    match args.first_mut() {
        Some(name) => *name = "aqueduct".into(),
        None => args.push("aqueduct".into()),
    }
    args.insert(1, "bench".into());
    aqueduct_cli::client_cmd::main_with(args)
}
