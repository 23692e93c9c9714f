//! The protocol's floor, for `benches/epp_load.sh`: an ext_proc server that picks
//! endpoints in turn from its arguments and does nothing else (no request reading,
//! booking or response watching), answering the same messages `kvgate epp` answers,
//! from the same `wire` builders, on the same tonic server, plaintext. Envoy + it,
//! minus Envoy alone, is what any picker built this way pays for the round trips.
//!
//! Usage: null_picker PORT ENDPOINT...

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as In;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::{Stream, StreamExt};
use kvgate_epp::wire::{self, Half, PickMessage};
use tonic::{Request, Response, Status, Streaming};

struct NullPicker {
    endpoints: Vec<String>,
    next: AtomicUsize,
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for NullPicker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Answers>, Status> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.endpoints.len();
        let destination = self.endpoints[i].clone();
        let mut body = Vec::new();
        let answers = request
            .into_inner()
            .filter_map(move |m| {
                let out: Vec<ProcessingResponse> = match m.ok().and_then(|m| m.request) {
                    Some(In::RequestHeaders(h)) if h.end_of_stream => {
                        vec![pick(&destination).headers_response()]
                    }
                    Some(In::RequestBody(b)) => {
                        body.extend_from_slice(&b.body);
                        if b.end_of_stream {
                            let mut out = vec![pick(&destination).headers_response()];
                            out.extend(wire::request_body_chunks(&body, true));
                            out
                        } else {
                            Vec::new()
                        }
                    }
                    Some(In::ResponseHeaders(_)) => vec![wire::continue_headers(Half::Response)],
                    Some(In::ResponseBody(b)) => {
                        vec![wire::response_chunk(b.body, b.end_of_stream)]
                    }
                    Some(In::ResponseTrailers(_)) => vec![wire::continue_trailers(Half::Response)],
                    _ => Vec::new(),
                };
                std::future::ready(Some(futures::stream::iter(out.into_iter().map(Ok))))
            })
            .flatten();
        Ok(Response::new(Box::pin(answers)))
    }
}

fn pick(destination: &str) -> PickMessage<'_> {
    PickMessage {
        destination,
        rank: None,
        remove: Vec::new(),
        conformance_echo: false,
    }
}

/// A multi-threaded runtime, as `kvgate epp` runs on.
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().unwrap_or_default().parse()?;
    let endpoints: Vec<String> = args.collect();
    anyhow::ensure!(!endpoints.is_empty(), "usage: null_picker PORT ENDPOINT...");
    let picker = NullPicker {
        endpoints,
        next: AtomicUsize::new(0),
    };
    let incoming = tonic::transport::server::TcpIncoming::bind(([127, 0, 0, 1], port).into())?
        .with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(ExternalProcessorServer::new(picker))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}
