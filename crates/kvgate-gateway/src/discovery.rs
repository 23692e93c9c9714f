//! Engines found without naming them: a model's `workers_dns` name (a Kubernetes
//! headless Service of engine pods) re-resolved periodically, or its
//! `workers_kubernetes` pods listed through the Kubernetes API by label selector
//! (`--features kubernetes`); each address a worker. A disaggregated model's prefill
//! pool has its own (`pd.prefill_workers_dns`, `pd.prefill_workers_kubernetes`).
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
    Dns(WorkersDnsConfig),
    #[cfg(feature = "kubernetes")]
    Kubernetes(crate::config::WorkersKubernetesConfig, Option<kube::Client>),
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Dns(d) => format!("dns {}", d.name),
            #[cfg(feature = "kubernetes")]
            Source::Kubernetes(k, _) => match &k.inference_pool {
                Some(pool) => format!("inference pool {pool}"),
                None => format!("pods {}", k.label_selector),
            },
        }
    }

    fn refresh(&self) -> Duration {
        Duration::from_millis(match self {
            Source::Dns(d) => d.refresh_ms,
            #[cfg(feature = "kubernetes")]
            Source::Kubernetes(k, _) => k.refresh_ms,
        })
    }

    /// The addresses of the workers now, and the ports and ranks each is given.
    async fn resolve(&mut self) -> anyhow::Result<(Vec<SocketAddr>, DiscoveredPorts)> {
        match self {
            Source::Dns(d) => Ok((
                tokio::net::lookup_host(d.name.as_str()).await?.collect(),
                d.ports(),
            )),
            #[cfg(feature = "kubernetes")]
            Source::Kubernetes(cfg, client) => {
                let c = match client {
                    Some(c) => c.clone(),
                    None => {
                        let c = kubernetes::client(cfg).await?;
                        *client = Some(c.clone());
                        c
                    }
                };
                let pods = match &cfg.inference_pool {
                    // The pool's selector and ports as they are now.
                    Some(pool) => kubernetes::inference_pool(&c, cfg, pool).await?,
                    None => cfg.clone(),
                };
                Ok((kubernetes::ready_pod_addrs(&c, &pods).await?, pods.ports()))
            }
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
                sources.push((m.name.clone(), pool, Source::Dns(d.clone())));
            }
            #[cfg(feature = "kubernetes")]
            if let Some(k) = kubernetes {
                sources.push((m.name.clone(), pool, Source::Kubernetes(k.clone(), None)));
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
    let mut ticks = gw.ticks(source.refresh());
    let what = source.describe();
    let mut last_error = String::new();
    while ticks.next().await {
        let (resolved, ports) = match source.resolve().await {
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

/// Engine pods through the Kubernetes API (`--features kubernetes`).
#[cfg(feature = "kubernetes")]
pub mod kubernetes {
    use std::net::{IpAddr, SocketAddr};

    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, ApiResource, DynamicObject, ListParams};

    use crate::config::WorkersKubernetesConfig;

    /// A client for the configured API URL, else the in-cluster service account or
    /// the kubeconfig.
    pub async fn client(cfg: &WorkersKubernetesConfig) -> anyhow::Result<kube::Client> {
        Ok(match &cfg.api_url {
            Some(url) => kube::Client::try_from(kube::Config::new(url.parse()?))?,
            None => kube::Client::try_default().await?,
        })
    }

    /// The addresses of the running, ready pods the selector matches: one per pod
    /// and port.
    pub async fn ready_pod_addrs(
        client: &kube::Client,
        cfg: &WorkersKubernetesConfig,
    ) -> anyhow::Result<Vec<SocketAddr>> {
        let api: Api<Pod> = match &cfg.namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::default_namespaced(client.clone()),
        };
        let pods = api
            .list(&ListParams::default().labels(&cfg.label_selector))
            .await?;
        let ports = cfg.pod_ports();
        Ok(pods
            .items
            .iter()
            .filter_map(ready_ip)
            .flat_map(|ip| ports.iter().map(move |p| SocketAddr::new(ip, *p)))
            .collect())
    }

    /// `cfg` with the selector and ports of the InferencePool `name`
    /// (`inference.networking.k8s.io/v1`) as the API server has it now.
    pub async fn inference_pool(
        client: &kube::Client,
        cfg: &WorkersKubernetesConfig,
        name: &str,
    ) -> anyhow::Result<WorkersKubernetesConfig> {
        let resource = ApiResource {
            group: "inference.networking.k8s.io".into(),
            version: "v1".into(),
            api_version: "inference.networking.k8s.io/v1".into(),
            kind: "InferencePool".into(),
            plural: "inferencepools".into(),
        };
        let api: Api<DynamicObject> = match &cfg.namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
            None => Api::default_namespaced_with(client.clone(), &resource),
        };
        let pool = api.get(name).await?;
        let (label_selector, target_ports) = pool_spec(&pool.data["spec"])
            .map_err(|e| anyhow::anyhow!("InferencePool {name}: {e}"))?;
        Ok(WorkersKubernetesConfig {
            label_selector,
            target_ports,
            ..cfg.clone()
        })
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
