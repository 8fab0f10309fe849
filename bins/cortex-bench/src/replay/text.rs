//! Block ids to text: every block id of a request becomes the same chunk of words wherever it
//! appears, so requests that share their first k ids share their first k chunks of text — and
//! therefore their first tokens — exactly.
//!
//! Key decisions:
//! - A chunk is `words` words drawn from a fixed vocabulary of 256 English words, each written
//!   with a leading space (` word`, one Qwen3 token), followed by a newline. The choice of words
//!   is a pure function of the id (splitmix64), so the same id gives the same words in every run
//!   and on every machine.
//! - Tokenization of a chunk does not depend on its neighbours: Qwen's pre-tokenizer splits
//!   before every ` word` and at every newline, and byte-pair merges never cross those splits,
//!   so the tokens of a prompt are the concatenation of its chunks' tokens (a test checks this
//!   with the real tokenizer). A full chunk is therefore exactly `chunk_tokens` tokens: with
//!   the default 64 and the engines' 16-token pages, one 512-token block of the trace becomes
//!   four pages.
//! - A partial block (the last of a request, `input_length` not a multiple of 512) becomes the
//!   first words of its id's chunk, in proportion, and still ends with a newline (never an
//!   empty chunk: two newlines in a row would merge into one token).

/// The fixed vocabulary. Every entry, with a leading space, is a single Qwen3 token (tested).
pub const VOCABULARY: [&str; 256] = [
    "this",
    "that",
    "with",
    "return",
    "from",
    "class",
    "public",
    "have",
    "self",
    "will",
    "your",
    "function",
    "else",
    "more",
    "they",
    "data",
    "name",
    "true",
    "their",
    "private",
    "time",
    "which",
    "false",
    "value",
    "about",
    "string",
    "over",
    "type",
    "part",
    "work",
    "when",
    "other",
    "been",
    "were",
    "file",
    "would",
    "year",
    "some",
    "there",
    "said",
    "like",
    "also",
    "than",
    "just",
    "result",
    "them",
    "into",
    "what",
    "list",
    "case",
    "first",
    "only",
    "back",
    "need",
    "start",
    "user",
    "under",
    "then",
    "people",
    "should",
    "test",
    "make",
    "after",
    "right",
    "long",
    "read",
    "form",
    "want",
    "number",
    "size",
    "where",
    "while",
    "look",
    "could",
    "know",
    "hand",
    "most",
    "break",
    "every",
    "point",
    "error",
    "text",
    "show",
    "find",
    "current",
    "used",
    "play",
    "help",
    "these",
    "pass",
    "down",
    "even",
    "item",
    "through",
    "last",
    "event",
    "again",
    "high",
    "line",
    "does",
    "before",
    "because",
    "state",
    "here",
    "final",
    "very",
    "model",
    "call",
    "well",
    "object",
    "years",
    "default",
    "view",
    "many",
    "being",
    "good",
    "using",
    "request",
    "child",
    "person",
    "style",
    "method",
    "expect",
    "found",
    "post",
    "such",
    "think",
    "much",
    "count",
    "check",
    "open",
    "next",
    "follow",
    "game",
    "path",
    "each",
    "support",
    "sign",
    "those",
    "system",
    "best",
    "same",
    "create",
    "made",
    "mark",
    "group",
    "world",
    "process",
    "main",
    "color",
    "report",
    "take",
    "free",
    "action",
    "index",
    "real",
    "build",
    "message",
    "input",
    "between",
    "table",
    "head",
    "must",
    "order",
    "product",
    "double",
    "place",
    "program",
    "response",
    "code",
    "without",
    "still",
    "field",
    "team",
    "second",
    "going",
    "range",
    "fact",
    "home",
    "left",
    "direct",
    "allow",
    "page",
    "different",
    "around",
    "really",
    "image",
    "target",
    "both",
    "level",
    "document",
    "local",
    "content",
    "develop",
    "great",
    "month",
    "title",
    "context",
    "life",
    "change",
    "position",
    "book",
    "version",
    "three",
    "base",
    "during",
    "against",
    "power",
    "width",
    "label",
    "project",
    "element",
    "success",
    "date",
    "match",
    "node",
    "another",
    "care",
    "effect",
    "service",
    "since",
    "full",
    "turn",
    "body",
    "something",
    "stand",
    "available",
    "block",
    "keep",
    "things",
    "control",
    "come",
    "custom",
    "source",
    "output",
    "email",
    "business",
    "required",
    "might",
    "never",
    "hard",
    "called",
    "options",
    "height",
    "small",
    "access",
    "address",
    "little",
    "port",
    "status",
    "update",
    "link",
    "given",
    "better",
    "feel",
    "already",
];

/// One chunk of a request: a block id and how many tokens of its chunk the request uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Piece {
    /// The block id (the trace's `hash_ids` entry, or a synthetic workload's).
    pub id: u64,
    /// Tokens of the chunk used, in `2..=chunk_tokens` (a full chunk when equal).
    pub tokens: u32,
}

/// splitmix64: the word stream of an id.
fn splitmix(mut x: u64) -> impl Iterator<Item = u64> {
    std::iter::repeat_with(move || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// The words of block `id`'s chunk, first `n` of them.
pub fn words(id: u64, n: usize) -> impl Iterator<Item = &'static str> {
    // Eight words per 64-bit draw; the id is mixed with a constant so id 0 is not special.
    splitmix(id ^ 0x6a09_e667_f3bc_c908)
        .flat_map(|r| (0..8).map(move |k| VOCABULARY[((r >> (8 * k)) & 0xff) as usize]))
        .take(n)
}

/// Appends the text of `piece` to `out`: `piece.tokens − 1` words and a newline.
pub fn push_piece(out: &mut String, piece: Piece) {
    for w in words(piece.id, piece.tokens.saturating_sub(1).max(1) as usize) {
        out.push(' ');
        out.push_str(w);
    }
    out.push('\n');
}

/// The text of a prompt made of `pieces`.
#[must_use]
pub fn prompt(pieces: &[Piece]) -> String {
    let mut s = String::with_capacity(pieces.len() * 64 * 7);
    for p in pieces {
        push_piece(&mut s, *p);
    }
    s
}

/// The pieces of a trace request: one full chunk per id but the last, which gets the share of
/// `chunk_tokens` that the partial block's tokens are of `block_tokens` (at least 2 tokens).
#[must_use]
pub fn trace_pieces(hash_ids: &[u64], input_length: u64, block_tokens: u64, chunk_tokens: u32) -> Vec<Piece> {
    let n = hash_ids.len() as u64;
    let mut out = Vec::with_capacity(hash_ids.len());
    for (i, &id) in hash_ids.iter().enumerate() {
        let last = i as u64 + 1 == n;
        let block = if last {
            input_length.saturating_sub(block_tokens * (n - 1)).clamp(1, block_tokens)
        } else {
            block_tokens
        };
        let tokens = if block == block_tokens {
            chunk_tokens
        } else {
            let share = (block * u64::from(chunk_tokens) + block_tokens / 2) / block_tokens;
            u32::try_from(share).unwrap_or(chunk_tokens).clamp(2, chunk_tokens)
        };
        out.push(Piece { id, tokens });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_id_gives_the_same_words_and_ids_differ() {
        let a: Vec<_> = words(7, 63).collect();
        let b: Vec<_> = words(7, 63).collect();
        let c: Vec<_> = words(8, 63).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let prefix: Vec<_> = words(7, 10).collect();
        assert_eq!(prefix, a[..10]);
    }

    #[test]
    fn trace_blocks_map_to_chunks() {
        let p = trace_pieces(&[0, 1, 2], 512 * 2 + 256, 512, 64);
        assert_eq!(
            p,
            vec![Piece { id: 0, tokens: 64 }, Piece { id: 1, tokens: 64 }, Piece { id: 2, tokens: 32 }]
        );
        let p = trace_pieces(&[5], 3, 512, 64);
        assert_eq!(p, vec![Piece { id: 5, tokens: 2 }]);
        let p = trace_pieces(&[5, 6], 1024, 512, 64);
        assert_eq!(p[1].tokens, 64);
    }

    #[test]
    fn vocabulary_has_no_duplicates() {
        let mut v = VOCABULARY.to_vec();
        v.sort_unstable();
        v.dedup();
        assert_eq!(v.len(), VOCABULARY.len());
    }
}
