//! Byte sizes on the command line: `4096`, `64K`, `4M`, `1G`, `2GiB`.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a size (try 4096, 64K, 4M, 1G)"))?;
        let shift = match unit.trim().to_ascii_uppercase().as_str() {
            "" | "B" => 0,
            "K" | "KB" | "KIB" => 10,
            "M" | "MB" | "MIB" => 20,
            "G" | "GB" | "GIB" => 30,
            "T" | "TB" | "TIB" => 40,
            other => return Err(format!("unknown size unit {other:?} (use K, M, G or T)")),
        };
        n.checked_mul(1 << shift).map(ByteSize).ok_or_else(|| format!("{s:?} is too large"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = [(40, "T"), (30, "G"), (20, "M"), (10, "K")];
        for (shift, unit) in units {
            if self.0 >= 1 << shift && self.0.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", self.0 >> shift);
            }
        }
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("4096".parse::<ByteSize>().unwrap().0, 4096);
        assert_eq!("64K".parse::<ByteSize>().unwrap().0, 65536);
        assert_eq!("4MiB".parse::<ByteSize>().unwrap().0, 4 << 20);
        assert_eq!("1g".parse::<ByteSize>().unwrap().0, 1 << 30);
        assert!("x".parse::<ByteSize>().is_err());
        assert!("5Q".parse::<ByteSize>().is_err());
        assert!("99999999999T".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(4 << 20).to_string(), "4M");
        assert_eq!(ByteSize(1000).to_string(), "1000");
    }
}
