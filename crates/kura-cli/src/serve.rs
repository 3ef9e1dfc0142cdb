//! `kura serve`: the memcached-compatible server (see `kura_server`).

pub use kura_server::ServeArgs;

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    let config = args.to_config().map_err(anyhow::Error::msg)?;
    kura_server::run(&config)?;
    Ok(())
}
