//! The soak's requests: request `i` is a pure function of `i`, so a run is reproducible and a
//! failure can be replayed by its index.
//!
//! Key decision: prefix churn by a rotating population. `prefixes` slots each hold one shared
//! prefix; every `churn_every` requests the oldest slot gets a new prefix never seen before. A
//! request takes a pseudo-random slot's prefix and a suffix of its own, so shared blocks are
//! stored, hit, and (once their slot is retired) evicted all the time, and every request stores
//! blocks nobody else uses. The four request shapes (chat or completions, streaming or not) and
//! the two models (one per engine) rotate with `i`.

/// Words the texts are made of (common English words: one or two tokens each).
const WORDS: &[&str] = &[
    "cache", "block", "token", "worker", "prefix", "model", "query", "answer", "river", "stone", "light",
    "paper", "garden", "window", "silver", "market", "winter", "engine", "signal", "bridge", "forest",
    "number", "letter", "planet", "orange", "yellow", "morning", "evening", "station", "harbor", "mountain",
    "village", "teacher", "student", "kitchen", "library", "battery", "circle", "square", "history",
    "science", "weather", "holiday", "picture", "journey", "machine", "pattern", "theory",
];

/// The route and shape of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// `/v1/chat/completions`, `stream: false`.
    Chat,
    /// `/v1/chat/completions`, `stream: true`.
    ChatStream,
    /// `/v1/completions`, `stream: false`.
    Completion,
    /// `/v1/completions`, `stream: true`.
    CompletionStream,
}

impl Shape {
    /// Every shape, in the order requests rotate through them.
    pub const ALL: [Shape; 4] = [Shape::Chat, Shape::ChatStream, Shape::Completion, Shape::CompletionStream];

    /// Whether the response is a stream of server-sent events.
    #[must_use]
    pub const fn streams(self) -> bool {
        matches!(self, Shape::ChatStream | Shape::CompletionStream)
    }

    /// The route.
    #[must_use]
    pub const fn path(self) -> &'static str {
        match self {
            Shape::Chat | Shape::ChatStream => "/v1/chat/completions",
            Shape::Completion | Shape::CompletionStream => "/v1/completions",
        }
    }
}

/// The shared-prefix population and its churn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Prefixes alive at once.
    pub prefixes: u64,
    /// Requests between two retirements of a prefix.
    pub churn_every: u64,
    /// Words of a prefix.
    pub prefix_words: usize,
    /// Words of a request's own suffix.
    pub suffix_words: usize,
}

/// One request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Req {
    /// Route and streaming.
    pub shape: Shape,
    /// Which model (index into the soak's models: one per engine).
    pub model: usize,
    /// The shared prefix it uses (a prefix id is never reused once retired).
    pub prefix: u64,
    /// The prompt (completions) or the user message (chat).
    pub text: String,
}

/// splitmix64: a well-mixed 64-bit value from a counter.
#[must_use]
const fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn words(out: &mut String, seed: u64, n: usize) {
    let mut s = seed;
    for _ in 0..n {
        s = mix(s);
        out.push(' ');
        out.push_str(WORDS[(s % WORDS.len() as u64) as usize]);
    }
}

impl Workload {
    /// The prefix id slot `slot` holds at request `i`: slot `s` is replaced by the retirements
    /// `k = 1, 2, …` (one every `churn_every` requests) with `(k - 1) % prefixes == s`, and each
    /// replacement takes the id `s + prefixes × generation`.
    #[must_use]
    pub fn prefix_at(&self, slot: u64, i: u64) -> u64 {
        let r = i / self.churn_every.max(1);
        let p = self.prefixes.max(1);
        let generation = r / p + u64::from(slot < r % p);
        slot + p * generation
    }

    /// Request `i`.
    #[must_use]
    pub fn request(&self, i: u64) -> Req {
        let shape = Shape::ALL[(i % 4) as usize];
        let model = ((i / 4) % 2) as usize;
        let slot = mix(i ^ 0x5EED) % self.prefixes.max(1);
        let prefix = self.prefix_at(slot, i);
        let mut text = format!("Context {prefix}:");
        words(&mut text, mix(prefix), self.prefix_words);
        text.push_str(&format!(". Question {i}:"));
        words(&mut text, mix(i.wrapping_add(1 << 40)), self.suffix_words);
        text.push('?');
        Req { shape, model, prefix, text }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Workload = Workload { prefixes: 4, churn_every: 10, prefix_words: 8, suffix_words: 3 };

    #[test]
    fn the_population_turns_over_one_slot_per_churn_period() {
        // Before the first retirement every slot holds its first prefix.
        assert_eq!((0..4).map(|s| W.prefix_at(s, 9)).collect::<Vec<_>>(), [0, 1, 2, 3]);
        // Retirement 1 (request 10) replaces slot 0, retirement 2 slot 1, … and wraps around.
        assert_eq!((0..4).map(|s| W.prefix_at(s, 10)).collect::<Vec<_>>(), [4, 1, 2, 3]);
        assert_eq!((0..4).map(|s| W.prefix_at(s, 29)).collect::<Vec<_>>(), [4, 5, 2, 3]);
        assert_eq!((0..4).map(|s| W.prefix_at(s, 40)).collect::<Vec<_>>(), [4, 5, 6, 7]);
        assert_eq!((0..4).map(|s| W.prefix_at(s, 50)).collect::<Vec<_>>(), [8, 5, 6, 7]);
    }

    #[test]
    fn requests_share_prefixes_never_suffixes_and_rotate_shapes_and_models() {
        let reqs: Vec<Req> = (0..400).map(|i| W.request(i)).collect();
        // Deterministic.
        assert_eq!(W.request(123), reqs[123]);
        // Same prefix id, same prefix text; the suffix is the request's own.
        let (a, b) = {
            let mut same = reqs.iter().filter(|r| r.prefix == reqs[0].prefix);
            (same.next().map(|r| r.text.clone()), same.nth(1).map(|r| r.text.clone()))
        };
        let (a, b) = (a.unwrap_or_default(), b.unwrap_or_default());
        let head = |t: &str| t.split(". Question").next().unwrap_or_default().to_owned();
        assert_eq!(head(&a), head(&b));
        assert_ne!(a, b);
        let mut texts: Vec<&str> = reqs.iter().map(|r| r.text.as_str()).collect();
        texts.sort_unstable();
        texts.dedup();
        assert_eq!(texts.len(), reqs.len());
        // Churn: 40 retirements in 400 requests, so 44 prefix ids in all; every slot is used.
        let mut ids: Vec<u64> = reqs.iter().map(|r| r.prefix).collect();
        ids.sort_unstable();
        ids.dedup();
        assert!(ids.len() > 30 && ids.len() <= 44, "{}", ids.len());
        // Shapes and models rotate evenly.
        for s in Shape::ALL {
            assert_eq!(reqs.iter().filter(|r| r.shape == s).count(), 100);
        }
        assert_eq!(reqs.iter().filter(|r| r.model == 1).count(), 200);
        assert!(
            Shape::ALL
                .iter()
                .all(|s| [0, 1].iter().all(|m| reqs.iter().any(|r| r.shape == *s && r.model == *m)))
        );
    }
}
