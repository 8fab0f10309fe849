//! `--policies NAME@N`: Cortex as N gateway replicas in separate processes in front of the same
//! simulated cluster, the requests spread across them round robin as an upstream load balancer
//! would. Each replica is this binary's `gateway` command (the gateway library, started exactly
//! as `cortex-gateway --config` starts it), follows the engines' KV events itself and books only
//! its own requests; nothing connects the replicas but the engines' own load reports.
//!
//! Key decision: separate processes, because what a replica holds is per process (the metrics
//! recorder is process-wide, and a replica must not see another's bookings through shared
//! memory).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The line a `gateway` command prints once it listens: the public address, then ` admin ` and
/// the admin listener's (where `/debug/workers` is).
pub const LISTENING: &str = "cortex-bench gateway listening on ";

/// The environment variable that hands a replica its admin token.
pub const ADMIN_TOKEN_ENV: &str = "CORTEX_BENCH_ADMIN_TOKEN";

/// Running replicas.
pub struct Replicas {
    /// Their public addresses, in order.
    pub addrs: Vec<SocketAddr>,
    /// Their admin listeners, in the same order.
    admins: Vec<SocketAddr>,
    /// The admin token every replica was given.
    token: String,
    children: Vec<Child>,
}

impl std::fmt::Debug for Replicas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replicas").field("addrs", &self.addrs).finish()
    }
}

impl Replicas {
    /// Starts `n` replicas of the configuration `yaml` (written to `dir`), each logging to
    /// `dir/replica-<i>.log`, and waits until every one sees every one of `workers` workers
    /// healthy, its profile confirmed and its ledger READY.
    ///
    /// # Errors
    /// A replica cannot start or does not become ready within 60 s.
    pub async fn start(yaml: &str, n: usize, workers: usize, dir: &Path) -> Result<Replicas> {
        let file = dir.join("replica.cortex.yaml");
        std::fs::write(&file, yaml).with_context(|| format!("writing {}", file.display()))?;
        let exe = std::env::current_exe().context("this binary's path")?;
        // A fresh token per run (the standard library's randomly seeded hasher, twice).
        let random = || {
            use std::hash::{BuildHasher, Hasher};
            std::collections::hash_map::RandomState::new().build_hasher().finish()
        };
        let token = format!("{:016x}{:016x}", random(), random());
        let mut r = Replicas { addrs: Vec::new(), admins: Vec::new(), token, children: Vec::new() };
        for i in 0..n {
            let log = std::fs::File::create(dir.join(format!("replica-{i}.log")))?;
            let mut child = Command::new(&exe)
                .args(["gateway", "--config"])
                .arg(&file)
                .env(ADMIN_TOKEN_ENV, &r.token)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting replica {i}"))?;
            let stdout = child.stdout.take().context("the replica's stdout")?;
            r.children.push(child);
            let line = tokio::task::spawn_blocking(move || {
                BufReader::new(stdout).lines().map_while(Result::ok).find(|l| l.starts_with(LISTENING))
            })
            .await?;
            let addrs = line.and_then(|l| {
                let (public, admin) = l[LISTENING.len()..].trim().split_once(" admin ")?;
                Some((public.parse().ok()?, admin.parse().ok()?))
            });
            let Some((addr, admin)) = addrs else {
                r.stop().await;
                bail!(
                    "replica {i} exited before it listened; see {}",
                    dir.join(format!("replica-{i}.log")).display()
                );
            };
            r.addrs.push(addr);
            r.admins.push(admin);
        }
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let deadline = Instant::now() + Duration::from_secs(60);
        for (i, admin) in r.admins.clone().into_iter().enumerate() {
            loop {
                if ready(&client, admin, &r.token, workers).await {
                    break;
                }
                if Instant::now() > deadline {
                    r.stop().await;
                    bail!("replica {i} did not see every worker ready within 60 s");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(r)
    }

    /// Every replica's `GET /debug/workers`, in order (`Null` for one that does not answer).
    pub async fn workers_views(&self) -> Vec<serde_json::Value> {
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let mut out = Vec::with_capacity(self.admins.len());
        for &admin in &self.admins {
            out.push(workers_view(&client, admin, &self.token).await);
        }
        out
    }

    /// Kills every replica.
    pub async fn stop(mut self) {
        for mut c in self.children.drain(..) {
            let _ = c.kill();
            let _ = tokio::task::spawn_blocking(move || c.wait()).await;
        }
    }
}

/// `GET /debug/workers` of the replica whose admin listener is `admin` (`Null` when it does not
/// answer within 2 s).
async fn workers_view(
    client: &Client<HttpConnector, Full<Bytes>>,
    admin: SocketAddr,
    token: &str,
) -> serde_json::Value {
    let Ok(req) = http::Request::get(format!("http://{admin}/debug/workers"))
        .header("authorization", format!("Bearer {token}"))
        .body(Full::new(Bytes::new()))
    else {
        return serde_json::Value::Null;
    };
    let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), client.request(req)).await else {
        return serde_json::Value::Null;
    };
    let Ok(body) = resp.into_body().collect().await.map(|b| b.to_bytes()) else {
        return serde_json::Value::Null;
    };
    serde_json::from_slice(&body).unwrap_or_default()
}

/// Whether the replica whose admin listener is `admin` sees `workers` workers healthy,
/// confirmed, READY.
async fn ready(
    client: &Client<HttpConnector, Full<Bytes>>,
    admin: SocketAddr,
    token: &str,
    workers: usize,
) -> bool {
    let v = workers_view(client, admin, token).await;
    let Some(ws) = v["workers"].as_array() else { return false };
    ws.len() == workers
        && ws.iter().all(|w| {
            w["health"] == "healthy"
                && w["profile"]["verdict"] == "confirmed"
                && w["ranks"][0]["ledger"] == "ready"
        })
}

/// The `gateway` command: the gateway of `config`, with an admin listener on a free loopback
/// port behind the token in [`ADMIN_TOKEN_ENV`], until killed.
///
/// # Errors
/// The configuration does not validate or the gateway cannot start.
#[allow(clippy::print_stdout)] // the address is the command's output
pub fn serve(root: &Path, config: &Path) -> Result<std::process::ExitCode> {
    let yaml = std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let mut settings = cortex_gateway::config::Config::parse(&yaml)?.into_settings(root)?;
    let token = std::env::var(ADMIN_TOKEN_ENV).with_context(|| format!("{ADMIN_TOKEN_ENV} is not set"))?;
    settings.admin = Some(cortex_gateway::config::AdminSettings {
        listen: "127.0.0.1:0".parse()?,
        token: cortex_gateway::Token::new(&token),
        tls: None,
    });
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let running = cortex_gateway::start(settings, None).await?;
        let admin = running.admin_addr.context("the admin listener")?;
        println!("{LISTENING}{} admin {admin}", running.addr);
        std::future::pending::<()>().await;
        drop(running);
        Ok(std::process::ExitCode::SUCCESS)
    })
}
