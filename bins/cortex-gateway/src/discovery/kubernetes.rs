//! Kubernetes discovery: one list/watch loop per label selector over the pods of a namespace,
//! feeding the pure [`Reconciler`](super::pods::Reconciler) and applying what it says through
//! [`Membership`](super::Membership).
//!
//! Key decisions:
//! - **kube-client, not kube-runtime.** The loop is the Kubernetes list/watch protocol written
//!   out: list (its `resourceVersion`), watch from it with bookmarks, resume a watch that ends
//!   from the last version seen, relist on `410 Gone` and on every `resync`. It is short, and
//!   it is what the tests drive against a fake API server, step by step.
//! - **Never stuck, never busy.** A watch that delivers nothing for longer than the server's own
//!   watch timeout is presumed dead and resumed; failures back off exponentially (up to 30 s);
//!   a bad selector is logged with its key at every retry, never applied half.
//! - **The API access comes from the environment** (in the cluster: the service account; else
//!   the kubeconfig), found at start so that a gateway that cannot reach Kubernetes is refused
//!   at start with the reason.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use cortex_proxy::Gateway;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube_client::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::pods::{NotServing, PodReading, PodState, Reconciler, pod_state};
use super::{Applied, Change, DISCOVERY_ERRORS, DISCOVERY_RELISTS, Membership, WorkerTemplate};

/// The metric label of this source.
const SOURCE: &str = "kubernetes";

/// The server-side timeout of one watch request (the API server ends it then; it is resumed).
const WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// A watch silent for this long is presumed dead (the server would have ended it).
const WATCH_IDLE: Duration = Duration::from_secs(290 + 30);

/// The longest a list, or the request that opens a watch, may take: a connection that stops
/// answering without being reset (a node lost, a conntrack entry dropped) fails then, is counted
/// and retried, instead of freezing the selector's discovery with no sign.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// First and longest wait after a failed request.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(30));

/// How the gateway reaches the Kubernetes API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiAccess {
    /// From the environment: `KUBECONFIG` or `~/.kube/config`, else the pod's service account.
    Infer,
    /// This URL (`http://host:port`), unauthenticated: a `kubectl proxy`, or a test's fake API
    /// server.
    Url(String),
}

/// One selector: which pods, and what workers they are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodGroup {
    /// The configuration key it came from (`discovery.kubernetes.workers[0]`), for logs.
    pub key: String,
    /// A Kubernetes label selector (`app=sglang,tier!=canary`).
    pub selector: String,
    /// How its pods are read.
    pub reading: PodReading,
    /// What its workers are.
    pub template: WorkerTemplate,
}

/// `discovery.kubernetes`, typed and validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesSettings {
    /// How to reach the API.
    pub api: ApiAccess,
    /// The namespace; `None`: the service account's (or the kubeconfig context's).
    pub namespace: Option<String>,
    /// How often every selector is listed again in full.
    pub resync: Duration,
    /// The selectors.
    pub groups: Vec<PodGroup>,
}

/// A started selector loop and the sender that stops it.
pub type Stoppable = (oneshot::Sender<()>, JoinHandle<()>);

/// Connects to the API and starts one loop per selector.
///
/// # Errors
/// No API access can be found (neither a kubeconfig nor a service account).
pub async fn start(settings: KubernetesSettings, gateway: &Arc<Gateway>) -> Result<Vec<Stoppable>> {
    let config = match &settings.api {
        ApiAccess::Infer => kube_client::Config::infer()
            .await
            .context("discovery.kubernetes: no Kubernetes API access (no kubeconfig, not in a pod)")?,
        ApiAccess::Url(url) => kube_client::Config::new(
            url.parse().with_context(|| format!("discovery.kubernetes: the API URL `{url}`"))?,
        ),
    };
    let namespace = settings.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
    let client = kube_client::Client::try_from(config).context("discovery.kubernetes: the API client")?;
    super::describe();
    tracing::info!(%namespace, selectors = settings.groups.len(), "discovering workers in Kubernetes");
    let mut started = Vec::new();
    for group in settings.groups {
        let api: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        let membership = Membership::new(Arc::clone(gateway), SOURCE, group.template.clone());
        let (tx, rx) = oneshot::channel::<()>();
        let resync = settings.resync;
        let task = tokio::spawn(async move {
            tokio::select! {
                () = follow(api, group, resync, membership) => {}
                _ = rx => {}
            }
        });
        started.push((tx, task));
    }
    Ok(started)
}

/// Applies the reconciler's changes; a refused join is forgotten so that a later event retries.
fn apply(changes: Vec<Change>, reconciler: &mut Reconciler, membership: &mut Membership) {
    for change in changes {
        let name = match &change {
            Change::Join(d) => Some(d.name.clone()),
            Change::Leave(_) => None,
        };
        if let (Applied::Refused(_), Some(name)) = (membership.apply(change), name) {
            reconciler.forget(&name);
        }
    }
}

/// Exponential backoff between failed requests.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Backoff(BACKOFF.0)
    }

    async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(BACKOFF.1);
    }

    fn reset(&mut self) {
        self.0 = BACKOFF.0;
    }
}

/// Why the watch phase ended.
enum Relist {
    /// `410 Gone`: the version is too old to resume from.
    Gone,
    /// The resync period is over.
    Resync,
}

/// The list/watch loop of one selector, forever.
async fn follow(api: Api<Pod>, group: PodGroup, resync: Duration, mut membership: Membership) {
    let mut reconciler = Reconciler::new();
    let mut backoff = Backoff::new();
    let mut reason = "start";
    let mut warned = NotServingLog::default();
    loop {
        let params = ListParams::default().labels(&group.selector);
        let list = match tokio::time::timeout(REQUEST_TIMEOUT, api.list(&params)).await {
            Ok(Ok(list)) => list,
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer in {REQUEST_TIMEOUT:?}"),
                };
                metrics::counter!(DISCOVERY_ERRORS, "source" => SOURCE, "op" => "list").increment(1);
                tracing::error!(key = %group.key, selector = %group.selector, %error, "cannot list pods; retrying");
                backoff.wait().await;
                reason = "error";
                continue;
            }
        };
        backoff.reset();
        metrics::counter!(DISCOVERY_RELISTS, "source" => SOURCE, "reason" => reason).increment(1);
        // Workers removed through the admin API since: the relist adds them again.
        for name in membership.removed_elsewhere() {
            reconciler.forget(&name);
        }
        let pods: Vec<PodState> = list.items.iter().filter_map(|p| pod_state(p, &group.reading)).collect();
        warned.log(&group, &pods);
        apply(reconciler.relist(pods), &mut reconciler, &mut membership);
        let version = list.metadata.resource_version.unwrap_or_default();
        let until = tokio::time::Instant::now() + resync;
        reason = match watch(
            &api,
            &group,
            version,
            until,
            &mut reconciler,
            &mut membership,
            &mut backoff,
            &mut warned,
        )
        .await
        {
            Relist::Gone => "gone",
            Relist::Resync => "resync",
        };
    }
}

/// Watches from `version` until `until` or a `410 Gone`, resuming every watch that ends from
/// the last version seen.
#[allow(clippy::too_many_arguments)] // one caller; the pieces of one selector's loop
async fn watch(
    api: &Api<Pod>,
    group: &PodGroup,
    mut version: String,
    until: tokio::time::Instant,
    reconciler: &mut Reconciler,
    membership: &mut Membership,
    backoff: &mut Backoff,
    warned: &mut NotServingLog,
) -> Relist {
    let params = WatchParams::default()
        .labels(&group.selector)
        .timeout(u32::try_from(WATCH_TIMEOUT.as_secs()).unwrap_or(290));
    loop {
        let stream = tokio::select! {
            s = tokio::time::timeout(REQUEST_TIMEOUT, api.watch(&params, &version)) => s,
            () = tokio::time::sleep_until(until) => return Relist::Resync,
        };
        let stream = match stream {
            Ok(Ok(s)) => s,
            Ok(Err(kube_client::Error::Api(status))) if status.code == 410 => return Relist::Gone,
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer in {REQUEST_TIMEOUT:?}"),
                };
                metrics::counter!(DISCOVERY_ERRORS, "source" => SOURCE, "op" => "watch").increment(1);
                tracing::warn!(key = %group.key, %error, "cannot watch pods; retrying");
                backoff.wait().await;
                continue;
            }
        };
        let mut stream = std::pin::pin!(stream);
        let started = tokio::time::Instant::now();
        let mut delivered = false;
        loop {
            let next = tokio::select! {
                n = tokio::time::timeout(WATCH_IDLE, stream.next()) => n,
                () = tokio::time::sleep_until(until) => return Relist::Resync,
            };
            let event = match next {
                Ok(Some(Ok(event))) => event,
                Ok(Some(Err(kube_client::Error::Api(status)))) if status.code == 410 => return Relist::Gone,
                Ok(Some(Err(e))) => {
                    metrics::counter!(DISCOVERY_ERRORS, "source" => SOURCE, "op" => "watch").increment(1);
                    tracing::warn!(key = %group.key, error = %e, "pod watch failed; resuming");
                    break;
                }
                // The server ended the watch (its timeout), or it went silent.
                Ok(None) | Err(_) => break,
            };
            delivered = true;
            let changes = match event {
                WatchEvent::Added(pod) | WatchEvent::Modified(pod) => {
                    version = pod.metadata.resource_version.clone().unwrap_or(version);
                    let Some(state) = pod_state(&pod, &group.reading) else { continue };
                    warned.log(group, std::slice::from_ref(&state));
                    reconciler.applied(state)
                }
                WatchEvent::Deleted(pod) => {
                    version = pod.metadata.resource_version.clone().unwrap_or(version);
                    match &pod.metadata.name {
                        Some(name) => reconciler.deleted(name),
                        None => continue,
                    }
                }
                WatchEvent::Bookmark(b) => {
                    version = b.metadata.resource_version;
                    continue;
                }
                WatchEvent::Error(status) if status.code == 410 => return Relist::Gone,
                WatchEvent::Error(status) => {
                    tracing::warn!(key = %group.key, error = ?status, "pod watch error; resuming");
                    break;
                }
            };
            apply(changes, reconciler, membership);
        }
        // A watch that ends at once with nothing, again and again, backs off; one that delivered
        // or lasted resumes now.
        if delivered || started.elapsed() >= Duration::from_secs(1) {
            backoff.reset();
        } else {
            backoff.wait().await;
        }
    }
}

/// Logs why pods do not serve: a passing state (not Ready yet, no IP, terminating) at debug; a
/// configuration that keeps a Ready pod out for good (no container port of the configured name,
/// a bad bootstrap-port annotation) as a warning, once per pod (by uid), with a count.
#[derive(Default)]
struct NotServingLog {
    warned: std::collections::HashSet<String>,
}

impl NotServingLog {
    fn log(&mut self, group: &PodGroup, pods: &[PodState]) {
        for p in pods {
            match &p.serving {
                Err(why @ (NotServing::NoSuchPort(_) | NotServing::BadBootstrapPort(_))) => {
                    if self.warned.len() > 4096 {
                        self.warned.clear();
                    }
                    if self.warned.insert(p.uid.clone()) {
                        let reason = match why {
                            NotServing::NoSuchPort(_) => "no_port",
                            _ => "bad_annotation",
                        };
                        metrics::counter!(super::DISCOVERY_REFUSED, "source" => SOURCE, "reason" => reason)
                            .increment(1);
                        tracing::warn!(key = %group.key, pod = %p.name, %why, "a Ready pod of the selector cannot be used; it stays out");
                    }
                }
                Err(why) => {
                    tracing::debug!(key = %group.key, pod = %p.name, %why, "pod does not serve (yet)")
                }
                Ok(_) => {}
            }
        }
    }
}
