//! `cargo xtask obs-check`: the Grafana dashboard and the Prometheus alert rules of `deploy/`
//! checked against a real Prometheus scraping the demo gateway under traffic.
//!
//! Steps: Debian's `prometheus` package installed if `promtool` is missing (it has the server
//! and `promtool`); `promtool check rules` and `promtool test rules`; the demo gateway started
//! twice (`--demo` and `--demo --pd`, the test build's binary in CI) and sent traffic, with
//! worker faults injected through the simulator's fault API (a refused request, a 503 that is
//! retried, a dropped event batch); `promtool check metrics` on a scrape of each; then a
//! Prometheus server on loopback scraping both every second with the rules loaded.
//!
//! Key decisions:
//! - **Every dashboard expression returns data** with its variables substituted as Grafana's
//!   "All" (`.*`) and `$__rate_interval` as `1m`, and every template variable's query too.
//! - **Rules are checked by their parts**: an alert's condition is normally empty on a healthy
//!   demo, so each rule must evaluate healthy and each series selector inside it must match
//!   series Cortex exports. For both, every label an expression groups or matches on (`by`,
//!   `on`) must be carried by one of the metrics it selects: a renamed metric or a label Cortex
//!   does not carry fails the check.
//! - Processes are children killed when dropped; waits are on observable state with deadlines.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

use crate::net::{self, Proc, STARTUP, free_port, http, wait_ready};

/// `cargo xtask obs-check` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// The gateway's executable, already built (CI passes the test build's); without it the
    /// gateway is built with `cargo build`.
    #[arg(long)]
    pub gateway: Option<PathBuf>,
}

#[allow(clippy::print_stdout)]
fn say(s: &str) {
    println!("obs-check: {s}");
}

/// `promtool` on the `PATH`, else Debian's `prometheus` package installed (after an `apt-get
/// update` if the package is unknown). Returns its version line.
fn promtool() -> Result<String> {
    let version = || {
        Command::new("promtool")
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or_default().to_owned())
    };
    if let Some(v) = version() {
        return Ok(v);
    }
    let install = || {
        crate::command_output(
            Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends", "prometheus"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
            "apt-get install prometheus",
        )
    };
    if install().is_err() {
        crate::command_output(Command::new("apt-get").arg("update"), "apt-get update")?;
        install()?;
    }
    version().context("prometheus is installed but `promtool --version` fails")
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query's result vector.
fn query(prom: SocketAddr, q: &str) -> Result<Vec<Value>> {
    let a = http(prom, "GET", &format!("/api/v1/query?query={}", encode(q)), None)?;
    let v: Value = serde_json::from_slice(&a.body).with_context(|| format!("query `{q}`: {}", a.text()))?;
    ensure!(v["status"] == "success", "query `{q}` failed: {v}");
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// The series selectors of a PromQL expression: every `cortex_…` metric name, with its
/// `{…}` matchers when it has them.
fn selectors(expr: &str) -> Vec<String> {
    let b = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = expr[i..].find("cortex_") {
        let start = i + at;
        let boundary = start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
            end += 1;
        }
        if boundary {
            let mut sel = expr[start..end].to_owned();
            if b.get(end) == Some(&b'{')
                && let Some(close) = expr[end..].find('}')
            {
                sel.push_str(&expr[end..=end + close]);
                end += close + 1;
            }
            out.push(sel);
        }
        i = end.max(start + 1);
    }
    out
}

/// The labels an expression groups or matches on (`by (…)`, `on (…)`), `le` excepted.
fn grouping_labels(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in ["by", "on"] {
        let mut rest = expr;
        while let Some(at) = rest.find(kw) {
            let before = rest[..at].chars().last();
            let after = rest[at + kw.len()..].trim_start();
            rest = &rest[at + kw.len()..];
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') || !after.starts_with('(') {
                continue;
            }
            let Some(close) = after.find(')') else { continue };
            for l in after[1..close].split(',').map(str::trim).filter(|l| !l.is_empty() && *l != "le") {
                if !out.iter().any(|o| o == l) {
                    out.push(l.to_owned());
                }
            }
        }
    }
    out
}

/// Checks that every selector of `expr` matches series, and every grouping label is carried by
/// one of its metrics. Returns the problems.
fn check_parts(prom: SocketAddr, what: &str, expr: &str) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    let sels = selectors(expr);
    if sels.is_empty() {
        problems.push(format!("{what}: no Cortex metric in `{expr}`"));
    }
    for s in &sels {
        if query(prom, &format!("count({s})"))?.is_empty() {
            problems.push(format!("{what}: `{s}` matches no series Cortex exports"));
        }
    }
    for l in grouping_labels(expr) {
        let mut carried = false;
        for s in &sels {
            let name = s.split('{').next().unwrap_or(s);
            if !query(prom, &format!("count({name}{{{l}!=\"\"}})"))?.is_empty() {
                carried = true;
                break;
            }
        }
        if !carried {
            problems.push(format!("{what}: no metric of `{expr}` carries the label `{l}`"));
        }
    }
    Ok(problems)
}

/// A demo gateway process and its address.
struct Demo {
    /// Kept to be killed when dropped; its log is shown when a request to it fails.
    proc: Proc,
    addr: SocketAddr,
    workers: Vec<SocketAddr>,
}

fn start_demo(root: &Path, exe: &Path, pd: bool, logs: &Path) -> Result<Demo> {
    let name = if pd { "demo-pd" } else { "demo" };
    let d = net::start_demo(
        root,
        Command::new(exe),
        if pd { &["--pd"] } else { &[] },
        &format!("cortex-gateway ({name})"),
        logs.join(format!("{name}.log")),
        STARTUP,
    )?;
    // The workers' own addresses, for the faults: `/debug/workers` on the admin listener.
    let dbg = net::get_with_token(d.admin, "/debug/workers", &d.token)?;
    let v: Value = serde_json::from_slice(&dbg.body).context("/debug/workers")?;
    let workers = v["workers"]
        .as_array()
        .context("/debug/workers has no workers")?
        .iter()
        .filter_map(|w| w["url"].as_str())
        .map(|u| u.trim_start_matches("http://").trim_end_matches('/').parse())
        .collect::<Result<Vec<SocketAddr>, _>>()
        .context("a worker URL")?;
    Ok(Demo { proc: d.proc, addr: d.public, workers })
}

/// One round of requests of every route, streaming and not, to both demo models.
fn traffic(addr: SocketAddr, tag: &str) -> Result<()> {
    let long = format!("[{tag}] You are a careful assistant. ").repeat(30);
    for model in ["qwen3-vllm", "qwen3-sglang"] {
        for stream in [false, true] {
            let chat = json!({"model": model, "stream": stream, "max_tokens": 4,
                "messages": [{"role": "system", "content": long}, {"role": "user", "content": "Hi."}]});
            http(addr, "POST", "/v1/chat/completions", Some(&chat))?;
            let completion = json!({"model": model, "stream": stream, "max_tokens": 4, "prompt": long});
            http(addr, "POST", "/v1/completions", Some(&completion))?;
        }
    }
    let generate = json!({"model": "qwen3-sglang", "text": long, "sampling_params": {"max_new_tokens": 4}});
    http(addr, "POST", "/generate", Some(&generate))?;
    Ok(())
}

fn fault(worker: SocketAddr, f: &Value) -> Result<()> {
    let a = http(worker, "POST", "/sim/fault", Some(f))?;
    ensure!(a.status == 200, "POST /sim/fault {f} to {worker}: {} {}", a.status, a.text());
    Ok(())
}

/// Traffic with faults: each worker refuses one request (400), fails one with a 503 (retried
/// elsewhere), drops one event batch; and a request for a model nobody serves.
fn faults(d: &Demo, tag: &str) -> Result<()> {
    for w in &d.workers {
        fault(*w, &json!({"fail_next": {"status": 400, "count": 1}}))?;
    }
    traffic(d.addr, &format!("{tag}-refused"))?;
    for w in &d.workers {
        fault(*w, &json!({"fail_next": {"status": 503, "count": 1}}))?;
    }
    traffic(d.addr, &format!("{tag}-retried"))?;
    for w in &d.workers {
        fault(*w, &json!({"drop_batches": {"rank": 0, "count": 1}}))?;
    }
    traffic(d.addr, &format!("{tag}-gap"))?;
    traffic(d.addr, &format!("{tag}-after-gap"))?;
    let unknown = json!({"model": "no-such-model", "prompt": "x", "max_tokens": 1});
    http(d.addr, "POST", "/v1/completions", Some(&unknown))?;
    Ok(())
}

/// `promtool check metrics` on a scrape of `d`.
fn check_metrics(d: &Demo, dir: &Path, name: &str) -> Result<()> {
    let m = http(d.addr, "GET", "/metrics", None)?;
    ensure!(m.status == 200, "/metrics answered {}", m.status);
    let file = dir.join(format!("metrics-{name}.txt"));
    std::fs::write(&file, &m.body)?;
    let out = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file)?)
        .output()
        .context("running promtool check metrics")?;
    ensure!(
        out.status.success(),
        "promtool check metrics on the {name} gateway's scrape ({}):\n{}{}",
        file.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Every query of the dashboard: its panels' targets and its template variables'.
fn dashboard_queries(dash: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut panels: Vec<&Value> = dash["panels"].as_array().map(|p| p.iter().collect()).unwrap_or_default();
    while let Some(p) = panels.pop() {
        if let Some(inner) = p["panels"].as_array() {
            panels.extend(inner);
        }
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((format!("panel `{}`", p["title"].as_str().unwrap_or("?")), e.to_owned()));
            }
        }
    }
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        let q = v["query"]["query"].as_str().or_else(|| v["query"].as_str()).unwrap_or_default();
        if let Some(args) = q.strip_prefix("label_values(").and_then(|r| r.strip_suffix(')'))
            && let Some((sel, label)) = args.rsplit_once(',')
        {
            let (sel, label) = (sel.trim(), label.trim());
            out.push((
                format!("variable `{}`", v["name"].as_str().unwrap_or("?")),
                format!("count by ({label}) ({sel})"),
            ));
        }
    }
    out
}

/// Grafana's "All" for every variable, and a rate window Prometheus accepts.
fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m").replace("$instance", ".*").replace("$worker", ".*")
}

/// Runs the check.
///
/// # Errors
/// The first step that fails, or every expression that does not hold.
pub fn run(root: &Path, args: &Args) -> Result<()> {
    let started = Instant::now();
    let version = promtool()?;
    say(&version);
    let rules_dir = root.join("deploy/prometheus");
    let rules = rules_dir.join("cortex-rules.yaml");
    crate::command_output(
        Command::new("promtool").arg("check").arg("rules").arg(&rules),
        "promtool check rules",
    )?;
    crate::command_output(
        Command::new("promtool").args(["test", "rules", "cortex-rules.test.yaml"]).current_dir(&rules_dir),
        "promtool test rules",
    )?;
    say("promtool check rules and test rules: ok");

    let exe = match &args.gateway {
        Some(e) => e.clone(),
        None => {
            crate::command_output(
                Command::new(crate::cargo())
                    .args(["build", "--quiet", "-p", "cortex-gateway", "--bin", "cortex-gateway"])
                    .current_dir(root),
                "cargo build -p cortex-gateway",
            )?;
            crate::target_dir(root).join("debug").join("cortex-gateway")
        }
    };
    let dir = crate::target_dir(root).join("obs-check");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let regular = start_demo(root, &exe, false, &dir)?;
    let pd = start_demo(root, &exe, true, &dir)?;
    for (d, name) in [(&regular, "demo"), (&pd, "pd")] {
        traffic(d.addr, name)
            .and_then(|()| faults(d, name))
            .and_then(|()| check_metrics(d, &dir, name))
            .map_err(|e| anyhow::anyhow!("{e:#}\n{}", d.proc.tail()))?;
    }
    say("promtool check metrics on both scrapes: ok");

    let prom_port = free_port()?;
    let prom: SocketAddr = format!("127.0.0.1:{prom_port}").parse()?;
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: ['{}']\nscrape_configs:\n  - job_name: cortex\n    static_configs:\n      - targets: ['{}', '{}']\n",
        rules.display(),
        regular.addr,
        pd.addr
    );
    std::fs::write(dir.join("prometheus.yml"), config)?;
    let log = dir.join("prometheus.log");
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address={prom}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .context("starting prometheus")?;
    let mut server = Proc { name: "prometheus".to_owned(), child, log: Some(log) };
    wait_ready(prom, "/-/ready", &mut server)?;

    // Traffic while Prometheus scrapes, until both targets have samples a rate can use.
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut round = 0;
    loop {
        round += 1;
        traffic(regular.addr, &format!("scraped-{round}"))?;
        traffic(pd.addr, &format!("scraped-{round}"))?;
        let up = query(prom, "count(up{job=\"cortex\"} == 1)")?;
        let rated = query(prom, "count(rate(cortex_requests_total[1m]) > 0) by (instance)")?;
        if up.first().and_then(|v| v["value"][1].as_str()) == Some("2") && rated.len() == 2 && round >= 4 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "Prometheus has no rate of both gateways' requests after 90s\n{}",
            server.tail()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // One more round of scrapes and rule evaluations after the last traffic.
    std::thread::sleep(Duration::from_secs(2));

    let mut problems = Vec::new();
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("deploy/grafana/cortex.json"))?)
            .context("deploy/grafana/cortex.json")?;
    let queries = dashboard_queries(&dash);
    ensure!(!queries.is_empty(), "the dashboard has no query");
    for (what, expr) in &queries {
        let e = substitute(expr);
        match query(prom, &e) {
            Ok(r) if r.is_empty() => problems.push(format!("{what}: `{e}` returns no data")),
            Ok(_) => {}
            Err(err) => problems.push(format!("{what}: {err:#}")),
        }
        problems.extend(check_parts(prom, what, &e)?);
    }
    let r = http(prom, "GET", "/api/v1/rules", None)?;
    let v: Value = serde_json::from_slice(&r.body).context("/api/v1/rules")?;
    let loaded: Vec<&Value> = v["data"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .collect();
    let file: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&rules)?).context("cortex-rules.yaml")?;
    let in_file = file["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| g["rules"].as_array().map_or(0, Vec::len))
        .sum::<usize>();
    ensure!(
        loaded.len() == in_file && in_file > 0,
        "Prometheus loaded {} rules, the file has {in_file}",
        loaded.len()
    );
    for rule in &loaded {
        let name = rule["name"].as_str().unwrap_or("?");
        let what = format!("rule `{name}`");
        if rule["health"] != "ok" || rule["lastError"].as_str().is_some_and(|e| !e.is_empty()) {
            problems.push(format!("{what}: health {} {}", rule["health"], rule["lastError"]));
        }
        if rule["lastEvaluation"].as_str().is_none_or(|t| t.starts_with("0001")) {
            problems.push(format!("{what}: never evaluated"));
        }
        problems.extend(check_parts(prom, &what, rule["query"].as_str().unwrap_or_default())?);
    }
    if !problems.is_empty() {
        bail!(
            "{} problem(s):\n  {}\n(scrapes and logs under {})",
            problems.len(),
            problems.join("\n  "),
            dir.display()
        );
    }
    say(&format!(
        "{} dashboard queries and {} rules hold against Prometheus scraping the demo and the PD demo ({:.0}s)",
        queries.len(),
        loaded.len(),
        started.elapsed().as_secs_f64()
    ));
    drop((server, regular, pd));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{grouping_labels, selectors};
    use serde_json::Value;

    /// docs/observability.md lists every metric (the constants of telemetry.rs and of the
    /// binary's discovery and log pipe), every panel of the dashboard and every alert.
    #[test]
    fn the_doc_lists_every_metric_panel_and_alert() {
        let root = crate::workspace_root();
        let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_default();
        let doc = read("docs/observability.md");
        let mut missing = Vec::new();
        let mut names = 0;
        for file in [
            "crates/cortex-proxy/src/telemetry.rs",
            "bins/cortex-gateway/src/discovery/mod.rs",
            "bins/cortex-gateway/src/log_pipe.rs",
        ] {
            for line in read(file).lines().filter(|l| l.contains(": &str = \"cortex_")) {
                let name = line.split('"').nth(1).unwrap_or_default();
                names += 1;
                if !doc.contains(&format!("| `{name}` |")) {
                    missing.push(format!("metric {name}"));
                }
            }
        }
        assert!(names > 40, "only {names} metric names found");
        let dash: Value = serde_json::from_str(&read("deploy/grafana/cortex.json")).unwrap_or_default();
        let panels: Vec<&Value> = dash["panels"].as_array().into_iter().flatten().collect();
        assert!(panels.len() > 20);
        for p in panels {
            let title = p["title"].as_str().unwrap_or_default();
            // A row is a heading of the panels' table, a panel a line of it.
            let listed = if p["type"] == "row" { format!("**{title}**") } else { format!("| {title} |") };
            if !doc.contains(&listed) {
                missing.push(format!("panel {title}"));
            }
        }
        let rules: Value =
            serde_yaml_ng::from_str(&read("deploy/prometheus/cortex-rules.yaml")).unwrap_or_default();
        let alerts: Vec<&str> = rules["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .filter_map(|r| r["alert"].as_str())
            .collect();
        assert_eq!(alerts.len(), 9);
        for alert in alerts {
            if !doc.contains(&format!("`{alert}`")) {
                missing.push(format!("alert {alert}"));
            }
        }
        assert!(missing.is_empty(), "docs/observability.md does not list: {missing:?}");
    }

    #[test]
    fn selectors_and_labels_are_found() {
        let e = "sum by (instance, worker) (rate(cortex_a_total{x=\"y\"}[5m])) / on (instance) cortex_b and notcortex_c";
        assert_eq!(selectors(e), ["cortex_a_total{x=\"y\"}", "cortex_b"]);
        assert_eq!(grouping_labels(e), ["instance", "worker"]);
        assert_eq!(grouping_labels("histogram_quantile(0.9, sum by (le, route) (x))"), ["route"]);
        assert!(grouping_labels("sum(cortex_x) by_the_way").is_empty());
    }
}
