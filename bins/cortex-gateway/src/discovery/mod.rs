//! Worker discovery beside the configuration file and the admin API: sources that follow an
//! orchestrator and turn what they see into membership changes (today one, [`kubernetes`]).
//!
//! Key decision: a source computes a pure stream of [`Change`]s — a worker joins, a worker
//! leaves, by name — and [`Membership::apply`] is the one place a discovered worker enters or
//! leaves the gateway, through the same join and leave as static and admin-API workers: a
//! leaving worker is out of the pool, its events are unfollowed and its ledger is pruned, so
//! late events are never applied. A source removes only workers it added itself: a name that is
//! already taken (by the file, the admin API or another selector) is refused, logged and
//! counted, never overwritten.

pub mod kubernetes;
pub mod pods;

use std::collections::HashMap;
use std::sync::Arc;

use cortex_hash::Engine;
use cortex_hash::kv::WorkerId;
use cortex_proxy::{Gateway, WorkerConfig};
use cortex_sched::Role;

/// Counter: membership changes a discovery source applied (`source`, `change` = `join`/`leave`).
pub const DISCOVERY_CHANGES: &str = "cortex_discovery_changes_total";
/// Counter: joins a discovery source was refused (`source`, `reason` = `name_taken`/`invalid`).
pub const DISCOVERY_REFUSED: &str = "cortex_discovery_refused_total";
/// Counter: full relists of a discovery source (`source`, `reason` = `start`/`gone`/`resync`/`error`).
pub const DISCOVERY_RELISTS: &str = "cortex_discovery_relists_total";
/// Counter: failed requests of a discovery source to its API (`source`, `op` = `list`/`watch`),
/// timeouts included.
pub const DISCOVERY_ERRORS: &str = "cortex_discovery_errors_total";

/// Describes the discovery metrics to the installed recorder.
pub fn describe() {
    metrics::describe_counter!(DISCOVERY_CHANGES, "Workers a discovery source added or removed.");
    metrics::describe_counter!(
        DISCOVERY_REFUSED,
        "Discovered workers refused (a name already taken, a bad URL)."
    );
    metrics::describe_counter!(DISCOVERY_RELISTS, "Full relists of a discovery source.");
    metrics::describe_counter!(
        DISCOVERY_ERRORS,
        "Failed requests of a discovery source to its API (list, watch), timeouts included."
    );
}

/// A discovered worker, as a source sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovered {
    /// Unique name (a pod's name).
    pub name: String,
    /// `http://host:port` of its engine.
    pub url: String,
    /// SGLang's bootstrap port (prefill pods' `sglang.ai/bootstrap-port` annotation): sent when
    /// the engine's `/server_info` reports none.
    pub bootstrap_port: Option<u16>,
}

/// One membership change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A worker to add.
    Join(Discovered),
    /// The worker of this name leaves.
    Leave(String),
}

/// What every worker of one selector shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerTemplate {
    /// The engine.
    pub engine: Engine,
    /// A configured model's name.
    pub model: String,
    /// Its pool.
    pub role: Role,
    /// See [`WorkerConfig::unlabeled_stores_unknown`].
    pub unlabeled_stores_unknown: bool,
    /// See [`WorkerConfig::max_running_requests`].
    pub max_running_requests: Option<u32>,
}

/// What applying a change did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The worker was added.
    Joined(WorkerId),
    /// The worker this source had added was removed.
    Left,
    /// The join was refused; the source should forget the worker (a later event tries again).
    Refused(String),
    /// A leave of a worker this source never added (or already removed): nothing happened.
    NotOurs,
}

/// The workers one source added, and the one path through which it adds and removes them.
pub struct Membership {
    gateway: Arc<Gateway>,
    source: &'static str,
    template: WorkerTemplate,
    joined: HashMap<String, WorkerId>,
}

impl Membership {
    /// An empty membership of `source` (a metric label), whose workers share `template`.
    #[must_use]
    pub fn new(gateway: Arc<Gateway>, source: &'static str, template: WorkerTemplate) -> Self {
        Membership { gateway, source, template, joined: HashMap::new() }
    }

    /// Applies one change: the single place discovered workers join and leave the gateway.
    pub fn apply(&mut self, change: Change) -> Applied {
        match change {
            Change::Join(d) => {
                // A join of a worker this source already has is a new address: the old one
                // leaves first. The reconciler sends that leave itself; this only keeps a
                // missed one from leaving a duplicate behind.
                self.leave(&d.name);
                self.join(d)
            }
            Change::Leave(name) => {
                if self.leave(&name) {
                    Applied::Left
                } else {
                    Applied::NotOurs
                }
            }
        }
    }

    /// The one call of `Control::join`.
    fn join(&mut self, d: Discovered) -> Applied {
        let name = d.name.clone();
        let config = WorkerConfig {
            name: d.name,
            url: d.url,
            engine: self.template.engine,
            model: self.template.model.clone(),
            role: self.template.role,
            max_running_requests: self.template.max_running_requests,
            events: None,
            unlabeled_stores_unknown: self.template.unlabeled_stores_unknown,
            bootstrap_port: d.bootstrap_port,
        };
        let taken = self.gateway.control().registry().by_name(&name).is_some();
        match self.gateway.control().join(config) {
            Ok(id) => {
                tracing::info!(source = self.source, worker = %name, "discovered worker joins");
                metrics::counter!(DISCOVERY_CHANGES, "source" => self.source, "change" => "join")
                    .increment(1);
                self.joined.insert(name, id);
                Applied::Joined(id)
            }
            Err(e) => {
                let reason = if taken { "name_taken" } else { "invalid" };
                tracing::warn!(source = self.source, worker = %name, error = %e, "discovered worker refused");
                metrics::counter!(DISCOVERY_REFUSED, "source" => self.source, "reason" => reason)
                    .increment(1);
                Applied::Refused(e.to_string())
            }
        }
    }

    /// Forgets the workers this source added that were removed since by someone else (the
    /// admin API), and returns their names: the next relist adds them again while their pods
    /// serve (discovery's view of the cluster wins, at the next `resync` at the latest).
    pub fn removed_elsewhere(&mut self) -> Vec<String> {
        let registry = self.gateway.control().registry();
        let gone: Vec<String> = self
            .joined
            .iter()
            .filter(|(_, id)| registry.get(**id).is_none())
            .map(|(n, _)| n.clone())
            .collect();
        for name in &gone {
            self.joined.remove(name);
            tracing::info!(source = self.source, worker = %name, "discovered worker was removed elsewhere; the relist adds it again while its pod serves");
        }
        gone
    }

    /// The one call of `Control::leave`, for a worker this source added; false for any other.
    fn leave(&mut self, name: &str) -> bool {
        let Some(id) = self.joined.remove(name) else { return false };
        self.gateway.control().leave(id);
        tracing::info!(source = self.source, worker = %name, "discovered worker leaves");
        metrics::counter!(DISCOVERY_CHANGES, "source" => self.source, "change" => "leave").increment(1);
        true
    }
}
