//! Tools for kura's whole-system benchmarks (`kura bench …`): each benchmark prints JSON and
//! draws plots, with its anchor (fio, memcached, redis) measured in the same run.
//!
//! - [`fio`]: run fio from a job struct and read its JSON result;
//! - [`dist`]: YCSB's key choosers (uniform, scrambled zipfian, latest), ported from YCSB;
//! - [`hist`]: latency histograms (HdrHistogram) with percentiles and merging;
//! - [`plot`]: line and bar charts as PNG, fonts compiled in;
//! - [`json`]: print a result pretty and optionally save it;
//! - [`proc`]: a process's RSS and CPU time from /proc;
//! - [`memcg`]: a memory cgroup capping an anchor's RAM, its page cache included;
//! - [`host`]: a free TCP port, whether a tool is installed, medians of rounds.

pub mod dist;
pub mod fio;
pub mod hist;
pub mod host;
pub mod json;
pub mod memcg;
pub mod plot;
pub mod proc;
