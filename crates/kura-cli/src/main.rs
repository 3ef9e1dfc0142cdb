//! The `kura` command.

mod bench_block;
mod bench_engine;
mod bench_fs;
mod block_cmd;
mod bench_pool;
mod bench_server;
mod engine_cmd;
mod fs_cmd;
mod process;
mod serve;
mod size;

use clap::{Parser, Subcommand};

/// kura: a storage stack on flash key-value stores.
///
/// The engine keeps keys and values on flash with a RAM index of about 16 bits per key.
#[derive(Parser)]
#[command(name = "kura", version, about, long_about = None)]
struct Cli {
    /// More log output (-v debug, -vv trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the memcached protocol from a kura store (values on flash, hot items in RAM).
    #[command(version)]
    Serve(serve::ServeArgs),
    /// Work with an embedded engine store in a local file or on a raw device.
    Engine {
        #[command(subcommand)]
        command: engine_cmd::EngineCommand,
    },
    /// Block volumes in a pool: create, list, resize, delete.
    Volume {
        #[command(subcommand)]
        command: block_cmd::VolumeCommand,
    },
    /// Serve volumes as block devices: NBD, a FUSE file for loop devices, ublk.
    Block {
        #[command(subcommand)]
        command: block_cmd::BlockCommand,
    },
    /// The POSIX file system on the pool: run programs with it preloaded, or mount it (FUSE).
    Fs {
        #[command(subcommand)]
        command: fs_cmd::FsCommand,
    },
    /// Benchmarks that print JSON, each with its anchor measured in the same run.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// The flash KV engine against fio on the same file (paper 002's measurements).
    Engine(bench_engine::EngineBenchArgs),
    /// kura's memcached server against memcached (DRAM) and memcached with extstore (paper 003).
    Server(bench_server::ServerBenchArgs),
    /// The pool client on each backend, with memaslap and redis-benchmark as anchors (paper 000).
    Pool(bench_pool::PoolBenchArgs),
    /// The file system under the preload and through FUSE against ext4 on the same disk (paper 004).
    Fs(bench_fs::FsBenchArgs),
    /// Block frontends (NBD, FUSE file + loop, ublk) with fio, against the pool client alone and qemu-nbd (paper 000).
    Block(bench_block::BlockBenchArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{}", error_report(&error));
            std::process::ExitCode::FAILURE
        }
    }
}

/// `Error: ` and the error, then each cause its text does not already carry: the libraries'
/// errors (thiserror's) put their source in their own message, and anyhow's report would
/// print the same words once per layer.
fn error_report(error: &anyhow::Error) -> String {
    let mut report = format!("Error: {error}");
    let mut last = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !last.contains(&text) {
            report.push_str(&format!("\n  caused by: {text}"));
        }
        last = text;
    }
    report
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Engine { command } => engine_cmd::run(command),
        Command::Bench { command: BenchCommand::Engine(args) } => bench_engine::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Volume { command } => block_cmd::run_volume(command),
        Command::Block { command } => block_cmd::run_block(command),
        Command::Bench { command: BenchCommand::Server(args) } => bench_server::run(&args),
        Command::Bench { command: BenchCommand::Pool(args) } => bench_pool::run(&args),
        Command::Fs { command } => fs_cmd::run(command),
        Command::Bench { command: BenchCommand::Fs(args) } => bench_fs::run(&args),
        Command::Bench { command: BenchCommand::Block(args) } => bench_block::run(&args),
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_report_says_each_cause_once() {
        #[derive(Debug)]
        struct Wrapped {
            source: std::io::Error,
        }
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "I/O error during open: {}", self.source)
            }
        }
        impl std::error::Error for Wrapped {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.source)
            }
        }
        let inner = std::io::Error::other("s.kura is in use");
        let error = anyhow::Error::new(Wrapped { source: inner }).context("cannot open the store at s.kura");
        assert_eq!(error_report(&error), "Error: cannot open the store at s.kura\n  caused by: I/O error during open: s.kura is in use");
        let plain = anyhow::anyhow!("no such volume").context("kura block nbd");
        assert_eq!(error_report(&plain), "Error: kura block nbd\n  caused by: no such volume");
    }
}
