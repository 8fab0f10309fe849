//! Typed decode and encode errors, one pair for both engines. Every byte offset points into the
//! payload, so a counted decode error in the ingest logs says where a frame went wrong.
//!
//! Key decision: a decode error rejects the whole batch. A batch is the unit of the sequence
//! number; the ingest runtime treats a batch it could not decode like a gap (its removals may be
//! lost), so half-applying one is never useful. The variants are what can go wrong in either
//! engine's format; one an engine cannot produce (SGLang publishes no `bin` hashes) simply never
//! occurs for it.

/// The MessagePack type found where another was expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueKind {
    /// `nil`.
    Nil,
    /// `true` / `false`.
    Bool,
    /// Any integer form.
    Int,
    /// `float32` / `float64`.
    Float,
    /// A string.
    Str,
    /// A `bin`.
    Bin,
    /// An array.
    Array,
    /// A map.
    Map,
    /// An extension type.
    Ext,
    /// The reserved marker `0xc1`.
    Reserved,
}

/// Why a payload is not a KV-event batch.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The payload ends inside a value.
    #[error("payload truncated at byte {offset}")]
    Truncated {
        /// Payload length (where more bytes were needed).
        offset: usize,
    },
    /// A value of the wrong type.
    #[error("byte {offset}: expected {expected}, found {found:?}")]
    UnexpectedType {
        /// Start of the value.
        offset: usize,
        /// What the format requires there.
        expected: &'static str,
        /// What the payload holds.
        found: ValueKind,
    },
    /// A string that is not UTF-8.
    #[error("byte {offset}: string is not UTF-8")]
    InvalidUtf8 {
        /// Start of the string value.
        offset: usize,
    },
    /// An integer outside the range of its field.
    #[error("byte {offset}: integer out of range for `{field}`")]
    OutOfRange {
        /// Start of the integer.
        offset: usize,
        /// The field.
        field: &'static str,
    },
    /// An event whose tag is none of `BlockStored`, `BlockRemoved`, `AllBlocksCleared`. Its
    /// effect on the cache is unknown, so the batch is rejected rather than half applied.
    #[error("byte {offset}: unknown event type")]
    UnknownEventType {
        /// Start of the tag string.
        offset: usize,
    },
    /// A field without which the event means nothing.
    #[error("byte {offset}: {event} without `{field}`")]
    MissingField {
        /// Start of the event.
        offset: usize,
        /// The event type.
        event: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// A `bin` block hash that is neither a 32-byte (SHA-256) nor a 16-byte (xxh3-128) digest
    /// (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; SGLang publishes integers only).
    #[error("byte {offset}: block hash of {len} bytes")]
    HashLength {
        /// Start of the `bin`.
        offset: usize,
        /// Its length.
        len: usize,
    },
    /// The batch array has fewer than its two required elements, `ts` and `events` (the rank,
    /// third, may be missing).
    #[error("batch array of {len} elements")]
    BatchShape {
        /// Number of elements.
        len: usize,
    },
    /// Bytes after the batch.
    #[error("trailing bytes from byte {offset}")]
    TrailingBytes {
        /// First byte after the batch.
        offset: usize,
    },
}

/// Why a wire batch cannot be written in the requested format (a vLLM release, an SGLang
/// encoding).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The batch sets a field the format does not have (the engine releases writing it could not
    /// have published it).
    #[error("`{field}` does not exist in this format")]
    FieldNotInFormat {
        /// The field.
        field: &'static str,
    },
    /// A collection longer than MessagePack can express.
    #[error("`{field}` is too long for MessagePack")]
    TooLong {
        /// The field.
        field: &'static str,
    },
}
