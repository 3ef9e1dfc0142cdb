//! YCSB's key choosers, ported from YCSB's Java (`site.ycsb.generator`): `UniformLongGenerator`,
//! `ZipfianGenerator`, `ScrambledZipfianGenerator` and `SkewedLatestGenerator`, with the same
//! constants and arithmetic, so that "zipfian" and "latest" here mean what they mean in YCSB
//! results. The random source is passed in (seed it to replay a run).
//!
//! YCSB's request distributions map to: `uniform` → [`Uniform`], `zipfian` → [`ScrambledZipfian`]
//! (popular keys scattered over the key space), `latest` → [`Latest`]. See [`KeyDistribution`].

use std::str::FromStr;

use rand::{Rng, RngCore};
use thiserror::Error;

/// YCSB's default zipfian constant (theta).
pub const ZIPFIAN_CONSTANT: f64 = 0.99;
/// The item space ScrambledZipfianGenerator draws from before hashing into the key range.
pub const SCRAMBLED_ITEM_COUNT: u64 = 10_000_000_000_000_000;
/// zeta(SCRAMBLED_ITEM_COUNT, 0.99), precomputed by YCSB (the sum has 10^16 terms).
pub const SCRAMBLED_ZETAN: f64 = 26.469_028_201_783_02;

const FNV_OFFSET_BASIS_64: i64 = 0xCBF2_9CE4_8422_2325_u64 as i64;
const FNV_PRIME_64: i64 = 1_099_511_628_211;

/// Picks the next key number.
pub trait KeyChooser: Send {
    fn next(&mut self, rng: &mut dyn RngCore) -> u64;

    /// Keys up to `latest` now exist. YCSB's `latest` distribution follows the newest insert;
    /// the others ignore it.
    fn set_latest(&mut self, _latest: u64) {}
}

#[derive(Debug, Error, PartialEq)]
pub enum DistError {
    #[error("empty key range: min {min} > max {max}")]
    EmptyRange { min: u64, max: u64 },
    #[error("the zipfian constant must be in (0, 1), got {0}")]
    BadZipfianConstant(f64),
    #[error("the latest key must be at least 1")]
    LatestZero,
    #[error("unknown key distribution '{0}' (want uniform, zipfian or latest)")]
    UnknownDistribution(String),
    #[error("{distribution} needs at least {min} records, got {got}")]
    TooFewRecords {
        distribution: KeyDistribution,
        min: u64,
        got: u64,
    },
}

/// Uniform over `[lb, ub]`, both inclusive (YCSB's `UniformLongGenerator`). YCSB takes
/// `abs(nextLong()) % interval`; this samples without that modulo bias.
#[derive(Clone, Debug)]
pub struct Uniform {
    lb: u64,
    ub: u64,
}

impl Uniform {
    pub fn new(lb: u64, ub: u64) -> Result<Self, DistError> {
        if lb > ub {
            return Err(DistError::EmptyRange { min: lb, max: ub });
        }
        Ok(Self { lb, ub })
    }
}

impl KeyChooser for Uniform {
    fn next(&mut self, rng: &mut dyn RngCore) -> u64 {
        rng.random_range(self.lb..=self.ub)
    }
}

/// Zipfian over `[min, max]` with item `min` the most popular, then `min + 1`, … (YCSB's
/// `ZipfianGenerator`; the algorithm is from Gray et al., "Quickly Generating Billion-Record
/// Synthetic Databases", SIGMOD 1994). Construction sums `max - min + 1` terms: about a
/// second per 10^8 items.
#[derive(Clone, Debug)]
pub struct Zipfian {
    items: u64,
    base: u64,
    theta: f64,
    zeta2theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
    /// The item count `zetan` was summed for.
    count_for_zeta: u64,
}

impl Zipfian {
    pub fn new(min: u64, max: u64) -> Result<Self, DistError> {
        Self::with_constant(min, max, ZIPFIAN_CONSTANT)
    }

    pub fn with_constant(min: u64, max: u64, theta: f64) -> Result<Self, DistError> {
        check_range(min, max)?;
        check_theta(theta)?;
        Self::with_zetan(min, max, theta, Self::zeta(max - min + 1, theta))
    }

    /// With `zetan` = zeta(max - min + 1, theta) precomputed.
    pub fn with_zetan(min: u64, max: u64, theta: f64, zetan: f64) -> Result<Self, DistError> {
        check_range(min, max)?;
        check_theta(theta)?;
        let items = max - min + 1;
        let zeta2theta = Self::zeta(2, theta);
        Ok(Self {
            items,
            base: min,
            theta,
            zeta2theta,
            alpha: 1.0 / (1.0 - theta),
            zetan,
            eta: eta(items, theta, zeta2theta, zetan),
            count_for_zeta: items,
        })
    }

    /// zeta(n, theta) = sum over i in 1..=n of 1 / i^theta.
    pub fn zeta(n: u64, theta: f64) -> f64 {
        zeta_from(0, n, theta, 0.0)
    }

    /// The next item for a distribution over `item_count` items starting at `min` (YCSB's
    /// `nextLong(itemcount)`): growing the count extends zeta incrementally; a smaller count
    /// keeps the larger zeta, as YCSB does by default (`allowitemcountdecrease = false`).
    pub fn next_with_item_count(&mut self, item_count: u64, rng: &mut dyn RngCore) -> u64 {
        if item_count > self.count_for_zeta {
            self.zetan = zeta_from(self.count_for_zeta, item_count, self.theta, self.zetan);
            self.count_for_zeta = item_count;
            // YCSB recomputes eta with the construction-time item count here; kept as it is.
            self.eta = eta(self.items, self.theta, self.zeta2theta, self.zetan);
        }
        let u: f64 = rng.random();
        let uz = u * self.zetan;
        if uz < 1.0 {
            return self.base;
        }
        if uz < 1.0 + 0.5_f64.powf(self.theta) {
            return self.base + 1;
        }
        // `as` truncates toward zero like Java's (long) cast.
        self.base + (item_count as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64
    }
}

impl KeyChooser for Zipfian {
    fn next(&mut self, rng: &mut dyn RngCore) -> u64 {
        self.next_with_item_count(self.items, rng)
    }
}

fn zeta_from(start: u64, n: u64, theta: f64, initial_sum: f64) -> f64 {
    (start..n).fold(initial_sum, |sum, i| {
        sum + 1.0 / ((i + 1) as f64).powf(theta)
    })
}

fn eta(items: u64, theta: f64, zeta2theta: f64, zetan: f64) -> f64 {
    (1.0 - (2.0 / items as f64).powf(1.0 - theta)) / (1.0 - zeta2theta / zetan)
}

fn check_range(min: u64, max: u64) -> Result<(), DistError> {
    if min > max || max - min == u64::MAX {
        return Err(DistError::EmptyRange { min, max });
    }
    Ok(())
}

fn check_theta(theta: f64) -> Result<(), DistError> {
    if !(theta > 0.0 && theta < 1.0) {
        return Err(DistError::BadZipfianConstant(theta));
    }
    Ok(())
}

/// YCSB's 64-bit FNV hash of a long (`Utils.fnvhash64`), Java arithmetic included.
pub fn fnv_hash64(mut val: i64) -> i64 {
    let mut hash = FNV_OFFSET_BASIS_64;
    for _ in 0..8 {
        let octet = val & 0xff;
        val >>= 8;
        hash ^= octet;
        hash = hash.wrapping_mul(FNV_PRIME_64);
    }
    hash.wrapping_abs()
}

/// Zipfian (theta 0.99) with the popular keys scattered over `[min, max]` (YCSB's
/// `ScrambledZipfianGenerator`, its "zipfian" request distribution): a zipfian item from a
/// space of 10^16 is hashed with FNV-64 into the range.
#[derive(Clone, Debug)]
pub struct ScrambledZipfian {
    generator: Zipfian,
    min: u64,
    item_count: u64,
}

impl ScrambledZipfian {
    pub fn new(min: u64, max: u64) -> Result<Self, DistError> {
        check_range(min, max)?;
        let generator =
            Zipfian::with_zetan(0, SCRAMBLED_ITEM_COUNT, ZIPFIAN_CONSTANT, SCRAMBLED_ZETAN)?;
        Ok(Self {
            generator,
            min,
            item_count: max - min + 1,
        })
    }
}

impl KeyChooser for ScrambledZipfian {
    fn next(&mut self, rng: &mut dyn RngCore) -> u64 {
        let item = self.generator.next(rng);
        let item = i64::try_from(item).expect("zipfian items stay below 10^16 + 1");
        // Java's `%` of a non-negative hash; unsigned_abs differs only for i64::MIN, whose
        // Java abs stays negative.
        self.min + fnv_hash64(item).unsigned_abs() % self.item_count
    }
}

/// Skewed toward the newest keys (YCSB's `SkewedLatestGenerator`): `latest - z` with `z`
/// zipfian over `[0, latest)`, so `latest` is the most popular key, then `latest - 1`, …
/// (key 0 is never chosen, as in YCSB). Tell it about inserts with
/// [`KeyChooser::set_latest`].
#[derive(Clone, Debug)]
pub struct Latest {
    zipfian: Zipfian,
    latest: u64,
}

impl Latest {
    pub fn new(latest: u64) -> Result<Self, DistError> {
        if latest == 0 {
            return Err(DistError::LatestZero);
        }
        Ok(Self {
            zipfian: Zipfian::new(0, latest - 1)?,
            latest,
        })
    }

    pub fn latest(&self) -> u64 {
        self.latest
    }
}

impl KeyChooser for Latest {
    fn next(&mut self, rng: &mut dyn RngCore) -> u64 {
        self.latest - self.zipfian.next_with_item_count(self.latest, rng)
    }

    fn set_latest(&mut self, latest: u64) {
        self.latest = latest.max(1);
    }
}

/// YCSB's `requestdistribution` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyDistribution {
    Uniform,
    Zipfian,
    Latest,
}

impl FromStr for KeyDistribution {
    type Err = DistError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "uniform" => Ok(Self::Uniform),
            "zipfian" => Ok(Self::Zipfian),
            "latest" => Ok(Self::Latest),
            other => Err(DistError::UnknownDistribution(other.to_owned())),
        }
    }
}

impl std::fmt::Display for KeyDistribution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Uniform => "uniform",
            Self::Zipfian => "zipfian",
            Self::Latest => "latest",
        })
    }
}

impl KeyDistribution {
    /// The chooser YCSB's CoreWorkload builds for keys `0..record_count` when about
    /// `expected_new_keys` inserts will follow (CoreWorkload passes opcount × insert
    /// proportion × 2). Zipfian's range covers the future keys so that inserts do not move
    /// which keys are popular; draw with [`next_existing_key`] to skip keys not inserted yet.
    pub fn chooser(
        self,
        record_count: u64,
        expected_new_keys: u64,
    ) -> Result<Box<dyn KeyChooser>, DistError> {
        let too_few = |min| DistError::TooFewRecords {
            distribution: self,
            min,
            got: record_count,
        };
        match self {
            Self::Uniform => {
                let last = record_count.checked_sub(1).ok_or(too_few(1))?;
                Ok(Box::new(Uniform::new(0, last)?))
            }
            Self::Zipfian => {
                if record_count == 0 {
                    return Err(too_few(1));
                }
                let max = record_count.saturating_add(expected_new_keys);
                Ok(Box::new(ScrambledZipfian::new(0, max)?))
            }
            Self::Latest => {
                let last = record_count
                    .checked_sub(1)
                    .filter(|&l| l >= 1)
                    .ok_or(too_few(2))?;
                Ok(Box::new(Latest::new(last)?))
            }
        }
    }
}

/// Draws until the key is at most `last_key` (YCSB's `CoreWorkload.nextKeynum`).
pub fn next_existing_key(
    chooser: &mut dyn KeyChooser,
    rng: &mut dyn RngCore,
    last_key: u64,
) -> u64 {
    loop {
        let key = chooser.next(rng);
        if key <= last_key {
            return key;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    const SAMPLES: usize = 200_000;

    fn rng() -> StdRng {
        StdRng::seed_from_u64(0x6b75_7261)
    }

    fn counts(chooser: &mut dyn KeyChooser, n: u64, samples: usize) -> Vec<u64> {
        let mut rng = rng();
        let mut counts = vec![0_u64; usize::try_from(n).unwrap()];
        for _ in 0..samples {
            let key = chooser.next(&mut rng);
            assert!(key < n, "key {key} outside [0, {n})");
            counts[usize::try_from(key).unwrap()] += 1;
        }
        counts
    }

    /// |observed - expected| within `sigmas` binomial standard deviations.
    fn assert_frequency(observed: u64, p: f64, samples: usize, sigmas: f64, what: &str) {
        let expected = p * samples as f64;
        let sd = (samples as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (observed as f64 - expected).abs() <= sigmas * sd,
            "{what}: observed {observed}, expected {expected:.0} ± {:.0}",
            sigmas * sd
        );
    }

    #[test]
    fn fnv_hash_matches_java() {
        // Reference values from an independent model of Java's long arithmetic.
        assert_eq!(fnv_hash64(0), 6_284_781_860_667_377_211);
        assert_eq!(fnv_hash64(1), 8_517_097_267_634_966_620);
        assert_eq!(fnv_hash64(123_456_789), 2_350_796_791_908_741_607);
        assert_eq!(
            fnv_hash64(10_000_000_000_000_000),
            1_698_458_313_664_423_714
        );
    }

    #[test]
    fn zeta_matches_the_direct_sum() {
        assert!((Zipfian::zeta(1, 0.99) - 1.0).abs() < 1e-12);
        assert!((Zipfian::zeta(2, 0.99) - (1.0 + 0.5_f64.powf(0.99))).abs() < 1e-12);
        // The incremental form gives the same sum.
        let whole = Zipfian::zeta(1000, 0.99);
        let split = zeta_from(400, 1000, 0.99, Zipfian::zeta(400, 0.99));
        assert!((whole - split).abs() < 1e-9);
    }

    #[test]
    fn uniform_is_flat() {
        let n = 20;
        let mut chooser = Uniform::new(0, n - 1).unwrap();
        let counts = counts(&mut chooser, n, SAMPLES);
        let expected = SAMPLES as f64 / n as f64;
        let chi2: f64 = counts
            .iter()
            .map(|&c| (c as f64 - expected).powi(2) / expected)
            .sum();
        // 19 degrees of freedom: P(chi2 > 43.8) = 0.001.
        assert!(chi2 < 43.8, "chi2 {chi2} for {counts:?}");
    }

    #[test]
    fn uniform_covers_its_inclusive_bounds() {
        let mut chooser = Uniform::new(5, 7).unwrap();
        let mut rng = rng();
        let mut seen = [false; 3];
        for _ in 0..1000 {
            seen[usize::try_from(chooser.next(&mut rng) - 5).unwrap()] = true;
        }
        assert_eq!(seen, [true; 3]);
        assert_eq!(
            Uniform::new(8, 7).unwrap_err(),
            DistError::EmptyRange { min: 8, max: 7 }
        );
    }

    #[test]
    fn zipfian_head_has_the_zipf_probabilities() {
        let n = 1000;
        let mut chooser = Zipfian::new(0, n - 1).unwrap();
        let counts = counts(&mut chooser, n, SAMPLES);
        let zetan = Zipfian::zeta(n, ZIPFIAN_CONSTANT);
        // Gray's method is exact for the two most popular items.
        assert_frequency(counts[0], 1.0 / zetan, SAMPLES, 5.0, "item 0");
        assert_frequency(
            counts[1],
            0.5_f64.powf(ZIPFIAN_CONSTANT) / zetan,
            SAMPLES,
            5.0,
            "item 1",
        );
        // And follows rank^-theta further down: compare decades of ranks.
        let decade = |lo: usize, hi: usize| counts[lo..hi].iter().sum::<u64>() as f64;
        let want = |lo: usize, hi: usize| {
            (lo..hi)
                .map(|r| ((r + 1) as f64).powf(-ZIPFIAN_CONSTANT))
                .sum::<f64>()
                / zetan
        };
        for (lo, hi) in [(10, 100), (100, 1000)] {
            let observed = decade(lo, hi) / SAMPLES as f64;
            let expected = want(lo, hi);
            assert!(
                (observed / expected - 1.0).abs() < 0.1,
                "ranks {lo}..{hi}: {observed} vs {expected}"
            );
        }
    }

    #[test]
    fn zipfian_respects_min() {
        let mut chooser = Zipfian::new(100, 199).unwrap();
        let mut rng = rng();
        let keys: Vec<u64> = (0..10_000).map(|_| chooser.next(&mut rng)).collect();
        assert!(keys.iter().all(|k| (100..=199).contains(k)));
        let hits_100 = keys.iter().filter(|&&k| k == 100).count();
        assert!(
            hits_100 > keys.len() / 10,
            "the minimum is the most popular item"
        );
    }

    #[test]
    fn zipfian_grows_its_item_count_incrementally() {
        let mut grown = Zipfian::new(0, 99).unwrap();
        let mut rng = rng();
        let key = grown.next_with_item_count(1000, &mut rng);
        assert!(key < 1000);
        assert!((grown.zetan - Zipfian::zeta(1000, ZIPFIAN_CONSTANT)).abs() < 1e-9);
        assert!(Zipfian::with_constant(0, 9, 1.0).is_err());
    }

    #[test]
    fn scrambled_zipfian_is_skewed_but_scattered() {
        let n = 10_000;
        let mut chooser = ScrambledZipfian::new(0, n - 1).unwrap();
        let counts = counts(&mut chooser, n, SAMPLES);
        let mut ranked: Vec<(u64, usize)> =
            counts.iter().enumerate().map(|(k, &c)| (c, k)).collect();
        ranked.sort_unstable_by(|a, b| b.cmp(a));
        // The most popular key has zipf rank 1: probability 1 / ZETAN (plus rare collisions).
        assert_frequency(
            ranked[0].0,
            1.0 / SCRAMBLED_ZETAN,
            SAMPLES,
            6.0,
            "most popular key",
        );
        // The top 1 % of keys take far more than 1 % of requests (uniform would give ~1.3 %).
        let top_share = ranked[..100].iter().map(|&(c, _)| c).sum::<u64>() as f64 / SAMPLES as f64;
        assert!(top_share > 0.15, "top 1% share {top_share}");
        // Scattered: the ten most popular keys are not bunched at the start of the range.
        let top_keys: Vec<usize> = ranked[..10].iter().map(|&(_, k)| k).collect();
        assert!(top_keys.iter().any(|&k| k > 5_000), "top keys {top_keys:?}");
        assert!(top_keys.iter().any(|&k| k < 5_000), "top keys {top_keys:?}");
        // The mean is the middle of the range, as YCSB states.
        let mean = counts
            .iter()
            .enumerate()
            .map(|(k, &c)| k as f64 * c as f64)
            .sum::<f64>()
            / SAMPLES as f64;
        assert!((mean / (n as f64 / 2.0) - 1.0).abs() < 0.1, "mean {mean}");
    }

    #[test]
    fn latest_favours_the_newest_keys_and_follows_inserts() {
        let latest = 9_999;
        let mut chooser = Latest::new(latest).unwrap();
        let counts = counts(&mut chooser, latest + 1, SAMPLES);
        assert_eq!(counts[0], 0, "YCSB's latest never picks key 0");
        let zetan = Zipfian::zeta(latest, ZIPFIAN_CONSTANT);
        assert_frequency(counts[9_999], 1.0 / zetan, SAMPLES, 5.0, "newest key");
        assert_frequency(
            counts[9_998],
            0.5_f64.powf(ZIPFIAN_CONSTANT) / zetan,
            SAMPLES,
            5.0,
            "second newest",
        );
        let newest_100 = counts[9_900..].iter().sum::<u64>() as f64 / SAMPLES as f64;
        let expected = Zipfian::zeta(100, ZIPFIAN_CONSTANT) / zetan;
        assert!(
            (newest_100 / expected - 1.0).abs() < 0.05,
            "{newest_100} vs {expected}"
        );

        chooser.set_latest(20_000);
        let mut rng = rng();
        let at_new_head = (0..10_000)
            .filter(|_| chooser.next(&mut rng) == 20_000)
            .count();
        assert!(
            at_new_head > 700,
            "after inserts the newest key is the most popular ({at_new_head})"
        );
    }

    #[test]
    fn distributions_by_ycsb_name() {
        let mut rng = rng();
        for name in ["uniform", "zipfian", "latest"] {
            let dist: KeyDistribution = name.parse().unwrap();
            assert_eq!(dist.to_string(), name);
            let mut chooser = dist.chooser(1000, 100).unwrap();
            for _ in 0..1000 {
                assert!(next_existing_key(chooser.as_mut(), &mut rng, 999) <= 999);
            }
        }
        assert!("hotspot".parse::<KeyDistribution>().is_err());
        assert!(KeyDistribution::Latest.chooser(1, 0).is_err());
        assert!(KeyDistribution::Uniform.chooser(0, 0).is_err());
    }
}
