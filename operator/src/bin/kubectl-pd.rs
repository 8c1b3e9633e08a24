//! `kubectl pd`: the kubectl plugin (see `perspective_operator::plugin`).

use std::process::ExitCode;

use clap::Parser;
use perspective_operator::plugin::{run, Cli};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
