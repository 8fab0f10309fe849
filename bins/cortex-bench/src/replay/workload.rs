//! The request streams a replay sends: the Mooncake conversation trace and three synthetic
//! generators (shared system prompts, multi-turn chats, one hot shared prefix).
//!
//! Key decision: every workload is written in the trace's own terms — a timestamp, a list of
//! block ids (each becoming one text chunk, see [`super::text`]) and an output length — so one
//! expansion, one infinite-cache bound and one driver serve them all, and the synthetic
//! generators are deterministic functions of a seed (no wall clock, no global RNG).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::text::{Piece, trace_pieces};

/// The trace file shipped in the repository, relative to the workspace root.
pub const MOONCAKE_PATH: &str = "bins/cortex-bench/traces/mooncake_conversation_trace.jsonl";
/// Its sha256, as written in `bins/cortex-bench/traces/README.md`.
pub const MOONCAKE_SHA256: &str = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df";
/// Tokens per `hash_ids` block in the Mooncake trace.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Arrival, in trace time since the first request.
    pub at: Duration,
    /// The prompt, chunk by chunk.
    pub pieces: Vec<Piece>,
    /// Output tokens asked for (`max_tokens`).
    pub max_tokens: u32,
}

/// The workloads `--workload` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Kind {
    /// The Mooncake conversation trace (FAST '25), at its own timestamps.
    Mooncake,
    /// N groups × M prompts sharing their group's system prompt (SGLang's
    /// generated-shared-prefix benchmark), Poisson arrivals.
    SharedPrefix,
    /// Multi-turn chats: every turn resends the whole history plus a new user message.
    MultiTurn,
    /// Every request shares one long prefix (a single hot spot for a cache-affine router).
    HotSpot,
}

impl Kind {
    /// The name used in reports and file names.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Mooncake => "mooncake",
            Kind::SharedPrefix => "shared-prefix",
            Kind::MultiTurn => "multi-turn",
            Kind::HotSpot => "hot-spot",
        }
    }
}

/// Shape of the workloads (flags of `cargo xtask replay`).
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Requests to take (`None`: the workload's default; the whole trace with `--all`).
    pub requests: Option<usize>,
    /// The whole Mooncake trace.
    pub all: bool,
    /// Cap on every request's output tokens.
    pub max_output: u32,
    /// Tokens of one chunk (one trace block).
    pub chunk_tokens: u32,
    /// Arrival rate of the synthetic workloads, requests per second of trace time.
    pub rate: Option<f64>,
    /// shared-prefix: groups.
    pub groups: usize,
    /// Chunks of the shared prefix: shared-prefix's system prompt per group (default 4),
    /// hot-spot's hot prefix (16), multi-turn's system prompt (2).
    pub prefix_chunks: Option<usize>,
    /// multi-turn: turns per conversation.
    pub turns: usize,
    /// Seed of the synthetic generators.
    pub seed: u64,
}

/// A workload, ready to send.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Which one.
    pub kind: Kind,
    /// What was generated, in a sentence (printed in the report).
    pub description: String,
    /// Requests, sorted by arrival.
    pub requests: Vec<Request>,
}

/// Builds `kind` from `shape`, reading the trace from the workspace at `root` if needed.
///
/// # Errors
/// The trace cannot be read, has the wrong checksum, or does not parse.
pub fn build(kind: Kind, shape: &Shape, root: &Path) -> Result<Workload> {
    let w = match kind {
        Kind::Mooncake => mooncake(shape, &root.join(MOONCAKE_PATH))?,
        Kind::SharedPrefix => shared_prefix(shape),
        Kind::MultiTurn => multi_turn(shape),
        Kind::HotSpot => hot_spot(shape),
    };
    if w.requests.is_empty() {
        bail!("workload {} has no requests", kind.name());
    }
    Ok(w)
}

/// One line of the Mooncake trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceLine {
    /// Milliseconds since the start.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Output tokens.
    pub output_length: u64,
    /// One chained id per 512-token block.
    pub hash_ids: Vec<u64>,
}

/// Reads the Mooncake trace, checking its sha256.
///
/// # Errors
/// The file is missing, altered, or a line does not parse.
pub fn read_trace(path: &Path) -> Result<Vec<TraceLine>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading the trace {}", path.display()))?;
    let digest = hex::encode(Sha256::digest(&bytes));
    if digest != MOONCAKE_SHA256 {
        bail!(
            "{}: sha256 {digest}, expected {MOONCAKE_SHA256} (see bins/cortex-bench/traces/README.md)",
            path.display()
        );
    }
    let text = std::str::from_utf8(&bytes).context("the trace is not UTF-8")?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).with_context(|| format!("trace line {}", i + 1))?;
        let num = |k: &str| v[k].as_u64().with_context(|| format!("trace line {}: `{k}`", i + 1));
        let ids = v["hash_ids"].as_array().with_context(|| format!("trace line {}: `hash_ids`", i + 1))?;
        out.push(TraceLine {
            timestamp_ms: num("timestamp")?,
            input_length: num("input_length")?,
            output_length: num("output_length")?,
            hash_ids: ids.iter().filter_map(Value::as_u64).collect(),
        });
    }
    Ok(out)
}

fn mooncake(shape: &Shape, path: &Path) -> Result<Workload> {
    let lines = read_trace(path)?;
    let n = if shape.all { lines.len() } else { shape.requests.unwrap_or(2000).min(lines.len()) };
    let t0 = lines.first().map_or(0, |l| l.timestamp_ms);
    let requests = lines[..n]
        .iter()
        .map(|l| Request {
            at: Duration::from_millis(l.timestamp_ms - t0),
            pieces: trace_pieces(&l.hash_ids, l.input_length, MOONCAKE_BLOCK_TOKENS, shape.chunk_tokens),
            max_tokens: u32::try_from(l.output_length).unwrap_or(u32::MAX).clamp(1, shape.max_output.max(1)),
        })
        .collect();
    Ok(Workload {
        kind: Kind::Mooncake,
        description: format!(
            "Mooncake conversation trace (FAST '25), the first {n} of {} requests, each 512-token block id as one {}-token text chunk",
            lines.len(),
            shape.chunk_tokens
        ),
        requests,
    })
}

/// A deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponential with mean `mean`.
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Poisson arrival times for `n` requests at `rate` per second.
fn poisson(rng: &mut Rng, n: usize, rate: f64) -> Vec<Duration> {
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += rng.exp(1.0 / rate);
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// Ids of synthetic chunks: disjoint from each other by construction (a running counter).
struct Ids(u64);

impl Ids {
    fn take(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }
}

fn full(id: u64, shape: &Shape) -> Piece {
    Piece { id, tokens: shape.chunk_tokens }
}

fn shared_prefix(shape: &Shape) -> Workload {
    let mut rng = Rng(shape.seed ^ 0x5348_4152);
    let mut ids = Ids(1 << 40);
    let groups = shape.groups.max(1);
    let n = shape.requests.unwrap_or(groups * 32);
    let rate = shape.rate.unwrap_or(4.0);
    let prefix_chunks = shape.prefix_chunks.unwrap_or(4).max(1);
    let system: Vec<Vec<Piece>> =
        (0..groups).map(|_| (0..prefix_chunks).map(|_| full(ids.take(), shape)).collect()).collect();
    let times = poisson(&mut rng, n, rate);
    let requests = times
        .into_iter()
        .map(|at| {
            let g = rng.below(groups);
            let mut pieces = system[g].clone();
            // A question of a quarter chunk (128 tokens of the original scale).
            pieces.push(Piece { id: ids.take(), tokens: (shape.chunk_tokens / 4).max(2) });
            Request { at, pieces, max_tokens: shape.max_output.clamp(1, 256) }
        })
        .collect();
    Workload {
        kind: Kind::SharedPrefix,
        description: format!(
            "{n} requests over {groups} groups (uniform), each a {prefix_chunks}-chunk group system prompt and a quarter-chunk question, Poisson {rate} req/s"
        ),
        requests,
    }
}

fn multi_turn(shape: &Shape) -> Workload {
    let mut rng = Rng(shape.seed ^ 0x4d54_5552);
    let mut ids = Ids(2 << 40);
    let turns = shape.turns.max(1);
    let n = shape.requests.unwrap_or(64 * turns);
    let conversations = n.div_ceil(turns);
    let rate = shape.rate.unwrap_or(2.0);
    let system: Vec<Piece> =
        (0..shape.prefix_chunks.unwrap_or(2).max(1)).map(|_| full(ids.take(), shape)).collect();
    let starts = poisson(&mut rng, conversations, rate / turns as f64);
    let mut requests = Vec::with_capacity(n);
    for start in starts {
        let mut history = system.clone();
        let mut at = start;
        for _ in 0..turns {
            if requests.len() == n {
                break;
            }
            // A new user message of one chunk; the previous answer (one chunk) is already in
            // the history.
            history.push(full(ids.take(), shape));
            requests.push(Request {
                at,
                pieces: history.clone(),
                max_tokens: shape.max_output.clamp(1, 128),
            });
            history.push(full(ids.take(), shape));
            at += Duration::from_secs_f64(5.0 + rng.exp(25.0));
        }
    }
    requests.sort_by_key(|r| r.at);
    Workload {
        kind: Kind::MultiTurn,
        description: format!(
            "{n} requests: {conversations} conversations of up to {turns} turns (one-chunk user message and answer per turn, think time 5 s + Exp(25 s)), conversations start Poisson at {} conv/s",
            rate / turns as f64
        ),
        requests,
    }
}

fn hot_spot(shape: &Shape) -> Workload {
    let mut rng = Rng(shape.seed ^ 0x484f_5453);
    let mut ids = Ids(3 << 40);
    let n = shape.requests.unwrap_or(800);
    let rate = shape.rate.unwrap_or(HOT_SPOT_RATE);
    let prefix: Vec<Piece> =
        (0..shape.prefix_chunks.unwrap_or(16).max(1)).map(|_| full(ids.take(), shape)).collect();
    let requests = poisson(&mut rng, n, rate)
        .into_iter()
        .map(|at| {
            let mut pieces = prefix.clone();
            pieces.extend((0..HOT_SPOT_SUFFIX).map(|_| full(ids.take(), shape)));
            Request { at, pieces, max_tokens: shape.max_output.clamp(1, 64) }
        })
        .collect();
    Workload {
        kind: Kind::HotSpot,
        description: format!(
            "{n} requests sharing one {}-chunk prefix, each with a {HOT_SPOT_SUFFIX}-chunk unique suffix and 64 output tokens, Poisson {rate} req/s",
            prefix.len()
        ),
        requests,
    }
}

/// Unique chunks after the hot prefix: enough prefill per request that piling onto the prefix's
/// holder costs queueing, at a rate the replay machine sends without falling behind.
const HOT_SPOT_SUFFIX: usize = 4;
/// Default arrivals per second of the hot-spot workload: the suffixes alone need about 1.7
/// workers' worth of prefill (8 × 210 ms per second with the default cost model), so no single
/// holder of the prefix can take the traffic, while eight workers run at about a fifth of theirs.
const HOT_SPOT_RATE: f64 = 8.0;

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            requests: Some(40),
            all: false,
            max_output: 256,
            chunk_tokens: 64,
            rate: None,
            groups: 4,
            prefix_chunks: Some(4),
            turns: 4,
            seed: 1,
        }
    }

    #[test]
    fn synthetic_workloads_are_deterministic_and_sorted() {
        for kind in [Kind::SharedPrefix, Kind::MultiTurn, Kind::HotSpot] {
            let a = build(kind, &shape(), Path::new("/nonexistent")).unwrap();
            let b = build(kind, &shape(), Path::new("/nonexistent")).unwrap();
            assert_eq!(a.requests, b.requests, "{kind:?}");
            assert_eq!(a.requests.len(), 40, "{kind:?}");
            assert!(a.requests.windows(2).all(|w| w[0].at <= w[1].at), "{kind:?}");
        }
    }

    #[test]
    fn multi_turn_resends_the_history() {
        let w = build(Kind::MultiTurn, &shape(), Path::new("/nonexistent")).unwrap();
        // Some request's prompt extends an earlier request's prompt by two chunks.
        let extends = w.requests.iter().any(|r| {
            w.requests.iter().any(|e| e.pieces.len() + 2 == r.pieces.len() && r.pieces.starts_with(&e.pieces))
        });
        assert!(extends);
    }

    #[test]
    fn the_shipped_trace_parses() {
        let root = crate::workspace_root();
        let lines = read_trace(&root.join(MOONCAKE_PATH)).unwrap();
        assert_eq!(lines.len(), 12_031);
        let w = build(Kind::Mooncake, &shape(), &root).unwrap();
        assert_eq!(w.requests.len(), 40);
        assert_eq!(w.requests[0].pieces[0].id, 0);
    }
}
