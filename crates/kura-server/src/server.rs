//! Starting, running and stopping the server.
//!
//! Threads: the main thread waits for SIGTERM/SIGINT; one acceptor thread
//! takes new connections and hands them to the workers in turn (refusing
//! those over `-c` as memcached does); `-t` workers each run an event loop
//! (`worker`); a housekeeping thread syncs with `--sync <interval>` and
//! gives freed heap memory back; with `--metrics-addr` a thread answers
//! scrapes. The engine has its own sealer threads.
//!
//! Shutdown: stop accepting, let every worker answer what is in flight and
//! close each connection once its client has taken every reply (see
//! `worker`; at most 5 s for a client that does not read), sync the store,
//! close it, return.

use std::io::{self, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kura_proto::ParserLimits;
use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::config::{ProcessConfig, ServerConfig, SyncPolicy};
use crate::heap;
use crate::process::{self, PidFile, ProcessError};
use crate::signals::TerminationSignals;
use crate::socket::{Listener, Stream};
use crate::stats::{ConnStats, ServerInfo, StatsSources, WorkerStats};
use crate::store::{Store, StoreConfig, StoreError};
use crate::worker::{Shared, WAKER, Worker, WorkerLimits};

/// What a refused connection is told (memcached 1.6's words).
const TOO_MANY_CONNECTIONS: &[u8] = b"ERROR Too many open connections\r\n";
const ACCEPTOR_WAKER: Token = Token(usize::MAX);
const SIGNAL_POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Tells the housekeeping thread to stop (the flag) and wakes it (the condvar).
type StopSignal = Arc<(Mutex<bool>, Condvar)>;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("invalid configuration: {0}")]
    Config(String),
    /// `-Z`: the certificate, key or CA file cannot be used.
    #[error("TLS: {0}")]
    Tls(String),
    #[error("cannot open the store at {path}: {source}")]
    Store { path: String, source: StoreError },
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: io::Error },
    #[error("cannot listen on the Unix socket {path}: {source}")]
    ListenUnix { path: String, source: io::Error },
    #[error(transparent)]
    Process(#[from] ProcessError),
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics { addr: SocketAddr, source: io::Error },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
    #[error("a worker thread failed; the server stopped")]
    WorkerFailed,
    #[error("the final sync failed, recent writes may be lost: {0}")]
    FinalSync(StoreError),
}

/// A running server, for embedding and tests: stop it with [`Server::shutdown`].
pub struct Server {
    shared: Arc<Shared>,
    local_addrs: Vec<SocketAddr>,
    acceptor: Option<(JoinHandle<()>, Arc<Waker>)>,
    workers: Vec<(JoinHandle<()>, Arc<Waker>)>,
    housekeeper: Option<(JoinHandle<()>, StopSignal)>,
    metrics: Option<JoinHandle<()>>,
}

/// Runs the server until SIGTERM, SIGINT or (with `-A`) a client's `shutdown`, then shuts it
/// down cleanly; as a daemon, with a pid file, as another user as `process` says. Call it
/// before the process starts any thread (`-d` forks).
pub fn run(config: &ServerConfig, process: &ProcessConfig) -> Result<(), ServerError> {
    if !process.daemon {
        return serve(config, process, None);
    }
    // The daemon's working directory is /.
    let mut config = config.clone();
    config.path = process::absolute(&config.path);
    if let Some(unix) = config.unix_socket.as_mut() {
        unix.path = process::absolute(&unix.path);
    }
    let pidfile = process.pidfile.as_deref().map(process::absolute);
    let process = ProcessConfig { pidfile, ..process.clone() };
    let daemon = process::daemonize()?;
    serve(&config, &process, Some(daemon))
}

fn serve(config: &ServerConfig, process: &ProcessConfig, daemon: Option<process::Daemon>) -> Result<(), ServerError> {
    // Before any thread starts, so that every thread inherits the mask.
    let signals = TerminationSignals::block().map_err(|source| ServerError::Io {
        what: "blocking signals",
        source,
    })?;
    if process.enable_coredumps {
        process::enable_coredumps();
    }
    if process.lock_memory {
        process::lock_memory();
    }
    let started = Server::start(config).and_then(|server| {
        let pidfile = process.pidfile.as_deref().map(PidFile::create).transpose()?;
        if let Some(user) = &process.user {
            process::drop_privileges(user)?;
        }
        Ok((server, pidfile))
    });
    let (server, _pidfile) = match started {
        Ok(started) => started,
        Err(error) => {
            if let Some(daemon) = daemon {
                daemon.failed(&error);
            }
            return Err(error);
        }
    };
    for addr in server.local_addrs() {
        tracing::info!(%addr, path = %config.path.display(), "kura serves memcached");
    }
    if let Some(unix) = &config.unix_socket {
        tracing::info!(socket = %unix.path.display(), path = %config.path.display(), "kura serves memcached");
    }
    if let Some(daemon) = daemon {
        daemon.ready();
    }
    loop {
        if let Some(signal) = signals.wait(SIGNAL_POLL_INTERVAL) {
            tracing::info!(signal, "shutting down");
            break;
        }
        if server.stop_requested() {
            tracing::info!("a client sent shutdown; shutting down");
            break;
        }
        if server.shared.shutdown.load(Ordering::Acquire) {
            tracing::error!("a worker stopped; shutting down");
            break;
        }
    }
    server.shutdown()
}

impl Server {
    /// Opens the store, binds, and starts every thread.
    pub fn start(config: &ServerConfig) -> Result<Self, ServerError> {
        config.validate().map_err(ServerError::Config)?;
        // The certificate is loaded before anything else, so that a bad one stops the start.
        let tls = config.tls.enabled.then(|| crate::tls::ServerTls::new(&config.tls).map(Arc::new)).transpose().map_err(ServerError::Tls)?;
        let store = open_store(config)?;
        let instance_id = crate::stats::new_instance_id();
        publish_changes(&store, &config.path, instance_id);
        let listeners = bind_all(&config.listen, config.listen_backlog)?;
        let mut listeners: Vec<(Listener, bool)> = listeners.into_iter().zip(&config.listen).map(|(l, addr)| (l, tls.is_some() && !config.listen_notls.contains(addr))).collect();
        let local_addrs = listeners
            .iter()
            .filter_map(|(l, _)| match l {
                Listener::Tcp(l) => l.local_addr().ok(),
                Listener::Unix { .. } => None,
            })
            .collect::<Vec<_>>();
        if let Some(unix) = &config.unix_socket {
            let listener = Listener::bind_unix(&unix.path, unix.mode, config.listen_backlog).map_err(|source| ServerError::ListenUnix {
                path: unix.path.display().to_string(),
                source,
            })?;
            listeners.push((listener, false));
        }
        let metrics_listener = config
            .metrics_addr
            .map(|addr| {
                crate::metrics::bind(addr).map_err(|source| ServerError::Metrics { addr, source })
            })
            .transpose()?;

        let worker_stats: Vec<Arc<WorkerStats>> = (0..config.threads)
            .map(|_| Arc::new(WorkerStats::default()))
            .collect();
        let conns = Arc::new(ConnStats::default());
        for (listener, _) in &listeners {
            if let Some(addr) = listener.addr() {
                use std::os::fd::AsRawFd as _;
                let entry = crate::stats::ConnEntry::listener(addr);
                conns.registry.insert(listener.as_raw_fd(), Arc::new(entry));
            }
        }
        let shared = Arc::new(Shared {
            sources: StatsSources {
                info: ServerInfo {
                    started: Instant::now(),
                    started_unix_s: crate::clock::unix_now_s(),
                    threads: config.threads,
                    max_connections: config.max_connections,
                    item_size_max_bytes: config.item_size_max_bytes,
                    port: local_addrs.first().map_or(0, SocketAddr::port),
                    allowed: config.allowed,
                    domain_socket: config.unix_socket.clone(),
                    tcp_backlog: config.listen_backlog,
                    idle_timeout_s: config.idle_timeout.map_or(0, |t| t.as_secs()),
                    protocol: config.protocol.clone(),
                    instance_id,
                },
                conns: Arc::clone(&conns),
                workers: worker_stats.clone(),
                store: Arc::clone(&store),
                crawler: Arc::new(crate::crawler::Crawler::new(Arc::clone(&store), Arc::clone(&conns))),
                watchers: Arc::default(),
                stop_requested: AtomicBool::new(false),
                detail: crate::detail::Detail::new(config.protocol.detail_delimiter),
                tls_settings: config.tls.clone(),
                tls,
            },
            store,
            conns,
            limits: worker_limits(config),
            shutdown: AtomicBool::new(false),
        });

        for &command in &config.crawler_setup {
            shared.sources.crawler.command(command);
        }
        let mut workers = Vec::new();
        let mut inboxes = Vec::new();
        for (index, stats) in worker_stats.into_iter().enumerate() {
            let poll = Poll::new().map_err(|source| ServerError::Io {
                what: "creating a worker's poll",
                source,
            })?;
            let waker =
                Arc::new(
                    Waker::new(poll.registry(), WAKER).map_err(|source| ServerError::Io {
                        what: "creating a waker",
                        source,
                    })?,
                );
            let (tx, rx) = mpsc::channel();
            let worker = Worker::new(Arc::clone(&shared), stats, poll, Arc::clone(&waker), rx).map_err(|source| {
                ServerError::Io {
                    what: "starting a worker",
                    source,
                }
            })?;
            let guard_shared = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("kura-worker-{index}"))
                .spawn(move || {
                    let _guard = StopOnExit(guard_shared);
                    worker.run();
                })
                .map_err(|source| ServerError::Io {
                    what: "spawning a worker",
                    source,
                })?;
            inboxes.push((tx, Arc::clone(&waker)));
            workers.push((handle, waker));
        }

        let acceptor = start_acceptor(
            listeners,
            inboxes,
            Arc::clone(&shared),
            config.max_connections,
        )?;
        let sync_interval = match config.sync {
            SyncPolicy::Every(interval) => Some(interval),
            SyncPolicy::Always | SyncPolicy::Never => None,
        };
        let housekeeper = Some(start_housekeeper(Arc::clone(&shared), sync_interval)?);
        let metrics = match metrics_listener {
            Some(listener) => {
                let shared = Arc::clone(&shared);
                Some(
                    std::thread::Builder::new()
                        .name("kura-metrics".to_owned())
                        .spawn(move || crate::metrics::serve(listener, shared))
                        .map_err(|source| ServerError::Io {
                            what: "spawning the metrics thread",
                            source,
                        })?,
                )
            }
            None => None,
        };
        Ok(Self {
            shared,
            local_addrs,
            acceptor: Some(acceptor),
            workers,
            housekeeper,
            metrics,
        })
    }

    /// The TCP addresses it listens on.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local_addrs
    }

    /// A client sent `shutdown` (allowed by `-A`): the caller should [`Server::shutdown`].
    pub fn stop_requested(&self) -> bool {
        self.shared.sources.stop_requested.load(Ordering::Acquire)
    }

    /// Stops accepting, drains every connection, syncs and closes the store.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        self.shared.shutdown.store(true, Ordering::Release);
        let mut failed = false;
        if let Some((handle, waker)) = self.acceptor.take() {
            let _ = waker.wake();
            failed |= handle.join().is_err();
        }
        for (_, waker) in &self.workers {
            let _ = waker.wake();
        }
        for (handle, _) in self.workers.drain(..) {
            failed |= handle.join().is_err();
        }
        if let Some((handle, signal)) = self.housekeeper.take() {
            let (lock, cvar) = &*signal;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
            cvar.notify_all();
            failed |= handle.join().is_err();
        }
        if let Some(handle) = self.metrics.take() {
            failed |= handle.join().is_err();
        }
        self.shared.sources.crawler.stop();
        if let Some(changes) = self.shared.store.changes() {
            changes.close();
        }
        self.shared
            .store
            .engine()
            .sync()
            .map_err(|e| ServerError::FinalSync(StoreError::Engine(e)))?;
        tracing::info!("store synced; bye");
        if failed {
            Err(ServerError::WorkerFailed)
        } else {
            Ok(())
        }
    }
}

/// Sets the shutdown flag when a worker thread ends for any reason (a panic included).
struct StopOnExit(Arc<Shared>);

impl Drop for StopOnExit {
    fn drop(&mut self) {
        self.0.shutdown.store(true, Ordering::Release);
    }
}

fn open_store(config: &ServerConfig) -> Result<Arc<Store>, ServerError> {
    if let Some(dir) = config.path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| ServerError::Io {
            what: "creating the data directory",
            source,
        })?;
    }
    let store_config = StoreConfig {
        item_size_max_bytes: config.item_size_max_bytes,
        cache_limit_bytes: config.memory_limit_bytes,
        size_bytes: config.size_bytes,
        mode: config.mode,
        block_size_bytes: config.block_size_bytes,
        seal_threads: config.seal_threads,
        partitions_max: config.partitions_max,
        cas_enabled: config.protocol.cas_enabled,
        slab_classes: crate::metadump::SlabClasses::new(config.protocol.slab_growth_factor, config.protocol.slab_chunk_size, config.protocol.cas_enabled),
    };
    let store = Store::open(&config.path, &store_config).map_err(|source| ServerError::Store {
        path: config.path.display().to_string(),
        source,
    })?;
    Ok(Arc::new(store))
}

/// Publishes the store's change counter beside it (`STORE.changes`, see
/// [`kura_engine::changes`]) for clients on this host; a store on a block device, or a file
/// that cannot be made, goes without (clients then read every record from the server).
fn publish_changes(store: &Store, store_path: &std::path::Path, instance_id: u64) {
    use std::os::unix::fs::FileTypeExt as _;
    if std::fs::metadata(store_path).is_ok_and(|m| m.file_type().is_block_device()) {
        return;
    }
    let path = kura_engine::changes::changes_path(store_path);
    let path = std::path::absolute(&path).unwrap_or(path);
    match kura_engine::changes::ChangeFile::create(&path, instance_id) {
        Ok(changes) => {
            let _ = store.publish_changes(changes);
        }
        Err(error) => tracing::warn!(path = %path.display(), %error, "cannot publish the change counter; clients on this host will not keep copies of records"),
    }
}

fn bind_all(addrs: &[SocketAddr], backlog: u32) -> Result<Vec<Listener>, ServerError> {
    addrs
        .iter()
        .map(|&addr| {
            let listener = Listener::Tcp(TcpListener::bind(addr).map_err(|source| ServerError::Listen { addr, source })?);
            listener.set_backlog(backlog).map_err(|source| ServerError::Listen { addr, source })?;
            Ok(listener)
        })
        .collect()
}

fn worker_limits(config: &ServerConfig) -> WorkerLimits {
    // The parser bounds the value alone; the store checks the whole record against -I.
    let value_max = config.item_size_max_bytes - crate::record::RECORD_OVERHEAD_BYTES_MIN;
    let parser = ParserLimits {
        item_size_max_bytes: value_max,
        ..ParserLimits::default()
    };
    WorkerLimits {
        // A storage frame is a command line, the data block and its `\r\n`.
        input_max_bytes: parser.item_size_max_bytes
            + parser.line_length_max.max(parser.retrieval_line_length_max)
            + 2,
        parser,
        output_high_bytes: config.output_high_bytes,
        pending_reads_max: config.pending_reads_per_conn_max,
        read_queue_depth: config.read_queue_depth,
        idle_timeout: config.idle_timeout,
        sync_always: config.sync == SyncPolicy::Always,
        poll_spin: config.poll_spin,
    }
}

/// A worker's queue of new connections (each with whether it speaks TLS) and its waker.
type Inbox = (Sender<(Stream, bool)>, Arc<Waker>);

fn start_acceptor(
    mut listeners: Vec<(Listener, bool)>,
    inboxes: Vec<Inbox>,
    shared: Arc<Shared>,
    max_connections: usize,
) -> Result<(JoinHandle<()>, Arc<Waker>), ServerError> {
    let io_error = |what| move |source| ServerError::Io { what, source };
    let mut poll = Poll::new().map_err(io_error("creating the acceptor's poll"))?;
    for (i, (listener, _)) in listeners.iter_mut().enumerate() {
        poll.registry()
            .register(listener, Token(i), Interest::READABLE)
            .map_err(io_error("watching a listener"))?;
    }
    let waker = Arc::new(
        Waker::new(poll.registry(), ACCEPTOR_WAKER).map_err(io_error("creating a waker"))?,
    );
    let handle = std::thread::Builder::new()
        .name("kura-acceptor".to_owned())
        .spawn(move || {
            let mut events = Events::with_capacity(64);
            let mut next = 0usize;
            while !shared.shutdown.load(Ordering::Acquire) {
                if let Err(error) = poll.poll(&mut events, None)
                    && error.kind() != io::ErrorKind::Interrupted
                {
                    tracing::error!(%error, "acceptor poll failed");
                    break;
                }
                for event in events.iter() {
                    let Some((listener, tls)) = listeners.get(event.token().0) else {
                        continue;
                    };
                    accept_all(listener, *tls, &inboxes, &shared, max_connections, &mut next);
                }
            }
            // Dropping the listeners here stops the kernel from queueing new connections.
        })
        .map_err(io_error("spawning the acceptor"))?;
    Ok((handle, waker))
}

/// Accepts every connection waiting on `listener` and hands each to a worker, with whether
/// it speaks TLS.
fn accept_all(
    listener: &Listener,
    tls: bool,
    inboxes: &[Inbox],
    shared: &Shared,
    max_connections: usize,
    next: &mut usize,
) {
    loop {
        let mut stream = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => {
                // EMFILE and the like: back off briefly rather than spin.
                tracing::warn!(%error, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
                return;
            }
        };
        let conns = &shared.conns;
        if conns.curr_connections.load(Ordering::Relaxed) >= max_connections as u64 {
            conns.rejected_connections.fetch_add(1, Ordering::Relaxed);
            let _ = stream.write(TOO_MANY_CONNECTIONS);
            continue;
        }
        conns.curr_connections.fetch_add(1, Ordering::Relaxed);
        conns.total_connections.fetch_add(1, Ordering::Relaxed);
        let (tx, waker) = &inboxes[*next % inboxes.len()];
        *next = next.wrapping_add(1);
        if tx.send((stream, tls)).is_err() {
            conns.curr_connections.fetch_sub(1, Ordering::Relaxed);
            continue;
        }
        let _ = waker.wake();
    }
}

/// The housekeeping thread: syncs the store every `sync_interval` (when
/// writes are synced on a timer) and gives freed heap memory back to the
/// kernel every [`heap::HEAP_TRIM_INTERVAL`].
fn start_housekeeper(
    shared: Arc<Shared>,
    sync_interval: Option<Duration>,
) -> Result<(JoinHandle<()>, StopSignal), ServerError> {
    let signal = Arc::new((Mutex::new(false), Condvar::new()));
    let stop = Arc::clone(&signal);
    let handle = std::thread::Builder::new()
        .name("kura-housekeeper".to_owned())
        .spawn(move || {
            let (lock, cvar) = &*stop;
            let start = Instant::now();
            let mut next_sync = sync_interval.map(|interval| start + interval);
            let mut next_trim = start + heap::HEAP_TRIM_INTERVAL;
            let beat_interval = Duration::from_millis(kura_engine::changes::CHANGES_HEARTBEAT_MS);
            let mut next_beat = start + beat_interval;
            let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                let now = Instant::now();
                let next = next_sync.map_or(next_trim, |at| at.min(next_trim)).min(next_beat);
                let (guard, _) = cvar
                    .wait_timeout(stopped, next.saturating_duration_since(now))
                    .unwrap_or_else(|e| e.into_inner());
                stopped = guard;
                if *stopped {
                    return;
                }
                drop(stopped);
                let now = Instant::now();
                if now >= next_beat {
                    if let Some(changes) = shared.store.changes() {
                        changes.beat();
                    }
                    next_beat = now + beat_interval;
                }
                if let (Some(at), Some(interval)) = (next_sync, sync_interval)
                    && now >= at
                {
                    if let Err(error) = shared.store.sync_if_dirty() {
                        tracing::error!(%error, "periodic sync failed");
                    }
                    next_sync = Some(now + interval);
                }
                if now >= next_trim {
                    let trim = heap::release_free_heap();
                    if trim.released {
                        tracing::debug!(
                            free_bytes = trim.free_bytes,
                            elapsed_us = now.elapsed().as_micros() as u64,
                            "gave free heap memory back to the kernel"
                        );
                    }
                    next_trim = Instant::now() + heap::HEAP_TRIM_INTERVAL;
                }
                stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
            }
        })
        .map_err(|source| ServerError::Io {
            what: "spawning the housekeeping thread",
            source,
        })?;
    Ok((handle, signal))
}
