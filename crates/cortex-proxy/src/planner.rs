//! The planner: the gateway's only planning code. From a request's facts to a ranked, explained
//! list of holders — for the request path, the dry run (`/debug/route`) and `/tokenize` alike.
//!
//! ```text
//! facts ─► model (OpenAI `model`, SGLang `lora_path`) ─► tokenize (inline or blocking pool)
//!   │                                       └─ /tokenize stops here
//!   └─► hash (SeqHash chain) ─► ledger query ─► decide(pool role) ─► pinned rank ─► Plan
//! ```
//!
//! Key decisions:
//! - One pipeline, three callers. [`Planner::plan`] (the request path) and [`Planner::explain`]
//!   (the dry run) run the same steps on the same inputs — routing key, adapter, pinned rank,
//!   estimated prompt tokens — and differ only in what they keep: the plan keeps the admissible
//!   candidates for booking and retries, the explanation the whole ranking. Neither books: the
//!   forwarder does, so a dry run leaves no trace on any holder.
//! - The pool [`Role`] is an argument, not a constant: a disaggregated request plans its prefill
//!   and its decode leg through the same code.
//! - A request whose tokens cannot be trusted gets no cache view ([`Untrusted`], with the reason)
//!   and is routed by load, never by a guessed hit.
//! - A rank the client pins (`routed_dp_rank` / `data_parallel_rank` in the body,
//!   `X-data-parallel-rank` as a header) restricts the candidates to that rank, so the rank
//!   booked, reported and checked is the rank that serves.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use cortex_hash::kv::{DpRank, HolderId};
use cortex_hash::{Engine, SeqHash, Token};
use cortex_radix::{Ledger, OverlapScores, QueryOptions};
use cortex_sched::{
    CacheView, Candidate, Cluster, FallbackReason, MatchMode, MonotonicClock, PendingPrefixes, Ranking,
    Request as SchedRequest, Role, SchedError, Scheduler, Snapshot, Timestamp, Untrusted,
};
use http::HeaderMap;

use crate::config::Mode;
use crate::error::ProxyError;
use crate::models::{ModelRoute, ModelTable, TokenizeError};
use crate::request::{Prompt, RequestFacts, Route};
use crate::telemetry as t;

/// The header a client pins a vLLM data-parallel rank with (vLLM reads it; Cortex reads it for
/// both engines).
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// The header that carries the routing key of `consistent_hashing` and `manual`.
pub const ROUTING_KEY_HEADER: &str = "x-cortex-routing-key";

/// What the client asked for, as planning reads it: the body's facts and the headers that steer
/// routing.
#[derive(Clone, Debug)]
pub struct Ask {
    /// The body's routing facts.
    pub facts: Arc<RequestFacts>,
    /// `x-cortex-routing-key`, when sent.
    pub routing_key: Option<Vec<u8>>,
    /// The rank the client pinned, if any.
    pub pinned: Option<DpRank>,
}

impl Ask {
    /// Reads the routing key and the pinned rank from `headers` (the body's pin, if any, is in
    /// `facts`).
    ///
    /// # Errors
    /// [`ProxyError::InvalidRequest`] when `X-data-parallel-rank` is not a rank number, or names
    /// another rank than the body.
    pub fn new(facts: RequestFacts, headers: &HeaderMap) -> Result<Ask, ProxyError> {
        let header = match headers.get(RANK_HEADER) {
            None => None,
            Some(v) => Some(v.to_str().ok().and_then(|s| s.trim().parse::<u16>().ok()).ok_or_else(|| {
                ProxyError::InvalidRequest(
                    "`X-data-parallel-rank` must be a data-parallel rank number".into(),
                )
            })?),
        };
        let pinned = match (facts.client_rank, header) {
            (Some(b), Some(h)) if b != h => {
                return Err(ProxyError::InvalidRequest(format!(
                    "the body pins data-parallel rank {b} and `X-data-parallel-rank` rank {h}"
                )));
            }
            (b, h) => b.or(h).map(DpRank),
        };
        let routing_key = headers.get(ROUTING_KEY_HEADER).map(|v| v.as_bytes().to_vec());
        Ok(Ask { facts: Arc::new(facts), routing_key, pinned })
    }
}

/// What planning decided for one request: the candidates to book in order, and what the
/// forwarder and the alignment checks need of the pipeline.
#[derive(Debug)]
pub struct Plan {
    /// The served model or adapter.
    pub model: Arc<ModelRoute>,
    /// Admissible candidates, best first (only the pinned rank's, when the client pinned one).
    pub candidates: Vec<Candidate>,
    /// The decision's level in the degradation chain.
    pub mode: MatchMode,
    /// Why it is not `exact_kv_events`.
    pub reason: Option<FallbackReason>,
    /// Prompt tokens (an estimate when the prompt could not be tokenized).
    pub prompt_tokens: u32,
    /// The prompt's block identities (empty when untrusted).
    pub seq: Vec<SeqHash>,
    /// The tokens of the prompt's first block, for the alignment checks (empty without one).
    pub first_page: Vec<Token>,
    /// The cluster view the decision used (bookings and retries use the same).
    pub snapshot: Arc<Snapshot>,
    /// The prefixes in flight: a booking records the prompt's chain there.
    pub pending: Arc<PendingPrefixes>,
}

impl Plan {
    /// The most prompt tokens a worker can reuse for this request: whole blocks, never the
    /// last token (both engines compute at least one), so a prompt of exactly n blocks reuses
    /// at most n − 1 whatever the ledger holds. What `x-cortex-cache-hit-tokens` says at most.
    #[must_use]
    pub fn max_hit(&self) -> u32 {
        self.model.max_cached_tokens(self.prompt_tokens as usize)
    }
}

/// What planning decided for a disaggregated request: the rankings of the model's prefill,
/// decode and (if any) regular pools, decided once on one snapshot and one ledger answer, for the
/// PD state machine to pick its pair — and its single-worker fallback — from.
#[derive(Debug)]
pub struct PdPlan {
    /// The served model or adapter.
    pub model: Arc<ModelRoute>,
    /// The prefill pool, best first (empty when the model has no prefill worker).
    pub prefill: Ranking,
    /// The decode pool, best first (empty when the model has no decode worker).
    pub decode: Ranking,
    /// The regular pool, when the model has regular workers too (the fallback's first choice).
    pub regular: Option<Ranking>,
    /// Prompt tokens (an estimate when the prompt could not be tokenized).
    pub prompt_tokens: u32,
    /// KV blocks the request holds at its longest: its prompt and its output limit (the prompt
    /// alone when the request gives none).
    pub kv_blocks: u32,
    /// The prompt's block identities (empty when untrusted).
    pub seq: Vec<SeqHash>,
    /// The tokens of the prompt's first block, for the alignment checks (empty without one).
    pub first_page: Vec<Token>,
    /// The cluster view the decisions used (bookings and retries use the same).
    pub snapshot: Arc<Snapshot>,
    /// The prefixes in flight: a prefill leg's booking records the prompt's chain there.
    pub pending: Arc<PendingPrefixes>,
}

impl PdPlan {
    /// The ranking `role`'s pool got (`None` for a regular pool the model does not have).
    #[must_use]
    pub fn ranking(&self, role: Role) -> Option<&Ranking> {
        match role {
            Role::Prefill => Some(&self.prefill),
            Role::Decode => Some(&self.decode),
            Role::Regular => self.regular.as_ref(),
        }
    }

    /// `holder`'s candidate in `role`'s ranking, if it was ranked there.
    #[must_use]
    pub fn candidate(&self, role: Role, holder: HolderId) -> Option<&Candidate> {
        self.ranking(role)?.all().find(|c| c.holder == holder)
    }
}

/// A dry run: the plan a request would get, with the whole ranking behind it.
#[derive(Debug)]
pub struct Explanation {
    /// The same plan as [`Planner::plan`] would return, when the decision succeeded.
    pub plan: Result<Plan, ProxyError>,
    /// Every holder of the pool: admissible ones in rank order, then excluded ones with why.
    pub ranking: Ranking,
    /// Why the prompt could not be used for exact routing, when it could not.
    pub untrusted: Option<(Untrusted, String)>,
    /// The rank the client pinned.
    pub pinned: Option<DpRank>,
    /// The model route.
    pub model: Arc<ModelRoute>,
}

/// The pipeline up to the ledger query.
struct Prepared {
    model: Arc<ModelRoute>,
    tokens: Vec<Token>,
    seq: Vec<SeqHash>,
    untrusted: Option<(Untrusted, String)>,
    prompt_tokens: u32,
    /// KV blocks the request holds at its longest (see `cortex_sched::Request::kv_blocks`).
    kv_blocks: u32,
}

thread_local! {
    /// Per-thread buffers for the overlap query and the ranking: a decision allocates nothing.
    static BUFFERS: RefCell<(OverlapScores, Ranking)> =
        RefCell::new((OverlapScores::with_capacity(64), Ranking::with_capacity(64)));
}

/// The planner. Shared by every request task (`&self` everywhere).
pub struct Planner {
    mode: Mode,
    models: Arc<ModelTable>,
    ledger: Arc<Ledger>,
    cluster: Arc<Cluster>,
    sched: Scheduler,
    clock: MonotonicClock,
}

impl std::fmt::Debug for Planner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planner").field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl Planner {
    /// A planner over `models`, reading `ledger` and `cluster`, deciding with `sched`.
    #[must_use]
    pub fn new(
        mode: Mode,
        models: Arc<ModelTable>,
        ledger: Arc<Ledger>,
        cluster: Arc<Cluster>,
        sched: Scheduler,
        clock: MonotonicClock,
    ) -> Self {
        Planner { mode, models, ledger, cluster, sched, clock }
    }

    /// The route serving a request: SGLang names its adapter in `lora_path`, OpenAI routes name
    /// it as the model.
    ///
    /// A prompt of token ids must stay within the model's vocabulary: the engines refuse a
    /// larger id (vLLM with a 400, SGLang deeper down), so the gateway refuses it before it
    /// plans or forwards anything.
    ///
    /// # Errors
    /// [`ProxyError::UnknownModel`] when neither names a served model or adapter;
    /// [`ProxyError::ModelRequired`] when the request names none and several are served (but
    /// `/generate`, which goes to the only SGLang model if there is one);
    /// [`ProxyError::UnsupportedRoute`] for SGLang's `/generate` naming a vLLM model;
    /// [`ProxyError::InvalidRequest`] for a token id out of its vocabulary.
    pub fn model_for(&self, facts: &RequestFacts) -> Result<Arc<ModelRoute>, ProxyError> {
        let model = self.model_named(facts)?;
        let engine = model.spec().profile.engine();
        if facts.route == Route::Generate && engine == Engine::Vllm {
            return Err(ProxyError::UnsupportedRoute {
                route: "/generate",
                model: model.base_model().to_owned(),
                engine: engine.as_str(),
                hint: "; use /v1/completions or /v1/chat/completions",
            });
        }
        within_vocabulary(&model, facts)?;
        Ok(model)
    }

    /// The model the request names (or the only one it may mean), whatever its route: what
    /// `/tokenize` needs, since a `/generate`-shaped body's prompt is tokenized as a completion's
    /// for every engine.
    ///
    /// # Errors
    /// [`ProxyError::UnknownModel`] and [`ProxyError::ModelRequired`], as [`Planner::model_for`].
    fn model_named(&self, facts: &RequestFacts) -> Result<Arc<ModelRoute>, ProxyError> {
        let model = match facts.lora.as_deref().and_then(|l| self.models.get(Some(l))) {
            Some(m) => Arc::clone(m),
            None => match (&facts.model, self.models.get(facts.model.as_deref())) {
                (_, Some(m)) => Arc::clone(m),
                (Some(m), None) => return Err(ProxyError::UnknownModel(m.clone())),
                (None, None) => self.only_model_for(facts.route)?,
            },
        };
        Ok(model)
    }

    /// The model of a request that names none, when several are served: SGLang's `/generate`
    /// (whose clients seldom name one) goes to the only SGLang model, if there is exactly one.
    ///
    /// # Errors
    /// [`ProxyError::ModelRequired`] listing the models served.
    fn only_model_for(&self, route: Route) -> Result<Arc<ModelRoute>, ProxyError> {
        let sglang = |m: &&Arc<ModelRoute>| m.lora().is_none() && m.spec().profile.engine() == Engine::Sglang;
        let candidates: Vec<&Arc<ModelRoute>> =
            self.models.names().filter_map(|n| self.models.get(Some(n))).filter(sglang).collect();
        match candidates.as_slice() {
            [only] if route == Route::Generate => Ok(Arc::clone(only)),
            _ => Err(ProxyError::ModelRequired(self.models.names().map(str::to_owned).collect())),
        }
    }

    /// The token ids the worker will compute for the request's prompt (`/tokenize`: the first
    /// half of the pipeline).
    ///
    /// # Errors
    /// As [`Planner::model_for`] but for the route (a `/generate`-shaped body is tokenized for a
    /// vLLM model too); [`ProxyError::InvalidRequest`] when the prompt cannot be tokenized (with
    /// why).
    pub async fn tokenize(&self, facts: &Arc<RequestFacts>) -> Result<Vec<Token>, ProxyError> {
        let model = self.model_named(facts)?;
        within_vocabulary(&model, facts)?;
        match tokens(&model, facts).await {
            Ok(t) => Ok(t),
            Err(Failed::Tokenizer(e)) => Err(ProxyError::InvalidRequest(e.to_string())),
            Err(Failed::Task(e)) => Err(ProxyError::Internal(e)),
        }
    }

    /// Plans `ask` in the pool of `role`: the request path.
    ///
    /// # Errors
    /// [`ProxyError::UnknownModel`]; [`ProxyError::NoWorker`] when no holder is admissible;
    /// [`ProxyError::InvalidRequest`] when the pinned rank exists on no worker of the pool.
    pub async fn plan(&self, ask: &Ask, role: Role) -> Result<Plan, ProxyError> {
        let p = self.prepare(&ask.facts).await?;
        let snapshot = self.cluster.load();
        let started = Instant::now();
        let plan = BUFFERS.with(|b| {
            let (overlap, ranking) = &mut *b.borrow_mut();
            let decided = self.decide(&p, ask, role, &snapshot, overlap, ranking);
            self.keep(p, ask, &snapshot, decided, ranking)
        });
        metrics::histogram!(t::ROUTING_SECONDS).record(started.elapsed().as_secs_f64());
        plan
    }

    /// What [`Planner::plan`] would decide for `ask`, with the whole ranking: the dry run. Books
    /// nothing.
    ///
    /// # Errors
    /// [`ProxyError::UnknownModel`] (every other outcome is explained, not an error).
    pub async fn explain(&self, ask: &Ask, role: Role) -> Result<Explanation, ProxyError> {
        let p = self.prepare(&ask.facts).await?;
        let snapshot = self.cluster.load();
        let mut overlap = OverlapScores::with_capacity(16);
        // The view shows each score's terms, which the request path does not compute.
        let mut ranking = Ranking::with_capacity(16).explaining();
        let decided = self.decide(&p, ask, role, &snapshot, &mut overlap, &mut ranking);
        let (untrusted, model) = (p.untrusted.clone(), Arc::clone(&p.model));
        let plan = self.keep(p, ask, &snapshot, decided, &mut ranking);
        ranking.sort_all();
        Ok(Explanation { plan, ranking, untrusted, pinned: ask.pinned, model })
    }

    /// Whether `ask`'s model is served disaggregated: it has prefill or decode workers and the
    /// gateway routes (`proxy_only` never disaggregates).
    ///
    /// # Errors
    /// [`ProxyError::UnknownModel`].
    pub fn disaggregated(&self, ask: &Ask) -> Result<bool, ProxyError> {
        if self.mode == Mode::ProxyOnly {
            return Ok(false);
        }
        let model = self.model_for(&ask.facts)?;
        let snapshot = self.cluster.load();
        let base = model.base_model();
        Ok(snapshot.serves(base, Role::Prefill) || snapshot.serves(base, Role::Decode))
    }

    /// Plans a disaggregated request: the prompt tokenized and hashed once, the ledger asked
    /// once, and the prefill, decode and regular pools ranked on the same snapshot.
    ///
    /// # Errors
    /// [`ProxyError::UnknownModel`]; [`ProxyError::InvalidRequest`] when the client pins a
    /// data-parallel rank (Cortex chooses both legs' ranks, and tells each engine which).
    pub async fn plan_pd(&self, ask: &Ask) -> Result<PdPlan, ProxyError> {
        if let Some(r) = ask.pinned {
            return Err(ProxyError::InvalidRequest(format!(
                "the request pins data-parallel rank {}, but its model is served disaggregated: Cortex \
                 chooses the prefill and decode workers' ranks itself",
                r.0
            )));
        }
        let p = self.prepare(&ask.facts).await?;
        let snapshot = self.cluster.load();
        let started = Instant::now();
        let mut overlap = OverlapScores::with_capacity(16);
        self.query(&p, &mut overlap);
        let base = p.model.base_model();
        let rank = |role: Role| {
            let mut ranking = Ranking::with_capacity(8);
            // A pool without an admissible holder is an empty ranking: the PD machine falls back.
            let _ = self.rank(&p, ask, role, &snapshot, &overlap, &mut ranking);
            ranking
        };
        let prefill = rank(Role::Prefill);
        let decode = rank(Role::Decode);
        let regular = snapshot.serves(base, Role::Regular).then(|| rank(Role::Regular));
        metrics::histogram!(t::ROUTING_SECONDS).record(started.elapsed().as_secs_f64());
        let block = p.model.block_size() as usize;
        let first_page = if p.seq.is_empty() { Vec::new() } else { p.tokens[..block].to_vec() };
        Ok(PdPlan {
            model: p.model,
            prefill,
            decode,
            regular,
            prompt_tokens: p.prompt_tokens,
            kv_blocks: p.kv_blocks,
            seq: p.seq,
            first_page,
            snapshot,
            pending: Arc::clone(self.sched.pending()),
        })
    }

    /// Forgets `manual` assignments idle past their `max_idle`; returns how many.
    pub fn sweep_sticky(&self, now: Timestamp) -> usize {
        self.sched.sweep_sticky(now)
    }

    /// `manual` assignments held now.
    #[must_use]
    pub fn sticky_assignments(&self) -> usize {
        self.sched.sticky_assignments()
    }

    /// Model, tokens, hashes: everything before the ledger.
    async fn prepare(&self, facts: &Arc<RequestFacts>) -> Result<Prepared, ProxyError> {
        let model = self.model_for(facts)?;
        let mut untrusted = None;
        let mut toks = Vec::new();
        if self.mode == Mode::ProxyOnly {
            untrusted = Some((Untrusted::ExactRoutingOff, "proxy-only mode".to_owned()));
        } else {
            let started = Instant::now();
            let result = tokens(&model, facts).await;
            metrics::histogram!(t::TOKENIZE_SECONDS).record(started.elapsed().as_secs_f64());
            match result {
                Ok(t) => toks = t,
                Err(Failed::Tokenizer(e)) => {
                    tracing::debug!(error = %e, "no tokens for this request; routing by load");
                    untrusted = Some((untrusted_for(&e), e.to_string()));
                }
                Err(Failed::Task(e)) => {
                    tracing::warn!(error = %e, "tokenizer task failed; routing by load");
                    untrusted = Some((Untrusted::TokenizerFailed, e));
                }
            }
        }
        let mut seq = Vec::new();
        if untrusted.is_none() {
            let h = Instant::now();
            if let Err(e) = model.seq_hashes(&toks, facts.cache_salt.as_deref(), &mut seq) {
                tracing::debug!(error = %e, "no exact identity for this request");
                untrusted = Some((Untrusted::ExactRoutingOff, e.to_string()));
            }
            metrics::histogram!(t::HASH_SECONDS).record(h.elapsed().as_secs_f64());
        }
        let prompt_tokens = if toks.is_empty() { estimate_tokens(&facts.prompt) } else { toks.len() };
        let prompt_tokens = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
        let kv_blocks = kv_blocks(prompt_tokens, facts.max_output_tokens, model.block_size());
        Ok(Prepared { model, tokens: toks, seq, untrusted, prompt_tokens, kv_blocks })
    }

    /// The ledger query and the scheduler's ranking, into `ranking`.
    fn decide(
        &self,
        p: &Prepared,
        ask: &Ask,
        role: Role,
        snapshot: &Snapshot,
        overlap: &mut OverlapScores,
        ranking: &mut Ranking,
    ) -> Result<(), SchedError> {
        self.query(p, overlap);
        self.rank(p, ask, role, snapshot, overlap, ranking)
    }

    /// The ledger's answer for the prompt (nothing when its tokens cannot be trusted).
    fn query(&self, p: &Prepared, overlap: &mut OverlapScores) {
        if p.untrusted.is_none() {
            self.ledger.query(&p.seq, QueryOptions::default(), overlap);
        }
    }

    /// The scheduler's ranking of `role`'s pool on the ledger's answer `overlap`, into `ranking`.
    fn rank(
        &self,
        p: &Prepared,
        ask: &Ask,
        role: Role,
        snapshot: &Snapshot,
        overlap: &OverlapScores,
        ranking: &mut Ranking,
    ) -> Result<(), SchedError> {
        let cache = match &p.untrusted {
            Some((u, _)) => CacheView::Untrusted(*u),
            None => CacheView::Overlap { scores: overlap, block_tokens: p.model.block_size() },
        };
        let req = SchedRequest {
            model: p.model.base_model(),
            role,
            now: self.clock.now(),
            prompt_tokens: p.prompt_tokens,
            cache,
            routing_key: ask.routing_key.as_deref(),
            prefix: &p.seq,
            kv_blocks: p.kv_blocks,
        };
        self.sched.decide(snapshot, &req, ranking)
    }

    /// The plan from a decided ranking: the admissible candidates (of the pinned rank, if any).
    fn keep(
        &self,
        p: Prepared,
        ask: &Ask,
        snapshot: &Arc<Snapshot>,
        decided: Result<(), SchedError>,
        ranking: &mut Ranking,
    ) -> Result<Plan, ProxyError> {
        let no_worker = || ProxyError::NoWorker(p.model.base_model().to_owned());
        decided.map_err(|_| no_worker())?;
        // A decision orders only its first `RANKED` admissible holders; the pinned rank's best
        // may rank below them.
        if ask.pinned.is_some() {
            ranking.sort_all();
        }
        let candidates: Vec<Candidate> =
            ranking.admissible().filter(|c| ask.pinned.is_none_or(|r| c.holder.rank == r)).copied().collect();
        if candidates.is_empty() {
            return Err(match ask.pinned {
                Some(r) if !ranking.all().any(|c| c.holder.rank == r) => ProxyError::InvalidRequest(format!(
                    "no worker of `{}` has data-parallel rank {}",
                    p.model.base_model(),
                    r.0
                )),
                _ => no_worker(),
            });
        }
        let block = p.model.block_size() as usize;
        let first_page = if p.seq.is_empty() { Vec::new() } else { p.tokens[..block].to_vec() };
        Ok(Plan {
            model: p.model,
            candidates,
            mode: ranking.mode(),
            reason: ranking.reason(),
            prompt_tokens: p.prompt_tokens,
            seq: p.seq,
            first_page,
            snapshot: Arc::clone(snapshot),
            pending: Arc::clone(self.sched.pending()),
        })
    }
}

/// Output tokens a request's KV is sized for at most, whatever its limit: SGLang's scheduler
/// clips its own estimate of a request's output there (`SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`,
/// 4096), since a client's limit is a bound most requests stop far short of. Without the clip,
/// one request asking for a context's worth of output would fill a decode worker by the count
/// and turn every other request away from it.
const OUTPUT_ESTIMATE_CLIP: u32 = 4096;

/// The KV blocks of `prompt_tokens` and up to `max_output` generated tokens (clipped at
/// [`OUTPUT_ESTIMATE_CLIP`]), in pages of `block_size` tokens.
fn kv_blocks(prompt_tokens: u32, max_output: Option<u32>, block_size: u32) -> u32 {
    let output = max_output.unwrap_or(0).min(OUTPUT_ESTIMATE_CLIP);
    let tokens = u64::from(prompt_tokens) + u64::from(output);
    u32::try_from(tokens.div_ceil(u64::from(block_size.max(1)))).unwrap_or(u32::MAX)
}

/// Why tokenizing did not give tokens.
enum Failed {
    /// The prompt cannot be tokenized (or not trusted).
    Tokenizer(TokenizeError),
    /// The blocking task died.
    Task(String),
}

/// A prompt of token ids must stay within the model's vocabulary: the engines refuse a larger
/// id, so the gateway refuses it before it plans or forwards anything.
fn within_vocabulary(model: &ModelRoute, facts: &RequestFacts) -> Result<(), ProxyError> {
    match facts.max_token_id.filter(|&id| id > model.max_token_id()) {
        Some(id) => Err(ProxyError::InvalidRequest(format!(
            "token id {id} is out of the vocabulary of `{}` (ids 0..={})",
            model.base_model(),
            model.max_token_id()
        ))),
        None => Ok(()),
    }
}

/// Tokenizes inline when that is cheaper than the hand-off, else on the blocking pool.
async fn tokens(model: &Arc<ModelRoute>, facts: &Arc<RequestFacts>) -> Result<Vec<Token>, Failed> {
    if tokenize_inline(&facts.prompt) {
        return model.tokens(&facts.prompt).map_err(Failed::Tokenizer);
    }
    let (m, f) = (Arc::clone(model), Arc::clone(facts));
    match tokio::task::spawn_blocking(move || m.tokens(&f.prompt)).await {
        Ok(r) => r.map_err(Failed::Tokenizer),
        Err(e) => Err(Failed::Task(e.to_string())),
    }
}

/// Why a request without tokens is routed by load: an extra key the profile does not reproduce
/// turns exact routing off, a prompt Cortex cannot reproduce is a known limit, anything else is a
/// tokenizer failure.
fn untrusted_for(e: &TokenizeError) -> Untrusted {
    match e {
        TokenizeError::ExtraKeyNotReproduced(_) => Untrusted::ExactRoutingOff,
        TokenizeError::Unreproducible(_) => Untrusted::UnreproduciblePrompt,
        TokenizeError::Text(_) => Untrusted::TokenizerFailed,
    }
}

/// Plain-text prompts up to this many bytes (about 60 tokens) are tokenized on the I/O thread.
/// Handing a prompt to the blocking pool costs two thread wake-ups: for a 40-token completion
/// `cargo xtask bench --only overhead` measured about 50 µs more latency (p50) and 60 µs more
/// CPU per request through the pool than tokenizing inline (about 50 µs). Longer prompts and
/// chat prompts (template rendering) go to the pool, so no I/O thread blocks for long.
pub const INLINE_TOKENIZE_BYTES: usize = 256;

/// Whether [`ModelRoute::tokens`] for `p` is cheap enough to run on the I/O thread.
fn tokenize_inline(p: &Prompt) -> bool {
    match p {
        Prompt::Tokens(_) | Prompt::Unreproducible(_) => true,
        Prompt::Text(t) => t.len() <= INLINE_TOKENIZE_BYTES,
        Prompt::Chat(_) => false,
    }
}

/// A rough token count when tokenization failed: what a booking reserves.
fn estimate_tokens(p: &Prompt) -> usize {
    match p {
        Prompt::Chat(ctx) => ctx.get("messages").map_or(0, |m| m.to_string().len() / 4),
        Prompt::Text(t) => t.len() / 4,
        Prompt::Tokens(t) => t.len(),
        Prompt::Unreproducible(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{self, Route};

    #[test]
    fn only_cheap_prompts_are_tokenized_inline() {
        assert!(tokenize_inline(&Prompt::Tokens(vec![1; 100_000])));
        assert!(tokenize_inline(&Prompt::Unreproducible("x")));
        assert!(tokenize_inline(&Prompt::Text("a short completion prompt".into())));
        assert!(!tokenize_inline(&Prompt::Text("x".repeat(INLINE_TOKENIZE_BYTES + 1))));
        assert!(!tokenize_inline(&Prompt::Chat(serde_json::Map::new())));
    }

    #[test]
    fn a_request_s_kv_is_its_prompt_and_output_limit_in_whole_pages() {
        assert_eq!(kv_blocks(272, Some(256), 16), 33);
        assert_eq!(kv_blocks(273, Some(256), 16), 34, "a partial page is a page");
        assert_eq!(kv_blocks(272, None, 16), 17, "no limit given: the prompt alone");
        assert_eq!(kv_blocks(100, Some(1_000_000), 16), (100 + 4096_u32).div_ceil(16), "clipped");
        assert_eq!(kv_blocks(u32::MAX, Some(u32::MAX), 1), u32::MAX);
    }

    fn ask(body: &str, headers: &[(&str, &str)]) -> Result<Ask, ProxyError> {
        let facts = request::parse(Route::Generate, body.as_bytes())?;
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        Ask::new(facts, &h)
    }

    #[test]
    fn a_pinned_rank_comes_from_the_body_or_the_header_and_they_must_agree() {
        assert_eq!(ask(r#"{"text":"x"}"#, &[]).unwrap().pinned, None);
        assert_eq!(ask(r#"{"text":"x","routed_dp_rank":2}"#, &[]).unwrap().pinned, Some(DpRank(2)));
        assert_eq!(ask(r#"{"text":"x","data_parallel_rank":1}"#, &[]).unwrap().pinned, Some(DpRank(1)));
        assert_eq!(ask(r#"{"text":"x"}"#, &[("X-data-parallel-rank", "3")]).unwrap().pinned, Some(DpRank(3)));
        let same = ask(r#"{"text":"x","routed_dp_rank":1}"#, &[("x-data-parallel-rank", "1")]).unwrap();
        assert_eq!(same.pinned, Some(DpRank(1)));
        let e = ask(r#"{"text":"x","routed_dp_rank":1}"#, &[("x-data-parallel-rank", "2")]).unwrap_err();
        assert!(
            matches!(e, ProxyError::InvalidRequest(ref m) if m.contains("rank 1") && m.contains("rank 2")),
            "{e}"
        );
        let e = ask(r#"{"text":"x"}"#, &[("x-data-parallel-rank", "first")]).unwrap_err();
        assert!(matches!(e, ProxyError::InvalidRequest(_)), "{e}");
        let k = ask(r#"{"text":"x"}"#, &[("x-cortex-routing-key", "user-7")]).unwrap();
        assert_eq!(k.routing_key.as_deref(), Some(&b"user-7"[..]));
    }
}
