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

/// Run kvgate as the Endpoint Picker of a Gateway API Inference Extension gateway.
#[derive(clap::Args, Debug, Clone)]
pub struct EppArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// The ext_proc gRPC port the gateway dials (gRPC health answers there too).
    #[arg(long, default_value_t = 9002, help_heading = EPP)]
    pub grpc_port: u16,
    /// The plaintext gRPC health port (`liveness`, `readiness`, the ext_proc service);
    /// 0 for none.
    #[arg(long, default_value_t = 9003, help_heading = EPP)]
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
}

impl EppArgs {
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
    let config = args.serve.to_config()?;
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
