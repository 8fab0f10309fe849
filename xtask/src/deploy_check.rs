//! `cargo xtask deploy-check`: the deployment files checked offline — every kustomization under
//! `deploy/` rendered, every object validated against the Kubernetes API schemas, the gateway's
//! configuration in each rendered ConfigMap checked by the gateway's own parser, the manifests
//! checked against each other and against the `Dockerfile`.
//!
//! Key decisions:
//! - **Render with `kubectl kustomize`**, the `kubectl` on the `PATH` or else Debian's
//!   `kubernetes-client` (installed with apt-get; its kustomize is 2.0.3, so the kustomizations
//!   use only the fields that version reads).
//! - **Strict schemas, two Kubernetes versions.** `kubernetes-validate` (PyPI, pinned, in a venv
//!   under the target directory) checks each object against the oldest Kubernetes the manifests
//!   need ([`KUBERNETES_VERSIONS`]: the preStop `sleep` action is on by default from 1.30) and
//!   the newest it knows, with unknown fields refused. The ServiceMonitor, a custom resource
//!   those schemas lack, is checked against `deploy/schemas/servicemonitor-v1.json` (the
//!   Prometheus Operator's CRD schema, its source in the README beside it), made as strict.
//! - **The gateway reads its own configuration**: each rendered `cortex.yaml` goes through
//!   `Config::parse` and `into_settings` (model files pointed at the repository's Qwen3 files),
//!   so a key the gateway refuses fails here, not in a cluster. An overlay that must be refused
//!   until a feature lands is listed in [`REFUSED`] with the reason, and checked to be refused for it.
//! - Anything it cannot install or run fails the check loudly, with the tool's own output.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

/// What the venv gets from PyPI, pinned so that every machine checks against the same schemas.
const REQUIREMENTS: &[&str] = &["kubernetes-validate==1.37.0", "jsonschema==4.26.0", "PyYAML==6.0.4"];

/// The Kubernetes versions every object is validated against: the oldest the manifests need
/// and the newest the pinned schemas know.
const KUBERNETES_VERSIONS: &[&str] = &["1.30.0", "1.37.0"];

/// The image's build command: CI's `--locked`, the release profile, the gateway only.
const RELEASE_BUILD: &str = "cargo build --release --locked -p cortex-gateway --bin cortex-gateway";

/// Kustomizations whose configuration the gateway must refuse today, and the words of the refusal.
const REFUSED: &[(&str, &str)] = &[];

/// Custom resources those schemas lack: (apiVersion, kind) → schema file under `deploy/`.
const CUSTOM_SCHEMAS: &[(&str, &str, &str)] =
    &[("monitoring.coreos.com/v1", "ServiceMonitor", "schemas/servicemonitor-v1.json")];

/// Validates `{"versions": [...], "objects": [{"source", "object", "schema"?}]}` read from the
/// file named by its first argument; prints every failure; exits 1 if there is one.
const VALIDATE_PY: &str = r#"
import json, sys
import jsonschema, kubernetes_validate

def strict(schema):
    # What the API server does with a structural schema: unknown fields are errors.
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema

job = json.load(open(sys.argv[1]))
failures = 0
for item in job["objects"]:
    obj, name = item["object"], "%s %s/%s" % (item["source"], item["object"]["kind"], item["object"]["metadata"]["name"])
    if "schema" in item:
        schema = strict(json.load(open(item["schema"])))
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=str)
        for e in errors:
            print("FAIL %s (%s): %s: %s" % (name, item["schema"], "/".join(map(str, e.absolute_path)), e.message))
        failures += len(errors)
        continue
    for version in job["versions"]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            print("FAIL %s (Kubernetes %s): %s: %s" % (name, version, "/".join(map(str, e.absolute_path)), e.message))
            failures += 1
        except kubernetes_validate.SchemaNotFoundError as e:
            print("FAIL %s: %s" % (name, e.message))
            failures += 1
print("%d object(s), %d failure(s)" % (len(job["objects"]), failures))
sys.exit(1 if failures else 0)
"#;

/// `cargo xtask deploy-check` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// The Python that creates the venv.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// The gateway's executable, already built (CI passes the test build's); without it the
    /// gateway is built and run with `cargo run`.
    #[arg(long)]
    pub gateway: Option<std::path::PathBuf>,
}

#[allow(clippy::print_stdout)]
fn say(s: &str) {
    println!("{s}");
}

/// A `kubectl` that renders kustomizations: the one on the `PATH`, else Debian's
/// `kubernetes-client`, installed (after an `apt-get update` if the package is unknown).
fn kubectl() -> Result<(String, Option<Duration>)> {
    let works =
        || Command::new("kubectl").args(["version", "--client"]).output().is_ok_and(|o| o.status.success());
    if works() {
        return Ok(("kubectl".to_owned(), None));
    }
    let start = Instant::now();
    let install = || {
        crate::command_output(
            Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends", "kubernetes-client"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
            "apt-get install kubernetes-client",
        )
    };
    if install().is_err() {
        crate::command_output(Command::new("apt-get").arg("update"), "apt-get update")?;
        install()?;
    }
    ensure!(works(), "kubernetes-client is installed but `kubectl version --client` fails");
    Ok(("kubectl".to_owned(), Some(start.elapsed())))
}

/// The kustomizations to render: `deploy/` and every directory under `deploy/overlays/`.
fn kustomizations(deploy: &Path) -> Result<Vec<String>> {
    let mut dirs = vec![".".to_owned()];
    let overlays = deploy.join("overlays");
    if overlays.is_dir() {
        let mut found: Vec<String> = std::fs::read_dir(&overlays)?
            .filter_map(|e| e.ok())
            .filter(|e| e.path().join("kustomization.yaml").is_file())
            .map(|e| format!("overlays/{}", e.file_name().to_string_lossy()))
            .collect();
        found.sort();
        dirs.extend(found);
    }
    Ok(dirs)
}

/// The documents of a multi-document YAML text, as JSON.
fn documents(text: &str) -> Result<Vec<Value>> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).context("rendered YAML")?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn one<'a>(objects: &'a [Value], kind: &str) -> Result<&'a Value> {
    let found = of_kind(objects, kind);
    ensure!(found.len() == 1, "expected one {kind}, found {}", found.len());
    Ok(found[0])
}

/// What the manifests and the Dockerfile must agree on.
#[derive(Debug, Default, PartialEq, Eq)]
struct Facts {
    /// The gateway container's `http` port.
    container_port: u16,
    /// Where the Deployment mounts the ConfigMap, joined with the key `--config` names.
    config_path: String,
}

/// How to run the gateway: the executable CI built (`--gateway`), or `cargo run`.
fn gateway_command(root: &Path, exe: Option<&Path>) -> Command {
    match exe {
        Some(exe) => Command::new(exe),
        None => {
            let mut c = Command::new(crate::cargo());
            c.args(["run", "--quiet", "-p", "cortex-gateway", "--"]).current_dir(root);
            c
        }
    }
}

/// The gateway's own verdict on a rendered `cortex.yaml` (`cortex-gateway --check-config`):
/// `Ok(shutdown_delay + shutdown_grace, listen port)` or its refusal. The model files live on a volume in the
/// cluster; the repository's Qwen3 files stand in for them.
fn gateway_config(
    root: &Path,
    exe: Option<&Path>,
    yaml: &str,
    file: &Path,
) -> Result<std::result::Result<(Duration, u16), String>> {
    let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(yaml).context("cortex.yaml is not YAML")?;
    let qwen = root.join("golden/models/qwen3");
    if let Some(models) = doc.get_mut("models").and_then(serde_yaml_ng::Value::as_sequence_mut) {
        for m in models.iter_mut().filter_map(serde_yaml_ng::Value::as_mapping_mut) {
            for (key, name) in
                [("tokenizer", "tokenizer.json"), ("tokenizer_config", "tokenizer_config.json")]
            {
                m.insert(key.into(), qwen.join(name).display().to_string().into());
            }
            m.remove("chat_template");
        }
    }
    std::fs::write(file, serde_yaml_ng::to_string(&doc)?)
        .with_context(|| format!("writing {}", file.display()))?;
    let out = gateway_command(root, exe)
        .arg("--check-config")
        .arg(file)
        .output()
        .context("running cortex-gateway --check-config")?;
    if !out.status.success() {
        return Ok(Err(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    let summary: Value = serde_json::from_slice(out.stdout.trim_ascii())
        .context("cortex-gateway --check-config printed no JSON summary")?;
    // What the gateway may take after SIGTERM: its drain delay, then its grace for streams.
    let grace = summary["shutdown_grace_ms"].as_u64().context("summary: no shutdown_grace_ms")?
        + summary["shutdown_delay_ms"].as_u64().unwrap_or(0);
    let listen: std::net::SocketAddr =
        summary["listen"].as_str().context("summary: no listen")?.parse().context("summary: listen")?;
    Ok(Ok((Duration::from_millis(grace), listen.port())))
}

/// The gateway as the check runs it, and the verdict on the first (base) configuration.
struct Gateway<'a> {
    exe: Option<&'a Path>,
    work: &'a Path,
    base: std::cell::Cell<Option<(Duration, u16)>>,
}

/// Checks one rendered kustomization: the objects agree with each other and with the
/// gateway's configuration. Returns what the Dockerfile must match.
fn check_objects(root: &Path, dir: &str, objects: &[Value], gateway: &Gateway<'_>) -> Result<Facts> {
    let deployment = one(objects, "Deployment")?;
    let pod = &deployment["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().context("Deployment: no containers")?;
    ensure!(containers.len() == 1, "Deployment: one container expected");
    let c = &containers[0];
    let port = c["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "http")
        .and_then(|p| p["containerPort"].as_u64())
        .context("Deployment: no container port named http")?;
    let port = u16::try_from(port)?;
    for (probe, path) in [("readinessProbe", "/health/ready"), ("livenessProbe", "/health/live")] {
        ensure!(
            c[probe]["httpGet"]["path"] == path && c[probe]["httpGet"]["port"] == "http",
            "Deployment: {probe} must GET {path} on port http"
        );
    }
    // --config names a file of the ConfigMap's mount.
    let args: Vec<&str> = c["args"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    let config_path = args
        .windows(2)
        .find(|w| w[0] == "--config")
        .map(|w| w[1].to_owned())
        .context("Deployment: no --config argument")?;
    let configmap = one(objects, "ConfigMap")?;
    let cm_name = configmap["metadata"]["name"].as_str().unwrap_or_default();
    let volume = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["configMap"]["name"] == cm_name)
        .and_then(|v| v["name"].as_str())
        .context("Deployment: no volume of the ConfigMap")?;
    let mount = c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["name"] == volume)
        .and_then(|m| m["mountPath"].as_str())
        .context("Deployment: the ConfigMap is not mounted")?;
    let (dir_part, file) = config_path.rsplit_once('/').context("--config is not a path")?;
    ensure!(
        dir_part == mount.trim_end_matches('/'),
        "--config {config_path} is not under the ConfigMap's mount {mount}"
    );
    let yaml = configmap["data"][file].as_str().with_context(|| format!("ConfigMap: no key {file}"))?;
    // The gateway's own verdict.
    let file = gateway.work.join(format!("{}.cortex.yaml", dir.replace(['/', '.'], "_")));
    let verdict = gateway_config(root, gateway.exe, yaml, &file)?;
    let refused = REFUSED.iter().find(|(d, _)| *d == dir).map(|(_, why)| *why);
    let (grace, listen_port) = match (verdict, refused) {
        (Ok(v), None) => v,
        (Err(e), None) => bail!("the gateway refuses its configuration: {e}"),
        (Ok(_), Some(why)) => bail!(
            "the gateway accepts this configuration, listed as refused ({why}): remove it from REFUSED in xtask/src/deploy_check.rs"
        ),
        (Err(e), Some(why)) => {
            ensure!(e.contains(why), "the gateway refuses this configuration, but not because {why}: {e}");
            say(&format!("deploy-check: {dir}: refused by the gateway as expected ({why})"));
            // The rest is still checked with the base's timings.
            gateway.base.get().context("an overlay refused before its base was checked")?
        }
    };
    if gateway.base.get().is_none() {
        gateway.base.set(Some((grace, listen_port)));
    }
    ensure!(listen_port == port, "cortex.yaml listens on {listen_port}, the container port is {port}");
    // Termination: the kubelet's grace covers the preStop sleep, the gateway's own grace and the
    // last spans' flush after it (up to 5 s, `Gateway::flush_traces`).
    let termination = pod["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
    let sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"].as_u64().unwrap_or(0);
    let flush = Duration::from_secs(5);
    ensure!(
        Duration::from_secs(termination) > Duration::from_secs(sleep) + grace + flush,
        "terminationGracePeriodSeconds {termination}s must exceed the preStop sleep {sleep}s plus shutdown_delay and shutdown_grace ({grace:?}) plus the trace flush ({flush:?})"
    );
    // The Service reaches the container port; the ServiceMonitor scrapes a Service port.
    let service = one(objects, "Service")?;
    let sport = service["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["targetPort"] == "http" || p["targetPort"].as_u64() == Some(u64::from(port)))
        .context("Service: no port targets the container's http port")?;
    let selector = service["spec"]["selector"].as_object().context("Service: no selector")?;
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    ensure!(selector.iter().all(|(k, v)| &labels[k] == v), "Service: its selector misses the gateway's pods");
    for sm in of_kind(objects, "ServiceMonitor") {
        let endpoint = &sm["spec"]["endpoints"][0];
        ensure!(
            endpoint["port"] == sport["name"],
            "ServiceMonitor: scrapes port {} , the Service's is {}",
            endpoint["port"],
            sport["name"]
        );
        ensure!(endpoint["path"] == "/metrics", "ServiceMonitor: the gateway serves /metrics");
        let want =
            sm["spec"]["selector"]["matchLabels"].as_object().context("ServiceMonitor: no matchLabels")?;
        let have = &service["metadata"]["labels"];
        ensure!(want.iter().all(|(k, v)| &have[k] == v), "ServiceMonitor: its selector misses the Service");
    }
    // Discovery reads pods: the service account may list and watch them, nothing more.
    let sa = pod["serviceAccountName"].as_str().context("Deployment: no serviceAccountName")?;
    let binding = of_kind(objects, "RoleBinding")
        .into_iter()
        .find(|b| b["subjects"].as_array().into_iter().flatten().any(|s| s["name"] == sa))
        .context("no RoleBinding for the gateway's service account")?;
    let role = of_kind(objects, "Role")
        .into_iter()
        .find(|r| r["metadata"]["name"] == binding["roleRef"]["name"])
        .context("the RoleBinding's Role is missing")?;
    let rules = role["rules"].as_array().context("Role: no rules")?;
    let pods = rules.iter().find(|r| r["resources"] == json!(["pods"])).context("Role: no rule for pods")?;
    let verbs: BTreeSet<&str> =
        pods["verbs"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    ensure!(
        verbs == BTreeSet::from(["list", "watch"]),
        "Role: pods need list and watch, which discovery calls, and nothing else (found {verbs:?})"
    );
    ensure!(!of_kind(objects, "PodDisruptionBudget").is_empty(), "no PodDisruptionBudget");
    Ok(Facts { container_port: port, config_path })
}

/// The Dockerfile's instructions, continuation lines joined, comments dropped.
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && current.is_empty()) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(t);
                let (op, rest) =
                    current.trim().split_once(char::is_whitespace).unwrap_or((current.trim(), ""));
                out.push((op.to_uppercase(), rest.trim().to_owned()));
                current.clear();
            }
        }
    }
    out
}

/// The toolchain `rust-toolchain.toml` pins.
fn toolchain_channel(root: &Path) -> Result<String> {
    let toolchain =
        std::fs::read_to_string(root.join("rust-toolchain.toml")).context("reading rust-toolchain.toml")?;
    toolchain
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("channel")
                .map(|r| r.trim_start_matches([' ', '=']).trim().trim_matches('"').to_owned())
        })
        .context("rust-toolchain.toml: no channel")
}

/// Checks a Dockerfile against the pinned toolchain, CI's build and the manifests.
fn check_dockerfile(text: &str, channel: &str, facts: &Facts) -> Result<()> {
    let ins = instructions(text);
    let froms: Vec<&String> = ins.iter().filter(|(op, _)| op == "FROM").map(|(_, r)| r).collect();
    ensure!(froms.len() >= 2, "Dockerfile: a multi-stage build expected (a build stage and a runtime stage)");
    ensure!(
        froms[0].starts_with(&format!("rust:{channel}-"))
            || froms[0].starts_with(&format!("rust:{channel} ")),
        "Dockerfile: the build stage must use rust:{channel} (rust-toolchain.toml), not `{}`",
        froms[0]
    );
    let builds: Vec<&String> =
        ins.iter().filter(|(op, r)| op == "RUN" && r.contains("cargo build")).map(|(_, r)| r).collect();
    ensure!(builds.len() == 1, "Dockerfile: one `RUN cargo build` expected, found {}", builds.len());
    let words = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    ensure!(
        words(builds[0]) == words(RELEASE_BUILD),
        "Dockerfile: the build must be `{RELEASE_BUILD}`, not `{}`",
        builds[0]
    );
    // The runtime stage: the instructions after the last FROM.
    let last_from = ins.iter().rposition(|(op, _)| op == "FROM").unwrap_or(0);
    let runtime = &ins[last_from..];
    let user = runtime
        .iter()
        .rev()
        .find(|(op, _)| op == "USER")
        .map(|(_, u)| u.as_str())
        .context("Dockerfile: the runtime stage sets no USER")?;
    let uid = user.split(':').next().unwrap_or_default();
    ensure!(!matches!(uid, "" | "0" | "root"), "Dockerfile: USER {user} is root");
    ensure!(
        uid.parse::<u32>().is_ok(),
        "Dockerfile: USER {user} must be numeric, so that runAsNonRoot can verify it"
    );
    let exposed: BTreeSet<u16> = runtime
        .iter()
        .filter(|(op, _)| op == "EXPOSE")
        .flat_map(|(_, r)| r.split_whitespace().map(|p| p.split('/').next().unwrap_or(p).parse::<u16>()))
        .collect::<Result<_, _>>()
        .context("Dockerfile: EXPOSE")?;
    ensure!(
        exposed == BTreeSet::from([facts.container_port]),
        "Dockerfile: EXPOSE {exposed:?}, the manifests' container port is {}",
        facts.container_port
    );
    let cmd = runtime.iter().rev().find(|(op, _)| op == "CMD").map(|(_, c)| c.as_str()).unwrap_or_default();
    ensure!(
        cmd.contains(&facts.config_path),
        "Dockerfile: CMD should read the manifests' --config {}",
        facts.config_path
    );
    ensure!(
        !runtime.iter().any(|(op, r)| op == "COPY" && !r.contains("--from=")),
        "Dockerfile: the runtime stage copies files from the build context (demo files?); only the binary belongs there"
    );
    Ok(())
}

/// Runs the check.
///
/// # Errors
/// A tool cannot be installed or run, or any check fails.
pub fn run(root: &Path, args: &Args) -> Result<()> {
    let start = Instant::now();
    let deploy = root.join("deploy");
    let work = crate::target_dir(root).join("deploy-check");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let (kubectl, installed) = kubectl()?;
    let version =
        crate::command_output(Command::new(&kubectl).args(["version", "--client"]), "kubectl version")?;
    say(&format!(
        "deploy-check: {} ({})",
        version.lines().next().unwrap_or("kubectl").trim(),
        installed.map_or("already installed".to_owned(), |t| format!("installed in {:.1}s", t.as_secs_f64()))
    ));
    let (py, venv_took) = crate::python_venv(&args.python, &work.join("venv"), REQUIREMENTS)?;
    say(&format!(
        "deploy-check: venv with {} ({})",
        REQUIREMENTS.join(", "),
        venv_took.map_or("already there".to_owned(), |t| format!("created in {:.1}s", t.as_secs_f64()))
    ));
    let gateway = Gateway { exe: args.gateway.as_deref(), work: &work, base: std::cell::Cell::new(None) };
    let mut job = Vec::new();
    let mut facts = None;
    for dir in kustomizations(&deploy)? {
        let rendered = crate::command_output(
            Command::new(&kubectl).arg("kustomize").arg(deploy.join(&dir)),
            &format!("kubectl kustomize deploy/{dir}"),
        )?;
        let objects = documents(&rendered).with_context(|| format!("deploy/{dir}"))?;
        let f = check_objects(root, &dir, &objects, &gateway).with_context(|| format!("deploy/{dir}"))?;
        if dir == "." {
            facts = Some(f);
        }
        say(&format!("deploy-check: deploy/{dir}: {} objects rendered, consistent", objects.len()));
        for o in objects {
            let schema = CUSTOM_SCHEMAS
                .iter()
                .find(|(api, kind, _)| o["apiVersion"] == *api && o["kind"] == *kind)
                .map(|(_, _, file)| deploy.join(file).display().to_string());
            let mut item = json!({"source": format!("deploy/{dir}"), "object": o});
            if let Some(s) = schema {
                item["schema"] = json!(s);
            }
            job.push(item);
        }
    }
    let facts = facts.context("deploy/ renders nothing")?;
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).context("reading Dockerfile")?;
    check_dockerfile(&dockerfile, &toolchain_channel(root)?, &facts).context("Dockerfile")?;
    say("deploy-check: Dockerfile: CI's build, the pinned toolchain, a non-root user, the manifests' port");
    let job_file = work.join("objects.json");
    std::fs::write(&job_file, json!({"versions": KUBERNETES_VERSIONS, "objects": job}).to_string())?;
    let report = Command::new(&py)
        .arg("-c")
        .arg(VALIDATE_PY)
        .arg(&job_file)
        .output()
        .context("running the validator")?;
    let text = String::from_utf8_lossy(&report.stdout);
    ensure!(
        report.status.success(),
        "schema validation failed:\n{text}{}",
        String::from_utf8_lossy(&report.stderr)
    );
    say(&format!(
        "deploy-check: schemas (Kubernetes {}): {} ({:.1}s in all)",
        KUBERNETES_VERSIONS.join(", "),
        text.trim(),
        start.elapsed().as_secs_f64()
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dockerfile_instructions_join_continuations_and_drop_comments() {
        let ins = instructions("# c\nFROM a AS b\nRUN x \\\n  y\n\nuser 1:1\n");
        assert_eq!(
            ins,
            vec![
                ("FROM".into(), "a AS b".into()),
                ("RUN".into(), "x  y".into()),
                ("USER".into(), "1:1".into())
            ]
        );
    }

    #[test]
    fn the_repository_dockerfile_passes_and_each_fault_is_caught() {
        let root = crate::workspace_root();
        let text = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
        let channel = toolchain_channel(&root).unwrap();
        let facts = Facts { container_port: 8080, config_path: "/etc/cortex/cortex.yaml".into() };
        check_dockerfile(&text, &channel, &facts).unwrap();
        let wrong_port = Facts { container_port: 9000, ..Facts::default() };
        assert!(
            check_dockerfile(
                &text,
                &channel,
                &Facts { config_path: facts.config_path.clone(), ..wrong_port }
            )
            .is_err()
        );
        assert!(check_dockerfile(&text, "1.80.0", &facts).is_err(), "another toolchain");
        for (from, to) in [
            ("USER 65532:65532", "USER root"),
            ("USER 65532:65532", "USER 0"),
            ("USER 65532:65532", "USER app"),
            ("USER 65532:65532\n", ""),
            ("--release --locked", "--release"),
            ("EXPOSE 8080", "EXPOSE 8080 9090"),
            ("ENTRYPOINT", "COPY golden /golden\nENTRYPOINT"),
            ("/etc/cortex/cortex.yaml\"]", "/cortex.yaml\"]"),
        ] {
            assert!(text.contains(from), "{from}");
            let broken = text.replace(from, to);
            assert!(check_dockerfile(&broken, &channel, &facts).is_err(), "{from} -> {to} passed");
        }
    }
}
