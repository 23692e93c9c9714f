//! Engines found without naming them: a model's `workers_dns` name (a Kubernetes
//! headless Service of engine pods) re-resolved periodically, or its
//! `workers_kubernetes` pods (by label selector, or an InferencePool's) watched through
//! the Kubernetes API (`--features kubernetes`); each address a worker. A disaggregated
//! model's prefill pool has its own (`pd.prefill_workers_dns`,
//! `pd.prefill_workers_kubernetes`).
//!
//! Owns the resolve-and-reconcile loop and the pure reconcile step ([`reconcile`]):
//! which discovered workers to add and which to remove. Adding and removing go through
//! the gateway's own operations (as the admin API does), so subscribers, index purges
//! and metrics follow the same path. It must not touch workers it did not add (those
//! from flags, YAML or the admin API), and a failed or empty resolution removes
//! nothing: a resolver hiccup must not empty the fleet.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{DiscoveredPorts, WorkerConfig, WorkersDnsConfig};
use crate::gateway::Gateway;

/// What one resolution changes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reconcile {
    /// Workers to add (addresses new to the name).
    pub add: Vec<WorkerConfig>,
    /// URLs of discovered workers whose address left the name.
    pub remove: Vec<String>,
}

/// Compares the addresses a source resolved to with the workers discovered through it
/// before (`known`, by URL). URLs configured otherwise (`configured`) are never added
/// twice nor removed. An empty resolution changes nothing.
pub fn reconcile(
    ports: &DiscoveredPorts,
    resolved: &[SocketAddr],
    known: &BTreeSet<String>,
    configured: &BTreeSet<String>,
) -> Reconcile {
    if resolved.is_empty() {
        return Reconcile::default();
    }
    let mut wanted: Vec<WorkerConfig> = resolved.iter().map(|a| ports.worker_at(*a)).collect();
    wanted.sort_by(|a, b| a.url.cmp(&b.url));
    wanted.dedup_by(|a, b| a.url == b.url);
    let wanted_urls: BTreeSet<&str> = wanted.iter().map(|w| w.url.as_str()).collect();
    Reconcile {
        remove: known
            .iter()
            .filter(|u| !wanted_urls.contains(u.as_str()))
            .cloned()
            .collect(),
        add: wanted
            .into_iter()
            .filter(|w| !known.contains(&w.url) && !configured.contains(&w.url))
            .collect(),
    }
}

/// Where a model's discovered workers come from.
enum Source {
    /// A name re-resolved on every tick.
    Dns(WorkersDnsConfig, crate::gateway::Ticks),
    /// Pods (of an InferencePool) watched through the Kubernetes API, until shutdown.
    #[cfg(feature = "kubernetes")]
    Kubernetes(
        Box<kubernetes::PoolWatch>,
        tokio_util::sync::CancellationToken,
    ),
}

/// The workers a source has now: their addresses, and the ports and ranks each is given.
type Resolution = (Vec<SocketAddr>, DiscoveredPorts);

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Dns(d, _) => format!("dns {}", d.name),
            #[cfg(feature = "kubernetes")]
            Source::Kubernetes(w, _) => w.describe(),
        }
    }

    /// The workers after the next change (a DNS name: at the next tick); `None` at
    /// shutdown.
    async fn next(&mut self) -> Option<anyhow::Result<Resolution>> {
        match self {
            Source::Dns(d, ticks) => {
                if !ticks.next().await {
                    return None;
                }
                Some(
                    tokio::net::lookup_host(d.name.as_str())
                        .await
                        .map(|addrs| (addrs.collect(), d.ports()))
                        .map_err(Into::into),
                )
            }
            #[cfg(feature = "kubernetes")]
            Source::Kubernetes(w, shutdown) => tokio::select! {
                _ = shutdown.cancelled() => None,
                r = w.next() => Some(r),
            },
        }
    }
}

/// Keeps every pool's discovered workers (DNS names, Kubernetes pods) in step with
/// their source, until shutdown: each model's, and a disaggregated model's prefill
/// pool's.
pub async fn run_worker_discovery(gw: Arc<Gateway>) {
    let mut sources: Vec<(String, &'static str, Source)> = Vec::new();
    for m in &gw.config.models {
        let prefill = m.pd.as_ref();
        let pools = [
            ("", m.workers_dns.as_ref(), m.workers_kubernetes.as_ref()),
            (
                crate::registry::PREFILL_POOL,
                prefill.and_then(|pd| pd.prefill_workers_dns.as_ref()),
                prefill.and_then(|pd| pd.prefill_workers_kubernetes.as_ref()),
            ),
        ];
        for (pool, dns, kubernetes) in pools {
            if let Some(d) = dns {
                let ticks = gw.ticks(Duration::from_millis(d.refresh_ms));
                sources.push((m.name.clone(), pool, Source::Dns(d.clone(), ticks)));
            }
            #[cfg(feature = "kubernetes")]
            if let Some(k) = kubernetes {
                let watch = kubernetes::PoolWatch::new(k.clone());
                let source = Source::Kubernetes(Box::new(watch), gw.shutdown.clone());
                sources.push((m.name.clone(), pool, source));
            }
            #[cfg(not(feature = "kubernetes"))]
            let _ = kubernetes;
        }
    }
    let tasks: Vec<_> = sources
        .into_iter()
        .map(|(model, pool, source)| tokio::spawn(discover(gw.clone(), model, pool, source)))
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

async fn discover(gw: Arc<Gateway>, model: String, pool: &'static str, mut source: Source) {
    let mut known: BTreeSet<String> = BTreeSet::new();
    let what = source.describe();
    let mut last_error = String::new();
    while let Some(resolution) = source.next().await {
        let (resolved, ports) = match resolution {
            Ok(addrs) => {
                last_error.clear();
                addrs
            }
            Err(err) => {
                let err = format!("{err:#}");
                if err != last_error {
                    tracing::warn!(%model, source = %what, %err, "cannot list the workers; keeping the workers found before");
                    last_error = err;
                }
                continue;
            }
        };
        let Some(m) = gw.pool(&model, pool) else {
            return;
        };
        let configured: BTreeSet<String> = m
            .workers()
            .iter()
            .map(|w| w.url.to_string())
            .filter(|u| !known.contains(u))
            .collect();
        let plan = reconcile(&ports, &resolved, &known, &configured);
        for url in plan.remove {
            known.remove(&url);
            if let Some(w) = m.worker_by_url(&url) {
                gw.remove_worker_from(&m, w.id);
                tracing::info!(%model, worker = %url, source = %what, "worker left its discovery source: removed");
            }
        }
        for worker in plan.add {
            let url = worker.url.clone();
            match gw.add_worker_to(&m, worker) {
                Ok(_) => {
                    tracing::info!(%model, worker = %url, source = %what, "worker discovered: added");
                    known.insert(url);
                }
                Err(err) => {
                    tracing::warn!(%model, worker = %url, %err, "cannot add a discovered worker")
                }
            }
        }
    }
}

/// Engine pods through the Kubernetes API (`--features kubernetes`): watched, not
/// polled (one list, then the API server's change stream; a broken watch is resumed,
/// or listed again, with the client-go backoff, keeping what was known).
#[cfg(feature = "kubernetes")]
pub mod kubernetes {
    use std::collections::BTreeMap;
    use std::net::{IpAddr, SocketAddr};
    use std::time::Duration;

    use futures::stream::BoxStream;
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, ApiResource, DynamicObject};
    use kube::runtime::watcher::{self, Event};
    use kube::runtime::WatchStreamExt;
    use kube::ResourceExt;

    use super::Resolution;
    use crate::config::WorkersKubernetesConfig;

    /// A client for the configured API URL, else the in-cluster service account or
    /// the kubeconfig.
    pub async fn client(cfg: &WorkersKubernetesConfig) -> anyhow::Result<kube::Client> {
        Ok(match &cfg.api_url {
            Some(url) => kube::Client::try_from(kube::Config::new(url.parse()?))?,
            None => kube::Client::try_default().await?,
        })
    }

    /// Wait before making a client again after it could not be made.
    const CLIENT_RETRY: Duration = Duration::from_secs(5);

    type Watch<K> = BoxStream<'static, Result<Event<K>, watcher::Error>>;

    /// The ready pods of a label selector, or of an InferencePool (whose selector and
    /// ports are watched too: a change restarts the pods' watch with the new ones).
    pub struct PoolWatch {
        cfg: WorkersKubernetesConfig,
        client: Option<kube::Client>,
        /// The InferencePool's watch, when one is followed.
        pool: Option<Watch<DynamicObject>>,
        /// The pods' watch, and the selector and ports it was made with.
        pods: Option<(Watch<Pod>, WorkersKubernetesConfig)>,
        /// Ready pods by name, as of the last complete list plus the changes since.
        ready: BTreeMap<String, IpAddr>,
        /// A list in progress (the watch started or restarted): replaces `ready` once
        /// complete.
        listing: Option<BTreeMap<String, IpAddr>>,
    }

    impl PoolWatch {
        pub fn new(cfg: WorkersKubernetesConfig) -> Self {
            Self {
                cfg,
                client: None,
                pool: None,
                pods: None,
                ready: BTreeMap::new(),
                listing: None,
            }
        }

        pub fn describe(&self) -> String {
            match &self.cfg.inference_pool {
                Some(pool) => format!("inference pool {pool}"),
                None => format!("pods {}", self.cfg.label_selector),
            }
        }

        /// The pool's ready endpoints (one per pod and target port) after the next
        /// change: a list completed, a pod became ready or stopped being so, or left.
        /// An error (the API server unreachable, a pool it does not have or one whose
        /// spec does not read) changes nothing; calling again resumes.
        pub async fn next(&mut self) -> anyhow::Result<Resolution> {
            let client = match &self.client {
                Some(c) => c.clone(),
                None => match client(&self.cfg).await {
                    Ok(c) => self.client.insert(c).clone(),
                    Err(e) => {
                        tokio::time::sleep(CLIENT_RETRY).await;
                        return Err(e);
                    }
                },
            };
            if let Some(name) = &self.cfg.inference_pool {
                if self.pool.is_none() {
                    let resource = ApiResource {
                        group: "inference.networking.k8s.io".into(),
                        version: "v1".into(),
                        api_version: "inference.networking.k8s.io/v1".into(),
                        kind: "InferencePool".into(),
                        plural: "inferencepools".into(),
                    };
                    let api: Api<DynamicObject> = match &self.cfg.namespace {
                        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
                        None => Api::default_namespaced_with(client.clone(), &resource),
                    };
                    let config =
                        watcher::Config::default().fields(&format!("metadata.name={name}"));
                    self.pool = Some(watcher::watcher(api, config).default_backoff().boxed());
                }
            } else if self.pods.is_none() {
                self.watch_pods(&client, self.cfg.clone());
            }
            loop {
                let pool = async {
                    match self.pool.as_mut() {
                        Some(w) => w.next().await,
                        None => std::future::pending().await,
                    }
                };
                let pods = async {
                    match self.pods.as_mut() {
                        Some((w, _)) => w.next().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    event = pool => match event {
                        Some(Ok(Event::Apply(p) | Event::InitApply(p))) => {
                            let name = p.name_any();
                            let (label_selector, target_ports) = pool_spec(&p.data["spec"])
                                .map_err(|e| anyhow::anyhow!("InferencePool {name}: {e}"))?;
                            let pods = WorkersKubernetesConfig {
                                label_selector,
                                target_ports,
                                ..self.cfg.clone()
                            };
                            let same = self.pods.as_ref().is_some_and(|(_, was)| {
                                was.label_selector == pods.label_selector
                                    && was.target_ports == pods.target_ports
                            });
                            if !same {
                                tracing::info!(pool = %name, selector = %pods.label_selector, ports = ?pods.target_ports, "InferencePool: watching its pods");
                                self.watch_pods(&client, pods);
                            }
                        }
                        Some(Ok(Event::Delete(p))) => {
                            anyhow::bail!("InferencePool {} was deleted; keeping its endpoints", p.name_any())
                        }
                        Some(Ok(Event::Init | Event::InitDone)) => {}
                        Some(Err(e)) => return Err(e.into()),
                        None => anyhow::bail!("the InferencePool's watch ended"),
                    },
                    event = pods => {
                        let changed = match event {
                            Some(Ok(event)) => self.apply(event),
                            Some(Err(e)) => return Err(e.into()),
                            None => anyhow::bail!("the pods' watch ended"),
                        };
                        if changed {
                            return Ok(self.endpoints());
                        }
                    }
                }
            }
        }

        /// Watches the pods `pods` selects (and forgets the previous selection's: the
        /// new watch's first list replaces them).
        fn watch_pods(&mut self, client: &kube::Client, pods: WorkersKubernetesConfig) {
            let api: Api<Pod> = match &pods.namespace {
                Some(ns) => Api::namespaced(client.clone(), ns),
                None => Api::default_namespaced(client.clone()),
            };
            let config = watcher::Config::default().labels(&pods.label_selector);
            let watch = watcher::watcher(api, config).default_backoff().boxed();
            self.pods = Some((watch, pods));
            self.listing = None;
        }

        /// Applies one pod event; true when the ready set may have changed (a list
        /// completed, or a pod's readiness or address changed).
        fn apply(&mut self, event: Event<Pod>) -> bool {
            match event {
                Event::Init => {
                    self.listing = Some(BTreeMap::new());
                    false
                }
                Event::InitApply(pod) => {
                    if let (Some(listing), Some(ip)) = (self.listing.as_mut(), ready_ip(&pod)) {
                        listing.insert(pod.name_any(), ip);
                    }
                    false
                }
                Event::InitDone => {
                    self.ready = self.listing.take().unwrap_or_default();
                    true
                }
                Event::Apply(pod) => {
                    let name = pod.name_any();
                    let now = ready_ip(&pod);
                    let was = match now {
                        Some(ip) => self.ready.insert(name, ip),
                        None => self.ready.remove(&name),
                    };
                    was != now
                }
                Event::Delete(pod) => self.ready.remove(&pod.name_any()).is_some(),
            }
        }

        /// One endpoint per ready pod and port of the current selection.
        fn endpoints(&self) -> Resolution {
            let pods = self.pods.as_ref().map_or(&self.cfg, |(_, c)| c);
            let ports = pods.pod_ports();
            let addrs = self
                .ready
                .values()
                .flat_map(|ip| ports.iter().map(move |p| SocketAddr::new(*ip, *p)))
                .collect();
            (addrs, pods.ports())
        }
    }

    /// An InferencePool's `spec`: its pods' label selector (`spec.selector.matchLabels`
    /// as `k=v,...`) and `spec.targetPorts` (1 to 8 `{number}`).
    pub fn pool_spec(spec: &serde_json::Value) -> Result<(String, Vec<u16>), String> {
        let labels = spec["selector"]["matchLabels"]
            .as_object()
            .filter(|l| !l.is_empty())
            .ok_or("spec.selector.matchLabels names no label")?;
        let mut selector: Vec<String> = labels
            .iter()
            .map(|(k, v)| match v.as_str() {
                Some(v) => Ok(format!("{k}={v}")),
                None => Err(format!("label {k} is not a string")),
            })
            .collect::<Result<_, _>>()?;
        selector.sort();
        let ports: Vec<u16> = spec["targetPorts"]
            .as_array()
            .ok_or("spec.targetPorts is missing")?
            .iter()
            .map(|p| {
                p["number"]
                    .as_u64()
                    .and_then(|n| u16::try_from(n).ok())
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("target port {p} is not a port number"))
            })
            .collect::<Result<_, _>>()?;
        if ports.is_empty() || ports.len() > 8 {
            return Err(format!(
                "spec.targetPorts has {} ports (1 to 8)",
                ports.len()
            ));
        }
        Ok((selector.join(","), ports))
    }

    /// A pod's IP when it can take requests: running, ready, not being deleted.
    pub fn ready_ip(pod: &Pod) -> Option<IpAddr> {
        if pod.metadata.deletion_timestamp.is_some() {
            return None;
        }
        let status = pod.status.as_ref()?;
        if status.phase.as_deref() != Some("Running") {
            return None;
        }
        let ready = status
            .conditions
            .as_ref()?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        if !ready {
            return None;
        }
        status.pod_ip.as_deref()?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> DiscoveredPorts {
        WorkersDnsConfig {
            name: "vllm.llm.svc:8000".into(),
            kv_events_port: Some(5557),
            kv_events_replay_port: Some(5558),
            ..WorkersDnsConfig::default()
        }
        .ports()
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn set(urls: &[&str]) -> BTreeSet<String> {
        urls.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn new_addresses_join_with_their_event_endpoints_and_vanished_ones_leave() {
        let first = reconcile(
            &cfg(),
            &[
                addr("10.0.0.2:8000"),
                addr("10.0.0.1:8000"),
                addr("10.0.0.1:8000"),
            ],
            &set(&[]),
            &set(&[]),
        );
        let urls: Vec<&str> = first.add.iter().map(|w| w.url.as_str()).collect();
        assert_eq!(urls, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        assert_eq!(
            first.add[0].kv_events.as_deref(),
            Some("tcp://10.0.0.1:5557")
        );
        assert_eq!(
            first.add[0].kv_events_replay.as_deref(),
            Some("tcp://10.0.0.1:5558")
        );
        assert!(first.remove.is_empty());
        // 10.0.0.1 replaced by 10.0.0.3 (a pod rescheduled).
        let known = set(&["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        let next = reconcile(
            &cfg(),
            &[addr("10.0.0.2:8000"), addr("10.0.0.3:8000")],
            &known,
            &set(&[]),
        );
        assert_eq!(next.remove, vec!["http://10.0.0.1:8000".to_owned()]);
        assert_eq!(next.add.len(), 1);
        assert_eq!(next.add[0].url, "http://10.0.0.3:8000");
    }

    #[test]
    fn an_empty_answer_removes_nothing_and_configured_workers_are_left_alone() {
        let known = set(&["http://10.0.0.1:8000"]);
        assert_eq!(
            reconcile(&cfg(), &[], &known, &set(&[])),
            Reconcile::default()
        );
        let plan = reconcile(
            &cfg(),
            &[addr("10.0.0.9:8000")],
            &set(&[]),
            &set(&["http://10.0.0.9:8000"]),
        );
        assert!(plan.add.is_empty(), "already configured by flag or YAML");
    }

    #[test]
    fn ipv6_addresses_are_bracketed() {
        let plan = reconcile(&cfg(), &[addr("[fd00::1]:8000")], &set(&[]), &set(&[]));
        assert_eq!(plan.add[0].url, "http://[fd00::1]:8000");
        assert_eq!(
            plan.add[0].kv_events.as_deref(),
            Some("tcp://[fd00::1]:5557")
        );
    }
}
