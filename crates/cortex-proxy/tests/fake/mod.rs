//! A fake engine and a gateway in front of it, on loopback, for the request path's tests.
//!
//! The fake answers like an SGLang or vLLM worker — discovery (`/server_info`; `/metrics`,
//! `/kv_event_sources`, `/v1/models`), health, load, `/tokenize` and the three inference routes —
//! records every request it gets, fails or holds a stream on command, and caches what it serves
//! per data-parallel rank. Instead of ZeroMQ it publishes what it caches straight into the
//! gateway's ledger, under the engine hashes its recipe predicts, as the event plane would after
//! a KV event: the harness plays the event plane (it follows what the control plane asks). Every
//! wait polls observable state under a deadline.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // each test uses part of it; a failed setup step should panic

use std::collections::{HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use cortex_hash::kv::{
    BlockStored, DpRank, EngineHash, HolderId, KvEvent, Lineage, Medium, StoredBlock, WorkerId,
};
use cortex_hash::profile::{Bigram, ExtraKeyPolicy, FileDigest, HashRecipe, ModelProfile};
use cortex_hash::sglang::EventFormat;
use cortex_hash::text::{ChatTemplate, TextTokenizer, TokenizerConfig};
use cortex_hash::vllm::{ExtraKeyForm, HashAlgo, NoneHashSeed};
use cortex_hash::{Engine, SeqHash};
use cortex_proxy::config::{AlignmentConfig, ModelSpec, ProbeConfig, ProxyConfig};
use cortex_proxy::request::{self, Route};
use cortex_proxy::{Gateway, GatewayParts, ModelRoute, ModelTable, RegistryEvent, WorkerConfig};
use cortex_radix::{HolderConfig, HolderWriter, Ledger, LedgerConfig, Readiness};
use cortex_sched::{HealthPolicy, LedgerState, Role, SchedConfig};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body as HttpBody, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, oneshot};

pub(crate) const MODEL: &str = "m";
pub(crate) const ADAPTER: &str = "sql";
pub(crate) const WAIT: Duration = Duration::from_secs(20);

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../golden")
}

/// Qwen3's tokenizer and template, loaded once per test binary (the load dominates a harness).
fn qwen3() -> &'static (Arc<TextTokenizer>, Arc<ChatTemplate>, TokenizerConfig) {
    static FILES: OnceLock<(Arc<TextTokenizer>, Arc<ChatTemplate>, TokenizerConfig)> = OnceLock::new();
    FILES.get_or_init(|| {
        let dir = golden().join("models/qwen3");
        let tokenizer = TextTokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let cfg =
            TokenizerConfig::from_json(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
        let template = ChatTemplate::new(&cfg.chat_template).unwrap();
        (Arc::new(tokenizer), Arc::new(template), cfg)
    })
}

/// The model as a gateway and its workers configure it: Qwen3's files, 16-token blocks, the
/// engine's default recipe.
pub(crate) fn spec(engine: Engine) -> ModelSpec {
    let (tokenizer, template, cfg) = qwen3();
    let recipe = match engine {
        Engine::Sglang => HashRecipe::Sglang { format: EventFormat::Default, bigram: Bigram::Off },
        _ => HashRecipe::Vllm {
            algo: HashAlgo::Sha256,
            seed: NoneHashSeed::Default,
            extra_keys: ExtraKeyForm::Tagged,
        },
    };
    let profile = ModelProfile::builder()
        .model(MODEL)
        .recipe(recipe)
        .block_size(16)
        .tokenizer(tokenizer.digest())
        .chat_template(FileDigest::of(cfg.chat_template.as_bytes()))
        .extra_keys(ExtraKeyPolicy::default())
        .build()
        .unwrap();
    ModelSpec {
        profile,
        tokenizer: Arc::clone(tokenizer),
        template: Arc::clone(template),
        bos_token: cfg.bos_token.clone(),
        eos_token: cfg.eos_token.clone(),
    }
}

/// The served model and its adapter [`ADAPTER`].
pub(crate) fn models(engine: Engine) -> ModelTable {
    let mut t = ModelTable::new();
    t.add_model(spec(engine), 1 << 16);
    assert!(t.add_adapter(ADAPTER, "/adapters/sql", MODEL));
    t
}

/// The ledger writers of the holders the control plane asked to follow: the harness's stand-in
/// for the event plane.
#[derive(Default)]
pub(crate) struct Plane {
    writers: Mutex<HashMap<HolderId, HolderWriter>>,
}

impl Plane {
    /// Follows what the control plane sends, in order, until the gateway is dropped.
    async fn run(self: Arc<Self>, ledger: Arc<Ledger>, mut events: mpsc::UnboundedReceiver<RegistryEvent>) {
        while let Some(ev) = events.recv().await {
            match ev {
                RegistryEvent::Follow(sources) => {
                    for s in sources {
                        let cfg = HolderConfig {
                            capacity_blocks: s.capacity_blocks,
                            content_deterministic: s.content_deterministic,
                        };
                        let mut w = ledger.add_holder(s.holder, cfg).unwrap();
                        w.set_readiness(Readiness::Ready);
                        self.writers.lock().unwrap().insert(s.holder, w);
                    }
                }
                RegistryEvent::Unfollow(worker) => {
                    self.writers.lock().unwrap().retain(|h, _| h.worker != worker);
                    ledger.remove_worker(worker);
                }
                RegistryEvent::Running(..) => {}
            }
        }
    }

    /// Publishes a store on `holder`, if it is followed.
    fn apply(&self, holder: HolderId, ev: &KvEvent) {
        if let Some(w) = self.writers.lock().unwrap().get_mut(&holder) {
            w.apply(ev).unwrap();
        }
    }
}

/// How a fake engine is set up.
#[derive(Clone, Debug)]
pub(crate) struct FakeConfig {
    pub(crate) engine: Engine,
    pub(crate) dp_size: u16,
    /// SGLang: `internal_states[].effective_max_running_requests_per_dp` in `/server_info`.
    pub(crate) server_info_max_running: Option<u32>,
    /// Whether it advertises KV events (the harness then follows its holders).
    pub(crate) events: bool,
    /// The gateway's `workers[].max_running_requests`.
    pub(crate) configured_max_running: Option<u32>,
}

impl FakeConfig {
    pub(crate) fn new(engine: Engine) -> Self {
        FakeConfig {
            engine,
            dp_size: 1,
            server_info_max_running: None,
            events: true,
            configured_max_running: None,
        }
    }

    pub(crate) fn dp(mut self, n: u16) -> Self {
        self.dp_size = n;
        self
    }
}

/// One request the fake received.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub(crate) path: String,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    /// The rank it served on (SGLang `routed_dp_rank` / `data_parallel_rank`, vLLM
    /// `X-data-parallel-rank`, else 0).
    pub(crate) rank: u16,
}

struct Shared {
    cfg: FakeConfig,
    models: Arc<ModelTable>,
    plane: Arc<Plane>,
    worker: OnceLock<WorkerId>,
    seen: Mutex<Vec<Seen>>,
    failures: Mutex<VecDeque<u16>>,
    holding: AtomicBool,
    gate: Semaphore,
    /// Stream chunks after which the next stream breaks (0: never).
    break_after: AtomicU32,
    /// The break sends the first half of the next event before it.
    break_mid_event: AtomicBool,
    loads_max_running: AtomicU32,
    healthy: AtomicBool,
    cache: Mutex<HashMap<u16, HashSet<SeqHash>>>,
}

/// A fake engine on loopback. Dropping it stops its listener.
pub(crate) struct Fake {
    pub(crate) addr: SocketAddr,
    shared: Arc<Shared>,
    _stop: oneshot::Sender<()>,
}

impl Fake {
    async fn start(cfg: FakeConfig, models: Arc<ModelTable>, plane: Arc<Plane>) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            cfg,
            models,
            plane,
            worker: OnceLock::new(),
            seen: Mutex::new(Vec::new()),
            failures: Mutex::new(VecDeque::new()),
            holding: AtomicBool::new(false),
            gate: Semaphore::new(0),
            break_after: AtomicU32::new(0),
            break_mid_event: AtomicBool::new(false),
            loads_max_running: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            cache: Mutex::new(HashMap::new()),
        });
        let (stop, mut stopped) = oneshot::channel::<()>();
        let s = Arc::clone(&shared);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let s = Arc::clone(&s);
                        tokio::spawn(async move {
                            let svc = service_fn(move |req| Arc::clone(&s).handle(req));
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .await;
                        });
                    }
                    _ = &mut stopped => return,
                }
            }
        });
        Fake { addr, shared, _stop: stop }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request it received, in order.
    pub(crate) fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// The inference requests it received (not discovery, health, load or tokenize).
    pub(crate) fn served(&self) -> Vec<Seen> {
        self.seen().into_iter().filter(|s| inference_route(&s.path).is_some()).collect()
    }

    /// The next inference requests answer with these statuses, in order.
    pub(crate) fn fail_next(&self, statuses: &[u16]) {
        self.shared.failures.lock().unwrap().extend(statuses);
    }

    /// Streams stop after their first chunk until [`Fake::release`].
    pub(crate) fn hold(&self) {
        self.shared.gate.forget_permits(usize::MAX >> 4);
        self.shared.holding.store(true, Ordering::SeqCst);
    }

    /// Lets held streams (and later ones) finish.
    pub(crate) fn release(&self) {
        self.shared.holding.store(false, Ordering::SeqCst);
        self.shared.gate.add_permits(1 << 20);
    }

    /// The next stream breaks after `n` chunks.
    pub(crate) fn break_stream_after(&self, n: u32) {
        self.shared.break_after.store(n, Ordering::SeqCst);
    }

    /// The next stream breaks after `n` chunks and half of the next one.
    pub(crate) fn break_stream_mid_event_after(&self, n: u32) {
        self.shared.break_mid_event.store(true, Ordering::SeqCst);
        self.shared.break_after.store(n, Ordering::SeqCst);
    }

    /// SGLang: what `/v1/loads` reports as each rank's `max_running_requests` (0: none).
    pub(crate) fn report_max_running(&self, n: u32) {
        self.shared.loads_max_running.store(n, Ordering::SeqCst);
    }

    /// Caches `body` (for `route`) on `rank` and publishes it, as serving it would.
    pub(crate) fn prime(&self, route: Route, rank: u16, body: &Value) {
        let body = Bytes::from(body.to_string());
        let facts = request::parse(route, &body).unwrap();
        let cached = self.shared.cache_and_publish(&facts, rank);
        assert!(cached.is_some(), "the primed prompt has full blocks");
    }
}

fn inference_route(path: &str) -> Option<Route> {
    match path {
        "/v1/chat/completions" => Some(Route::ChatCompletions),
        "/v1/completions" => Some(Route::Completions),
        "/generate" => Some(Route::Generate),
        _ => None,
    }
}

type FakeBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

fn json_resp(status: StatusCode, v: &Value) -> Response<FakeBody> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).map_err(|e| match e {}).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    r
}

/// A body fed by a channel: the fake writes a stream chunk by chunk.
struct ChanBody(mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl HttpBody for ChanBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

impl Shared {
    fn model_of(&self, facts: &request::RequestFacts) -> Arc<ModelRoute> {
        facts
            .lora
            .as_deref()
            .and_then(|l| self.models.get(Some(l)))
            .or_else(|| self.models.get(facts.model.as_deref()))
            .map(Arc::clone)
            .unwrap()
    }

    /// Caches the request's blocks on `rank` and publishes them; returns (prompt tokens,
    /// cached tokens before this request), `None` without tokens.
    fn cache_and_publish(&self, facts: &request::RequestFacts, rank: u16) -> Option<(u32, u32)> {
        let model = self.model_of(facts);
        let tokens = model.tokens(&facts.prompt).ok()?;
        let salt = facts.cache_salt.as_deref();
        let mut seq = Vec::new();
        model.seq_hashes(&tokens, salt, &mut seq).ok()?;
        let bs = model.block_size() as usize;
        let mut cache = self.cache.lock().unwrap();
        let held = cache.entry(rank).or_default();
        let hit_blocks = seq.iter().take_while(|s| held.contains(s)).count();
        held.extend(seq.iter().copied());
        drop(cache);
        if let Some(&worker) = self.worker.get() {
            let ns = model.namespace(salt).ok()?;
            let engine = model.predict_engine_hashes(&tokens, salt);
            let blocks = tokens
                .chunks_exact(bs)
                .enumerate()
                .map(|(i, page)| StoredBlock {
                    engine: engine.as_ref().map_or(EngineHash::from_u64(seq[i].to_bits()), |e| e[i]),
                    content: ns.block_hash(page),
                })
                .collect();
            let ev = KvEvent::Stored(BlockStored {
                parent: None,
                blocks,
                lineage: Some(Lineage::new(ns, salt)),
                medium: Medium::Gpu,
            });
            self.plane.apply(HolderId::new(worker, DpRank(rank)), &ev);
        }
        let cached = u32::try_from(hit_blocks * bs).unwrap().min(model.max_cached_tokens(tokens.len()));
        Some((u32::try_from(tokens.len()).unwrap(), cached))
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Result<Response<FakeBody>, Infallible> {
        let (parts, body) = req.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let path = parts.uri.path().to_owned();
        let engine = self.cfg.engine;
        let rank = match engine {
            Engine::Sglang => serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| {
                    v.get("routed_dp_rank").or_else(|| v.get("data_parallel_rank")).and_then(Value::as_u64)
                })
                .map_or(0, |r| r as u16),
            _ => parts
                .headers
                .get("x-data-parallel-rank")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(0),
        };
        self.seen.lock().unwrap().push(Seen {
            path: path.clone(),
            headers: parts.headers.clone(),
            body: body.clone(),
            rank,
        });
        let dp = self.cfg.dp_size;
        let resp = match (engine, path.as_str()) {
            (_, "/ready" | "/health") => {
                let ok = self.healthy.load(Ordering::SeqCst);
                json_resp(if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, &json!({}))
            }
            (Engine::Sglang, "/server_info") => {
                let internal: Vec<Value> = (0..dp)
                    .map(|_| json!({"effective_max_running_requests_per_dp": self.cfg.server_info_max_running, "last_gen_throughput": 0.0}))
                    .collect();
                let events = self.cfg.events.then(|| {
                    json!({"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 40000, "topic": "", "block_size": 16, "dp_size": dp})
                });
                json_resp(
                    StatusCode::OK,
                    &json!({"served_model_name": MODEL, "model_path": MODEL, "page_size": 16, "dcp_size": 1, "dp_size": dp,
                            "speculative_algorithm": null, "max_running_requests": null, "max_total_num_tokens": 16 * 4096,
                            "internal_states": internal, "kv_events": events, "version": "0.5.23"}),
                )
            }
            (Engine::Sglang, "/v1/loads") => {
                let m = self.loads_max_running.load(Ordering::SeqCst);
                let loads: Vec<Value> = (0..dp)
                    .map(|r| json!({"dp_rank": r, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0,
                                    "max_total_num_tokens": 16 * 4096, "max_running_requests": m, "token_usage": 0.0}))
                    .collect();
                json_resp(StatusCode::OK, &json!({"version": "0.5.23", "loads": loads}))
            }
            (Engine::Vllm, "/metrics") => {
                let mut text = "vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"4096\",prefix_caching_hash_algo=\"sha256\"} 1.0\n".to_owned();
                for r in 0..dp {
                    text.push_str(&format!(
                        "vllm:num_requests_running{{engine=\"{r}\",model_name=\"{MODEL}\"}} 0.0\n"
                    ));
                }
                let mut resp = Response::new(Full::new(Bytes::from(text)).map_err(|e| match e {}).boxed());
                resp.headers_mut()
                    .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain"));
                resp
            }
            (Engine::Vllm, "/kv_event_sources") => {
                let mut v = serde_json::Map::new();
                if self.cfg.events {
                    for r in 0..dp {
                        v.insert(r.to_string(), json!({"enable_kv_cache_events": true, "publisher": "zmq",
                            "endpoint": format!("tcp://*:{}", 40000 + u32::from(r)), "replay_endpoint": null, "topic": ""}));
                    }
                }
                json_resp(StatusCode::OK, &Value::Object(v))
            }
            (Engine::Vllm, "/v1/models") => {
                json_resp(StatusCode::OK, &json!({"object": "list", "data": [{"id": MODEL}]}))
            }
            (_, "/tokenize") => {
                let facts = request::parse(Route::ChatCompletions, &body).unwrap();
                let tokens = self.model_of(&facts).tokens(&facts.prompt).unwrap();
                json_resp(StatusCode::OK, &json!({"tokens": tokens, "count": tokens.len()}))
            }
            (_, p) => match inference_route(p) {
                Some(route) => self.infer(route, &body, rank),
                None => json_resp(StatusCode::NOT_FOUND, &json!({"error": "no route"})),
            },
        };
        Ok(resp)
    }

    fn infer(self: &Arc<Self>, route: Route, body: &Bytes, rank: u16) -> Response<FakeBody> {
        if let Some(status) = self.failures.lock().unwrap().pop_front() {
            let code = StatusCode::from_u16(status).unwrap();
            let mut r = json_resp(
                code,
                &json!({"error": {"message": format!("scripted {status}"), "type": "server_error"}}),
            );
            if status == 429 {
                r.headers_mut().insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("7"));
            }
            return r;
        }
        let facts = request::parse(route, body).unwrap();
        let (prompt, cached) = self.cache_and_publish(&facts, rank).unwrap_or((0, 0));
        let usage = json!({"prompt_tokens": prompt, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": cached}});
        let meta = json!({"prompt_tokens": prompt, "completion_tokens": 2, "cached_tokens": cached});
        let chunk = |text: &str| match route {
            Route::Generate => json!({"text": text, "meta_info": meta}),
            _ => json!({"object": "text_completion", "choices": [{"index": 0, "text": text}]}),
        };
        if !facts.stream {
            let v = match route {
                Route::Generate => json!({"text": "ok", "meta_info": meta}),
                _ => {
                    json!({"object": "text_completion", "choices": [{"index": 0, "text": "ok"}], "usage": usage})
                }
            };
            let mut r = json_resp(StatusCode::OK, &v);
            // A header for this hop only, named in `Connection`: the gateway must not relay it.
            r.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("x-fake-hop"));
            r.headers_mut().insert("x-fake-hop", http::HeaderValue::from_static("1"));
            return r;
        }
        let mut events: Vec<Bytes> =
            ["o", "k"].iter().map(|t| Bytes::from(format!("data: {}\n\n", chunk(t)))).collect();
        if route != Route::Generate {
            events.push(Bytes::from(format!(
                "data: {}\n\n",
                json!({"object": "text_completion", "choices": [], "usage": usage})
            )));
        }
        events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        let break_after = self.break_after.swap(0, Ordering::SeqCst) as usize;
        let mid_event = self.break_mid_event.swap(false, Ordering::SeqCst);
        let holding = self.holding.load(Ordering::SeqCst);
        let (tx, rx) = mpsc::channel(8);
        let shared = Arc::clone(self);
        tokio::spawn(async move {
            for (i, e) in events.into_iter().enumerate() {
                if i == 1 && holding {
                    let _ = shared.gate.acquire().await.map(tokio::sync::SemaphorePermit::forget);
                }
                if break_after > 0 && i == break_after {
                    if mid_event {
                        let _ = tx.send(Ok(e.slice(..e.len() / 2))).await;
                        // Time for the half event to leave before the break aborts the connection.
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                    let _ = tx.send(Err(std::io::Error::other("scripted break"))).await;
                    return;
                }
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
        });
        let mut r = Response::new(ChanBody(rx).boxed());
        r.headers_mut()
            .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/event-stream"));
        r
    }
}

/// How the gateway under test is set up.
pub(crate) struct Options {
    pub(crate) engine: Engine,
    pub(crate) workers: Vec<FakeConfig>,
    pub(crate) proxy: ProxyConfig,
    pub(crate) sched: SchedConfig,
}

impl Options {
    pub(crate) fn new(engine: Engine, workers: Vec<FakeConfig>) -> Self {
        let proxy = ProxyConfig {
            probes: ProbeConfig {
                health_interval: Duration::from_millis(100),
                load_interval: Duration::from_millis(50),
                timeout: Duration::from_secs(2),
                failures_to_remove: 2,
                successes_to_restore: 1,
            },
            alignment: AlignmentConfig {
                window: 4,
                tolerance: 0.0,
                min_samples: 2,
                settle: Duration::from_millis(10),
            },
            ..ProxyConfig::default()
        };
        Options { engine, workers, proxy, sched: SchedConfig::default() }
    }
}

/// A gateway in front of fakes `w0`, `w1`, …
pub(crate) struct Harness {
    pub(crate) addr: SocketAddr,
    /// The admin listener (the admin API and `/debug/*`, behind [`ADMIN_TOKEN`]).
    pub(crate) admin: SocketAddr,
    pub(crate) gateway: Arc<Gateway>,
    pub(crate) fakes: Vec<Fake>,
    pub(crate) client: Client<HttpConnector, Full<Bytes>>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
    admin_stop: Option<oneshot::Sender<()>>,
    admin_server: Option<tokio::task::JoinHandle<()>>,
}

/// The admin listener's token.
pub(crate) const ADMIN_TOKEN: &str = "fake-admin-token";

pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// (`x-cortex-assigned-worker`, `x-cortex-assigned-rank`).
    pub(crate) fn assigned(&self) -> (String, u16) {
        (
            self.header("x-cortex-assigned-worker").to_owned(),
            self.header("x-cortex-assigned-rank").parse().unwrap_or(u16::MAX),
        )
    }
}

/// Starts the fakes and a gateway in front of them, and waits until every worker is live and,
/// for workers with events, every holder's ledger is READY in the scheduler.
pub(crate) async fn start(opts: Options) -> Harness {
    let table = models(opts.engine);
    let ledger = Ledger::new(LedgerConfig::default());
    let (gateway, events) = Gateway::new(GatewayParts {
        config: opts.proxy,
        models: models(opts.engine),
        ledger: Arc::clone(&ledger),
        sched: opts.sched,
        health: HealthPolicy::default(),
        prometheus: None,
    })
    .unwrap();
    let models = Arc::new(table);
    let plane = Arc::new(Plane::default());
    tokio::spawn(Arc::clone(&plane).run(ledger, events));
    gateway.start_background();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(cortex_proxy::server::serve(listener, None, Arc::clone(&gateway), async {
        let _ = stopped.await;
    }));
    let admin_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = admin_listener.local_addr().unwrap();
    let (admin_stop, admin_stopped) = oneshot::channel::<()>();
    let admin_api = cortex_proxy::Admin::new(Arc::clone(&gateway), cortex_proxy::Token::new(ADMIN_TOKEN));
    let limits = gateway.limits().clone();
    let admin_server = tokio::spawn(async move {
        let handler = move |req| admin_api.clone().serve(req);
        cortex_proxy::server::serve_with(
            admin_listener,
            None,
            handler,
            &limits,
            Duration::from_secs(1),
            async {
                let _ = admin_stopped.await;
            },
        )
        .await;
    });
    let mut fakes = Vec::new();
    for (i, cfg) in opts.workers.into_iter().enumerate() {
        let configured = cfg.configured_max_running;
        let fake = Fake::start(cfg, Arc::clone(&models), Arc::clone(&plane)).await;
        let id = gateway
            .control()
            .join(WorkerConfig {
                name: format!("w{i}"),
                url: fake.url(),
                engine: opts.engine,
                model: MODEL.into(),
                role: Role::Regular,
                max_running_requests: configured,
                events: None,
                unlabeled_stores_unknown: false,
                bootstrap_port: None,
            })
            .unwrap();
        fake.shared.worker.set(id).unwrap();
        fakes.push(fake);
    }
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let h = Harness {
        addr,
        admin,
        gateway,
        fakes,
        client,
        stop: Some(stop),
        server: Some(server),
        admin_stop: Some(admin_stop),
        admin_server: Some(admin_server),
    };
    h.wait("every worker live", || h.gateway.control().live_workers() == h.fakes.len()).await;
    h.wait("every followed holder READY in the scheduler", || {
        let c = h.gateway.control();
        c.registry().snapshot().values().all(|w| {
            let s = w.status();
            s.sources.is_empty()
                || (0..w.dp_size()).all(|r| c.holder_state(w.id, DpRank(r)) == LedgerState::Ready)
        }) && c.cluster().load().workers().iter().all(|e| {
            let w = c.registry().get(e.spec().id).unwrap();
            w.status().sources.is_empty()
                || (0..w.dp_size()).all(|r| e.state().ledger(DpRank(r)) == Some(LedgerState::Ready))
        })
    })
    .await;
    h
}

impl Harness {
    pub(crate) async fn wait(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "timed out after {WAIT:?} waiting for: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub(crate) fn id(&self, name: &str) -> WorkerId {
        self.gateway.control().registry().by_name(name).unwrap().id
    }

    pub(crate) fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Request<Full<Bytes>> {
        // The debug views are on the admin listener, behind its token.
        let debug = path.starts_with("/debug/");
        let host = if debug { self.admin } else { self.addr };
        let mut b = Request::builder().method(method).uri(format!("http://{host}{path}"));
        if debug {
            b = b.header("authorization", format!("Bearer {ADMIN_TOKEN}"));
        }
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.header("content-type", "application/json").body(Full::new(body)).unwrap()
    }

    pub(crate) async fn send(&self, req: Request<Full<Bytes>>) -> Reply {
        let resp = self.client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        Reply { status: parts.status, headers: parts.headers, body }
    }

    /// Sends a request from a task of its own (one that will be held in flight): its reply.
    pub(crate) fn spawn_send(&self, req: Request<Full<Bytes>>) -> tokio::task::JoinHandle<Reply> {
        let client = self.client.clone();
        tokio::spawn(async move {
            let resp = client.request(req).await.unwrap();
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            Reply { status: parts.status, headers: parts.headers, body }
        })
    }

    pub(crate) async fn post(&self, path: &str, headers: &[(&str, &str)], v: &Value) -> Reply {
        self.send(self.request("POST", path, headers, Bytes::from(v.to_string()))).await
    }

    pub(crate) async fn get(&self, path: &str) -> Reply {
        self.send(self.request("GET", path, &[], Bytes::new())).await
    }

    /// `POST /debug/route` of a request to `path`: its answer.
    pub(crate) async fn dry(&self, path: &str, headers: &[(&str, &str)], v: &Value) -> Value {
        let query = if path == "/generate" { "?route=generate" } else { "" };
        let r = self.post(&format!("/debug/route{query}"), headers, v).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        r.json()
    }

    pub(crate) async fn debug_workers(&self) -> Value {
        let r = self.get("/debug/workers").await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        r.json()
    }

    /// Requests booked on each holder of every worker now (0 everywhere when nothing is in flight).
    pub(crate) fn booked(&self) -> Vec<(WorkerId, u16, u32, u64)> {
        let snap = self.gateway.control().cluster().load();
        let now = self.gateway.control().clock().now();
        let mut out = Vec::new();
        for w in snap.workers() {
            for r in 0..w.spec().dp_size.max(1) {
                let l = w.state().rank_load(DpRank(r), now).unwrap();
                out.push((w.spec().id, r, l.booked_requests, l.booked_prefill_tokens));
            }
        }
        out
    }

    pub(crate) async fn shutdown(mut self) {
        self.gateway.begin_shutdown();
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.server.take() {
            let _ = t.await;
        }
        if let Some(s) = self.admin_stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.admin_server.take() {
            let _ = t.await;
        }
    }
}

/// `name`'s entry in a `/debug/workers` answer.
pub(crate) fn worker_entry<'a>(dbg: &'a Value, name: &str) -> &'a Value {
    dbg["workers"].as_array().unwrap().iter().find(|w| w["name"] == name).unwrap()
}

/// A prompt of about 200 tokens (a dozen full blocks), distinct per `tag`.
pub(crate) fn prompt(tag: &str) -> String {
    let mut s = format!("[{tag}] Keep these rules. ");
    for i in 0..20 {
        s.push_str(&format!("Rule {i} of {tag}: be brief and exact. "));
    }
    s
}
