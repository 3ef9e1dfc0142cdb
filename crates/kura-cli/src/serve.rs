//! `kura serve`: the memcached-compatible server (see `kura_server`).

pub use kura_server::ServeArgs;

/// glibc malloc arenas for the whole server. With one per thread (the default), the RAM cache's
/// churn of multi-KiB records between worker threads fragments every arena: `kura bench
/// server`'s GET phase grew RSS by ~220 MiB over a 64 MiB cache; with one arena it stays within
/// ~95 MiB of the loaded size. Large allocations are rare on the request path, so the shared
/// arena's lock is not contended.
const MALLOC_ARENAS_MAX: libc::c_int = 1;

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    if args.license {
        print!("{}", kura_server::cli::LICENSE_NOTICE);
        return Ok(());
    }
    // SAFETY: mallopt only adjusts glibc's allocator parameters; called before the server
    // starts its threads.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS_MAX) };
    let config = args.to_config().map_err(anyhow::Error::msg)?;
    kura_server::run(&config, &args.to_process_config())?;
    Ok(())
}
