//! A borrowing MessagePack reader and a msgspec-compatible writer: the subset KV-event payloads
//! use.
//!
//! Key decision: a hand-written cursor instead of `rmpv` values. Decoding reads straight into the
//! wire types (token ids into a `Vec`, strings borrowed from the payload), which is what makes
//! decoding several times faster than building an `rmpv::Value` tree. It never recurses (skipping
//! an unknown value counts the items still pending), so hostile nesting cannot overflow the stack,
//! and it never reserves more elements than there are bytes left, so a forged length prefix cannot
//! make it allocate gigabytes. The writer picks the smallest form of every integer, string, array
//! and map header, as msgspec does. The engine crates call it across a crate boundary, so every
//! method on their hot path is `#[inline]`.

use crate::error::{DecodeError, ValueKind};

/// A MessagePack integer: non-negative values as `u64` (msgpack's unsigned range), negative ones
/// as `i64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int {
    /// `0 ..= u64::MAX`.
    Pos(u64),
    /// `i64::MIN ..= -1`.
    Neg(i64),
}

/// The kind of value a marker byte starts.
#[inline]
#[must_use]
pub fn kind_of(marker: u8) -> ValueKind {
    match marker {
        0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => ValueKind::Int,
        0x80..=0x8f | 0xde | 0xdf => ValueKind::Map,
        0x90..=0x9f | 0xdc | 0xdd => ValueKind::Array,
        0xa0..=0xbf | 0xd9..=0xdb => ValueKind::Str,
        0xc0 => ValueKind::Nil,
        0xc1 => ValueKind::Reserved,
        0xc2 | 0xc3 => ValueKind::Bool,
        0xc4..=0xc6 => ValueKind::Bin,
        0xc7..=0xc9 | 0xd4..=0xd8 => ValueKind::Ext,
        0xca | 0xcb => ValueKind::Float,
    }
}

/// A cursor over a payload. Every method either consumes one whole value (or header) and returns
/// it, or returns an error and leaves the position unspecified.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A cursor at the start of `buf`.
    #[must_use]
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Current byte offset.
    #[inline]
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Moves back to an offset returned by [`Reader::pos`].
    #[inline]
    pub fn seek(&mut self, pos: usize) {
        self.pos = pos.min(self.buf.len());
    }

    /// Bytes from `start` to the current position (a value just skipped, verbatim).
    #[inline]
    pub fn since(&self, start: usize) -> &'a [u8] {
        self.buf.get(start..self.pos).unwrap_or_default()
    }

    /// Bytes left. Every value takes at least one byte, so this bounds any element count.
    #[inline]
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Errors unless every byte was consumed.
    #[inline]
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.pos == self.buf.len() { Ok(()) } else { Err(DecodeError::TrailingBytes { offset: self.pos }) }
    }

    #[cold]
    fn truncated(&self) -> DecodeError {
        DecodeError::Truncated { offset: self.buf.len() }
    }

    /// The next marker byte, not consumed.
    #[inline]
    pub fn peek(&self) -> Result<u8, DecodeError> {
        self.buf.get(self.pos).copied().ok_or_else(|| self.truncated())
    }

    /// The kind of the next value, not consumed.
    #[inline]
    pub fn kind(&self) -> Result<ValueKind, DecodeError> {
        self.peek().map(kind_of)
    }

    /// The error for "the next value is not `expected`".
    pub fn unexpected(&self, expected: &'static str) -> DecodeError {
        match self.peek() {
            Ok(m) => DecodeError::UnexpectedType { offset: self.pos, expected, found: kind_of(m) },
            Err(e) => e,
        }
    }

    #[inline]
    fn byte(&mut self) -> Result<u8, DecodeError> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| self.truncated())?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    #[inline]
    fn be16(&mut self) -> Result<u16, DecodeError> {
        self.array::<2>().map(u16::from_be_bytes)
    }

    #[inline]
    fn be32(&mut self) -> Result<u32, DecodeError> {
        self.array::<4>().map(u32::from_be_bytes)
    }

    #[inline]
    fn be64(&mut self) -> Result<u64, DecodeError> {
        self.array::<8>().map(u64::from_be_bytes)
    }

    /// Consumes a `nil` if one is next; true if it did.
    #[inline]
    pub fn nil(&mut self) -> Result<bool, DecodeError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// An array header: the element count, bounded by the bytes left.
    #[inline]
    pub fn array_len(&mut self) -> Result<usize, DecodeError> {
        let n = match self.peek()? {
            m @ 0x90..=0x9f => {
                self.pos += 1;
                usize::from(m & 0x0f)
            }
            0xdc => {
                self.pos += 1;
                usize::from(self.be16()?)
            }
            0xdd => {
                self.pos += 1;
                self.be32()? as usize
            }
            _ => return Err(self.unexpected("an array")),
        };
        self.bounded(n)
    }

    /// A map header: the entry count, bounded by the bytes left.
    #[inline]
    pub fn map_len(&mut self) -> Result<usize, DecodeError> {
        let n = match self.peek()? {
            m @ 0x80..=0x8f => {
                self.pos += 1;
                usize::from(m & 0x0f)
            }
            0xde => {
                self.pos += 1;
                usize::from(self.be16()?)
            }
            0xdf => {
                self.pos += 1;
                self.be32()? as usize
            }
            _ => return Err(self.unexpected("a map")),
        };
        self.bounded(n)
    }

    #[inline]
    fn bounded(&self, n: usize) -> Result<usize, DecodeError> {
        // Each element (each key and value of a map) takes at least one byte.
        if n > self.remaining() { Err(self.truncated()) } else { Ok(n) }
    }

    /// Any integer, every form read inline.
    #[inline]
    pub fn int(&mut self) -> Result<Int, DecodeError> {
        let (b, p) = (self.buf, self.pos);
        let (v, len) = match b.get(p) {
            Some(&m) if m < 0x80 => (Int::Pos(u64::from(m)), 1),
            Some(&m) if m >= 0xe0 => (Int::Neg(i64::from(m as i8)), 1),
            Some(0xcc) => match b.get(p + 1) {
                Some(&v) => (Int::Pos(u64::from(v)), 2),
                None => return Err(self.truncated()),
            },
            Some(0xcd) => match b.get(p + 1..p + 3) {
                Some(&[x, y]) => (Int::Pos(u64::from(u16::from_be_bytes([x, y]))), 3),
                _ => return Err(self.truncated()),
            },
            Some(0xce) => match b.get(p + 1..p + 5) {
                Some(&[w, x, y, z]) => (Int::Pos(u64::from(u32::from_be_bytes([w, x, y, z]))), 5),
                _ => return Err(self.truncated()),
            },
            Some(0xcf) => match b.get(p + 1..p + 9).and_then(|s| <[u8; 8]>::try_from(s).ok()) {
                Some(a) => (Int::Pos(u64::from_be_bytes(a)), 9),
                None => return Err(self.truncated()),
            },
            Some(0xd0) => match b.get(p + 1) {
                Some(&v) => (signed(i64::from(v as i8)), 2),
                None => return Err(self.truncated()),
            },
            Some(0xd1) => match b.get(p + 1..p + 3) {
                Some(&[x, y]) => (signed(i64::from(i16::from_be_bytes([x, y]))), 3),
                _ => return Err(self.truncated()),
            },
            Some(0xd2) => match b.get(p + 1..p + 5) {
                Some(&[w, x, y, z]) => (signed(i64::from(i32::from_be_bytes([w, x, y, z]))), 5),
                _ => return Err(self.truncated()),
            },
            Some(0xd3) => match b.get(p + 1..p + 9).and_then(|s| <[u8; 8]>::try_from(s).ok()) {
                Some(a) => (signed(i64::from_be_bytes(a)), 9),
                None => return Err(self.truncated()),
            },
            _ => return Err(self.unexpected("an integer")),
        };
        self.pos = p + len;
        Ok(v)
    }

    /// An integer that must fit `i64`.
    #[inline]
    pub fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        let offset = self.pos;
        match self.int()? {
            Int::Neg(v) => Ok(v),
            Int::Pos(v) => i64::try_from(v).map_err(|_| DecodeError::OutOfRange { offset, field }),
        }
    }

    /// A non-negative integer below 2^32 in one of the forms msgspec writes for one (positive
    /// fixint, `uint8`, `uint16`, `uint32`), read inline: the token-id fast path. `None` (position
    /// unchanged) for any other form or a truncated one.
    ///
    /// Three equality tests and no more, on purpose: with a fourth arm LLVM turns the chain into a
    /// jump table, and on token ids (which alternate between `uint16` and `uint32` at random) the
    /// mispredicted indirect jump made decoding about twice as slow on the benchmark machine; a
    /// branch-free width computation was slower too.
    #[inline(always)]
    fn uint_inline(&mut self) -> Option<u32> {
        let (b, p) = (self.buf, self.pos);
        match b.get(p) {
            Some(&m) if m < 0x80 => {
                self.pos = p + 1;
                return Some(u32::from(m));
            }
            Some(0xcc) => {
                if let Some(&v) = b.get(p + 1) {
                    self.pos = p + 2;
                    return Some(u32::from(v));
                }
            }
            Some(0xcd) => {
                if let Some(&[x, y]) = b.get(p + 1..p + 3) {
                    self.pos = p + 3;
                    return Some(u32::from(u16::from_be_bytes([x, y])));
                }
            }
            Some(0xce) => {
                if let Some(&[w, x, y, z]) = b.get(p + 1..p + 5) {
                    self.pos = p + 5;
                    return Some(u32::from_be_bytes([w, x, y, z]));
                }
            }
            _ => {}
        }
        None
    }

    /// An integer that must fit `u32` (token ids, block sizes).
    #[inline(always)]
    pub fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        match self.uint_inline() {
            Some(v) => Ok(v),
            None => self.u32_general(field),
        }
    }

    #[cold]
    #[inline(never)]
    fn u32_general(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        let offset = self.pos;
        match self.int()? {
            Int::Pos(v) => u32::try_from(v).map_err(|_| DecodeError::OutOfRange { offset, field }),
            Int::Neg(_) => Err(DecodeError::OutOfRange { offset, field }),
        }
    }

    /// An integer that must fit `u64` (non-negative).
    #[inline(always)]
    pub fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        match self.uint_inline() {
            Some(v) => Ok(u64::from(v)),
            None => self.u64_general(field),
        }
    }

    #[cold]
    #[inline(never)]
    fn u64_general(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        let offset = self.pos;
        match self.int()? {
            Int::Pos(v) => Ok(v),
            Int::Neg(_) => Err(DecodeError::OutOfRange { offset, field }),
        }
    }

    /// A number as `f64` (msgspec writes `float64`; `float32` and integers are accepted too).
    #[inline]
    pub fn f64(&mut self) -> Result<f64, DecodeError> {
        match self.peek()? {
            0xcb => {
                self.pos += 1;
                Ok(f64::from_bits(self.be64()?))
            }
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(self.be32()?)))
            }
            m if kind_of(m) == ValueKind::Int => Ok(match self.int()? {
                Int::Pos(v) => v as f64,
                Int::Neg(v) => v as f64,
            }),
            _ => Err(self.unexpected("a number")),
        }
    }

    /// A string, borrowed from the payload.
    #[inline]
    pub fn str(&mut self) -> Result<&'a str, DecodeError> {
        let offset = self.pos;
        let bytes = self.str_bytes()?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 { offset })
    }

    /// A string's raw bytes (for comparing tags and keys without UTF-8 validation).
    #[inline]
    pub fn str_bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = match self.peek()? {
            m @ 0xa0..=0xbf => {
                self.pos += 1;
                usize::from(m & 0x1f)
            }
            0xd9 => {
                self.pos += 1;
                usize::from(self.byte()?)
            }
            0xda => {
                self.pos += 1;
                usize::from(self.be16()?)
            }
            0xdb => {
                self.pos += 1;
                self.be32()? as usize
            }
            _ => return Err(self.unexpected("a string")),
        };
        self.take(n)
    }

    /// A `bin`, borrowed from the payload.
    #[inline]
    pub fn bin(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = match self.peek()? {
            0xc4 => {
                self.pos += 1;
                usize::from(self.byte()?)
            }
            0xc5 => {
                self.pos += 1;
                usize::from(self.be16()?)
            }
            0xc6 => {
                self.pos += 1;
                self.be32()? as usize
            }
            _ => return Err(self.unexpected("a bin")),
        };
        self.take(n)
    }

    /// Skips one whole value, however deeply nested, without recursion.
    pub fn skip(&mut self) -> Result<(), DecodeError> {
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            let m = self.byte()?;
            let data = match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                0x80..=0x8f => {
                    pending = self.add_pending(pending, 2 * usize::from(m & 0x0f))?;
                    0
                }
                0x90..=0x9f => {
                    pending = self.add_pending(pending, usize::from(m & 0x0f))?;
                    0
                }
                0xa0..=0xbf => usize::from(m & 0x1f),
                0xc1 => {
                    return Err(DecodeError::UnexpectedType {
                        offset: self.pos - 1,
                        expected: "a value",
                        found: ValueKind::Reserved,
                    });
                }
                0xc4 | 0xd9 => usize::from(self.byte()?),
                0xc5 | 0xda => usize::from(self.be16()?),
                0xc6 | 0xdb => self.be32()? as usize,
                0xc7 => usize::from(self.byte()?) + 1,
                0xc8 => usize::from(self.be16()?) + 1,
                0xc9 => self.be32()? as usize + 1,
                0xca => 4,
                0xcb => 8,
                0xcc | 0xd0 => 1,
                0xcd | 0xd1 => 2,
                0xce | 0xd2 => 4,
                0xcf | 0xd3 => 8,
                0xd4 => 2,
                0xd5 => 3,
                0xd6 => 5,
                0xd7 => 9,
                0xd8 => 17,
                0xdc => {
                    let n = usize::from(self.be16()?);
                    pending = self.add_pending(pending, n)?;
                    0
                }
                0xdd => {
                    let n = self.be32()? as usize;
                    pending = self.add_pending(pending, n)?;
                    0
                }
                0xde => {
                    let n = usize::from(self.be16()?);
                    pending = self.add_pending(pending, n.saturating_mul(2))?;
                    0
                }
                0xdf => {
                    let n = self.be32()? as usize;
                    pending = self.add_pending(pending, n.saturating_mul(2))?;
                    0
                }
            };
            self.take(data)?;
        }
        Ok(())
    }

    /// A map key: `Some(bytes)` for a string key; any other key is skipped and gives `None`.
    #[inline]
    pub fn key(&mut self) -> Result<Option<&'a [u8]>, DecodeError> {
        if self.kind()? == ValueKind::Str {
            Ok(Some(self.str_bytes()?))
        } else {
            self.skip()?;
            Ok(None)
        }
    }

    /// A string or `nil` (`None`).
    #[inline]
    pub fn opt_str(&mut self) -> Result<Option<&'a str>, DecodeError> {
        if self.nil()? { Ok(None) } else { self.str().map(Some) }
    }

    /// An integer that must fit `i64`, or `nil` (`None`).
    #[inline]
    pub fn opt_i64(&mut self, field: &'static str) -> Result<Option<i64>, DecodeError> {
        if self.nil()? { Ok(None) } else { self.i64(field).map(Some) }
    }

    /// An integer that must fit `u16` (a DP rank), or `nil` (`None`).
    #[inline]
    pub fn opt_u16(&mut self, field: &'static str) -> Result<Option<u16>, DecodeError> {
        if self.nil()? {
            return Ok(None);
        }
        let offset = self.pos;
        let v = self.u64(field)?;
        u16::try_from(v).map(Some).map_err(|_| DecodeError::OutOfRange { offset, field })
    }

    fn add_pending(&self, pending: usize, more: usize) -> Result<usize, DecodeError> {
        let total = pending.saturating_add(more);
        if total > self.remaining() { Err(self.truncated()) } else { Ok(total) }
    }
}

fn signed(v: i64) -> Int {
    match u64::try_from(v) {
        Ok(u) => Int::Pos(u),
        Err(_) => Int::Neg(v),
    }
}

/// Writes MessagePack in msgspec's forms: the smallest integer, string, `bin`, array and map
/// header for each value, `float64` for floats.
pub mod write {
    /// `nil`.
    pub fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    /// A non-negative integer in its smallest form.
    pub fn uint(out: &mut Vec<u8>, v: u64) {
        if v < 0x80 {
            out.push(v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            out.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(v) {
            out.push(0xcd);
            out.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            out.push(0xce);
            out.extend_from_slice(&v.to_be_bytes());
        } else {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Any signed integer: non-negative values as unsigned forms (as msgspec writes a Python
    /// `int`), negative ones in the smallest signed form.
    pub fn int(out: &mut Vec<u8>, v: i64) {
        if let Ok(u) = u64::try_from(v) {
            uint(out, u);
        } else if v >= -32 {
            out.push(v as u8);
        } else if let Ok(v) = i8::try_from(v) {
            out.extend_from_slice(&[0xd0, v as u8]);
        } else if let Ok(v) = i16::try_from(v) {
            out.push(0xd1);
            out.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = i32::try_from(v) {
            out.push(0xd2);
            out.extend_from_slice(&v.to_be_bytes());
        } else {
            out.push(0xd3);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// A `float64`.
    pub fn f64(out: &mut Vec<u8>, v: f64) {
        out.push(0xcb);
        out.extend_from_slice(&v.to_bits().to_be_bytes());
    }

    /// Length prefix with the given family markers; `None` if it does not fit 32 bits.
    fn len_prefix(
        out: &mut Vec<u8>,
        n: usize,
        fix: Option<(u8, usize)>,
        m8: Option<u8>,
        m16: u8,
        m32: u8,
    ) -> Option<()> {
        match fix {
            Some((base, max)) if n <= max => out.push(base | n as u8),
            _ => match (m8, u8::try_from(n), u16::try_from(n)) {
                (Some(m8), Ok(n8), _) => out.extend_from_slice(&[m8, n8]),
                (_, _, Ok(n16)) => {
                    out.push(m16);
                    out.extend_from_slice(&n16.to_be_bytes());
                }
                _ => {
                    out.push(m32);
                    out.extend_from_slice(&u32::try_from(n).ok()?.to_be_bytes());
                }
            },
        }
        Some(())
    }

    /// A string (fixstr, str8, str16 or str32).
    pub fn str(out: &mut Vec<u8>, s: &str) -> Option<()> {
        len_prefix(out, s.len(), Some((0xa0, 31)), Some(0xd9), 0xda, 0xdb)?;
        out.extend_from_slice(s.as_bytes());
        Some(())
    }

    /// A `bin` (bin8, bin16 or bin32).
    pub fn bin(out: &mut Vec<u8>, b: &[u8]) -> Option<()> {
        len_prefix(out, b.len(), None, Some(0xc4), 0xc5, 0xc6)?;
        out.extend_from_slice(b);
        Some(())
    }

    /// An array header (fixarray, array16 or array32).
    pub fn array(out: &mut Vec<u8>, n: usize) -> Option<()> {
        len_prefix(out, n, Some((0x90, 15)), None, 0xdc, 0xdd)
    }

    /// A map header in its smallest form.
    pub fn map(out: &mut Vec<u8>, n: usize) -> Option<()> {
        len_prefix(out, n, Some((0x80, 15)), None, 0xde, 0xdf)
    }

    /// A map header as msgspec writes a struct's: the form is chosen by how many keys the struct
    /// *could* have (`capacity`, tag included), the count is how many it has.
    pub fn struct_map(out: &mut Vec<u8>, n: usize, capacity: usize) -> Option<()> {
        if capacity < 16 { map(out, n) } else { len_prefix(out, n, None, None, 0xde, 0xdf) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut v = Vec::new();
        f(&mut v);
        v
    }

    #[test]
    fn integers_take_their_smallest_form_and_read_back() {
        let cases: &[(i64, &[u8])] = &[
            (0, &[0x00]),
            (127, &[0x7f]),
            (128, &[0xcc, 0x80]),
            (256, &[0xcd, 0x01, 0x00]),
            (65_536, &[0xce, 0, 1, 0, 0]),
            (1 << 32, &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0]),
            (-1, &[0xff]),
            (-32, &[0xe0]),
            (-33, &[0xd0, 0xdf]),
            (-200, &[0xd1, 0xff, 0x38]),
            (-40_000, &[0xd2, 0xff, 0xff, 0x63, 0xc0]),
            (i64::MIN, &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]),
        ];
        for &(v, want) in cases {
            let got = bytes(|o| write::int(o, v));
            assert_eq!(got, want, "{v}");
            assert_eq!(Reader::new(&got).i64("v").unwrap(), v);
        }
        let big = bytes(|o| write::uint(o, u64::MAX));
        assert_eq!(Reader::new(&big).int().unwrap(), Int::Pos(u64::MAX));
        // A non-negative value in a signed form is still non-negative.
        assert_eq!(Reader::new(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 5]).int().unwrap(), Int::Pos(5));
    }

    #[test]
    fn headers_switch_forms_at_the_msgpack_limits() {
        assert_eq!(bytes(|o| write::array(o, 15).unwrap()), [0x9f]);
        assert_eq!(bytes(|o| write::array(o, 16).unwrap()), [0xdc, 0, 16]);
        assert_eq!(bytes(|o| write::map(o, 3).unwrap()), [0x83]);
        assert_eq!(bytes(|o| write::struct_map(o, 8, 16).unwrap()), [0xde, 0, 8]);
        assert_eq!(bytes(|o| write::struct_map(o, 8, 15).unwrap()), [0x88]);
        assert_eq!(bytes(|o| write::str(o, &"x".repeat(31)).unwrap())[0], 0xbf);
        assert_eq!(bytes(|o| write::str(o, &"x".repeat(40)).unwrap())[..2], [0xd9, 40]);
        assert_eq!(bytes(|o| write::str(o, &"x".repeat(300)).unwrap())[..3], [0xda, 1, 44]);
        assert_eq!(bytes(|o| write::bin(o, &[7; 32]).unwrap())[..2], [0xc4, 32]);
    }

    #[test]
    fn skip_walks_nested_values_and_rejects_forged_lengths() {
        // [ {"a": [1, "xy", nil]}, 1.5 ] then a trailing 7.
        let v = [
            0x92, 0x81, 0xa1, b'a', 0x93, 0x01, 0xa2, b'x', b'y', 0xc0, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0,
            0x07,
        ];
        let mut r = Reader::new(&v);
        r.skip().unwrap();
        assert_eq!(r.int().unwrap(), Int::Pos(7));
        r.finish().unwrap();
        // array32 claiming 4 billion elements in 5 bytes.
        assert!(matches!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).skip(),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).array_len(),
            Err(DecodeError::Truncated { .. })
        ));
        // Deep nesting is walked iteratively.
        let mut deep = vec![0x91; 100_000];
        deep.push(0xc0);
        let mut r = Reader::new(&deep);
        r.skip().unwrap();
        r.finish().unwrap();
    }

    #[test]
    fn wrong_types_name_what_was_found() {
        let err = Reader::new(&[0xa1, b'x']).array_len().unwrap_err();
        assert_eq!(
            err,
            DecodeError::UnexpectedType { offset: 0, expected: "an array", found: ValueKind::Str }
        );
        assert_eq!(Reader::new(&[0xa1, 0xff]).str().unwrap_err(), DecodeError::InvalidUtf8 { offset: 0 });
        assert_eq!(
            Reader::new(&[0xcf, 0xff, 0, 0, 0, 0, 0, 0, 0]).u32("t").unwrap_err(),
            DecodeError::OutOfRange { offset: 0, field: "t" }
        );
    }
}
