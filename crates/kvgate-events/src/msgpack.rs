//! A minimal, allocation-free, bounds-checked MessagePack reader over a byte slice.
//!
//! Owns only the byte-level format: markers, lengths, integers, strings, and skipping
//! whole values. It must not know about KV events (that is [`crate::wire`]). Every read
//! is checked against the remaining input, never trusts a declared length for
//! allocation, and skipping nested values is iterative, so hostile input (deep nesting,
//! huge declared lengths, truncation) yields an error, never a panic or a stack overflow.

use std::fmt;

/// Why a payload could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadError {
    /// Byte offset in the payload where reading failed.
    pub offset: usize,
    pub kind: ReadErrorKind,
}

/// What went wrong at [`ReadError::offset`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadErrorKind {
    /// The payload ended inside a value.
    Truncated,
    /// A marker byte that MessagePack reserves (0xc1).
    ReservedMarker,
    /// A value of another type than the schema requires.
    UnexpectedType {
        expected: &'static str,
        found: &'static str,
    },
    /// A number outside the range the schema allows.
    OutOfRange(&'static str),
    /// A string that is not UTF-8.
    InvalidUtf8,
    /// Structurally valid MessagePack that breaks the event schema.
    Schema(&'static str),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ReadErrorKind::Truncated => write!(f, "payload truncated at byte {}", self.offset),
            ReadErrorKind::ReservedMarker => {
                write!(f, "reserved msgpack marker at byte {}", self.offset)
            }
            ReadErrorKind::UnexpectedType { expected, found } => write!(
                f,
                "expected {expected}, found {found} at byte {}",
                self.offset
            ),
            ReadErrorKind::OutOfRange(what) => {
                write!(f, "{what} out of range at byte {}", self.offset)
            }
            ReadErrorKind::InvalidUtf8 => write!(f, "invalid UTF-8 at byte {}", self.offset),
            ReadErrorKind::Schema(what) => write!(f, "{what} at byte {}", self.offset),
        }
    }
}

impl std::error::Error for ReadError {}

pub type ReadResult<T> = Result<T, ReadError>;

/// The type family of the next value, from its marker byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    /// Unsigned or non-negative integer.
    UInt,
    /// Negative integer.
    NegInt,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
    Reserved,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Nil => "nil",
            Kind::Bool => "bool",
            Kind::UInt => "unsigned integer",
            Kind::NegInt => "negative integer",
            Kind::Float => "float",
            Kind::Str => "string",
            Kind::Bin => "binary",
            Kind::Array => "array",
            Kind::Map => "map",
            Kind::Ext => "extension",
            Kind::Reserved => "reserved marker",
        }
    }

    fn of(marker: u8) -> Kind {
        match marker {
            0x00..=0x7f | 0xcc..=0xcf => Kind::UInt,
            0xe0..=0xff | 0xd0..=0xd3 => Kind::NegInt,
            0x80..=0x8f | 0xde | 0xdf => Kind::Map,
            0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
            0xc0 => Kind::Nil,
            0xc2 | 0xc3 => Kind::Bool,
            0xc4..=0xc6 => Kind::Bin,
            0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
            0xca | 0xcb => Kind::Float,
            0xc1 => Kind::Reserved,
        }
    }
}

/// An integer as MessagePack carries it: unsigned, or signed when negative.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int {
    U(u64),
    I(i64),
}

/// Cursor over one MessagePack payload.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not yet consumed.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn error(&self, kind: ReadErrorKind) -> ReadError {
        ReadError {
            offset: self.pos,
            kind,
        }
    }

    fn unexpected(&self, expected: &'static str, found: Kind) -> ReadError {
        self.error(ReadErrorKind::UnexpectedType {
            expected,
            found: found.name(),
        })
    }

    /// Kind of the next value without consuming it.
    pub fn peek_kind(&self) -> ReadResult<Kind> {
        match self.buf.get(self.pos) {
            Some(&m) => Ok(Kind::of(m)),
            None => Err(self.error(ReadErrorKind::Truncated)),
        }
    }

    #[inline]
    fn take(&mut self, n: usize) -> ReadResult<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(ReadError {
                offset: self.pos,
                kind: ReadErrorKind::Truncated,
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    #[inline]
    fn byte(&mut self) -> ReadResult<u8> {
        match self.buf.get(self.pos) {
            Some(&b) => {
                self.pos += 1;
                Ok(b)
            }
            None => Err(self.error(ReadErrorKind::Truncated)),
        }
    }

    #[inline]
    fn be<const N: usize>(&mut self) -> ReadResult<[u8; N]> {
        let s = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    /// Consumes a nil if one is next; returns whether it did.
    #[inline]
    pub fn try_nil(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Reads an array header and returns its element count.
    #[inline]
    pub fn array_len(&mut self) -> ReadResult<usize> {
        let start = self.pos;
        let m = self.byte()?;
        let len = match m {
            0x90..=0x9f => (m & 0x0f) as usize,
            0xdc => u16::from_be_bytes(self.be()?) as usize,
            0xdd => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = start;
                return Err(self.unexpected("array", Kind::of(m)));
            }
        };
        Ok(len)
    }

    /// Reads a map header and returns its entry count.
    pub fn map_len(&mut self) -> ReadResult<usize> {
        let start = self.pos;
        let m = self.byte()?;
        let len = match m {
            0x80..=0x8f => (m & 0x0f) as usize,
            0xde => u16::from_be_bytes(self.be()?) as usize,
            0xdf => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = start;
                return Err(self.unexpected("map", Kind::of(m)));
            }
        };
        Ok(len)
    }

    /// A capacity hint for `len` upcoming elements that cannot exceed what the rest of
    /// the payload could hold (every element is at least one byte).
    #[inline]
    pub fn capacity_hint(&self, len: usize) -> usize {
        len.min(self.remaining())
    }

    /// Reads an integer of any width.
    #[inline]
    pub fn int(&mut self) -> ReadResult<Int> {
        let start = self.pos;
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => Int::U(m as u64),
            0xe0..=0xff => Int::I(m as i8 as i64),
            0xcc => Int::U(self.byte()? as u64),
            0xcd => Int::U(u16::from_be_bytes(self.be()?) as u64),
            0xce => Int::U(u32::from_be_bytes(self.be()?) as u64),
            0xcf => Int::U(u64::from_be_bytes(self.be()?)),
            0xd0 => Int::I(self.byte()? as i8 as i64),
            0xd1 => Int::I(i16::from_be_bytes(self.be()?) as i64),
            0xd2 => Int::I(i32::from_be_bytes(self.be()?) as i64),
            0xd3 => Int::I(i64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = start;
                return Err(self.unexpected("integer", Kind::of(m)));
            }
        })
    }

    /// Reads an integer that must fit in a `u32`.
    #[inline]
    pub fn u32(&mut self) -> ReadResult<u32> {
        // Fast paths for the unsigned encodings token ids use; everything else (signed
        // encodings of small values, errors) goes through `int`.
        let (buf, p) = (self.buf, self.pos);
        match buf.get(p) {
            Some(&m) if m < 0x80 => {
                self.pos = p + 1;
                return Ok(m as u32);
            }
            Some(0xcc) => {
                if let Some(&b) = buf.get(p + 1) {
                    self.pos = p + 2;
                    return Ok(b as u32);
                }
            }
            Some(0xcd) => {
                if let Some(&[a, b]) = buf.get(p + 1..p + 3) {
                    self.pos = p + 3;
                    return Ok(u16::from_be_bytes([a, b]) as u32);
                }
            }
            Some(0xce) => {
                if let Some(&[a, b, c, d]) = buf.get(p + 1..p + 5) {
                    self.pos = p + 5;
                    return Ok(u32::from_be_bytes([a, b, c, d]));
                }
            }
            _ => {}
        }
        let v = match self.int()? {
            Int::U(v) => u32::try_from(v).ok(),
            Int::I(v) => u32::try_from(v).ok(),
        };
        v.ok_or(ReadError {
            offset: p,
            kind: ReadErrorKind::OutOfRange("u32"),
        })
    }

    /// Reads an unsigned 64-bit integer if that is what comes next (fast path for
    /// block hashes); `None` leaves the reader unchanged.
    #[inline]
    pub fn try_u64(&mut self) -> Option<u64> {
        let (buf, p) = (self.buf, self.pos);
        match buf.get(p) {
            Some(0xcf) => {
                let s: [u8; 8] = buf.get(p + 1..p + 9)?.try_into().ok()?;
                self.pos = p + 9;
                Some(u64::from_be_bytes(s))
            }
            Some(0xce) => {
                let s: [u8; 4] = buf.get(p + 1..p + 5)?.try_into().ok()?;
                self.pos = p + 5;
                Some(u32::from_be_bytes(s) as u64)
            }
            _ => None,
        }
    }

    /// Reads a float, accepting integers too (timestamps may be sent either way).
    pub fn f64(&mut self) -> ReadResult<f64> {
        let start = self.pos;
        let m = self.byte()?;
        match m {
            0xca => Ok(f32::from_be_bytes(self.be()?) as f64),
            0xcb => Ok(f64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = start;
                match self.int() {
                    Ok(Int::U(v)) => Ok(v as f64),
                    Ok(Int::I(v)) => Ok(v as f64),
                    Err(_) => Err(self.unexpected("float", Kind::of(m))),
                }
            }
        }
    }

    /// Reads a string or binary value and returns its raw bytes.
    pub fn str_or_bin(&mut self) -> ReadResult<&'a [u8]> {
        let start = self.pos;
        let m = self.byte()?;
        let len = match m {
            0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 | 0xc4 => self.byte()? as usize,
            0xda | 0xc5 => u16::from_be_bytes(self.be()?) as usize,
            0xdb | 0xc6 => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = start;
                return Err(self.unexpected("string", Kind::of(m)));
            }
        };
        self.take(len)
    }

    /// Reads a UTF-8 string (binary values holding UTF-8 are accepted as well).
    pub fn str(&mut self) -> ReadResult<&'a str> {
        let start = self.pos;
        let bytes = self.str_or_bin()?;
        std::str::from_utf8(bytes).map_err(|_| ReadError {
            offset: start,
            kind: ReadErrorKind::InvalidUtf8,
        })
    }

    /// Skips one complete value of any type, however deeply nested, without recursion.
    pub fn skip(&mut self) -> ReadResult<()> {
        // Number of values still to skip; containers add their children.
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let start = self.pos;
            let m = self.byte()?;
            match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => {}
                0x80..=0x8f => pending += 2 * (m & 0x0f) as u64,
                0x90..=0x9f => pending += (m & 0x0f) as u64,
                0xa0..=0xbf => {
                    self.take((m & 0x1f) as usize)?;
                }
                0xc1 => {
                    self.pos = start;
                    return Err(self.error(ReadErrorKind::ReservedMarker));
                }
                0xc4 | 0xd9 => {
                    let n = self.byte()? as usize;
                    self.take(n)?;
                }
                0xc5 | 0xda => {
                    let n = u16::from_be_bytes(self.be()?) as usize;
                    self.take(n)?;
                }
                0xc6 | 0xdb => {
                    let n = u32::from_be_bytes(self.be()?) as usize;
                    self.take(n)?;
                }
                0xc7 => {
                    let n = self.byte()? as usize;
                    self.take(n + 1)?;
                }
                0xc8 => {
                    let n = u16::from_be_bytes(self.be()?) as usize;
                    self.take(n + 1)?;
                }
                0xc9 => {
                    let n = u32::from_be_bytes(self.be()?) as usize;
                    self.take(n.saturating_add(1))?;
                }
                0xca => {
                    self.take(4)?;
                }
                0xcb => {
                    self.take(8)?;
                }
                0xcc | 0xd0 => {
                    self.take(1)?;
                }
                0xcd | 0xd1 => {
                    self.take(2)?;
                }
                0xce | 0xd2 => {
                    self.take(4)?;
                }
                0xcf | 0xd3 => {
                    self.take(8)?;
                }
                0xd4 => {
                    self.take(2)?;
                }
                0xd5 => {
                    self.take(3)?;
                }
                0xd6 => {
                    self.take(5)?;
                }
                0xd7 => {
                    self.take(9)?;
                }
                0xd8 => {
                    self.take(17)?;
                }
                0xdc => pending += u16::from_be_bytes(self.be()?) as u64,
                0xdd => pending += u32::from_be_bytes(self.be()?) as u64,
                0xde => pending += 2 * u16::from_be_bytes(self.be()?) as u64,
                0xdf => pending += 2 * u32::from_be_bytes(self.be()?) as u64,
            }
            // Each pending value needs at least one byte: a declared count larger than
            // the rest of the payload is truncated input, detected here cheaply.
            if pending > self.remaining() as u64 {
                return Err(self.error(ReadErrorKind::Truncated));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_integer_width() {
        let cases: &[(&[u8], Int)] = &[
            (&[0x05], Int::U(5)),
            (&[0xff], Int::I(-1)),
            (&[0xcc, 0xff], Int::U(255)),
            (&[0xcd, 0x01, 0x00], Int::U(256)),
            (&[0xce, 0, 1, 0, 0], Int::U(65536)),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                Int::U(u64::MAX),
            ),
            (&[0xd0, 0x80], Int::I(-128)),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Int::I(i64::MIN)),
        ];
        for (bytes, want) in cases {
            assert_eq!(Reader::new(bytes).int().unwrap(), *want, "{bytes:?}");
        }
    }

    #[test]
    fn truncated_input_is_an_error() {
        assert_eq!(
            Reader::new(&[0xcf, 0x01]).int().unwrap_err().kind,
            ReadErrorKind::Truncated
        );
        assert_eq!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff])
                .skip()
                .unwrap_err()
                .kind,
            ReadErrorKind::Truncated
        );
    }

    #[test]
    fn skip_handles_deep_nesting_without_recursion() {
        let mut bytes = vec![0x91u8; 1_000_000];
        bytes.push(0xc0);
        let mut r = Reader::new(&bytes);
        r.skip().unwrap();
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn skip_consumes_exactly_one_value() {
        // [1, {"a": [nil, true]}, "xy"] followed by 0x07
        let bytes = [
            0x93, 0x01, 0x81, 0xa1, b'a', 0x92, 0xc0, 0xc3, 0xa2, b'x', b'y', 0x07,
        ];
        let mut r = Reader::new(&bytes);
        r.skip().unwrap();
        assert_eq!(r.int().unwrap(), Int::U(7));
    }
}
