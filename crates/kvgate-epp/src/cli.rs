//! `kvgate epp`: `kvgate serve`'s flags (workers, KV events, tokenizer, policy, peers,
//! limits; its HTTP port serves `/metrics`, the admin API and `/v1/route/explain`) and
//! the Endpoint Picker's own; runs both until SIGTERM or ctrl-c. Must not contain
//! picking logic.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvgate_gateway::cli::ServeArgs;

use crate::server::{EppConfig, Tls};
use crate::stream::PickerOptions;

const EPP: &str = "Endpoint Picker (ext_proc)";
const POOL: &str = "Endpoints from Kubernetes (--features kubernetes)";

/// Run kvgate as the Endpoint Picker of a Gateway API Inference Extension gateway.
#[derive(clap::Args, Debug, Clone)]
pub struct EppArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// The ext_proc gRPC port the gateway dials (gRPC health answers there too).
    #[arg(long, value_name = "PORT", default_value_t = 9002, help_heading = EPP)]
    pub grpc_port: u16,
    /// The plaintext gRPC health port (`liveness`, `readiness`, the ext_proc service);
    /// 0 for none.
    #[arg(long, value_name = "PORT", default_value_t = 9003, help_heading = EPP)]
    pub grpc_health_port: u16,
    /// Serve ext_proc without TLS (gateways dial with TLS by default; kgateway needs it).
    #[arg(long, help_heading = EPP)]
    pub plaintext: bool,
    /// A folder with `tls.crt` and `tls.key` for the ext_proc port (default: a
    /// self-signed certificate made at start).
    #[arg(long, value_name = "DIR", help_heading = EPP, conflicts_with = "plaintext")]
    pub cert_path: Option<PathBuf>,
    /// Add up to N ranked fallback endpoints after the pick (`ip:port,ip:port`), for a
    /// gateway that retries down the list; not every gateway accepts a list.
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = EPP)]
    pub fallback_endpoints: usize,
    /// The Gateway API Inference Extension conformance suite's hooks: the
    /// `test-epp-endpoint-selection` header names the endpoints to pick from, and the
    /// pick is echoed for the suite's echo server. Never in production.
    #[arg(long, help_heading = EPP)]
    pub conformance_hooks: bool,
    /// The InferencePool (`inference.networking.k8s.io/v1`) whose ready pods are the
    /// endpoints: its selector and target ports, followed as they change.
    #[arg(long, value_name = "NAME", help_heading = POOL)]
    pub pool_name: Option<String>,
    /// The pool's (and its pods') namespace [default: this pod's].
    #[arg(long, value_name = "NS", help_heading = POOL)]
    pub pool_namespace: Option<String>,
    /// Without an InferencePool: the endpoints' pods by label selector (`app=vllm`).
    #[arg(long, value_name = "SELECTOR", help_heading = POOL, conflicts_with = "pool_name")]
    pub endpoint_selector: Option<String>,
    /// With --endpoint-selector: the pods' ports, each an endpoint (data-parallel ranks).
    #[arg(long, value_name = "PORT,...", value_delimiter = ',', default_value = "8000", help_heading = POOL)]
    pub target_ports: Vec<u16>,
    /// The pods' KV-event port (vLLM's default); the endpoint on the i-th target port
    /// publishes on this + i. 0: the pods publish no events.
    #[arg(long, value_name = "PORT", default_value_t = 5557, help_heading = POOL)]
    pub pool_kv_events_port: u16,
    /// The pods' KV-event replay port (+ i likewise), if they keep one.
    #[arg(long, value_name = "PORT", help_heading = POOL)]
    pub pool_kv_events_replay_port: Option<u16>,
    /// The Kubernetes API server's URL [default: in cluster, else the kubeconfig's].
    #[arg(long, value_name = "URL", help_heading = POOL)]
    pub kubernetes_api_url: Option<String>,
}

impl EppArgs {
    /// The model's workers from an InferencePool or a selector, when asked for (one
    /// model only: several name theirs in the YAML's `workers_kubernetes`).
    pub fn pool_discovery(&self, config: &mut kvgate_gateway::Config) -> anyhow::Result<()> {
        if self.pool_name.is_none() && self.endpoint_selector.is_none() {
            return Ok(());
        }
        let [model] = config.models.as_mut_slice() else {
            anyhow::bail!(
                "--pool-name and --endpoint-selector find one model's endpoints; with several models set workers_kubernetes per model in the YAML"
            );
        };
        let events = |port: u16| (port != 0).then_some(port);
        model.workers_kubernetes = Some(kvgate_gateway::WorkersKubernetesConfig {
            namespace: self.pool_namespace.clone(),
            inference_pool: self.pool_name.clone(),
            label_selector: self.endpoint_selector.clone().unwrap_or_default(),
            target_ports: self.target_ports.clone(),
            kv_events_port: events(self.pool_kv_events_port),
            kv_events_replay_port: self.pool_kv_events_replay_port,
            api_url: self.kubernetes_api_url.clone(),
            ..kvgate_gateway::WorkersKubernetesConfig::default()
        });
        config.validate()
    }

    /// The picker's listeners, on `serve`'s `--host`.
    pub fn epp_config(&self, host: &str) -> anyhow::Result<EppConfig> {
        let addr = |port: u16| -> anyhow::Result<SocketAddr> {
            let ip: std::net::IpAddr = host
                .parse()
                .map_err(|e| anyhow::anyhow!("--host {host:?} is not an IP address: {e}"))?;
            Ok(SocketAddr::new(ip, port))
        };
        let tls = match (&self.cert_path, self.plaintext) {
            (_, true) => Tls::Plaintext,
            (Some(dir), false) => Tls::Files(dir.clone()),
            (None, false) => Tls::SelfSigned,
        };
        Ok(EppConfig {
            grpc: addr(self.grpc_port)?,
            health: match self.grpc_health_port {
                0 => None,
                p => Some(addr(p)?),
            },
            tls,
            picker: PickerOptions {
                fallbacks: self.fallback_endpoints,
                conformance_hooks: self.conformance_hooks,
            },
        })
    }
}

/// Runs the gateway (its HTTP port) and the picker until SIGTERM or ctrl-c.
pub async fn run(args: EppArgs) -> anyhow::Result<()> {
    let mut config = args.serve.to_config()?;
    args.pool_discovery(&mut config)?;
    let epp = args.epp_config(&config.host)?;
    let grace = Duration::from_secs(config.shutdown_grace_secs);
    let gateway = kvgate_gateway::start(config).await?;
    let picker = crate::server::start(gateway.gateway().clone(), epp).await?;
    kvgate_gateway::cli::shutdown_signal().await;
    tracing::info!("shutdown requested: the picker stops taking streams; open ones may finish");
    picker.shutdown(grace).await;
    gateway.shutdown().await;
    Ok(())
}
