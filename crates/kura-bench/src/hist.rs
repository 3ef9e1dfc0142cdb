//! Latency histograms: HdrHistogram with 3 significant digits, in microseconds or nanoseconds,
//! one per thread while measuring and merged at the end.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;
use thiserror::Error;

/// Largest latency a histogram holds; longer ones are recorded as this (saturated).
pub const LATENCY_MAX: Duration = Duration::from_secs(3600);
const SIGNIFICANT_DIGITS: u8 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum LatencyUnit {
    #[serde(rename = "us")]
    Micros,
    #[serde(rename = "ns")]
    Nanos,
}

impl LatencyUnit {
    fn of(self, d: Duration) -> u64 {
        let v = match self {
            Self::Micros => d.as_micros(),
            Self::Nanos => d.as_nanos(),
        };
        u64::try_from(v).unwrap_or(u64::MAX)
    }

    pub fn suffix(self) -> &'static str {
        match self {
            Self::Micros => "us",
            Self::Nanos => "ns",
        }
    }
}

#[derive(Debug, Error)]
pub enum HistError {
    #[error("cannot merge a {theirs:?} histogram into a {ours:?} one")]
    UnitMismatch {
        ours: LatencyUnit,
        theirs: LatencyUnit,
    },
    #[error("cannot merge histograms: {0}")]
    Add(#[from] hdrhistogram::AdditionError),
}

/// A latency histogram in one unit.
#[derive(Clone, Debug)]
pub struct LatencyHist {
    hist: Histogram<u64>,
    unit: LatencyUnit,
}

/// The usual numbers of a latency histogram, in its unit; serialises to JSON.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LatencySummary {
    pub unit: LatencyUnit,
    pub count: u64,
    pub mean: f64,
    pub min: u64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

impl LatencyHist {
    pub fn new(unit: LatencyUnit) -> Self {
        let high = unit.of(LATENCY_MAX);
        let hist = Histogram::new_with_bounds(1, high, SIGNIFICANT_DIGITS)
            .expect("constant bounds: 1 <= high and 3 significant digits are valid");
        Self { hist, unit }
    }

    pub fn micros() -> Self {
        Self::new(LatencyUnit::Micros)
    }

    pub fn nanos() -> Self {
        Self::new(LatencyUnit::Nanos)
    }

    pub fn unit(&self) -> LatencyUnit {
        self.unit
    }

    pub fn record(&mut self, latency: Duration) {
        self.record_value(self.unit.of(latency));
    }

    /// Records a value already in this histogram's unit; past [`LATENCY_MAX`] it saturates.
    pub fn record_value(&mut self, value: u64) {
        self.hist.saturating_record(value);
    }

    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hist.is_empty()
    }

    pub fn mean(&self) -> f64 {
        self.hist.mean()
    }

    pub fn min(&self) -> u64 {
        self.hist.min()
    }

    pub fn max(&self) -> u64 {
        self.hist.max()
    }

    /// The value at `percentile` (0 to 100), in this histogram's unit.
    pub fn percentile(&self, percentile: f64) -> u64 {
        self.hist.value_at_percentile(percentile)
    }

    pub fn p50(&self) -> u64 {
        self.percentile(50.0)
    }

    pub fn p99(&self) -> u64 {
        self.percentile(99.0)
    }

    pub fn p999(&self) -> u64 {
        self.percentile(99.9)
    }

    /// Adds `other`'s samples to this one (per-thread histograms into a total).
    pub fn merge(&mut self, other: &LatencyHist) -> Result<(), HistError> {
        if other.unit != self.unit {
            return Err(HistError::UnitMismatch {
                ours: self.unit,
                theirs: other.unit,
            });
        }
        self.hist.add(&other.hist)?;
        Ok(())
    }

    /// One histogram with the samples of all of `hists` (an empty one for none).
    pub fn merge_all<'a>(
        unit: LatencyUnit,
        hists: impl IntoIterator<Item = &'a LatencyHist>,
    ) -> Result<Self, HistError> {
        let mut total = Self::new(unit);
        for h in hists {
            total.merge(h)?;
        }
        Ok(total)
    }

    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            unit: self.unit,
            count: self.count(),
            mean: self.mean(),
            min: self.min(),
            p50: self.p50(),
            p90: self.percentile(90.0),
            p99: self.p99(),
            p999: self.p999(),
            max: self.max(),
        }
    }

    /// The underlying HdrHistogram, for anything not wrapped here.
    pub fn inner(&self) -> &Histogram<u64> {
        &self.hist
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within HdrHistogram's precision of 3 significant digits.
    fn close(a: u64, b: u64) -> bool {
        a.abs_diff(b) as f64 <= b as f64 * 1e-3 + 1.0
    }

    #[test]
    fn percentiles_of_one_to_ten_thousand() {
        let mut h = LatencyHist::micros();
        for us in 1..=10_000 {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count(), 10_000);
        assert!(close(h.p50(), 5_000), "{}", h.p50());
        assert!(close(h.p99(), 9_900), "{}", h.p99());
        assert!(close(h.p999(), 9_990), "{}", h.p999());
        assert!(close(h.max(), 10_000), "{}", h.max());
        assert!((h.mean() - 5_000.5).abs() < 10.0, "{}", h.mean());
        assert_eq!(h.min(), 1);
    }

    #[test]
    fn nanosecond_histograms_keep_nanoseconds() {
        let mut h = LatencyHist::nanos();
        h.record(Duration::from_nanos(700));
        h.record(Duration::from_nanos(900));
        assert_eq!(h.min(), 700);
        assert!(close(h.max(), 900));
        assert_eq!(h.summary().unit, LatencyUnit::Nanos);
    }

    #[test]
    fn too_long_latencies_saturate() {
        let mut h = LatencyHist::micros();
        h.record(Duration::from_secs(100_000));
        assert_eq!(h.count(), 1);
        assert!(close(h.max(), LatencyUnit::Micros.of(LATENCY_MAX)));
    }

    #[test]
    fn merging_per_thread_histograms() {
        let per_thread: Vec<LatencyHist> = (0..4_u64)
            .map(|t| {
                std::thread::spawn(move || {
                    let mut h = LatencyHist::micros();
                    for i in 0..1000 {
                        h.record_value(t * 1000 + i + 1);
                    }
                    h
                })
            })
            .map(|handle| handle.join().unwrap())
            .collect();
        let total = LatencyHist::merge_all(LatencyUnit::Micros, &per_thread).unwrap();
        assert_eq!(total.count(), 4000);
        assert!(close(total.p50(), 2000), "{}", total.p50());
        assert!(close(total.max(), 4000));
        let err = LatencyHist::nanos().merge(&total).unwrap_err();
        assert!(matches!(err, HistError::UnitMismatch { .. }));
    }

    #[test]
    fn summary_serialises_with_its_unit() {
        let mut h = LatencyHist::micros();
        h.record(Duration::from_micros(42));
        let json = serde_json::to_value(h.summary()).unwrap();
        assert_eq!(json["unit"], "us");
        assert_eq!(json["count"], 1);
        assert_eq!(json["p50"], 42);
    }
}
