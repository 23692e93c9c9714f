//! The Endpoint Picker's gRPC servers, beside a running HTTP gateway: the ext_proc
//! service (`envoy.service.ext_proc.v3.ExternalProcessor`) and gRPC health on the
//! ext_proc port (TLS by default, as gateways dial it: a certificate from
//! `--cert-path`, else a self-signed one made at start; plaintext by flag), and gRPC
//! health alone, plaintext, on the health port (Kubernetes' gRPC probes do not speak
//! TLS).
//!
//! Health: `liveness` serves while the process runs; `readiness` and the ext_proc
//! service's own name serve once no index snapshot is loading from a peer replica
//! (a picker that answered before would pick blind), and stop serving at shutdown.
//!
//! Owns the listeners, TLS and health. Must not handle a stream's messages (stream.rs).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream;
use kvgate_gateway::Gateway;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use crate::metrics::EppMetrics;
use crate::stream::{PickerOptions, RequestStream};

/// The ext_proc service's name, as gateways health-check it.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// How the ext_proc port is secured.
#[derive(Clone, Debug)]
pub enum Tls {
    /// A self-signed certificate made at start (gateways dial without verifying).
    SelfSigned,
    /// `tls.crt` and `tls.key` in a folder (a mounted Kubernetes TLS secret).
    Files(PathBuf),
    /// No TLS.
    Plaintext,
}

/// The picker's listeners and options.
#[derive(Clone, Debug)]
pub struct EppConfig {
    /// The ext_proc port (upstream's default 9002).
    pub grpc: SocketAddr,
    /// The health port (upstream's default 9003), `None` for none.
    pub health: Option<SocketAddr>,
    pub tls: Tls,
    pub picker: PickerOptions,
}

/// The ext_proc service: one [`RequestStream`] per stream.
struct Picker {
    gw: Arc<Gateway>,
    opts: PickerOptions,
    metrics: Arc<EppMetrics>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let stream = RequestStream::new(self.gw.clone(), self.opts.clone(), self.metrics.clone());
        Ok(Response::new(Box::pin(
            stream.answers(request.into_inner()),
        )))
    }
}

/// The running picker: its addresses, and its servers until [`RunningEpp::shutdown`].
pub struct RunningEpp {
    pub grpc_addr: SocketAddr,
    pub health_addr: Option<SocketAddr>,
    stop: CancellationToken,
    servers: Vec<JoinHandle<()>>,
    health_task: JoinHandle<()>,
}

/// Starts the picker's servers for the gateway `gw` (already running: its HTTP port
/// serves `/metrics`, the admin API and explain) and returns once they listen.
pub async fn start(gw: Arc<Gateway>, cfg: EppConfig) -> anyhow::Result<RunningEpp> {
    let metrics = Arc::new(
        EppMetrics::register(gw.metrics.registry()).context("registering the picker's metrics")?,
    );
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let stop = CancellationToken::new();
    let health_task = tokio::spawn(report_readiness(gw.clone(), reporter, stop.clone()));

    let listener = tokio::net::TcpListener::bind(cfg.grpc)
        .await
        .with_context(|| format!("cannot listen on {} (ext_proc)", cfg.grpc))?;
    let grpc_addr = listener.local_addr()?;
    let picker = Picker {
        gw: gw.clone(),
        opts: cfg.picker.clone(),
        metrics,
    };
    let mut builder = Server::builder().http2_keepalive_interval(Some(Duration::from_secs(30)));
    if let Some(identity) = identity(&cfg.tls)? {
        builder = builder
            .tls_config(ServerTlsConfig::new().identity(identity))
            .context("the ext_proc port's TLS")?;
    }
    let router = builder
        .add_service(ExternalProcessorServer::new(picker))
        .add_service(health.clone());
    let mut servers = Vec::new();
    let s = stop.clone();
    servers.push(tokio::spawn(async move {
        // No Nagle: the response's chunks pass through here one by one (with it, a
        // chunk waited for the gateway's delayed ACK: ~25 ms more to first token).
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        if let Err(err) = router
            .serve_with_incoming_shutdown(incoming, s.cancelled())
            .await
        {
            tracing::error!(%err, "the ext_proc server failed");
        }
    }));

    let mut health_addr = None;
    if let Some(addr) = cfg.health {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} (gRPC health)"))?;
        health_addr = Some(listener.local_addr()?);
        let s = stop.clone();
        servers.push(tokio::spawn(async move {
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            if let Err(err) = Server::builder()
                .add_service(health)
                .serve_with_incoming_shutdown(incoming, s.cancelled())
                .await
            {
                tracing::error!(%err, "the gRPC health server failed");
            }
        }));
    }
    tracing::info!(%grpc_addr, ?health_addr, tls = ?cfg.tls, "kvgate Endpoint Picker listening (ext_proc)");
    Ok(RunningEpp {
        grpc_addr,
        health_addr,
        stop,
        servers,
        health_task,
    })
}

impl RunningEpp {
    /// Stops accepting streams, lets open ones end for up to `grace`, then stops.
    pub async fn shutdown(self, grace: Duration) {
        self.stop.cancel();
        for mut s in self.servers {
            if tokio::time::timeout(grace, &mut s).await.is_err() {
                s.abort();
            }
        }
        self.health_task.abort();
    }
}

/// The ext_proc port's certificate, or `None` for plaintext.
fn identity(tls: &Tls) -> anyhow::Result<Option<Identity>> {
    match tls {
        Tls::Plaintext => Ok(None),
        Tls::Files(dir) => {
            let read = |name: &str| {
                std::fs::read(dir.join(name))
                    .with_context(|| format!("cannot read {}", dir.join(name).display()))
            };
            Ok(Some(Identity::from_pem(read("tls.crt")?, read("tls.key")?)))
        }
        Tls::SelfSigned => {
            let made = rcgen::generate_simple_self_signed(vec![
                "kvgate-epp".to_owned(),
                "localhost".to_owned(),
            ])
            .context("making a self-signed certificate")?;
            Ok(Some(Identity::from_pem(
                made.cert.pem(),
                made.signing_key.serialize_pem(),
            )))
        }
    }
}

/// Keeps `readiness` and the ext_proc service's status current until `stop`, then
/// reports them not serving.
async fn report_readiness(
    gw: Arc<Gateway>,
    reporter: tonic_health::server::HealthReporter,
    stop: CancellationToken,
) {
    let mut last = None;
    loop {
        let ready = gw.index_bootstraps() == 0;
        if last != Some(ready) {
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for service in ["readiness", EXT_PROC_SERVICE, ""] {
                reporter.set_service_status(service, status).await;
            }
            last = Some(ready);
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
    for service in ["readiness", EXT_PROC_SERVICE, ""] {
        reporter
            .set_service_status(service, ServingStatus::NotServing)
            .await;
    }
}
