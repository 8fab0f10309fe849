//! Byte-level BPE on raw bytes, with the `tokenizers` crate's merge order.
//!
//! A pre-tokenizer piece starts as one token per byte; the adjacent pair with the lowest merge
//! rank is merged (the leftmost of equal ranks, which are the same pair), until no adjacent
//! pair has a merge. That is what `tokenizers`' `Word::merge_all` computes with its heap; for
//! pieces of up to [`SMALL`] bytes the same order is found by scanning an array of pair ranks,
//! longer pieces use a heap as `tokenizers` does.
//!
//! Key decision: most pieces are one vocabulary token, so each vocabulary entry records whether
//! BPE of its own bytes gives itself — a property of the vocabulary, computed the first time a
//! piece needs it (computing all 151k at load would take a fifth of a second) — and such a piece
//! then costs one hash lookup. There is no cache of text.
//!
//! The lookup is the encoder's main cost on a prompt never seen before: 151k entries are
//! megabytes, so each probe is a cache miss. The vocabulary therefore keeps a piece of up to
//! [`INLINE`] bytes inside its table entry and the whole-token flag next to the id, so that a
//! lookup touches the table alone, not a separately allocated key and a per-id flag array.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::Token;

/// Pieces up to this many bytes merge in fixed arrays by scanning.
const SMALL: usize = 48;

/// A fast hasher for the vocabulary (byte strings) and the merges (`u64` pairs).
#[derive(Default)]
pub(super) struct FastHasher(u64);

impl Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.0);
    }

    fn write_u64(&mut self, x: u64) {
        // The splitmix64 finalizer: every input bit reaches the low bits the table indexes by.
        let mut z = (self.0 ^ x).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        self.0 = z ^ (z >> 31);
    }

    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// A merge: its rank (lower merges first) and the token it makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Merge {
    rank: u32,
    new: Token,
}

const fn pair(a: Token, b: Token) -> u64 {
    ((a as u64) << 32) | b as u64
}

/// Why a vocabulary and merges list cannot be a byte-level BPE.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum BpeError {
    /// A token id is beyond any real vocabulary (the per-id table would be huge).
    #[error("token id {0} is too large")]
    IdTooLarge(Token),
    /// Some byte has no single-byte token (the piece would lose it or need an unknown token).
    #[error("byte 0x{0:02X} has no token")]
    MissingByte(u8),
    /// A merge names a token the vocabulary lacks.
    #[error("merge {0:?} uses or makes a token outside the vocabulary")]
    MergeOutOfVocabulary(String),
}

/// Pieces up to this many bytes are kept inside the vocabulary's table entry.
const INLINE: usize = 15;

/// A piece of up to [`INLINE`] bytes as a table key: the bytes, zero-padded, then the length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct InlineKey([u64; 2]);

impl InlineKey {
    /// The key of `bytes` (at most [`INLINE`] of them), read with overlapping word loads rather
    /// than a copy of variable length: the key is built on every lookup.
    #[inline]
    fn of(bytes: &[u8]) -> InlineKey {
        let n = bytes.len();
        debug_assert!(n <= INLINE);
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default());
        let half =
            |at: usize| u64::from(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or_default()));
        let (lo, hi) = if n >= 8 {
            // Bytes 8..n are the top n - 8 bytes of the last word.
            (word(0), word(n - 8).checked_shr(8 * (16 - n) as u32).unwrap_or(0))
        } else if n >= 4 {
            // Two overlapping halves: the shared bytes are the same on both sides.
            (half(0) | half(n - 4) << (8 * (n - 4)), 0)
        } else if n > 0 {
            let b = |i: usize| u64::from(bytes[i]) << (8 * i);
            (b(0) | b(n / 2) | b(n - 1), 0)
        } else {
            (0, 0)
        };
        InlineKey([lo, hi | (n as u64) << 56])
    }

    #[cfg(test)]
    fn bytes(self) -> Vec<u8> {
        let mut k = [0u8; 16];
        k[..8].copy_from_slice(&self.0[0].to_le_bytes());
        k[8..].copy_from_slice(&self.0[1].to_le_bytes());
        k[..usize::from(k[15])].to_vec()
    }
}

impl std::hash::Hash for InlineKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // One 64-bit input for the hasher's finalizer; a collision only costs a key compare.
        state.write_u64(self.0[0] ^ self.0[1].wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(31));
    }
}

/// Raw bytes → an entry: the token id in the low 24 bits ([`MAX_ID`]), and above them whether
/// BPE of the token's own bytes gives the token ([`UNKNOWN`] until a piece first needs it).
struct Vocab {
    short: FastMap<InlineKey, AtomicU32>,
    long: FastMap<Box<[u8]>, AtomicU32>,
}

const ID_BITS: u32 = 24;

impl Vocab {
    fn with_capacity(n: usize) -> Vocab {
        let mut short = FastMap::default();
        short.reserve(n);
        Vocab { short, long: FastMap::default() }
    }

    fn insert(&mut self, bytes: &[u8], id: Token) -> Result<(), BpeError> {
        if id >= MAX_ID {
            return Err(BpeError::IdTooLarge(id));
        }
        let entry = AtomicU32::new(id | u32::from(UNKNOWN) << ID_BITS);
        if bytes.len() <= INLINE {
            self.short.insert(InlineKey::of(bytes), entry);
        } else {
            self.long.insert(bytes.into(), entry);
        }
        Ok(())
    }

    #[inline]
    fn entry(&self, bytes: &[u8]) -> Option<&AtomicU32> {
        if bytes.len() <= INLINE { self.short.get(&InlineKey::of(bytes)) } else { self.long.get(bytes) }
    }

    fn id(&self, bytes: &[u8]) -> Option<Token> {
        self.entry(bytes).map(|e| e.load(Ordering::Relaxed) & (MAX_ID - 1))
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (Vec<u8>, Token)> + '_ {
        let id = |e: &AtomicU32| e.load(Ordering::Relaxed) & (MAX_ID - 1);
        self.short
            .iter()
            .map(move |(k, e)| (k.bytes(), id(e)))
            .chain(self.long.iter().map(move |(k, e)| (k.to_vec(), id(e))))
    }
}

/// A byte-level BPE model.
pub(super) struct Bpe {
    vocab: Vocab,
    merges: FastMap<u64, Merge>,
    byte_ids: [Token; 256],
    /// `ignore_merges`: a piece that is a vocabulary token is that token.
    ignore_merges: bool,
}

/// Token ids must be below this (vocabularies have a few hundred thousand).
const MAX_ID: Token = 1 << ID_BITS;

const UNKNOWN: u8 = 0;
const WHOLE: u32 = 1;
const SPLIT: u32 = 2;

/// Byte-level characters are below this code point.
const ALPHABET_END: usize = 0x144;

/// GPT-2's byte-to-character map, inverted: printable Latin-1 bytes are themselves, the others
/// are U+0100 onwards in byte order; `u16::MAX` for characters outside the alphabet.
fn byte_of_char() -> [u16; ALPHABET_END] {
    let mut out = [u16::MAX; ALPHABET_END];
    let mut next = 0x100;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            usize::from(b)
        } else {
            next += 1;
            next - 1
        };
        out[cp] = u16::from(b);
    }
    out
}

/// The raw bytes of a byte-level string into `out`, or `false` if a character is outside the
/// byte-level alphabet.
fn raw_bytes(s: &str, inverse: &[u16; ALPHABET_END], out: &mut Vec<u8>) -> bool {
    out.clear();
    for c in s.chars() {
        match inverse.get(c as usize).and_then(|&b| u8::try_from(b).ok()) {
            Some(b) => out.push(b),
            None => return false,
        }
    }
    true
}

impl Bpe {
    /// The model of `vocab` (byte-level strings → ids) and `merges` (pairs of byte-level
    /// strings, in rank order; a repeated pair takes its last rank, as `tokenizers` does).
    ///
    /// # Errors
    /// [`BpeError`] when the vocabulary is not a complete byte-level one or a merge is outside it.
    pub(super) fn new<'v>(
        vocab: impl ExactSizeIterator<Item = (&'v str, Token)>,
        merges: &[(&str, &str)],
        ignore_merges: bool,
    ) -> Result<Bpe, BpeError> {
        let inverse = byte_of_char();
        let mut raw = Vocab::with_capacity(vocab.len());
        let mut buf = Vec::new();
        for (s, id) in vocab {
            // A string outside the byte-level alphabet can never be a piece nor made by merges
            // (which concatenate byte-level strings): no input reaches it.
            if raw_bytes(s, &inverse, &mut buf) {
                raw.insert(&buf, id)?;
            }
        }
        let mut byte_ids = [0; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = raw.id(&[b as u8]).ok_or(BpeError::MissingByte(b as u8))?;
        }
        let mut merge_map: FastMap<u64, Merge> = FastMap::default();
        merge_map.reserve(merges.len());
        let (mut ra, mut rb) = (Vec::new(), Vec::new());
        for (rank, (a, b)) in merges.iter().enumerate() {
            // A merge of a string outside the alphabet never applies (`tokenizers` has already
            // refused a file whose merges are outside the vocabulary).
            if !raw_bytes(a, &inverse, &mut ra) || !raw_bytes(b, &inverse, &mut rb) {
                continue;
            }
            let oov = || BpeError::MergeOutOfVocabulary(format!("{a} {b}"));
            let ia = raw.id(&ra).ok_or_else(oov)?;
            let ib = raw.id(&rb).ok_or_else(oov)?;
            ra.extend_from_slice(&rb);
            let new = raw.id(&ra).ok_or_else(oov)?;
            merge_map.insert(pair(ia, ib), Merge { rank: u32::try_from(rank).unwrap_or(u32::MAX), new });
        }
        Ok(Bpe { vocab: raw, merges: merge_map, byte_ids, ignore_merges })
    }

    /// Appends the tokens of one pre-tokenizer piece to `out`.
    #[inline]
    pub(super) fn encode_piece(&self, piece: &[u8], out: &mut Vec<Token>) {
        let Some(entry) = self.vocab.entry(piece) else { return self.merge(piece, out) };
        // Relaxed: the flag is a pure function of the vocabulary, any thread computes the same.
        let e = entry.load(Ordering::Relaxed);
        let id = e & (MAX_ID - 1);
        if self.ignore_merges {
            out.push(id);
            return;
        }
        match e >> ID_BITS {
            WHOLE => out.push(id),
            SPLIT => self.merge(piece, out),
            _ => {
                let start = out.len();
                self.merge(piece, out);
                let flag = if out[start..] == [id] { WHOLE } else { SPLIT };
                entry.store(id | flag << ID_BITS, Ordering::Relaxed);
            }
        }
    }

    #[inline]
    fn lookup(&self, a: Token, b: Token) -> Option<Merge> {
        self.merges.get(&pair(a, b)).copied()
    }

    /// BPE of `piece` from single bytes, appended to `out`.
    fn merge(&self, piece: &[u8], out: &mut Vec<Token>) {
        if piece.len() <= SMALL {
            self.merge_small(piece, out);
        } else {
            self.merge_heap(piece, out);
        }
    }

    fn merge_small(&self, piece: &[u8], out: &mut Vec<Token>) {
        let n = piece.len();
        if n == 0 {
            return;
        }
        let mut sym = [0 as Token; SMALL];
        // `rank[i]`/`new[i]`: the merge of `sym[i]` and `sym[i + 1]` (rank u32::MAX: none).
        let mut rank = [u32::MAX; SMALL];
        let mut new = [0 as Token; SMALL];
        for (s, &b) in sym.iter_mut().zip(piece) {
            *s = self.byte_ids[usize::from(b)];
        }
        let set = |i: usize, sym: &[Token], rank: &mut [u32], new: &mut [Token]| {
            let m = self.lookup(sym[i], sym[i + 1]);
            rank[i] = m.map_or(u32::MAX, |m| m.rank);
            new[i] = m.map_or(0, |m| m.new);
        };
        for i in 0..n - 1 {
            set(i, &sym, &mut rank, &mut new);
        }
        let mut len = n;
        while len > 1 {
            let mut best = 0;
            for i in 1..len - 1 {
                if rank[i] < rank[best] {
                    best = i;
                }
            }
            if rank[best] == u32::MAX {
                break;
            }
            sym[best] = new[best];
            sym.copy_within(best + 2..len, best + 1);
            if best + 2 < len {
                rank.copy_within(best + 2..len - 1, best + 1);
                new.copy_within(best + 2..len - 1, best + 1);
            }
            len -= 1;
            rank[len - 1] = u32::MAX;
            if best + 1 < len {
                set(best, &sym, &mut rank, &mut new);
            } else {
                rank[best] = u32::MAX;
            }
            if best > 0 {
                set(best - 1, &sym, &mut rank, &mut new);
            }
        }
        out.extend_from_slice(&sym[..len]);
    }

    /// `tokenizers`' `Word::merge_all` without dropout: a linked list of symbols and a heap of
    /// candidate merges by (rank, position); entries whose pair changed are skipped.
    fn merge_heap(&self, piece: &[u8], out: &mut Vec<Token>) {
        #[derive(Clone, Copy)]
        struct Sym {
            id: Token,
            prev: usize,
            next: usize,
            alive: bool,
        }
        const NONE: usize = usize::MAX;
        let n = piece.len();
        let mut syms: Vec<Sym> = piece
            .iter()
            .enumerate()
            .map(|(i, &b)| Sym {
                id: self.byte_ids[usize::from(b)],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                alive: true,
            })
            .collect();
        // Min-heap by (rank, position) through Reverse.
        let mut heap: BinaryHeap<std::cmp::Reverse<(u32, usize, Token)>> = BinaryHeap::with_capacity(n);
        for i in 0..n.saturating_sub(1) {
            if let Some(m) = self.lookup(syms[i].id, syms[i + 1].id) {
                heap.push(std::cmp::Reverse((m.rank, i, m.new)));
            }
        }
        while let Some(std::cmp::Reverse((_, pos, new))) = heap.pop() {
            let s = syms[pos];
            if !s.alive || s.next == NONE {
                continue;
            }
            let right = syms[s.next];
            if self.lookup(s.id, right.id).is_none_or(|m| m.new != new) {
                continue;
            }
            syms[pos].id = new;
            syms[pos].next = right.next;
            syms[s.next].alive = false;
            if right.next != NONE {
                syms[right.next].prev = pos;
            }
            let cur = syms[pos];
            if cur.prev != NONE
                && let Some(m) = self.lookup(syms[cur.prev].id, cur.id)
            {
                heap.push(std::cmp::Reverse((m.rank, cur.prev, m.new)));
            }
            if cur.next != NONE
                && let Some(m) = self.lookup(cur.id, syms[cur.next].id)
            {
                heap.push(std::cmp::Reverse((m.rank, pos, m.new)));
            }
        }
        out.extend(syms.iter().filter(|s| s.alive).map(|s| s.id));
    }

    #[cfg(test)]
    fn merge_both(&self, piece: &[u8]) -> (Vec<Token>, Vec<Token>) {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        self.merge_small(piece, &mut a);
        self.merge_heap(piece, &mut b);
        (a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary where merge order matters: `abacb` → `ab a cb`, `abacbb` → `ab acbb`.
    fn toy() -> Bpe {
        let inverse = byte_of_char();
        let mut vocab: HashMap<String, Token> = (0..ALPHABET_END)
            .filter(|&c| inverse[c] != u16::MAX)
            .map(|c| (char::from_u32(c as u32).unwrap().to_string(), Token::from(inverse[c])))
            .collect();
        let merges = [
            ("a", "b"),
            ("c", "b"),
            ("a", "c"),
            ("b", "b"),
            ("cb", "b"),
            ("a", "cbb"),
            ("ab", "ab"),
            ("b", "c"),
            ("a", "bc"),
        ];
        for (a, b) in &merges {
            let next = vocab.len() as Token;
            vocab.entry(format!("{a}{b}")).or_insert(next);
        }
        Bpe::new(vocab.iter().map(|(s, &id)| (s.as_str(), id)), &merges, false).unwrap()
    }

    fn ids_to_text(bpe: &Bpe, ids: &[Token]) -> Vec<String> {
        let by_id: HashMap<u32, Vec<u8>> = bpe.vocab.iter().map(|(k, v)| (v, k)).collect();
        ids.iter().map(|id| String::from_utf8_lossy(&by_id[id]).into_owned()).collect()
    }

    /// The next value of a xorshift64 generator.
    fn xorshift(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    #[test]
    fn an_inline_key_holds_exactly_its_bytes() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        for n in 0..=INLINE {
            for _ in 0..200 {
                let bytes: Vec<u8> = (0..n).map(|_| xorshift(&mut seed) as u8).collect();
                assert_eq!(InlineKey::of(&bytes).bytes(), bytes);
            }
            // Trailing zero bytes are not padding: the length tells them apart.
            if n < INLINE {
                assert_ne!(InlineKey::of(&vec![0; n]), InlineKey::of(&vec![0; n + 1]));
            }
        }
    }

    #[test]
    fn merge_order_follows_ranks() {
        let bpe = toy();
        for (text, want) in [
            ("abacb", vec!["ab", "a", "cb"]),
            ("abacbb", vec!["ab", "acbb"]),
            ("abab", vec!["abab"]),
            ("aaa", vec!["a", "a", "a"]),
            ("bbb", vec!["bb", "b"]),
            ("", vec![]),
        ] {
            let (small, heap) = bpe.merge_both(text.as_bytes());
            assert_eq!(ids_to_text(&bpe, &small), want, "{text:?}");
            assert_eq!(small, heap, "{text:?}");
        }
    }

    /// `abc` is a token, but BPE of its bytes merges `ab` first and never reaches it.
    #[test]
    fn a_token_its_own_bytes_do_not_reach_is_split() {
        let bpe = toy();
        for _ in 0..2 {
            let mut out = Vec::new();
            bpe.encode_piece(b"abc", &mut out);
            assert_eq!(ids_to_text(&bpe, &out), ["ab", "c"]);
            let mut out = Vec::new();
            bpe.encode_piece(b"abab", &mut out);
            assert_eq!(ids_to_text(&bpe, &out), ["abab"]);
        }
    }

    #[test]
    fn scan_and_heap_agree() {
        let bpe = toy();
        let mut x = 0x1234_5678_u64;
        for len in 0..=SMALL {
            for _ in 0..64 {
                let piece: Vec<u8> = (0..len).map(|_| b"abc"[(xorshift(&mut x) % 3) as usize]).collect();
                let (small, heap) = bpe.merge_both(&piece);
                assert_eq!(small, heap, "{:?}", String::from_utf8_lossy(&piece));
            }
        }
    }
}
