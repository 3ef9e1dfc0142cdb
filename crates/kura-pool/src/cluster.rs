//! Redis Cluster's key placement: 16384 slots by CRC16 (XMODEM) of the key or of its hash
//! tag, and the slot map from `CLUSTER SLOTS`.

use crate::proto::resp::Resp;

pub const SLOTS: usize = 16384;

const fn crc16_table() -> [u16; 256] {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
}

static CRC16: [u16; 256] = crc16_table();

/// CRC16-CCITT (XMODEM), as Redis Cluster uses it.
pub fn crc16(data: &[u8]) -> u16 {
    data.iter().fold(0u16, |crc, &b| (crc << 8) ^ CRC16[usize::from((crc >> 8) as u8 ^ b)])
}

/// The slot of `key`: of its hash tag (`{…}`, first `{` to the next `}`, when not empty).
pub fn slot(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter().position(|&b| b == b'}').filter(|&close| close > 0).map(|close| &rest[..close])
        })
        .unwrap_or(key);
    crc16(hashed) % SLOTS as u16
}

/// A slot range and the address of its master.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRange {
    pub first: u16,
    pub last: u16,
    pub master: String,
}

/// Reads a `CLUSTER SLOTS` reply: `[[first, last, [host, port, id…], replicas…], …]`. An empty
/// host means the address the reply came from (`seen_from`'s host).
pub fn parse_slots(reply: &Resp<'_>, seen_from: &str) -> Result<Vec<SlotRange>, String> {
    let Resp::Array(ranges) = reply else { return Err(format!("CLUSTER SLOTS answered {reply:?}")) };
    let mut out = Vec::with_capacity(ranges.len());
    for range in ranges {
        let Resp::Array(fields) = range else { return Err("a slot range is not an array".into()) };
        let (Some(Resp::Int(first)), Some(Resp::Int(last)), Some(Resp::Array(master))) = (fields.first(), fields.get(1), fields.get(2)) else {
            return Err("a slot range lacks first, last and master".into());
        };
        let (Some(Resp::Bulk(host)), Some(Resp::Int(port))) = (master.first(), master.get(1)) else {
            return Err("a master lacks host and port".into());
        };
        if !(0..SLOTS as i64).contains(first) || !(*first..SLOTS as i64).contains(last) || !(1..=65535).contains(port) {
            return Err(format!("bad slot range {first}-{last} at port {port}"));
        }
        let host = if host.is_empty() || *host == b"?" {
            seen_from.rsplit_once(':').map_or(seen_from, |(h, _)| h).to_owned()
        } else {
            String::from_utf8_lossy(host).into_owned()
        };
        let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host };
        out.push(SlotRange { first: *first as u16, last: *last as u16, master: format!("{host}:{port}") });
    }
    Ok(out)
}

/// A key that hashes to `slot`: `kura:flush:{<tag>}` for the first tag found. Writing it
/// makes a master's replication offset cover everything it acknowledged before (the `WAIT`
/// of a flush then waits for all of it).
pub fn key_in_slot(slot: u16) -> Vec<u8> {
    (0u32..)
        .map(|n| format!("kura:flush:{{{n}}}").into_bytes())
        .find(|k| self::slot(k) == slot)
        .expect("some tag hashes to every slot")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(slot(b"foo{{bar}}zap"), crc16(b"{bar") % 16384);
        assert_eq!(slot(b"foo{bar}{zap}"), crc16(b"bar") % 16384);
    }

    #[test]
    fn keys_for_every_slot() {
        for s in [0u16, 1, 5000, 16383] {
            assert_eq!(slot(&key_in_slot(s)), s);
        }
    }

    #[test]
    fn slot_maps() {
        let reply = Resp::Array(vec![
            Resp::Array(vec![Resp::Int(0), Resp::Int(5460), Resp::Array(vec![Resp::Bulk(b"127.0.0.1"), Resp::Int(7000), Resp::Bulk(b"id")]), Resp::Array(vec![Resp::Bulk(b"127.0.0.1"), Resp::Int(7003)])]),
            Resp::Array(vec![Resp::Int(5461), Resp::Int(16383), Resp::Array(vec![Resp::Bulk(b""), Resp::Int(7001)])]),
        ]);
        let ranges = parse_slots(&reply, "10.1.1.1:7000").unwrap();
        assert_eq!(ranges[0], SlotRange { first: 0, last: 5460, master: "127.0.0.1:7000".into() });
        assert_eq!(ranges[1].master, "10.1.1.1:7001");
        assert!(parse_slots(&Resp::Int(1), "h:1").is_err());
        assert!(parse_slots(&Resp::Array(vec![Resp::Array(vec![Resp::Int(9), Resp::Int(3)])]), "h:1").is_err());
    }
}
