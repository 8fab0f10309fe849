//! `cortex-gateway`: the binary platform teams deploy.
//!
//! ```text
//! cortex-gateway --config cortex.yaml        # a real cluster
//! cortex-gateway --demo                      # a simulated cluster of both engines, no GPU
//! cortex-gateway --check-config cortex.yaml  # validate, print a JSON summary, exit
//! ```
//!
//! Installs the Prometheus recorder and the log subscriber, starts the gateway (see the library
//! half of this package) and shuts it down gracefully on SIGINT or SIGTERM.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use cortex_gateway::log_pipe::{self, LogPipe, Stream};
use cortex_gateway::{config::Config, demo, start};

/// Cortex: a KV-cache-aware gateway for SGLang and vLLM workers.
#[derive(Parser, Debug)]
#[command(name = "cortex-gateway", version, about)]
struct Cli {
    /// The configuration file (YAML; see docs/configuration.md).
    #[arg(long, value_name = "FILE", conflicts_with = "demo")]
    config: Option<PathBuf>,
    /// Run on an embedded simulated cluster (cortex-sim workers of both engines) with the Qwen3
    /// tokenizer and template shipped in the repository.
    #[arg(long)]
    demo: bool,
    /// Public listener of the demo.
    #[arg(long, default_value = "127.0.0.1:8080", requires = "demo")]
    listen: SocketAddr,
    /// Admin listener of the demo (the admin API and `/debug/*`, behind a token it prints).
    #[arg(long, default_value = "127.0.0.1:8081", requires = "demo")]
    admin_listen: SocketAddr,
    /// Simulated workers per engine in the demo (with --pd: prefill workers, and as many decode
    /// workers).
    #[arg(long, default_value_t = 2, requires = "demo")]
    workers_per_engine: usize,
    /// The demo's cluster is disaggregated: prefill and decode workers of each engine.
    #[arg(long, requires = "demo")]
    pd: bool,
    /// Simulated time per wall-clock time in the demo (1 = real time, 0 = instant).
    #[arg(long, default_value_t = 1.0, requires = "demo")]
    sim_speed: f64,
    /// Validate the configuration file and exit.
    #[arg(long, value_name = "FILE")]
    check_config: Option<PathBuf>,
    /// Log filter (`RUST_LOG` syntax).
    #[arg(long, default_value = "info", env = "RUST_LOG")]
    log: String,
    /// Threads of the async runtime that serves HTTP and relays bodies (default: one per core).
    /// Tokenizing long or chat prompts runs on a separate blocking pool either way. On a host
    /// where the gateway shares few cores with other busy processes, 1 avoids cross-thread
    /// wake-ups between a request's tasks (see docs/perf.md, gateway overhead).
    #[arg(long, value_name = "N", env = "CORTEX_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..))]
    worker_threads: Option<u16>,
    /// Bytes of log lines held for a reader that falls behind (per stream: stderr, and stdout's
    /// JSON access log). Past it, lines are dropped and counted
    /// (`cortex_log_lines_dropped_total`), never waited for.
    #[arg(long, value_name = "BYTES", env = "CORTEX_LOG_BUFFER_BYTES", default_value_t = log_pipe::DEFAULT_BUFFER_BYTES as u64, value_parser = clap::value_parser!(u64).range(1..))]
    log_buffer_bytes: u64,
}

/// The log pipes, flushed before the process exits.
static PIPES: OnceLock<Vec<LogPipe>> = OnceLock::new();

/// How long the exit waits for a log reader.
const LOG_FLUSH: Duration = Duration::from_secs(1);

#[allow(clippy::print_stdout, clippy::print_stderr)]
fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = run(cli);
    // Every pipe is flushed (`all` would stop at the first that times out).
    let flushed: Vec<bool> = PIPES.get().into_iter().flatten().map(|pipe| pipe.flush(LOG_FLUSH)).collect();
    let flushed = !flushed.contains(&false);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A reader that stopped reading holds the stderr lock in the writer thread's write:
            // writing here would hang the exit. The exit status still says it failed.
            if flushed {
                eprintln!("cortex-gateway: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The log subscriber: `--log`'s filter on stderr; with a JSON access log, its lines on stdout
/// whatever `--log` says (and not on stderr). Both through a [`LogPipe`] of `buffer` bytes, so
/// that a reader that stops reading costs log lines, never a request's time; colours only on a
/// terminal.
fn init_logging(log: &str, access_json: bool, buffer: usize) -> Result<()> {
    use std::io::IsTerminal;
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_new(log).context("--log")?;
    let stderr = LogPipe::start(Stream::Stderr, buffer).context("starting the log writer")?;
    // stdout is the command's output (the --check-config summary, the demo's URL and curl).
    let main = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(stderr.clone());
    if access_json {
        let stdout = LogPipe::start(Stream::Stdout, buffer).context("starting the access log writer")?;
        let target = cortex_proxy::observe::ACCESS_TARGET;
        let filter = filter.add_directive(format!("{target}=off").parse().context("--log")?);
        let access = tracing_subscriber::fmt::layer()
            .with_writer(stdout.clone())
            .event_format(MessageOnly)
            .with_filter(
                tracing_subscriber::filter::Targets::new().with_target(target, tracing::Level::INFO),
            );
        tracing_subscriber::registry().with(main.with_filter(filter)).with(access).init();
        let _ = PIPES.set(vec![stderr, stdout]);
    } else {
        tracing_subscriber::registry().with(main.with_filter(filter)).init();
        let _ = PIPES.set(vec![stderr]);
    }
    Ok(())
}

/// Writes an event's message alone (a JSON access line).
struct MessageOnly;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for MessageOnly
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        struct Message<'a, 'b>(&'a mut tracing_subscriber::fmt::format::Writer<'b>, std::fmt::Result);
        impl tracing::field::Visit for Message<'_, '_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.1 = write!(self.0, "{value:?}");
                }
            }
        }
        let mut m = Message(&mut writer, Ok(()));
        event.record(&mut m);
        m.1?;
        writeln!(writer)
    }
}

#[allow(clippy::print_stdout)]
fn run(cli: Cli) -> Result<()> {
    // The configuration is read before logging starts: it says where the access log goes.
    let loaded = match (&cli.config, cli.demo) {
        (Some(path), false) => Some(Config::load(path)?),
        _ => None,
    };
    let access_json = loaded.as_ref().is_some_and(|(c, _)| c.access_log.format.as_deref() == Some("json"));
    init_logging(&cli.log, access_json, usize::try_from(cli.log_buffer_bytes).unwrap_or(usize::MAX))?;
    if let Some(path) = &cli.check_config {
        let (cfg, base) = Config::load(path)?;
        let s = cfg.into_settings(&base)?;
        // One JSON line, for people and for checks that compare it with manifests.
        let summary = serde_json::json!({
            "file": path.display().to_string(),
            "ok": true,
            "listen": s.listen.to_string(),
            "shutdown_grace_ms": u64::try_from(s.proxy.shutdown_grace.as_millis()).unwrap_or(u64::MAX),
            "shutdown_delay_ms": u64::try_from(s.proxy.shutdown_delay.as_millis()).unwrap_or(u64::MAX),
            "models": s.models.names().count(),
            "workers": s.workers.len(),
        });
        println!("{summary}");
        return Ok(());
    }
    let prometheus = cortex_proxy::telemetry::prometheus_builder()
        .install_recorder()
        .context("installing the metrics recorder")?;
    cortex_proxy::telemetry::describe();
    log_pipe::describe(PIPES.get().map_or(&[][..], Vec::as_slice));
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cli.worker_threads {
        runtime.worker_threads(usize::from(n));
    }
    let runtime = runtime.enable_all().build().context("starting the runtime")?;
    runtime.block_on(async move {
        let (settings, sims, admin_token) = if cli.demo {
            let shape = if cli.pd { demo::Shape::Disaggregated } else { demo::Shape::Regular };
            let d = demo::start(cli.listen, cli.admin_listen, cli.workers_per_engine, cli.sim_speed, shape)?;
            (d.settings, d.workers, d.admin_token)
        } else {
            let (cfg, base) = loaded.context("either --config FILE or --demo is required")?;
            (cfg.into_settings(&base)?, Vec::new(), String::new())
        };
        let running = start(settings, Some(prometheus)).await?;
        tracing::info!(addr = %running.addr, admin = ?running.admin_addr, "cortex-gateway serving");
        if cli.demo {
            // Let discovery find the workers before telling the user to send traffic.
            let deadline = tokio::time::Instant::now() + demo::DISCOVERY_WAIT;
            while running.gateway.control().cluster().load().workers().len() < sims.len()
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let admin = running.admin_addr.context("the demo's admin listener")?;
            println!("{}", demo::banner(running.addr, admin, &admin_token, &sims));
        }
        shutdown_signal().await;
        tracing::info!("shutting down: not ready at once, new connections refused after shutdown_delay, in-flight streams may finish (a second signal exits at once)");
        tokio::select! {
            () = running.shutdown() => {}
            () = shutdown_signal() => {
                tracing::warn!("a second signal: exiting now, in-flight requests cut");
            }
        }
        drop(sims);
        Ok(())
    })
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
