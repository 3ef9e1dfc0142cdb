//! The pool (shared, immutable: nodes, ring, limits) and its contexts (one per thread: its
//! own connections, buffers and completion queue; nothing shared on the request path).

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kura_engine::Engine;
use kura_engine::device::EventFd;

use crate::config::{Backend, EMBEDDED_SIZE_BYTES_DEFAULT, NodeSpec, PoolConfig, default_embedded_path};
use crate::embedded::EmbeddedContext;
use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::net::NetContext;
use crate::ring::Ring;
use crate::stats::IoStats;

/// What a finished request produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<'a> {
    /// A get's value, borrowed from the context's receive buffer (or the engine's read
    /// buffer) until the completion callback returns: copy it where it belongs.
    Value(&'a [u8]),
    /// A get (or an existence probe) found no value.
    Missing,
    /// A set, delete or flush finished; or an existence probe ([`Context::submit_exists`])
    /// found the key. (Not a variant of its own: callers' exhaustive matches stay as they are.)
    Done,
}

/// One finished request, handed to the callback of [`Context::poll`].
#[derive(Debug)]
pub struct Completion<'a> {
    /// The caller's token given at submit.
    pub token: u64,
    pub result: Result<Outcome<'a>>,
}

/// A pool of nodes. Cheap to clone; `Send + Sync`; make one [`Context`] per thread.
#[derive(Clone)]
pub struct Pool {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub config: PoolConfig,
    pub ring: Ring,
    pub engine: Option<Engine>,
    /// Open connections per node address, for the per-node limits. Touched only when a
    /// connection opens or closes, never per request.
    pub connections: Mutex<HashMap<String, usize>>,
    /// Times a node may have lost writes it had acknowledged, seen by any context, and the
    /// node of the last one: a restart (a new instance), or a broken connection whose
    /// instance was unknown. Each context's next flush fails once (see [`crate::net`]).
    pub losses: Mutex<(u64, String)>,
    /// The instance last seen per node address. Touched only when a connection opens.
    pub instances: Mutex<HashMap<String, Instance>>,
}

impl Shared {
    /// Takes one of `addr`'s connection slots.
    pub fn reserve_connection(&self, addr: &str, max: usize) -> Result<()> {
        let mut counts = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        let count = counts.entry(addr.to_owned()).or_insert(0);
        if *count >= max {
            return Err(Error::ConnectionLimit { node: addr.to_owned(), max });
        }
        *count += 1;
        Ok(())
    }

    /// Notes that `addr` may have lost writes it had acknowledged.
    pub fn note_loss(&self, addr: &str) {
        let mut losses = self.losses.lock().unwrap_or_else(|e| e.into_inner());
        *losses = (losses.0 + 1, addr.to_owned());
    }

    /// A new connection to `addr` reached `instance`: when the node was seen as another
    /// instance before, it restarted since, and unsynced writes may be lost.
    pub fn note_instance(&self, addr: &str, instance: &Instance) {
        let mut instances = self.instances.lock().unwrap_or_else(|e| e.into_inner());
        let restarted = match instances.get(addr) {
            // Kept as first seen: a pid and start time read again may be a second off.
            Some(seen) if seen.same_start(instance) => return,
            Some(_) => true,
            None => false,
        };
        instances.insert(addr.to_owned(), instance.clone());
        drop(instances);
        if restarted {
            tracing::warn!(node = addr, ?instance, "the node restarted: writes it acknowledged and had not synced may be lost");
            self.note_loss(addr);
        }
    }

    pub fn release_connection(&self, addr: &str) {
        let mut counts = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = counts.get_mut(addr) {
            *count = count.saturating_sub(1);
        }
    }
}

impl Pool {
    /// Opens a pool: with no nodes, an embedded engine at `kura-data/pool.kura` (created at
    /// 1 GiB when new); an `embedded:` node opens (or creates, in store mode: never dropping
    /// data) its store here; servers are connected by each context.
    pub fn open(config: PoolConfig) -> Result<Self> {
        let mut config = config;
        if config.nodes.is_empty() {
            let path = default_embedded_path();
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            config.nodes = PoolConfig::embedded(&path, EMBEDDED_SIZE_BYTES_DEFAULT).nodes;
        }
        config.validate()?;
        let engine = match config.nodes.first() {
            Some(node) if node.backend == Backend::Embedded => Some(open_engine(node, &config)?),
            _ => None,
        };
        Ok(Self::assemble(config, engine))
    }

    /// A pool over an engine the caller already opened.
    pub fn with_engine(engine: Engine, config: PoolConfig) -> Self {
        let mut config = config;
        config.nodes = PoolConfig::embedded(Path::new("(in-process)"), 0).nodes;
        Self::assemble(config, Some(engine))
    }

    fn assemble(config: PoolConfig, engine: Option<Engine>) -> Self {
        let names: Vec<String> = config.nodes.iter().map(NodeSpec::name).collect();
        let ring = Ring::new(names.iter().map(String::as_str).zip(config.nodes.iter().map(|n| n.weight)));
        Self { shared: Arc::new(Shared { config, ring, engine, connections: Mutex::new(HashMap::new()), losses: Mutex::new((0, String::new())), instances: Mutex::new(HashMap::new()) }) }
    }

    pub fn config(&self) -> &PoolConfig {
        &self.shared.config
    }

    /// The embedded engine, when the pool is one.
    pub fn engine(&self) -> Option<&Engine> {
        self.shared.engine.as_ref()
    }

    /// The node `key` is placed on (for a Redis Cluster, the cluster).
    pub fn node_of(&self, key: &[u8]) -> &NodeSpec {
        &self.shared.config.nodes[self.node_index_of(key)]
    }

    /// The index in the configuration's nodes of the node `key` is placed on.
    pub fn node_index_of(&self, key: &[u8]) -> usize {
        self.shared.ring.locate(key)
    }

    /// A new context for the calling thread: its own connections to every node (opened now;
    /// a node that is down is retried with back-off when used).
    pub fn context(&self) -> Result<Context> {
        let inner = match &self.shared.engine {
            Some(engine) => Inner::Embedded(Box::new(EmbeddedContext::new(engine.clone(), &self.shared.config))),
            None => Inner::Net(Box::new(NetContext::new(Arc::clone(&self.shared))?)),
        };
        Ok(Context { inner })
    }
}

fn open_engine(node: &NodeSpec, config: &PoolConfig) -> Result<Engine> {
    let path = Path::new(&node.addrs[0]);
    let is_new = std::fs::metadata(path).map(|m| m.len() == 0).unwrap_or(true);
    let mut engine_config = config.engine.clone();
    if is_new {
        engine_config.size_bytes = Some(node.size_bytes.unwrap_or(EMBEDDED_SIZE_BYTES_DEFAULT));
        // A pool holds data (block devices, files): a new store never drops it to make room.
        engine_config.mode.get_or_insert(kura_engine::Mode::Store);
    }
    // The pool's limit is the engine's (a larger one needs larger blocks: the engine says so).
    engine_config.value_size_max_bytes = config.value_size_max_bytes;
    Ok(Engine::open(path, &engine_config)?)
}

/// Wakes a [`Context`] waiting in [`Context::poll`] (see [`Context::waker`]): an eventfd
/// that a networked context's epoll, or an embedded context's io_uring waits, watch.
#[derive(Clone, Debug)]
pub struct Waker(Arc<EventFd>);

impl Waker {
    /// Makes the context's current or next `poll` return; cheap enough to call per request
    /// handed over (one `eventfd` write).
    pub fn wake(&self) {
        if let Err(e) = self.0.signal() {
            tracing::error!(error = %e, "pool: cannot wake a context");
        }
    }
}

/// One thread's handle on the pool: submit requests with a token, then [`Context::poll`] for
/// completions. Many requests may be in flight (up to `in_flight_max`); requests to the same
/// node leave together in one send and their replies are read together. Not `Sync`: one
/// thread at a time (it is `Send`, so it can be made on one thread and moved to another).
pub struct Context {
    inner: Inner,
}

enum Inner {
    Embedded(Box<EmbeddedContext>),
    Net(Box<NetContext>),
}

/// Tokens the blocking helpers use (the caller has nothing else in flight then).
const HELPER_BATCH_MAX: usize = 1024;

impl Context {
    /// Queues a get of `key`. `Err` only for bad input or a full context; everything a node
    /// does arrives as the completion of `token`.
    pub fn submit_get(&mut self, key: &[u8], token: u64) -> Result<()> {
        match &mut self.inner {
            Inner::Embedded(c) => c.submit_get(key, token),
            Inner::Net(c) => c.submit_get(key, token),
        }
    }

    /// Queues an existence probe of `key`: it completes with [`Outcome::Done`] when the key
    /// holds a value and [`Outcome::Missing`] when not, without the value crossing the
    /// network — memcached-protocol nodes get `mg <key>` (no flags: `HD`/`EN`), Redis
    /// `EXISTS`. Costs a get where nothing cheaper tells the same: an embedded engine reads
    /// the record (to tell the key from one whose hash collides), a server that speaks only
    /// memcached's text protocol sends the value (which is dropped).
    pub fn submit_exists(&mut self, key: &[u8], token: u64) -> Result<()> {
        match &mut self.inner {
            Inner::Embedded(c) => c.submit_exists(key, token),
            Inner::Net(c) => c.submit_exists(key, token),
        }
    }

    /// Queues a set of `key` to `value` (copied into the send buffer at once).
    pub fn submit_set(&mut self, key: &[u8], value: &[u8], token: u64) -> Result<()> {
        match &mut self.inner {
            Inner::Embedded(c) => c.submit_set(key, value, token),
            Inner::Net(c) => c.submit_set(key, value, token),
        }
    }

    /// Queues a delete of `key` (done whether or not it existed).
    pub fn submit_delete(&mut self, key: &[u8], token: u64) -> Result<()> {
        match &mut self.inner {
            Inner::Embedded(c) => c.submit_delete(key, token),
            Inner::Net(c) => c.submit_delete(key, token),
        }
    }

    /// Queues a durability barrier: it completes once every write acknowledged (on any
    /// context of the pool) before it was submitted is durable on every node of the pool —
    /// the engine synced, each kura server synced (`sync`), each Redis master's writes
    /// acknowledged by `replicas` replicas (`WAIT`); memcached keeps data in RAM only, so
    /// there it is an ordering barrier. A node that is down fails the flush.
    pub fn submit_flush(&mut self, token: u64) -> Result<()> {
        match &mut self.inner {
            Inner::Embedded(c) => c.submit_flush(token),
            Inner::Net(c) => c.submit_flush(token),
        }
    }

    /// Sends what was submitted, waits up to `timeout` (`None`: until something completes)
    /// and hands every finished request to `on_complete`. Returns how many it handed over;
    /// returns at once with 0 when nothing is in flight.
    pub fn poll(&mut self, timeout: Option<Duration>, on_complete: &mut dyn FnMut(Completion<'_>)) -> Result<usize> {
        self.poll_watching(timeout, None, on_complete)
    }

    /// [`Context::poll`] that also returns early (with whatever completed, possibly nothing)
    /// when new data arrives on `watch`, a descriptor the caller reads from itself (a server's
    /// client socket): a thread waiting for its requests still picks up the next ones as they
    /// come, so its queue stays deep. The caller reads `watch` before each call (arrivals
    /// already seen may not wake it again) and keeps it open while this context lives.
    pub fn poll_watching(&mut self, timeout: Option<Duration>, watch: Option<RawFd>, on_complete: &mut dyn FnMut(Completion<'_>)) -> Result<usize> {
        match &mut self.inner {
            Inner::Embedded(c) => c.poll(timeout, watch, on_complete),
            Inner::Net(c) => c.poll(timeout, watch, on_complete),
        }
    }

    /// A handle another thread can use to make this context's [`Context::poll`] return early
    /// (with whatever completed, possibly nothing), so a thread that waits for completions
    /// also notices new work handed to it. `None` for an embedded engine without io_uring,
    /// whose reads are done synchronously (nothing to wake).
    pub fn waker(&mut self) -> Result<Option<Waker>> {
        match &mut self.inner {
            Inner::Embedded(c) => Ok(c.waker()?.map(Waker)),
            Inner::Net(c) => Ok(Some(Waker(c.waker()?))),
        }
    }

    /// Requests submitted and not yet handed to a callback.
    pub fn in_flight(&self) -> usize {
        match &self.inner {
            Inner::Embedded(c) => c.in_flight(),
            Inner::Net(c) => c.in_flight(),
        }
    }

    pub fn io_stats(&self) -> IoStats {
        match &self.inner {
            Inner::Embedded(c) => c.stats,
            Inner::Net(c) => c.stats(),
        }
    }

    /// Gets one key, waiting for it. Panics if other requests are in flight (their
    /// completions would be lost).
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.get_many(&[key])?.pop().expect("one key, one value")
    }

    /// Gets many keys at once (pipelined to every node); one result per key, in order.
    pub fn get_many<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<Result<Option<Vec<u8>>>>> {
        let mut out: Vec<Option<Result<Option<Vec<u8>>>>> = (0..keys.len()).map(|_| None).collect();
        self.run_batches(keys.len(), |ctx, i| ctx.submit_get(keys[i].as_ref(), i as u64), &mut |c| {
            out[c.token as usize] = Some(c.result.map(|o| match o {
                Outcome::Value(v) => Some(v.to_vec()),
                _ => None,
            }));
        })?;
        Ok(out.into_iter().map(|r| r.expect("every key completed")).collect())
    }

    /// Which of many keys exist ([`Context::submit_exists`], pipelined to every node); one
    /// result per key, in order.
    pub fn exists_many<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Result<Vec<Result<bool>>> {
        let mut out: Vec<Option<Result<bool>>> = (0..keys.len()).map(|_| None).collect();
        self.run_batches(keys.len(), |ctx, i| ctx.submit_exists(keys[i].as_ref(), i as u64), &mut |c| {
            out[c.token as usize] = Some(c.result.map(|o| o != Outcome::Missing));
        })?;
        Ok(out.into_iter().map(|r| r.expect("every key completed")).collect())
    }

    pub fn set(&mut self, key: &[u8], value: &[u8]) -> Result<()> {
        self.set_many(&[(key, value)])
    }

    /// Sets many keys at once; the first failure is returned (after all have finished).
    pub fn set_many<K: AsRef<[u8]>, V: AsRef<[u8]>>(&mut self, items: &[(K, V)]) -> Result<()> {
        let mut first_error = None;
        self.run_batches(items.len(), |ctx, i| ctx.submit_set(items[i].0.as_ref(), items[i].1.as_ref(), i as u64), &mut |c| {
            if let Err(e) = c.result {
                first_error.get_or_insert(e);
            }
        })?;
        first_error.map_or(Ok(()), Err)
    }

    pub fn delete(&mut self, key: &[u8]) -> Result<()> {
        let mut result = Ok(());
        self.run_batches(1, |ctx, _| ctx.submit_delete(key, 0), &mut |c| result = c.result.map(|_| ()))?;
        result
    }

    /// [`Context::submit_flush`], waiting for it.
    pub fn flush(&mut self) -> Result<()> {
        let mut result = Ok(());
        self.run_batches(1, |ctx, _| ctx.submit_flush(0), &mut |c| result = c.result.map(|_| ()))?;
        result
    }

    /// Submits `count` requests in windows and polls until all completed.
    fn run_batches(&mut self, count: usize, mut submit: impl FnMut(&mut Self, usize) -> Result<()>, on_complete: &mut dyn FnMut(Completion<'_>)) -> Result<()> {
        assert_eq!(self.in_flight(), 0, "the blocking helpers need a context with nothing in flight");
        let window = HELPER_BATCH_MAX.min(self.in_flight_max());
        let mut next = 0;
        while next < count || self.in_flight() > 0 {
            while next < count && self.in_flight() < window {
                if let Err(e) = submit(self, next) {
                    while self.in_flight() > 0 {
                        self.poll(None, &mut |_| {})?;
                    }
                    return Err(e);
                }
                next += 1;
            }
            self.poll(None, on_complete)?;
        }
        Ok(())
    }

    fn in_flight_max(&self) -> usize {
        match &self.inner {
            Inner::Embedded(c) => c.in_flight_max(),
            Inner::Net(c) => c.in_flight_max(),
        }
    }
}
