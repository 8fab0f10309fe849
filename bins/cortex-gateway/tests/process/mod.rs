//! Simulated workers in processes of their own, for the fault suite: a kill is a real `SIGKILL`
//! (the kernel closes the worker's sockets, its streams are cut mid-byte, nothing of it lives on
//! in the test's process) and a restart is a new process binding the dead one's ports.
//!
//! Key decision: the test binary re-executes itself as the worker (the ignored entry
//! [`sim_worker_process`]), so no other binary's path is needed — the simulator's binary is in
//! another package, which these tests cannot see as `CARGO_BIN_EXE_*` — and the suite runs the
//! same under `cargo test`, `cargo xtask ci` and on a fresh clone. The child takes its
//! [`Spec`] from [`SPEC_VAR`], binds every listener, and only then writes one line with the
//! bound ports on stdout. Its stdin is a pipe from the parent and it exits when that closes, so
//! even a parent killed before it could drop its [`SimProcess`]es leaves no worker behind.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use cortex_radix::Readiness;
use cortex_sim::{Fault, Role, SimWorker};
use http::StatusCode;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};

use crate::common::{self, Harness, worker_index};

/// The environment variable holding a worker process's [`Spec`] (JSON).
const SPEC_VAR: &str = "CORTEX_FAULTS_WORKER";
/// The libtest name of [`sim_worker_process`] in this binary.
const ENTRY: &str = "process::sim_worker_process";
/// What starts the line a worker process reports its ports on.
const READY: &str = "cortex-faults-worker bound ";
/// How long a worker process may take to report its ports. Loading the tokenizer takes it
/// about 1.5 s of CPU in a debug build, several times that on a machine busy with builds; a
/// child that dies is reported at once, whatever this says.
const STARTUP: Duration = Duration::from_secs(90);

/// What a worker process runs: [`common::sim`] or [`common::slow_sim`] of `engine`, on
/// ephemeral ports or on the ones a killed predecessor had.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Spec {
    engine: String,
    slow: bool,
    ports: Option<Ports>,
}

/// A worker serving instantly, as [`common::sim`].
pub(crate) fn sim(engine: &str) -> Spec {
    Spec { engine: engine.to_owned(), slow: false, ports: None }
}

/// A worker decoding in real time, as [`common::slow_sim`].
pub(crate) fn slow_sim(engine: &str) -> Spec {
    Spec { slow: true, ..sim(engine) }
}

/// The ports a worker (one DP rank) bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Ports {
    http: u16,
    publish: u16,
    replay: Option<u16>,
}

impl Spec {
    fn config(&self) -> cortex_sim::SimConfig {
        let mut c = if self.slow { common::slow_sim(&self.engine) } else { common::sim(&self.engine) };
        if let Some(p) = self.ports {
            c.http_port = p.http;
            c.events.port_base = Some(p.publish);
            c.events.replay_port_base = p.replay;
        }
        c
    }
}

/// Not a test: the body of a worker process. Started by [`SimProcess::start`] with its [`Spec`]
/// in [`SPEC_VAR`], it serves until it is killed or its stdin closes; run by hand (no spec) it
/// returns at once.
#[test]
#[ignore = "the worker process the fault tests start by re-executing this binary, not a test"]
fn sim_worker_process() {
    let Ok(spec) = std::env::var(SPEC_VAR) else { return };
    let spec: Spec = serde_json::from_str(&spec).unwrap();
    let worker = SimWorker::start(spec.config()).unwrap();
    let rank0 = worker.event_endpoints()[0];
    let ports = Ports {
        http: worker.http_addr().port(),
        publish: rank0.publish.port(),
        replay: rank0.replay.map(|a| a.port()),
    };
    println!("{READY}{}", serde_json::to_string(&ports).unwrap());
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    worker.shutdown();
}

/// A worker process. Dropping it kills the process (also when a test panics).
pub(crate) struct SimProcess {
    spec: Spec,
    ports: Ports,
    child: Child,
    /// Held open for the child's life: it exits when this closes.
    _stdin: ChildStdin,
}

/// A worker process started and not yet known to be serving ([`Starting::ready`] waits).
/// Dropped, it closes the child's stdin, so the child exits as soon as it is up.
pub(crate) struct Starting {
    spec: Spec,
    child: Child,
    stdin: ChildStdin,
    ports: mpsc::Receiver<Ports>,
}

impl Starting {
    /// Waits until the worker reported its bound ports (every listener accepts connections from
    /// then on).
    pub(crate) fn ready(self) -> SimProcess {
        let Starting { spec, mut child, stdin, ports } = self;
        match ports.recv_timeout(STARTUP) {
            Ok(ports) => SimProcess { spec, ports, child, _stdin: stdin },
            Err(e) => {
                let _ = child.kill();
                panic!("the worker process {spec:?} never reported its ports ({e}): {:?}", child.wait());
            }
        }
    }
}

impl SimProcess {
    /// Starts a worker process running `spec` (the test binary itself, at [`ENTRY`]).
    pub(crate) fn spawn(spec: Spec) -> Starting {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", ENTRY, "--ignored", "--nocapture", "--test-threads", "1"])
            .env(SPEC_VAR, serde_json::to_string(&spec).unwrap())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        // The reader drains stdout for the child's life, so libtest's lines never block it.
        let (tx, ports) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may have written `test … ... ` on the same line first.
                if let Some((_, p)) = line.split_once(READY) {
                    let _ = tx.send(serde_json::from_str::<Ports>(p).unwrap());
                }
            }
        });
        Starting { spec, child, stdin, ports }
    }

    /// [`SimProcess::spawn`], then [`Starting::ready`].
    pub(crate) fn start(spec: Spec) -> SimProcess {
        SimProcess::spawn(spec).ready()
    }

    /// `http://127.0.0.1:port`.
    pub(crate) fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.http)
    }

    /// `kill -9`, and waits until the process is gone (its ports are free again).
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// How the process ended, if it did.
    pub(crate) fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// Kills the process if it still runs and starts a new one on the same ports: a restarted
    /// engine, with an empty cache and its event sequence back to 0.
    pub(crate) fn restart(&mut self) {
        self.kill();
        *self = SimProcess::start(Spec { ports: Some(self.ports), ..self.spec.clone() });
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts a worker process for each of `specs` and a gateway in process in front of them (as
/// [`common::harness`], `prometheus` as [`common::harness_with`]), and waits until every
/// worker is live and its ledger READY: each fault hits a cluster in its steady state.
pub(crate) async fn harness(
    engine: &str,
    specs: Vec<Spec>,
    sections: &[(&str, &str)],
    prometheus: Option<PrometheusHandle>,
) -> Harness<SimProcess> {
    // Started together: each takes a moment to load its tokenizer. The wait blocks this thread,
    // not the runtime's other tasks.
    let starting: Vec<Starting> = specs.into_iter().map(SimProcess::spawn).collect();
    let sims: Vec<SimProcess> =
        tokio::task::block_in_place(|| starting.into_iter().map(Starting::ready).collect());
    let workers: Vec<(String, Role)> = sims.iter().map(|s| (s.base_url(), Role::Unified)).collect();
    let h = common::gateway_in_front(engine, sims, &workers, sections, |_| {}, prometheus).await;
    for i in 0..h.sims.len() {
        let holder = h.holder(&format!("w{i}"));
        h.wait("every ledger READY", || h.gw.ledger_state(holder) == Some(Readiness::Ready)).await;
    }
    h
}

/// Driving worker processes.
impl Harness<SimProcess> {
    /// Injects `fault` into worker `name` through its `POST /sim/fault`.
    pub(crate) async fn inject(&self, name: &str, fault: &Fault) {
        let url = format!("{}/sim/fault", self.sims[worker_index(name)].base_url());
        let r = self.send_to("POST", &url, Bytes::from(serde_json::to_vec(fault).unwrap())).await;
        assert_eq!(r.status, StatusCode::OK, "{fault:?} on {name}: {}", r.body);
    }

    /// `kill -9` to worker `name`.
    pub(crate) fn kill(&mut self, name: &str) {
        self.sims[worker_index(name)].kill();
    }

    /// Starts worker `name` again on the ports it had (after [`Harness::kill`]), blocking this
    /// thread (not the runtime's other tasks) until it serves.
    pub(crate) fn restart(&mut self, name: &str) {
        let w = &mut self.sims[worker_index(name)];
        tokio::task::block_in_place(|| w.restart());
    }
}
