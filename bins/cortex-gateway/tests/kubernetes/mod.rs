//! Kubernetes discovery end to end: the gateway watches a fake Kubernetes API server on loopback
//! (list and watch of pods, JSON lines, resource versions, `410 Gone`) whose pods point at
//! simulated workers, and its live pool follows every step. The fake is driven by the test:
//! each event is sent when the test says, each watch ends when the test ends it, and every
//! request is recorded so that the test can check what the gateway asked for.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cortex_gateway::discovery::kubernetes::ApiAccess;
use cortex_sim::SimWorker;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::common::{Harness, harness_with, metric, prometheus, sim};

const NAMESPACE: &str = "inference";
const SELECTOR: &str = "app=engine,tier!=canary";

/// One request the fake answered.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    watch: bool,
    resource_version: Option<String>,
    label_selector: Option<String>,
}

#[derive(Default)]
struct State {
    /// The pods a list returns, by name.
    pods: BTreeMap<String, Value>,
    /// The last resource version handed out.
    version: u64,
    seen: Vec<Seen>,
    /// The open watch's sender (dropping it ends the watch).
    watch: Option<mpsc::UnboundedSender<Bytes>>,
    /// Answer the next watch request `410 Gone`.
    gone_on_next_watch: bool,
}

/// A fake API server: list and watch of the pods of [`NAMESPACE`].
#[derive(Clone)]
struct FakeApi {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

fn query(uri: &http::Uri) -> BTreeMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), percent_decode(v)))
        .collect()
}

/// Decodes a query value (`application/x-www-form-urlencoded`, as kube-client encodes it).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 3 <= b.len() => {
                out.push(u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap(), 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}

type Body = BoxBody<Bytes, Infallible>;

fn full(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed())
        .unwrap()
}

fn status_410() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": "too old resource version", "reason": "Expired", "code": 410})
}

impl FakeApi {
    async fn start() -> FakeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api = FakeApi { addr: listener.local_addr().unwrap(), state: Arc::default() };
        let server = api.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else { return };
                let api = server.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let api = api.clone();
                        async move { Ok::<_, Infallible>(api.answer(req)) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        api
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn answer(&self, req: Request<Incoming>) -> Response<Body> {
        let q = query(req.uri());
        let watch = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
        let mut st = self.state.lock().unwrap();
        st.seen.push(Seen {
            path: req.uri().path().to_owned(),
            watch,
            resource_version: q.get("resourceVersion").cloned(),
            label_selector: q.get("labelSelector").cloned(),
        });
        if req.uri().path() != format!("/api/v1/namespaces/{NAMESPACE}/pods") {
            return full(StatusCode::NOT_FOUND, &json!({"kind": "Status", "code": 404}));
        }
        if !watch {
            let items: Vec<Value> = st.pods.values().cloned().collect();
            let list = json!({"kind": "PodList", "apiVersion": "v1",
                              "metadata": {"resourceVersion": st.version.to_string()}, "items": items});
            return full(StatusCode::OK, &list);
        }
        if std::mem::take(&mut st.gone_on_next_watch) {
            return full(StatusCode::GONE, &status_410());
        }
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        st.watch = Some(tx);
        let frames = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
        });
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(frames)))
            .unwrap()
    }

    fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    fn watches(&self) -> usize {
        self.seen().iter().filter(|s| s.watch).count()
    }

    fn lists(&self) -> usize {
        self.seen().iter().filter(|s| !s.watch).count()
    }

    fn watching(&self) -> bool {
        self.state.lock().unwrap().watch.as_ref().is_some_and(|w| !w.is_closed())
    }

    /// Stores `pod` with a new resource version, silently (a change a broken watch would miss).
    fn put_silently(&self, mut pod: Value) -> u64 {
        let mut st = self.state.lock().unwrap();
        st.version += 1;
        pod["metadata"]["resourceVersion"] = json!(st.version.to_string());
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        st.pods.insert(name, pod);
        st.version
    }

    fn remove_silently(&self, name: &str) -> Value {
        let mut st = self.state.lock().unwrap();
        st.version += 1;
        let mut pod = st.pods.remove(name).unwrap();
        pod["metadata"]["resourceVersion"] = json!(st.version.to_string());
        pod
    }

    /// Sends one watch event on the open watch.
    fn send(&self, kind: &str, object: &Value) {
        let st = self.state.lock().unwrap();
        let line = format!("{}\n", json!({"type": kind, "object": object}));
        st.watch.as_ref().expect("a watch is open").send(Bytes::from(line)).unwrap();
    }

    /// Stores `pod` and sends `ADDED` or `MODIFIED`; returns its resource version.
    fn put(&self, pod: Value) -> u64 {
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        let existed = self.state.lock().unwrap().pods.contains_key(&name);
        let version = self.put_silently(pod);
        let stored = self.state.lock().unwrap().pods[&name].clone();
        self.send(if existed { "MODIFIED" } else { "ADDED" }, &stored);
        version
    }

    fn delete(&self, name: &str) {
        let pod = self.remove_silently(name);
        self.send("DELETED", &pod);
    }

    fn bookmark(&self) -> u64 {
        let version = {
            let mut st = self.state.lock().unwrap();
            st.version += 1;
            st.version
        };
        self.send(
            "BOOKMARK",
            &json!({"kind": "Pod", "apiVersion": "v1",
                                       "metadata": {"resourceVersion": version.to_string()}}),
        );
        version
    }

    /// Ends the open watch (as the API server does at its timeout).
    fn end_watch(&self) {
        self.state.lock().unwrap().watch = None;
    }
}

/// A pod of [`SELECTOR`] whose engine is `sim` (IP 127.0.0.1, the named port `http`).
fn pod(name: &str, uid: &str, sim: &SimWorker, ready: bool) -> Value {
    let port: u16 = sim.base_url().rsplit(':').next().unwrap().trim_end_matches('/').parse().unwrap();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid, "labels": {"app": "engine"}},
        "spec": {"containers": [{"name": "engine", "image": "sglang",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    })
}

fn discovery_section() -> String {
    format!(
        "{{kubernetes: {{namespace: {NAMESPACE}, resync: 1h, workers: [{{selector: '{SELECTOR}', port: http, engine: sglang, model: m}}]}}}}"
    )
}

async fn gateway(api: &FakeApi, static_sims: Vec<cortex_sim::SimConfig>) -> Harness {
    let url = api.url();
    let section = discovery_section();
    harness_with(
        "sglang",
        static_sims,
        &[("discovery", &section)],
        move |s| s.kubernetes.as_mut().unwrap().api = ApiAccess::Url(url),
        Some(prometheus()),
    )
    .await
}

fn member(h: &Harness, name: &str) -> Option<String> {
    h.gw.gateway.control().registry().by_name(name).map(|w| w.config.url.clone())
}

fn live(h: &Harness, name: &str) -> bool {
    let Some(w) = h.gw.gateway.control().registry().by_name(name) else { return false };
    h.gw.gateway
        .control()
        .cluster()
        .load()
        .worker(w.id)
        .is_some_and(|e| e.health() == cortex_sched::Health::Healthy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_pool_follows_the_pods_through_list_watch_resume_and_gone() {
    let sims: Vec<SimWorker> = (0..4).map(|_| SimWorker::start(sim("sglang")).unwrap()).collect();
    let api = FakeApi::start().await;
    // Initial list: a serves, b is not ready yet.
    api.put_silently(pod("a", "uid-a", &sims[0], true));
    api.put_silently(pod("b", "uid-b", &sims[1], false));
    let h = gateway(&api, vec![]).await;
    h.wait("a joins from the initial list", || live(&h, "a")).await;
    assert_eq!(member(&h, "a").as_deref(), Some(sims[0].base_url().trim_end_matches('/')));
    assert_eq!(member(&h, "b"), None);
    let first = api.seen();
    assert_eq!(first[0].path, format!("/api/v1/namespaces/{NAMESPACE}/pods"));
    assert!(!first[0].watch);
    assert_eq!(first[0].label_selector.as_deref(), Some(SELECTOR));
    h.wait("the watch is open", || api.watching()).await;
    let w = api.seen().into_iter().find(|s| s.watch).unwrap();
    assert_eq!(w.resource_version.as_deref(), Some("2"), "the watch starts at the list's version");
    assert_eq!(w.label_selector.as_deref(), Some(SELECTOR));

    // MODIFIED: b becomes Ready and joins.
    api.put(pod("b", "uid-b", &sims[1], true));
    h.wait("b joins when Ready", || live(&h, "b")).await;
    // a's events are followed (the ledger has its holder) until it leaves.
    let a_holder = h.holder("a");
    h.wait("a's events are followed", || h.gw.ledger_state(a_holder).is_some()).await;
    // MODIFIED: a is no longer Ready: it leaves, its ledger pruned.
    api.put(pod("a", "uid-a", &sims[0], false));
    h.wait("a leaves when not Ready", || member(&h, "a").is_none()).await;
    h.wait("a's ledger entries are dropped", || h.gw.ledger_state(a_holder).is_none()).await;
    assert!(live(&h, "b"));

    // The watch ends (the server's timeout); the gateway resumes it from the last version seen.
    let version = api.bookmark();
    let watches = api.watches();
    api.end_watch();
    h.wait("the watch is resumed", || api.watches() > watches && api.watching()).await;
    let resumed = api.seen().into_iter().rev().find(|s| s.watch).unwrap();
    assert_eq!(resumed.resource_version, Some(version.to_string()), "resumed from the bookmark");
    assert_eq!(api.lists(), 1, "a resumed watch needs no relist");
    // ADDED on the resumed watch: c joins; DELETED: b leaves.
    api.put(pod("c", "uid-c", &sims[2], true));
    h.wait("c joins", || live(&h, "c")).await;
    api.delete("b");
    h.wait("b leaves when deleted", || member(&h, "b").is_none()).await;

    // While the watch is gone, pods change without events: c is deleted, d appears, a is back.
    // The server answers the resumed watch 410 Gone; the gateway relists and catches up.
    api.remove_silently("c");
    api.put_silently(pod("d", "uid-d", &sims[3], true));
    api.put_silently(pod("a", "uid-a", &sims[0], true));
    let (lists, watches) = (api.lists(), api.watches());
    api.send("ERROR", &status_410());
    h.wait("a relist after 410 Gone", || api.lists() > lists).await;
    h.wait("the relisted pool", || member(&h, "c").is_none() && live(&h, "d") && live(&h, "a")).await;

    // The same at the start of a watch: a watch request answered 410 forces a relist too.
    h.wait("a new watch after the relist", || api.watches() > watches && api.watching()).await;
    api.remove_silently("d");
    api.state.lock().unwrap().gone_on_next_watch = true;
    let lists = api.lists();
    api.end_watch();
    h.wait("a relist after a watch refused 410", || api.lists() > lists).await;
    h.wait("d leaves after the relist", || member(&h, "d").is_none()).await;
    assert!(live(&h, "a"));
    let mut names: Vec<String> =
        h.gw.gateway.control().registry().snapshot().values().map(|w| w.config.name.clone()).collect();
    names.sort();
    assert_eq!(names, ["a"]);
    h.shutdown().await;
    drop(sims);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_named_like_a_static_worker_is_refused_not_overwritten() {
    let other = SimWorker::start(sim("sglang")).unwrap();
    let api = FakeApi::start().await;
    // The file configures w0; a pod of the same name points elsewhere.
    api.put_silently(pod("w0", "uid-w0", &other, true));
    api.put_silently(pod("p1", "uid-p1", &other, true));
    let refused_before = refused(&prometheus().render());
    let h = gateway(&api, vec![sim("sglang")]).await;
    let static_url = h.worker("w0").base_url().trim_end_matches('/').to_owned();
    h.wait("p1 joins", || live(&h, "p1")).await;
    // The pod named w0 was refused: w0 is still the file's worker.
    assert_eq!(member(&h, "w0"), Some(static_url.clone()));
    let text = h.send("GET", "/metrics", Bytes::new()).await.body;
    assert!(refused(&text) > refused_before, "the refusal is counted:\n{text}");
    // The pod's deletion does not remove the file's worker (it was never the pod's).
    h.wait("the watch is open", || api.watching()).await;
    api.delete("w0");
    api.delete("p1");
    h.wait("p1 leaves", || member(&h, "p1").is_none()).await;
    assert_eq!(member(&h, "w0"), Some(static_url));
    assert!(live(&h, "w0"));
    h.shutdown().await;
}

/// A discovered worker removed through the admin API while its pod serves is added again by the
/// next relist: discovery's view wins (it was out until the pod changed or the gateway
/// restarted). A review's finding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_worker_removed_by_the_admin_api_comes_back_at_the_relist() {
    let engine = SimWorker::start(sim("sglang")).unwrap();
    let api = FakeApi::start().await;
    api.put_silently(pod("p1", "uid-p1", &engine, true));
    let h = gateway(&api, vec![]).await;
    h.wait("p1 joins", || live(&h, "p1")).await;
    h.wait("the watch is open", || api.watching()).await;
    let r = h.send("DELETE", "/admin/workers/p1", Bytes::new()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(member(&h, "p1"), None);
    let lists = api.lists();
    api.send("ERROR", &status_410());
    h.wait("a relist", || api.lists() > lists).await;
    h.wait("p1 is back", || live(&h, "p1")).await;
    h.shutdown().await;
}

/// The refusals counted so far in this test binary (the recorder is global).
fn refused(metrics_text: &str) -> f64 {
    metric(
        metrics_text,
        "cortex_discovery_refused_total",
        &[("source", "kubernetes"), ("reason", "name_taken")],
    )
}
