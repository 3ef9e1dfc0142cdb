//! `kura-server`: the same server as `kura serve`, as its own binary (the
//! wire-level tests start it).

use clap::Parser;
use kura_server::ServeArgs;

#[derive(Parser)]
#[command(
    name = "kura-server",
    version,
    args_override_self = true,
    about = "kura's memcached-compatible server (the same as `kura serve`)"
)]
struct Cli {
    /// More log output (-v debug, -vv trace); RUST_LOG overrides.
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(flatten)]
    serve: ServeArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.serve.license {
        print!("{}", kura_server::cli::LICENSE_NOTICE);
        return Ok(());
    }
    let default = match cli.verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let config = cli.serve.to_config().map_err(anyhow::Error::msg)?;
    kura_server::run(&config, &cli.serve.to_process_config())?;
    Ok(())
}
