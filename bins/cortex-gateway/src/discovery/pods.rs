//! Pods as discovery sees them, and the reconciler that turns what the Kubernetes API says about
//! them into membership [`Change`]s. Pure: no client, no clock, no I/O.
//!
//! Key decisions:
//! - **A pod serves when it is Ready, has an IP, is not terminating and has the port**; anything
//!   else is a reason, not a worker. A pod whose deletion has begun leaves at once, before its
//!   engine stops.
//! - **The reconciler keeps the members it announced**, keyed by pod name with the pod's uid and
//!   endpoint: an event or relist that agrees changes nothing, one that changes the endpoint or
//!   the uid (a pod recreated under the same name) is a leave then a join, and a relist (the
//!   first list, after `410 Gone`, on resync) leaves every member the list no longer has — so a
//!   missed watch event costs at most one resync, never a stale worker.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

use super::{Change, Discovered};

/// The annotation SGLang prefill pods carry their bootstrap port in.
pub const BOOTSTRAP_PORT_ANNOTATION: &str = "sglang.ai/bootstrap-port";

/// Which port of a pod the engine listens on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortSpec {
    /// A port number.
    Number(u16),
    /// The name of a container port (`spec.containers[].ports[].name`).
    Named(String),
}

/// Why a pod does not serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotServing {
    /// Its `Ready` condition is not `True`.
    NotReady,
    /// It has no IP yet.
    NoIp,
    /// Its deletion has begun.
    Terminating,
    /// No container declares the named port.
    NoSuchPort(String),
    /// The bootstrap-port annotation is not a port number.
    BadBootstrapPort(String),
}

impl std::fmt::Display for NotServing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotServing::NotReady => f.write_str("not Ready"),
            NotServing::NoIp => f.write_str("no pod IP"),
            NotServing::Terminating => f.write_str("terminating"),
            NotServing::NoSuchPort(p) => write!(f, "no container port named `{p}`"),
            NotServing::BadBootstrapPort(v) => {
                write!(f, "annotation {BOOTSTRAP_PORT_ANNOTATION} `{v}` is not a port number")
            }
        }
    }
}

/// Where a serving pod's engine is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// `http://ip:port`.
    pub url: String,
    /// SGLang's bootstrap port, when read.
    pub bootstrap_port: Option<u16>,
}

/// What the reconciler needs to know of one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodState {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid` (a pod recreated under the same name has a new one).
    pub uid: String,
    /// Its endpoint, or why it does not serve.
    pub serving: Result<Endpoint, NotServing>,
}

/// How pods of one selector are read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodReading {
    /// The engine's port.
    pub port: PortSpec,
    /// Read [`BOOTSTRAP_PORT_ANNOTATION`] (prefill pods).
    pub bootstrap_port: bool,
}

/// Reads a pod. `None` for an object without a name (the API never sends one).
#[must_use]
pub fn pod_state(pod: &Pod, reading: &PodReading) -> Option<PodState> {
    let meta = &pod.metadata;
    let name = meta.name.clone()?;
    let uid = meta.uid.clone().unwrap_or_default();
    Some(PodState { name, uid, serving: serving(pod, reading) })
}

fn serving(pod: &Pod, reading: &PodReading) -> Result<Endpoint, NotServing> {
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(NotServing::Terminating);
    }
    let status = pod.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    if !ready {
        return Err(NotServing::NotReady);
    }
    let ip = status.and_then(|s| s.pod_ip.as_deref()).filter(|ip| !ip.is_empty()).ok_or(NotServing::NoIp)?;
    let port = match &reading.port {
        PortSpec::Number(n) => *n,
        PortSpec::Named(name) => pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| u16::try_from(p.container_port).ok())
            .ok_or_else(|| NotServing::NoSuchPort(name.clone()))?,
    };
    let bootstrap_port = if reading.bootstrap_port {
        match pod.metadata.annotations.as_ref().and_then(|a| a.get(BOOTSTRAP_PORT_ANNOTATION)) {
            None => None,
            Some(v) => Some(
                v.trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| NotServing::BadBootstrapPort(v.clone()))?,
            ),
        }
    } else {
        None
    };
    // An IPv6 address takes brackets in a URL.
    let host = if ip.contains(':') { format!("[{ip}]") } else { ip.to_owned() };
    Ok(Endpoint { url: format!("http://{host}:{port}"), bootstrap_port })
}

/// A member the reconciler announced.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Member {
    uid: String,
    endpoint: Endpoint,
}

/// The members of one selector, kept from list and watch events.
#[derive(Debug, Default)]
pub struct Reconciler {
    members: BTreeMap<String, Member>,
}

impl Reconciler {
    /// An empty reconciler (nothing announced yet).
    #[must_use]
    pub fn new() -> Self {
        Reconciler::default()
    }

    /// The names of the members announced, in order.
    pub fn members(&self) -> impl Iterator<Item = &str> {
        self.members.keys().map(String::as_str)
    }

    /// A full list (the first one, a relist after `410 Gone`, a resync): members the list lacks
    /// or no longer serving leave, new serving pods join, changed ones rejoin.
    pub fn relist(&mut self, pods: impl IntoIterator<Item = PodState>) -> Vec<Change> {
        let listed: BTreeMap<String, PodState> = pods.into_iter().map(|p| (p.name.clone(), p)).collect();
        let gone: Vec<String> = self.members.keys().filter(|n| !listed.contains_key(*n)).cloned().collect();
        let mut changes: Vec<Change> = gone.iter().flat_map(|n| self.deleted(n)).collect();
        for pod in listed.into_values() {
            changes.extend(self.applied(pod));
        }
        // Every leave before any join: a pod that took the address of one no longer serving in
        // the same list would be refused (the address taken) and wait for the next relist.
        changes.sort_by_key(|c| matches!(c, Change::Join(_)));
        changes
    }

    /// A pod was added or modified.
    pub fn applied(&mut self, pod: PodState) -> Vec<Change> {
        let mut changes = Vec::new();
        let old = self.members.get(&pod.name);
        match pod.serving {
            Ok(endpoint) => {
                let member = Member { uid: pod.uid, endpoint };
                if old == Some(&member) {
                    return changes;
                }
                if old.is_some() {
                    changes.push(Change::Leave(pod.name.clone()));
                }
                changes.push(Change::Join(Discovered {
                    name: pod.name.clone(),
                    url: member.endpoint.url.clone(),
                    bootstrap_port: member.endpoint.bootstrap_port,
                }));
                self.members.insert(pod.name, member);
            }
            Err(_) => changes.extend(self.deleted(&pod.name)),
        }
        changes
    }

    /// A pod was deleted.
    pub fn deleted(&mut self, name: &str) -> Vec<Change> {
        match self.members.remove(name) {
            Some(_) => vec![Change::Leave(name.to_owned())],
            None => Vec::new(),
        }
    }

    /// Forgets a member whose join was refused, without a leave: the next event or relist that
    /// shows it serving announces it again.
    pub fn forget(&mut self, name: &str) {
        self.members.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, uid: &str, ready: bool, ip: Option<&str>) -> Pod {
        let mut status = json!({"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": if ready { "True" } else { "False" }},
        ]});
        if let Some(ip) = ip {
            status["podIP"] = json!(ip);
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "uid": uid, "annotations": {BOOTSTRAP_PORT_ANNOTATION: "8998"}},
            "spec": {"containers": [
                {"name": "sidecar", "ports": [{"name": "metrics", "containerPort": 9090}]},
                {"name": "engine", "ports": [{"name": "http", "containerPort": 30000}]},
            ]},
            "status": status,
        }))
        .unwrap()
    }

    fn reading(port: PortSpec) -> PodReading {
        PodReading { port, bootstrap_port: false }
    }

    fn state(p: &Pod) -> PodState {
        pod_state(p, &reading(PortSpec::Named("http".into()))).unwrap()
    }

    fn join(name: &str, url: &str) -> Change {
        Change::Join(Discovered { name: name.into(), url: url.into(), bootstrap_port: None })
    }

    fn leave(name: &str) -> Change {
        Change::Leave(name.into())
    }

    #[test]
    fn a_pod_serves_only_when_ready_with_an_ip_and_the_port() {
        let named = reading(PortSpec::Named("http".into()));
        let ok = pod_state(&pod("a", "1", true, Some("10.1.2.3")), &named).unwrap();
        assert_eq!(ok.serving.unwrap().url, "http://10.1.2.3:30000");
        let numbered = pod_state(&pod("a", "1", true, Some("10.1.2.3")), &reading(PortSpec::Number(8000)));
        assert_eq!(numbered.unwrap().serving.unwrap().url, "http://10.1.2.3:8000");
        let v6 = pod_state(&pod("a", "1", true, Some("fd00::7")), &named).unwrap();
        assert_eq!(v6.serving.unwrap().url, "http://[fd00::7]:30000");
        let cases = [
            (pod("a", "1", false, Some("10.1.2.3")), NotServing::NotReady),
            (pod("a", "1", true, None), NotServing::NoIp),
            (pod("a", "1", true, Some("")), NotServing::NoIp),
        ];
        for (p, why) in cases {
            assert_eq!(pod_state(&p, &named).unwrap().serving, Err(why));
        }
        let mut terminating = pod("a", "1", true, Some("10.1.2.3"));
        terminating.metadata.deletion_timestamp =
            serde_json::from_value(json!("2026-12-01T00:00:00Z")).unwrap();
        assert_eq!(pod_state(&terminating, &named).unwrap().serving, Err(NotServing::Terminating));
        let missing = reading(PortSpec::Named("grpc".into()));
        assert_eq!(
            pod_state(&pod("a", "1", true, Some("10.1.2.3")), &missing).unwrap().serving,
            Err(NotServing::NoSuchPort("grpc".into()))
        );
        // No Ready condition at all (a pod just created) is not ready.
        let fresh: Pod = serde_json::from_value(json!({"metadata": {"name": "b"}})).unwrap();
        assert_eq!(pod_state(&fresh, &named).unwrap().serving, Err(NotServing::NotReady));
        let nameless: Pod = serde_json::from_value(json!({"metadata": {}})).unwrap();
        assert_eq!(pod_state(&nameless, &named), None);
    }

    #[test]
    fn the_bootstrap_port_is_read_only_when_asked_and_must_be_a_port() {
        let ask = PodReading { port: PortSpec::Named("http".into()), bootstrap_port: true };
        let mut p = pod("p", "1", true, Some("10.0.0.9"));
        assert_eq!(pod_state(&p, &ask).unwrap().serving.unwrap().bootstrap_port, Some(8998));
        assert_eq!(state(&p).serving.unwrap().bootstrap_port, None);
        for bad in ["http", "0", "70000", ""] {
            p.metadata.annotations.as_mut().unwrap().insert(BOOTSTRAP_PORT_ANNOTATION.into(), bad.into());
            assert_eq!(
                pod_state(&p, &ask).unwrap().serving,
                Err(NotServing::BadBootstrapPort(bad.into())),
                "{bad}"
            );
        }
        p.metadata.annotations = None;
        assert_eq!(pod_state(&p, &ask).unwrap().serving.unwrap().bootstrap_port, None);
    }

    #[test]
    fn events_join_and_leave_once() {
        let mut r = Reconciler::new();
        // Initial list: one serving pod, one not yet ready.
        let changes =
            r.relist([state(&pod("a", "1", true, Some("10.0.0.1"))), state(&pod("b", "2", false, None))]);
        assert_eq!(changes, vec![join("a", "http://10.0.0.1:30000")]);
        // ADDED for a pod already a member (a watch resumed from an older version): nothing.
        assert_eq!(r.applied(state(&pod("a", "1", true, Some("10.0.0.1")))), vec![]);
        // MODIFIED: b becomes ready.
        assert_eq!(
            r.applied(state(&pod("b", "2", true, Some("10.0.0.2")))),
            vec![join("b", "http://10.0.0.2:30000")]
        );
        // MODIFIED: a is no longer ready, then ready again.
        assert_eq!(r.applied(state(&pod("a", "1", false, Some("10.0.0.1")))), vec![leave("a")]);
        assert_eq!(r.applied(state(&pod("a", "1", false, Some("10.0.0.1")))), vec![]);
        assert_eq!(
            r.applied(state(&pod("a", "1", true, Some("10.0.0.1")))),
            vec![join("a", "http://10.0.0.1:30000")]
        );
        // DELETED, twice (a relist raced the event): one leave.
        assert_eq!(r.deleted("b"), vec![leave("b")]);
        assert_eq!(r.deleted("b"), vec![]);
        // A pod never seen serving is deleted: nothing.
        assert_eq!(r.deleted("zzz"), vec![]);
        assert_eq!(r.members().collect::<Vec<_>>(), vec!["a"]);
    }

    #[test]
    fn a_new_address_or_a_recreated_pod_rejoins() {
        let mut r = Reconciler::new();
        r.relist([state(&pod("a", "1", true, Some("10.0.0.1")))]);
        // The same name, a new uid and IP (a StatefulSet pod recreated while the watch was away).
        assert_eq!(
            r.applied(state(&pod("a", "9", true, Some("10.0.0.7")))),
            vec![leave("a"), join("a", "http://10.0.0.7:30000")]
        );
        // Same IP, new uid: still a new worker (its engine restarted with an empty cache).
        assert_eq!(
            r.applied(state(&pod("a", "10", true, Some("10.0.0.7")))),
            vec![leave("a"), join("a", "http://10.0.0.7:30000")]
        );
    }

    #[test]
    fn a_relist_leaves_what_it_no_longer_lists() {
        let mut r = Reconciler::new();
        r.relist([
            state(&pod("a", "1", true, Some("10.0.0.1"))),
            state(&pod("b", "2", true, Some("10.0.0.2"))),
            state(&pod("c", "3", true, Some("10.0.0.3"))),
        ]);
        // After a 410: a was deleted, b turned unready, c is unchanged, d is new.
        let changes = r.relist([
            state(&pod("b", "2", false, Some("10.0.0.2"))),
            state(&pod("c", "3", true, Some("10.0.0.3"))),
            state(&pod("d", "4", true, Some("10.0.0.4"))),
        ]);
        assert_eq!(changes, vec![leave("a"), leave("b"), join("d", "http://10.0.0.4:30000")]);
        assert_eq!(r.members().collect::<Vec<_>>(), vec!["c", "d"]);
        // An empty relist empties it.
        assert_eq!(r.relist([]), vec![leave("c"), leave("d")]);
    }

    /// A pod given the address of another that no longer serves, seen in one relist: the other
    /// leaves first, so the join is not refused as an address taken (it would wait for the next
    /// relist, 5 min by default). Pod names sort the joiner first.
    #[test]
    fn a_relist_leaves_before_it_joins() {
        let mut r = Reconciler::new();
        r.relist([state(&pod("b-y", "2", true, Some("10.0.0.7")))]);
        let changes = r.relist([
            state(&pod("a-x", "1", true, Some("10.0.0.7"))),
            state(&pod("b-y", "2", false, Some("10.0.0.7"))),
        ]);
        assert_eq!(changes, vec![leave("b-y"), join("a-x", "http://10.0.0.7:30000")]);
        // A rejoin (a new address) keeps its leave before its join.
        let changes = r.relist([state(&pod("a-x", "1", true, Some("10.0.0.8")))]);
        assert_eq!(changes, vec![leave("a-x"), join("a-x", "http://10.0.0.8:30000")]);
    }

    #[test]
    fn a_refused_join_is_announced_again_by_the_next_event() {
        let mut r = Reconciler::new();
        assert_eq!(r.relist([state(&pod("a", "1", true, Some("10.0.0.1")))]).len(), 1);
        r.forget("a");
        // Forgotten: its deletion is no leave (it never joined) …
        assert_eq!(r.deleted("a"), vec![]);
        // … and the next list that shows it serving tries again.
        assert_eq!(
            r.relist([state(&pod("a", "1", true, Some("10.0.0.1")))]),
            vec![join("a", "http://10.0.0.1:30000")]
        );
    }
}
