//! The gateway's CPU work for an 8k-token multi-turn chat request, through the proxy's public
//! types (`ModelTable`, `ModelRoute::tokens`, `ModelRoute::seq_hashes`, the ledger and the
//! scheduler), each against a baseline measured in the same run.
//!
//! `cargo bench -p cortex-proxy --bench chat8k`
//!
//! The conversation: a 700-word system prompt, then turns of a 40-word question and a 120-word
//! answer (English and markdown from the READMEs in `golden/`) until the prompt holds 8,192
//! tokens or more; its last turn (an answer and a question, about 400 tokens) is the new one.
//!
//! - **Tokenization** (`chat8k_tokenize`), Qwen3's tokenizer and chat template from `golden/`:
//!   - `tokenizers_crate` — the baseline: `TextTokenizer::encode_reference` (the `tokenizers`
//!     crate alone) on the already rendered prompt;
//!   - `fast_encoder` — `TextTokenizer::encode` (Cortex's fast encoder, which Qwen3 uses) on the
//!     same rendered prompt;
//!   - `cold` — `ModelRoute::tokens` (template rendering, segment split, tokenization, segment
//!     cache inserts) and `ModelRoute::seq_hashes` (the block hashes) for a conversation never
//!     seen before (every message carries a fresh tag);
//!   - `prefix_seen` — the next turn of a conversation whose history an earlier request
//!     tokenized: the history's segments are in the cache, the assistant's answer and the new
//!     question are not;
//!   - `render_only` — rendering the chat template for that request, which `prefix_seen`
//!     includes.
//! - **Routing without tokenization** (`chat8k_route`), on a ledger of 8 ready holders: one holds
//!   the whole conversation, three its system prompt, all of them 20,000 unrelated blocks each;
//!   8 workers with 0–4 requests in flight, the default `cache_aware` scheduler:
//!   `seq_hashes` (page and chain-hash the tokens), `ledger_query`, `decide`, and `total` (the
//!   three in a row, as the gateway's `plan` runs them).
//!
//! - **The small request** of the gateway overhead benchmark (`small_completion`): parsing its
//!   body and tokenizing its 40-token prompt, through the gateway's segment cache (`tokens`, as
//!   the overhead benchmark's repeated prompt is) and with the tokenizer alone
//!   (`tokens_uncached`, a prompt never seen).
//!
//! After criterion, a percentile pass times 20,000 single calls of `total`, 1,000 of
//! `prefix_seen`, 300 each of `cold` and `tokenizers_crate` (alternating, so both see the
//! same machine), and the first encode of the rendered prompt by each of 3 freshly loaded
//! tokenizers, with `Instant::now`, and prints one machine-readable line starting with
//! `cortex-bench-json:` (read by `cargo xtask bench`). Nothing is asserted about time.

#![allow(missing_docs, clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)] // a benchmark's setup may panic

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cortex_hash::kv::{
    BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::profile::{ExtraKeyPolicy, FileDigest, HashRecipe, ModelProfile};
use cortex_hash::sglang::EventFormat;
use cortex_hash::text::{ChatTemplate, SpecialTokens, TextError, TextTokenizer, TokenizerConfig};
use cortex_hash::{Engine, SeqHash, Token};
use cortex_proxy::config::ModelSpec;
use cortex_proxy::request::{self, Prompt, Route};
use cortex_proxy::{ModelRoute, ModelTable};
use cortex_radix::{
    HolderConfig, HolderWriter, Ledger, LedgerConfig, OverlapScores, QueryOptions, Readiness,
};
use cortex_sched::{
    CacheView, Cluster, Health, HealthPolicy, LedgerState, Ranking, Request as SchedRequest, Role,
    SchedConfig, Scheduler, Timestamp, WorkerSpec,
};
use criterion::{BatchSize, BenchmarkId, Criterion};
use serde_json::{Value, json};

const MODEL: &str = "qwen3";
const TARGET_TOKENS: usize = 8192;
const WORKERS: u32 = 8;
const BACKGROUND_BLOCKS: usize = 20_000;
const PERCENTILE_CALLS: usize = 20_000;
/// Calls each of the cold request and its baseline in the percentile pass.
const COLD_CALLS: usize = 300;
/// The small request of `cargo xtask bench`'s gateway overhead benchmark (keep them equal).
const SMALL_COMPLETION: &str = r#"{"model":"qwen3","prompt":"You are a helpful assistant. Answer in one short sentence, without lists or code: what does a key-value cache store for a transformer model while it generates text?","max_tokens":4,"temperature":0}"#;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden")
}

/// The model as the gateway configures it (SGLang recipe, 16-token pages).
fn spec() -> ModelSpec {
    let dir = golden().join("models/qwen3");
    let tokenizer = TextTokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer");
    let cfg = TokenizerConfig::from_json(&std::fs::read(dir.join("tokenizer_config.json")).expect("config"))
        .expect("config");
    let template = ChatTemplate::new(&cfg.chat_template).expect("template");
    let profile = ModelProfile::builder()
        .model(MODEL)
        .recipe(HashRecipe::Sglang {
            format: EventFormat::Default,
            bigram: cortex_hash::profile::Bigram::Off,
        })
        .block_size(16)
        .tokenizer(tokenizer.digest())
        .chat_template(FileDigest::of(cfg.chat_template.as_bytes()))
        .extra_keys(ExtraKeyPolicy::default())
        .build()
        .expect("profile");
    ModelSpec {
        profile,
        tokenizer: Arc::new(tokenizer),
        template: Arc::new(template),
        bos_token: cfg.bos_token,
        eos_token: cfg.eos_token,
    }
}

/// Real English and markdown, cut into message-sized pieces.
struct Corpus {
    words: Vec<String>,
    at: usize,
}

impl Corpus {
    fn new() -> Self {
        let mut text = String::new();
        for f in ["sglang/README.md", "vllm/README.md", "README.md", "models/qwen3/README.md"] {
            if let Ok(t) = std::fs::read_to_string(golden().join(f)) {
                text.push_str(&t);
                text.push('\n');
            }
        }
        let words: Vec<String> = text.split_whitespace().map(str::to_owned).collect();
        assert!(words.len() > 500, "golden READMEs give a corpus");
        Corpus { words, at: 0 }
    }

    fn take(&mut self, n: usize) -> String {
        let mut s = String::new();
        for _ in 0..n {
            if !s.is_empty() {
                s.push(' ');
            }
            s.push_str(&self.words[self.at % self.words.len()]);
            self.at += 1;
        }
        s
    }
}

/// A conversation's messages: system prompt, then (user, assistant) turns, then a user question.
#[derive(Clone)]
struct Conversation {
    /// (role, text) without tags.
    messages: Vec<(&'static str, String)>,
}

impl Conversation {
    /// The request body for `messages`, each message prefixed with `[tag.i]` so that a fresh tag
    /// makes every segment new to the segment cache.
    fn body(messages: &[(&'static str, String)], tag: u64) -> Vec<u8> {
        let msgs: Vec<Value> = messages
            .iter()
            .enumerate()
            .map(|(i, (role, text))| json!({"role": role, "content": format!("[{tag}.{i}] {text}")}))
            .collect();
        serde_json::to_vec(&json!({"model": MODEL, "messages": msgs, "max_tokens": 16})).expect("json")
    }

    fn prompt(messages: &[(&'static str, String)], tag: u64) -> Prompt {
        request::parse(Route::ChatCompletions, &Self::body(messages, tag)).expect("parse").prompt
    }

    /// Grows a conversation until its rendered prompt (with the next turn) holds at least
    /// `TARGET_TOKENS` tokens.
    fn build(route: &ModelRoute, corpus: &mut Corpus) -> Conversation {
        let mut messages = vec![("system", corpus.take(700)), ("user", corpus.take(40))];
        loop {
            messages.push(("assistant", corpus.take(120)));
            messages.push(("user", corpus.take(40)));
            let n = route.tokens(&Self::prompt(&messages, 0)).expect("tokens").len();
            if n >= TARGET_TOKENS {
                return Conversation { messages };
            }
        }
    }

    /// The request before the last turn: history up to the previous question.
    fn earlier(&self) -> &[(&'static str, String)] {
        &self.messages[..self.messages.len() - 2]
    }
}

/// The rendered text `ModelRoute::tokens` tokenizes (same context, same special tokens).
fn render(spec: &ModelSpec, prompt: &Prompt) -> String {
    let Prompt::Chat(ctx) = prompt else { panic!("chat prompt") };
    let mut ctx = ctx.clone();
    if let Some(b) = &spec.bos_token {
        ctx.entry("bos_token").or_insert_with(|| b.clone().into());
    }
    if let Some(e) = &spec.eos_token {
        ctx.entry("eos_token").or_insert_with(|| e.clone().into());
    }
    spec.template.render(&Value::Object(ctx)).expect("render")
}

/// A populated ledger, cluster and scheduler for the routing benchmarks.
struct Routing {
    ledger: Arc<Ledger>,
    _writers: Vec<HolderWriter>,
    cluster: Cluster,
    sched: Scheduler,
}

fn store(w: &mut HolderWriter, lineage: Lineage, contents: &[cortex_hash::BlockHash], seqs: &[SeqHash]) {
    for (i, chunk) in seqs.chunks(16).enumerate() {
        let first = i * 16;
        let ev = KvEvent::Stored(BlockStored {
            parent: (first > 0).then(|| EngineHash::from_u64(seqs[first - 1].to_bits())),
            blocks: chunk
                .iter()
                .zip(&contents[first..])
                .map(|(s, c)| StoredBlock { engine: EngineHash::from_u64(s.to_bits()), content: *c })
                .collect(),
            lineage: Some(lineage),
            medium: Medium::Gpu,
        });
        w.apply(&ev).expect("apply");
    }
}

impl Routing {
    fn new(route: &ModelRoute, tokens: &[Token], system_tokens: usize) -> Routing {
        let ns = route.namespace(None).expect("namespace");
        let lineage = Lineage::new(ns, None);
        let bs = ns.block_size() as usize;
        let contents: Vec<_> = tokens.chunks_exact(bs).map(|p| ns.block_hash(p)).collect();
        let mut seqs = Vec::new();
        route.seq_hashes(tokens, None, &mut seqs).expect("seq");
        let system_blocks = system_tokens / bs;
        let ledger = Ledger::new(LedgerConfig::default());
        let mut writers = Vec::new();
        let cluster = Cluster::new(HealthPolicy::default());
        for w in 0..WORKERS {
            let holder = HolderId::new(WorkerId(w), DpRank(0));
            let cap = u32::try_from(BACKGROUND_BLOCKS + seqs.len() + 1024).expect("cap");
            let mut writer = ledger
                .add_holder(holder, HolderConfig { capacity_blocks: cap, content_deterministic: true })
                .expect("holder");
            // Unrelated chains of 64 blocks.
            for c in 0..BACKGROUND_BLOCKS / 64 {
                let bg: Vec<cortex_hash::BlockHash> = (0..64)
                    .map(|i| {
                        cortex_hash::BlockHash::from_bits(splitmix(
                            (u64::from(w) << 40) ^ ((c as u64) << 16) ^ i,
                        ))
                    })
                    .collect();
                let mut seq = lineage.root;
                let bg_seqs: Vec<SeqHash> = bg
                    .iter()
                    .map(|b| {
                        seq = cortex_hash::chain(seq, *b);
                        seq
                    })
                    .collect();
                store(&mut writer, lineage, &bg, &bg_seqs);
            }
            match w {
                0 => store(&mut writer, lineage, &contents, &seqs),
                1..=3 => store(&mut writer, lineage, &contents[..system_blocks], &seqs[..system_blocks]),
                _ => {}
            }
            writer.set_readiness(Readiness::Ready);
            writers.push(writer);
            cluster.upsert(WorkerSpec::new(WorkerId(w), route.base_model(), Engine::Sglang), Health::Healthy);
        }
        let snap = cluster.load();
        for (i, w) in snap.workers().iter().enumerate() {
            w.state().set_ledger(DpRank(0), LedgerState::Ready);
            for _ in 0..(i % 5) {
                std::mem::forget(snap.book_holder(
                    HolderId::new(w.spec().id, DpRank(0)),
                    300,
                    0,
                    Timestamp::ZERO,
                ));
            }
        }
        Routing {
            ledger,
            _writers: writers,
            cluster,
            sched: Scheduler::new(SchedConfig::default()).expect("sched"),
        }
    }

    fn decide(
        &self,
        route: &ModelRoute,
        prompt_tokens: u32,
        seq: &[SeqHash],
        overlap: &OverlapScores,
        ranking: &mut Ranking,
    ) {
        let snap = self.cluster.load();
        let req = SchedRequest {
            model: route.base_model(),
            role: Role::Regular,
            now: Timestamp::from_millis(1),
            prompt_tokens,
            cache: CacheView::Overlap { scores: overlap, block_tokens: route.block_size() },
            routing_key: None,
            prefix: seq,
            kv_blocks: 0,
        };
        self.sched.decide(&snap, &req, ranking).expect("decide");
    }

    /// Everything the gateway's `plan` does after tokenization.
    fn total(
        &self,
        route: &ModelRoute,
        tokens: &[Token],
        seq: &mut Vec<SeqHash>,
        overlap: &mut OverlapScores,
        ranking: &mut Ranking,
    ) {
        route.seq_hashes(tokens, None, seq).expect("seq");
        self.ledger.query(seq, QueryOptions::default(), overlap);
        let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
        self.decide(route, prompt_tokens, seq, overlap, ranking);
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Fixtures shared by criterion and the percentile pass.
struct Fixture {
    spec: ModelSpec,
    table: ModelTable,
    conv: Conversation,
    /// Tokens of the full request (history + the new turn).
    tokens: Vec<Token>,
    routing: Routing,
}

impl Fixture {
    fn new() -> Fixture {
        let spec = spec();
        let mut table = ModelTable::new();
        table.add_model(spec.clone(), 4 << 20);
        let route = Arc::clone(table.get(Some(MODEL)).expect("route"));
        let mut corpus = Corpus::new();
        let conv = Conversation::build(&route, &mut corpus);
        let prompt = Conversation::prompt(&conv.messages, 0);
        let tokens = route.tokens(&prompt).expect("tokens");
        // The tokens Cortex computes are exactly the tokenizers crate's on the rendered prompt.
        let plain =
            spec.tokenizer.encode_reference(&render(&spec, &prompt), SpecialTokens::Omit).expect("encode");
        assert_eq!(tokens, plain, "Cortex's tokens must be the tokenizers crate's");
        println!("chat8k encoder: {}", spec.tokenizer.encoder());
        let system = route.tokens(&Conversation::prompt(&conv.messages[..1], 0)).expect("system").len();
        let routing = Routing::new(&route, &tokens, system);
        // The earlier request of the same conversation (tag 0) leaves its segments cached.
        route.tokens(&Conversation::prompt(conv.earlier(), 0)).expect("earlier");
        println!(
            "chat8k: {} messages, {} tokens ({} blocks), new turn {} tokens; {} workers, {} background blocks each",
            conv.messages.len(),
            tokens.len(),
            tokens.len() / 16,
            tokens.len() - route.tokens(&Conversation::prompt(conv.earlier(), 0)).expect("earlier").len(),
            WORKERS,
            BACKGROUND_BLOCKS
        );
        Fixture { spec, table, conv, tokens, routing }
    }

    fn route(&self) -> &Arc<ModelRoute> {
        self.table.get(Some(MODEL)).expect("route")
    }

    /// The next turn of conversation 0: history seen, the last two messages new (tag `n`).
    fn next_turn(&self, n: u64) -> Prompt {
        let mut body: Value =
            serde_json::from_slice(&Conversation::body(&self.conv.messages, 0)).expect("json");
        let msgs = body["messages"].as_array_mut().expect("messages");
        let len = msgs.len();
        for (i, m) in msgs[len - 2..].iter_mut().enumerate() {
            let text = &self.conv.messages[len - 2 + i].1;
            m["content"] = Value::String(format!("[turn {n}] {text}"));
        }
        request::parse(Route::ChatCompletions, &serde_json::to_vec(&body).expect("json"))
            .expect("parse")
            .prompt
    }
}

fn benches(c: &mut Criterion, f: &Fixture) {
    let route = f.route();
    let mut g = c.benchmark_group("chat8k_tokenize");
    g.sample_size(20);
    let mut tag = 1_000_000u64;
    type Encode = fn(&TextTokenizer, &str, SpecialTokens) -> Result<Vec<Token>, TextError>;
    let encoders: [(&str, &str, Encode); 2] = [
        ("tokenizers_crate", "baseline", TextTokenizer::encode_reference),
        ("fast_encoder", "cortex", TextTokenizer::encode),
    ];
    for (name, who, encode) in encoders {
        g.bench_function(BenchmarkId::new(name, who), |b| {
            b.iter_batched(
                || {
                    tag += 1;
                    render(&f.spec, &Conversation::prompt(&f.conv.messages, tag))
                },
                |text| encode(&f.spec.tokenizer, black_box(&text), SpecialTokens::Omit).expect("encode"),
                BatchSize::SmallInput,
            );
        });
    }
    let mut cold_seq = Vec::with_capacity(f.tokens.len() / 16 + 1);
    g.bench_function(BenchmarkId::new("cold", "cortex"), |b| {
        b.iter_batched(
            || {
                tag += 1;
                Conversation::prompt(&f.conv.messages, tag)
            },
            |p| cold(route, black_box(&p), &mut cold_seq),
            BatchSize::SmallInput,
        );
    });
    g.bench_function(BenchmarkId::new("render_only", "template"), |b| {
        b.iter_batched(
            || {
                tag += 1;
                f.next_turn(tag)
            },
            |p| render(&f.spec, black_box(&p)),
            BatchSize::SmallInput,
        );
    });
    g.bench_function(BenchmarkId::new("prefix_seen", "cortex"), |b| {
        b.iter_batched(
            || {
                tag += 1;
                f.next_turn(tag)
            },
            |p| route.tokens(black_box(&p)).expect("tokens"),
            BatchSize::SmallInput,
        );
    });
    g.finish();

    // The small request of the gateway overhead benchmark: where its CPU goes.
    let small = SMALL_COMPLETION.as_bytes();
    let mut g = c.benchmark_group("small_completion");
    g.bench_function("parse_body", |b| {
        b.iter(|| request::parse(Route::Completions, black_box(small)).expect("parse"))
    });
    let prompt = request::parse(Route::Completions, small).expect("parse").prompt;
    // The overhead benchmark repeats one prompt, so the gateway's segment cache answers it;
    // `tokens_uncached` is what a prompt never seen before costs (the tokenizer alone).
    g.bench_function("tokens", |b| b.iter(|| route.tokens(black_box(&prompt)).expect("tokens")));
    let Prompt::Text(text) = &prompt else { panic!("the small request is a plain-text prompt") };
    g.bench_function("tokens_uncached", |b| {
        b.iter(|| f.spec.tokenizer.encode(black_box(text), SpecialTokens::Add).expect("encode"))
    });
    g.finish();

    let r = &f.routing;
    let mut seq = Vec::with_capacity(f.tokens.len() / 16 + 1);
    let mut overlap = OverlapScores::with_capacity(WORKERS as usize);
    let mut ranking = Ranking::with_capacity(WORKERS as usize);
    let mut g = c.benchmark_group("chat8k_route");
    g.bench_function("seq_hashes", |b| {
        b.iter(|| route.seq_hashes(black_box(&f.tokens), None, &mut seq).expect("seq"))
    });
    route.seq_hashes(&f.tokens, None, &mut seq).expect("seq");
    g.bench_function("ledger_query", |b| {
        b.iter(|| r.ledger.query(black_box(&seq), QueryOptions::default(), &mut overlap))
    });
    r.ledger.query(&seq, QueryOptions::default(), &mut overlap);
    assert!(overlap.len() >= 4, "the ledger holds the prompt on several holders");
    let prompt_tokens = u32::try_from(f.tokens.len()).expect("len");
    g.bench_function("decide", |b| {
        b.iter(|| r.decide(route, prompt_tokens, black_box(&seq), &overlap, &mut ranking))
    });
    assert_eq!(
        ranking.first().map(|c| c.holder.worker),
        Some(WorkerId(0)),
        "the holder of the conversation wins"
    );
    g.bench_function("total", |b| {
        b.iter(|| r.total(route, black_box(&f.tokens), &mut seq, &mut overlap, &mut ranking))
    });
    g.finish();
}

/// A never-seen chat: render, tokenize (segments into the cache) and hash its blocks.
fn cold(route: &ModelRoute, prompt: &Prompt, seq: &mut Vec<SeqHash>) -> usize {
    let tokens = route.tokens(prompt).expect("tokens");
    route.seq_hashes(&tokens, None, seq).expect("seq");
    tokens.len()
}

fn percentiles(f: &Fixture) {
    let route = f.route();
    // Cold request and baseline alternate, each with a conversation never seen before.
    let mut cold_ns = Vec::with_capacity(COLD_CALLS);
    let mut base_ns = Vec::with_capacity(COLD_CALLS);
    let mut seq = Vec::with_capacity(f.tokens.len() / 16 + 1);
    for i in 0..COLD_CALLS as u64 {
        let p = Conversation::prompt(&f.conv.messages, 7_000_000 + i);
        let t = Instant::now();
        black_box(cold(route, &p, &mut seq));
        cold_ns.push(t.elapsed().as_nanos() as u64);
        let text = render(&f.spec, &Conversation::prompt(&f.conv.messages, 8_000_000 + i));
        let t = Instant::now();
        black_box(f.spec.tokenizer.encode_reference(&text, SpecialTokens::Omit).expect("encode"));
        base_ns.push(t.elapsed().as_nanos() as u64);
    }
    let r = &f.routing;
    let mut seq = Vec::with_capacity(f.tokens.len() / 16 + 1);
    let mut overlap = OverlapScores::with_capacity(WORKERS as usize);
    let mut ranking = Ranking::with_capacity(WORKERS as usize);
    let mut route_ns = Vec::with_capacity(PERCENTILE_CALLS);
    for i in 0..PERCENTILE_CALLS + 1000 {
        let t = Instant::now();
        r.total(route, black_box(&f.tokens), &mut seq, &mut overlap, &mut ranking);
        if i >= 1000 {
            route_ns.push(t.elapsed().as_nanos() as u64);
        }
    }
    // The first encode of a tokenizer just loaded: no vocabulary token has its own-bytes BPE
    // result recorded yet (see cortex-hash's `text::bpe`).
    let mut first_ns = Vec::new();
    let text = render(&f.spec, &Conversation::prompt(&f.conv.messages, 9_000_000));
    for _ in 0..3 {
        let fresh =
            TextTokenizer::from_file(golden().join("models/qwen3/tokenizer.json")).expect("tokenizer");
        let t = Instant::now();
        black_box(fresh.encode(&text, SpecialTokens::Omit).expect("encode"));
        first_ns.push(t.elapsed().as_nanos() as u64);
    }
    let turns = PERCENTILE_CALLS / 20;
    let mut warm_ns = Vec::with_capacity(turns);
    let mut render_ns = Vec::with_capacity(turns);
    for i in 0..turns as u64 {
        let p = f.next_turn(5_000_000 + i);
        let t = Instant::now();
        black_box(render(&f.spec, &p));
        render_ns.push(t.elapsed().as_nanos() as u64);
        let t = Instant::now();
        black_box(route.tokens(&p).expect("tokens"));
        warm_ns.push(t.elapsed().as_nanos() as u64);
    }
    let pct = |v: &mut Vec<u64>| {
        v.sort_unstable();
        let p = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
        json!({"calls": v.len(), "p50_ns": p(0.5), "p90_ns": p(0.9), "p99_ns": p(0.99)})
    };
    let out = json!({
        "bench": "chat8k",
        "prompt_tokens": f.tokens.len(),
        "route_total": pct(&mut route_ns),
        "prefix_seen": pct(&mut warm_ns),
        "render_only": pct(&mut render_ns),
        "cold": pct(&mut cold_ns),
        "tokenizers_crate": pct(&mut base_ns),
        "first_encode_after_load": pct(&mut first_ns),
        "encoder": f.spec.tokenizer.encoder().to_string(),
    });
    println!("cortex-bench-json: {out}");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let f = Fixture::new();
    let mut c = Criterion::default()
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(4))
        .configure_from_args();
    benches(&mut c, &f);
    c.final_summary();
    if !args.iter().any(|a| a == "--profile-time" || a == "--test" || a == "--list") {
        percentiles(&f);
    }
}
