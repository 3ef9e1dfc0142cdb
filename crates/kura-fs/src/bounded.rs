//! A map bounded by the bytes charged for its entries: the small RAM copies of records the
//! file system keeps (the embedded engine's metadata, a process's recent directory buckets).
//! When an entry would take it past its bound, the map starts over: everything else goes.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

/// A map of at most `BYTES_MAX` charged bytes (each entry charged what its inserter says).
#[derive(Debug)]
pub(crate) struct BytesBounded<K, V, const BYTES_MAX: usize> {
    entries: HashMap<K, (V, usize)>,
    bytes: usize,
}

impl<K, V, const BYTES_MAX: usize> Default for BytesBounded<K, V, BYTES_MAX> {
    fn default() -> Self {
        Self { entries: HashMap::new(), bytes: 0 }
    }
}

impl<K: Hash + Eq, V, const BYTES_MAX: usize> BytesBounded<K, V, BYTES_MAX> {
    /// Puts `value` at `key`, charged `charge` bytes, in place of any value there; when that
    /// would pass `BYTES_MAX`, every other entry is dropped first (and a value charged more
    /// than `BYTES_MAX` on its own is not kept).
    pub(crate) fn insert(&mut self, key: K, value: V, charge: usize) {
        if let Some((_, old)) = self.entries.remove(&key) {
            self.bytes -= old;
        }
        if charge > BYTES_MAX {
            return;
        }
        if self.bytes + charge > BYTES_MAX {
            self.entries.clear();
            self.bytes = 0;
        }
        self.bytes += charge;
        self.entries.insert(key, (value, charge));
    }

    pub(crate) fn get<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.entries.get(key).map(|(value, _)| value)
    }

    pub(crate) fn remove<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        let (value, charge) = self.entries.remove(key)?;
        self.bytes -= charge;
        Some(value)
    }

    /// Bytes charged for the entries held.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries.iter().map(|(key, (value, _))| (key, value))
    }
}

#[cfg(test)]
mod tests {
    use super::BytesBounded;
    use proptest::prelude::*;

    proptest! {
        /// Against a plain map: what is held is what was last put (or nothing, after a start
        /// over), the charge is the sum of what is held, and it never passes the bound.
        #[test]
        fn holds_what_was_put_within_its_bytes(ops in prop::collection::vec((0u8..16, 0usize..120, any::<bool>()), 1..200)) {
            let mut map: BytesBounded<u8, usize, 100> = BytesBounded::default();
            let mut model = std::collections::HashMap::new();
            for (key, charge, insert) in ops {
                if insert {
                    let before = map.bytes() - model.remove(&key).unwrap_or(0);
                    map.insert(key, charge, charge);
                    if charge > 100 {
                        continue;
                    }
                    if before + charge > 100 {
                        model.clear();
                    }
                    model.insert(key, charge);
                } else {
                    prop_assert_eq!(map.remove(&key), model.remove(&key));
                }
                prop_assert!(map.bytes() <= 100);
                prop_assert_eq!(map.bytes(), model.values().sum::<usize>());
                for (k, v) in map.iter() {
                    prop_assert_eq!(model.get(k), Some(v));
                }
                prop_assert_eq!(map.iter().count(), model.len());
            }
        }
    }
}
