//! The Endpoint Picker's protocol in process, with a tonic ext_proc client playing the
//! gateway: the body buffered across chunks (or ended by trailers) and sent back
//! byte-exact in chunks of at most 62,000 bytes, the pick as a header equal to its
//! `envoy.lb` metadata, client-sent control headers stripped, the response echoed and
//! watched (the booking ends with it, or with the stream), the subset hint, a served
//! endpoint that is not the pick, the errors, gRPC health, and two pickers as replicas
//! of each other. The workers are addresses nobody calls: in this mode the gateway in
//! front proxies.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, external_processor_client::ExternalProcessorClient, processing_request,
    processing_response, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use kvgate_core::PolicyKind;
use kvgate_epp::wire::{self, string_list};
use kvgate_epp::{EppConfig, PickerOptions, RunningEpp};
use kvgate_gateway::{Config, HealthConfig, ModelConfig, RunningGateway, WorkerConfig};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

const WORKERS: [&str; 3] = [
    "http://127.0.0.1:18001",
    "http://127.0.0.2:18001",
    "http://127.0.0.3:18001",
];

fn endpoints() -> Vec<String> {
    WORKERS
        .iter()
        .map(|u| u.trim_start_matches("http://").to_owned())
        .collect()
}

fn config(policy: PolicyKind) -> Config {
    Config {
        host: "127.0.0.1".into(),
        port: 0,
        models: vec![ModelConfig {
            name: "m".into(),
            workers: WORKERS.iter().map(|u| WorkerConfig::new(*u)).collect(),
            policy,
            seed: Some(7),
            engine_metrics_interval_ms: 0,
            ..ModelConfig::default()
        }],
        // Nobody answers at the workers' addresses: no active health checks.
        health: HealthConfig {
            interval_ms: 0,
            ..HealthConfig::default()
        },
        shutdown_grace_secs: 2,
        ..Config::default()
    }
}

struct Picker {
    gw: RunningGateway,
    epp: RunningEpp,
}

async fn picker_with(cfg: Config, opts: PickerOptions) -> Picker {
    let gw = kvgate_gateway::start(cfg).await.unwrap();
    let epp = kvgate_epp::start(
        gw.gateway().clone(),
        EppConfig {
            grpc: "127.0.0.1:0".parse().unwrap(),
            health: Some("127.0.0.1:0".parse().unwrap()),
            tls: kvgate_epp::server::Tls::Plaintext,
            picker: opts,
        },
    )
    .await
    .unwrap();
    Picker { gw, epp }
}

async fn picker() -> Picker {
    picker_with(config(PolicyKind::LeastLoaded), PickerOptions::default()).await
}

impl Picker {
    async fn client(&self) -> ExternalProcessorClient<Channel> {
        ExternalProcessorClient::connect(format!("http://{}", self.epp.grpc_addr))
            .await
            .unwrap()
    }

    async fn open(&self) -> Conversation {
        let (tx, rx) = mpsc::channel(64);
        let mut client = self.client().await;
        let responses = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Conversation { tx, rx: responses }
    }

    fn booked(&self) -> u64 {
        self.gw.ledger_in_flight("m").unwrap()
    }

    /// Bookings per endpoint.
    fn booked_on(&self, endpoint: &str) -> u32 {
        let m = self.gw.gateway().model("m").unwrap();
        let workers = m.workers();
        let w = workers.iter().find(|w| w.url.ends_with(endpoint)).unwrap();
        m.ledger().loads_of(&[w.id])[0].in_flight
    }

    async fn until_booked(&self, want: u64) {
        let start = tokio::time::Instant::now();
        while self.booked() != want {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "bookings stayed {} (want {want})",
                self.booked()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

struct Conversation {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Conversation {
    async fn send(&self, msg: ProcessingRequest) {
        self.tx.send(msg).await.unwrap();
    }

    async fn recv(&mut self) -> processing_response::Response {
        self.recv_whole().await.response.expect("a response")
    }

    async fn recv_whole(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("an answer within 10 s")
            .expect("the stream is open")
            .expect("a message")
    }
}

fn header(k: &str, v: &str) -> HeaderValue {
    HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn duplex() -> Option<ProtocolConfiguration> {
    Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        response_body_mode: BodySendMode::FullDuplexStreamed as i32,
        ..Default::default()
    })
}

fn request_headers(path: &str, extra: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    let mut headers = vec![
        header(":method", "POST"),
        header(":path", path),
        header("content-type", "application/json"),
    ];
    headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    ProcessingRequest {
        protocol_config: duplex(),
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn with_subset(mut msg: ProcessingRequest, subset: &[&str]) -> ProcessingRequest {
    let inner = Struct {
        fields: [(wire::SUBSET_KEY.to_owned(), string_list(subset))]
            .into_iter()
            .collect(),
    };
    msg.metadata_context = Some(Metadata {
        filter_metadata: [(wire::SUBSET_NAMESPACE.to_owned(), inner)]
            .into_iter()
            .collect(),
        ..Default::default()
    });
    msg
}

fn body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_headers(status: u16, content_type: &str, served: Option<&str>) -> ProcessingRequest {
    let metadata_context = served.map(|s| {
        let inner = Struct {
            fields: [(
                wire::SERVED_KEY.to_owned(),
                Value {
                    kind: Some(Kind::StringValue(s.into())),
                },
            )]
            .into_iter()
            .collect(),
        };
        Metadata {
            filter_metadata: [(wire::DESTINATION_NAMESPACE.to_owned(), inner)]
                .into_iter()
                .collect(),
            ..Default::default()
        }
    });
    ProcessingRequest {
        metadata_context,
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":status", &status.to_string()),
                    header("content-type", content_type),
                ],
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn completion(prompt: &str, stream: bool) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "m", "prompt": prompt, "max_tokens": 8, "stream": stream
    }))
    .unwrap()
}

/// The pick in a headers answer: (the header's value, the metadata's value, the
/// headers removed, the route cache cleared).
struct PickSeen {
    header: String,
    metadata: String,
    removed: Vec<String>,
    clear_route_cache: bool,
}

fn pick_of(msg: &ProcessingResponse) -> PickSeen {
    let Some(processing_response::Response::RequestHeaders(h)) = &msg.response else {
        panic!("not a request headers answer: {msg:?}");
    };
    let common = h.response.as_ref().expect("a common response");
    let mutation = common.header_mutation.as_ref().expect("a header mutation");
    let header = mutation
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == wire::DESTINATION_KEY)
        .map(wire::header_value)
        .expect("the destination header");
    let metadata = msg
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get(wire::DESTINATION_NAMESPACE))
        .and_then(|v| match &v.kind {
            Some(Kind::StructValue(s)) => s.fields.get(wire::DESTINATION_KEY),
            _ => None,
        })
        .and_then(|v| match &v.kind {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            _ => None,
        })
        .expect("the destination metadata");
    PickSeen {
        header,
        metadata,
        removed: mutation.remove_headers.clone(),
        clear_route_cache: common.clear_route_cache,
    }
}

/// A streamed body chunk: (bytes, end of stream).
fn streamed(r: &processing_response::Response) -> (Vec<u8>, bool) {
    let b = match r {
        processing_response::Response::RequestBody(b)
        | processing_response::Response::ResponseBody(b) => b,
        other => panic!("not a body answer: {other:?}"),
    };
    match b
        .response
        .as_ref()
        .and_then(|c| c.body_mutation.as_ref())
        .and_then(|m| m.mutation.clone())
    {
        Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body, s.end_of_stream),
        other => panic!("not a streamed body: {other:?}"),
    }
}

/// The immediate response's status, headers and JSON body.
fn immediate(r: &processing_response::Response) -> (i32, Vec<(String, String)>, serde_json::Value) {
    let processing_response::Response::ImmediateResponse(i) = r else {
        panic!("not an immediate response: {r:?}");
    };
    let headers = i
        .headers
        .as_ref()
        .map(|m| {
            m.set_headers
                .iter()
                .filter_map(|o| o.header.as_ref())
                .map(|h| (h.key.clone(), wire::header_value(h)))
                .collect()
        })
        .unwrap_or_default();
    (
        i.status.as_ref().map_or(0, |s| s.code),
        headers,
        serde_json::from_slice(&i.body).expect("a JSON body"),
    )
}

/// A pick on a request whose body comes in three chunks (150 kB): the header equals the
/// metadata, the client's own control header is stripped, the body comes back
/// byte-exact in chunks of at most 62,000 bytes; the response's chunks are echoed as
/// they come and the booking ends with its last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_resends_the_body_byte_exact_and_echoes_the_response() {
    let p = picker().await;
    let mut c = p.open().await;
    let prompt: String = (0..40_000).map(|i| format!("w{} ", i % 97)).collect();
    let whole = completion(&prompt, true);
    assert!(whole.len() > 150_000);
    c.send(request_headers(
        "/v1/completions",
        &[("x-gateway-destination-endpoint", "10.9.9.9:1")],
        false,
    ))
    .await;
    let cut = [whole.len() / 3, 2 * whole.len() / 3];
    c.send(body(&whole[..cut[0]], false)).await;
    c.send(body(&whole[cut[0]..cut[1]], false)).await;
    c.send(body(&whole[cut[1]..], true)).await;

    let pick = pick_of(&c.recv_whole().await);
    assert_eq!(pick.header, pick.metadata);
    assert!(endpoints().contains(&pick.header), "{}", pick.header);
    assert!(pick.clear_route_cache);
    assert_eq!(pick.removed, ["x-gateway-destination-endpoint"]);
    let mut resent = Vec::new();
    loop {
        let (chunk, end) = streamed(&c.recv().await);
        assert!(chunk.len() <= wire::BODY_CHUNK_LIMIT);
        resent.extend_from_slice(&chunk);
        if end {
            break;
        }
    }
    assert_eq!(resent, whole, "the body comes back byte-exact");
    assert_eq!(p.booked(), 1);
    // The picked worker's progress clock (what the stall watcher reads) moves with its
    // answer, as it does for a proxied response.
    let worker_of = |endpoint: &str| {
        p.gw.gateway()
            .model("m")
            .unwrap()
            .workers()
            .iter()
            .find(|w| w.url.ends_with(endpoint))
            .cloned()
            .unwrap()
    };
    let untouched = worker_of(&pick.header).progress.last();
    tokio::time::sleep(Duration::from_millis(5)).await;

    c.send(response_headers(200, "text/event-stream", None))
        .await;
    assert!(matches!(
        c.recv().await,
        processing_response::Response::ResponseHeaders(_)
    ));
    for (i, event) in [
        &b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n"[..],
        b"data: {\"choices\":[{\"text\":\"b\"}]}\n\n",
        b"data: [DONE]\n\n",
    ]
    .iter()
    .enumerate()
    {
        let last = i == 2;
        c.send(response_body(event, last)).await;
        let (echo, end) = streamed(&c.recv().await);
        assert_eq!((echo.as_slice(), end), (*event, last), "echoed unchanged");
        if !last {
            assert_eq!(p.booked(), 1, "held while the response streams");
        }
    }
    assert!(worker_of(&pick.header).progress.last() > untouched);
    p.until_booked(0).await;
}

/// Trailers end a request body that did not say it ended: the pick, the body (its last
/// chunk not the end), then the trailers' answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_end_the_request_body() {
    let p = picker().await;
    let mut c = p.open().await;
    let whole = completion("hello there", false);
    c.send(request_headers("/v1/completions", &[], false)).await;
    c.send(body(&whole, false)).await;
    c.send(ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    })
    .await;
    let pick = pick_of(&c.recv_whole().await);
    assert!(endpoints().contains(&pick.header));
    let (chunk, end) = streamed(&c.recv().await);
    assert_eq!((chunk, end), (whole, false));
    assert!(matches!(
        c.recv().await,
        processing_response::Response::RequestTrailers(_)
    ));
}

/// The gateway's subset hint: a pick comes from it; an empty one is a 503; without one
/// every endpoint is picked in turn (least_loaded, each pick still booked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_bounds_the_pick() {
    let p = picker().await;
    let eps = endpoints();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut c = p.open().await;
        c.send(with_subset(
            request_headers("/v1/completions", &[], false),
            &[&eps[1]],
        ))
        .await;
        c.send(body(&completion("q", false), true)).await;
        assert_eq!(pick_of(&c.recv_whole().await).header, eps[1]);
        held.push(c);
    }
    assert_eq!(p.booked_on(&eps[1]), 4);

    let mut c = p.open().await;
    c.send(with_subset(
        request_headers("/v1/completions", &[], false),
        &[],
    ))
    .await;
    let (status, _, err) = immediate(&c.recv().await);
    assert_eq!(status, 503);
    assert_eq!(err["error"]["code"], "no_eligible_endpoint");

    // Without a hint, the least loaded: the two endpoints the hint kept empty.
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..2 {
        let mut c = p.open().await;
        c.send(request_headers("/v1/completions", &[], false)).await;
        c.send(body(&completion("q", false), true)).await;
        seen.insert(pick_of(&c.recv_whole().await).header);
        held.push(c);
    }
    assert_eq!(seen, [eps[0].clone(), eps[2].clone()].into_iter().collect());
    drop(held);
    p.until_booked(0).await;
}

/// The gateway reports another endpoint served (it retried, or ignored the pick): the
/// booking moves there, and the picker counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booking_moves_to_the_endpoint_that_served() {
    let p = picker().await;
    let mut c = p.open().await;
    c.send(request_headers("/v1/completions", &[], false)).await;
    c.send(body(&completion("q", true), true)).await;
    let picked = pick_of(&c.recv_whole().await).header;
    let _body = c.recv().await;
    let other = endpoints().into_iter().find(|e| *e != picked).unwrap();
    assert_eq!((p.booked_on(&picked), p.booked_on(&other)), (1, 0));
    c.send(response_headers(200, "text/event-stream", Some(&other)))
        .await;
    let _ = c.recv().await;
    assert_eq!((p.booked_on(&picked), p.booked_on(&other)), (0, 1));
    let metrics =
        p.gw.gateway()
            .metrics
            .render(|_| {}, &Default::default(), |_| None);
    assert!(
        metrics.contains("kvgate_epp_served_elsewhere_total{model=\"m\"} 1"),
        "{metrics}"
    );
    c.send(response_body(b"data: [DONE]\n\n", true)).await;
    let _ = c.recv().await;
    p.until_booked(0).await;
}

/// A stream the gateway breaks off (the client left, the gateway restarted) frees its
/// booking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_frees_its_booking() {
    let p = picker().await;
    let mut c = p.open().await;
    c.send(request_headers("/v1/completions", &[], false)).await;
    c.send(body(&completion("q", true), true)).await;
    let _ = pick_of(&c.recv_whole().await);
    let _ = c.recv().await;
    c.send(response_headers(200, "text/event-stream", None))
        .await;
    let _ = c.recv().await;
    c.send(response_body(b"data: {\"choices\":[]}\n\n", false))
        .await;
    let _ = c.recv().await;
    assert_eq!(p.booked(), 1);
    drop(c);
    p.until_booked(0).await;
}

/// The picker's own answers: a body that is not JSON is a 400, an unknown model a 404,
/// a full fleet a 429 with Retry-After, all OpenAI-style JSON; the client's request is
/// never forwarded after one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_immediate_responses_in_openai_json() {
    let mut cfg = config(PolicyKind::LeastLoaded);
    cfg.models[0].workers.truncate(1);
    cfg.limits.max_in_flight_per_worker = 1;
    cfg.limits.queue_timeout_ms = 100;
    let p = picker_with(cfg, PickerOptions::default()).await;

    let ask = |payload: Vec<u8>| {
        let p = &p;
        async move {
            let mut c = p.open().await;
            c.send(request_headers("/v1/completions", &[], false)).await;
            c.send(body(&payload, true)).await;
            (c.recv_whole().await, c)
        }
    };
    let (r, _) = ask(b"{not json".to_vec()).await;
    let (status, headers, err) = immediate(r.response.as_ref().unwrap());
    assert_eq!(status, 400, "{err}");
    assert!(headers.contains(&("content-type".into(), "application/json".into())));
    assert!(err["error"]["message"].is_string());

    let (r, _) = ask(br#"{"model":"nope","prompt":"x"}"#.to_vec()).await;
    assert_eq!(immediate(r.response.as_ref().unwrap()).0, 404);

    let (first, _held) = ask(completion("q", true)).await;
    let _ = pick_of(&first);
    let (r, _) = ask(completion("q", true)).await;
    let (status, headers, err) = immediate(r.response.as_ref().unwrap());
    assert_eq!(status, 429, "{err}");
    assert!(
        headers.iter().any(|(k, _)| k == "retry-after"),
        "{headers:?}"
    );
}

/// A request that is not routed (no body to route on: `GET /v1/models`) is picked in
/// rotation and books nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_is_not_routed_is_picked_in_rotation() {
    let p = picker().await;
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..3 {
        let mut c = p.open().await;
        let mut h = request_headers("/v1/models", &[], true);
        if let Some(processing_request::Request::RequestHeaders(hh)) = &mut h.request {
            hh.headers.as_mut().unwrap().headers[0] = header(":method", "GET");
        }
        c.send(h).await;
        seen.insert(pick_of(&c.recv_whole().await).header);
        assert_eq!(p.booked(), 0);
    }
    assert_eq!(seen.len(), 3);
    // Counted in kvgate_requests_total as `kvgate serve` counts: chat and completions.
    let counted = |p: &Picker| {
        let text =
            p.gw.gateway()
                .metrics
                .render(|_| {}, &Default::default(), |_| None);
        text.lines()
            .filter(|l| l.starts_with("kvgate_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(counted(&p), 0.0);
    let mut c = p.open().await;
    c.send(request_headers("/v1/completions", &[], false)).await;
    c.send(body(&completion("q", false), true)).await;
    let _ = pick_of(&c.recv_whole().await);
    let _ = c.recv().await;
    c.send(response_headers(200, "application/json", None))
        .await;
    let _ = c.recv().await;
    assert_eq!(counted(&p), 1.0);
}

/// gRPC health on the ext_proc port and the health port: liveness, readiness and the
/// ext_proc service all serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_services_serve_on_both_ports() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let p = picker().await;
    let ports = [p.epp.grpc_addr, p.epp.health_addr.unwrap()];
    for addr in ports {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = HealthClient::new(channel);
        for service in [
            "liveness",
            "readiness",
            "envoy.service.ext_proc.v3.ExternalProcessor",
        ] {
            let start = tokio::time::Instant::now();
            loop {
                let status = client
                    .check(HealthCheckRequest {
                        service: service.into(),
                    })
                    .await
                    .map(|r| r.into_inner().status);
                if status
                    .as_ref()
                    .is_ok_and(|s| *s == ServingStatus::Serving as i32)
                {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "{service} on {addr}: {status:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// With ranked fallbacks on, the destination lists the pick then the others by cost,
/// in the header and the metadata alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallbacks_follow_the_pick_in_cost_order() {
    let p = picker_with(
        config(PolicyKind::LeastLoaded),
        PickerOptions {
            fallbacks: 2,
            ..PickerOptions::default()
        },
    )
    .await;
    let mut c = p.open().await;
    c.send(request_headers("/v1/completions", &[], false)).await;
    c.send(body(&completion("q", false), true)).await;
    let pick = pick_of(&c.recv_whole().await);
    assert_eq!(pick.header, pick.metadata);
    let listed: Vec<&str> = pick.header.split(',').collect();
    assert_eq!(listed.len(), 3, "{}", pick.header);
    let mut sorted: Vec<String> = listed.iter().map(|s| s.to_string()).collect();
    sorted.sort();
    assert_eq!(sorted, endpoints());
}

/// The conformance suite's hooks, on by flag: `test-epp-endpoint-selection` names the
/// endpoint to pick, and the pick is echoed as `x-echo-set-header` for its echo server.
/// Off (the default), the header is an ordinary one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_hooks_steer_and_echo_the_pick_only_when_on() {
    let eps = endpoints();
    for on in [true, false] {
        let p = picker_with(
            config(PolicyKind::RoundRobin),
            PickerOptions {
                conformance_hooks: on,
                ..PickerOptions::default()
            },
        )
        .await;
        let mut picks = std::collections::BTreeSet::new();
        for _ in 0..3 {
            let mut c = p.open().await;
            c.send(request_headers(
                "/v1/completions",
                &[(wire::CONFORMANCE_SELECTION_HEADER, &eps[2])],
                false,
            ))
            .await;
            c.send(body(&completion("q", false), true)).await;
            let msg = c.recv_whole().await;
            let Some(processing_response::Response::RequestHeaders(h)) = &msg.response else {
                panic!("{msg:?}")
            };
            let echo = h
                .response
                .as_ref()
                .and_then(|r| r.header_mutation.as_ref())
                .and_then(|m| {
                    m.set_headers
                        .iter()
                        .filter_map(|o| o.header.as_ref())
                        .find(|h| h.key == wire::CONFORMANCE_ECHO_HEADER)
                        .map(wire::header_value)
                });
            let pick = pick_of(&msg).header;
            if on {
                assert_eq!(pick, eps[2]);
                assert_eq!(
                    echo.as_deref(),
                    Some(format!("{}:{}", wire::CONFORMANCE_RESULT_HEADER, eps[2]).as_str())
                );
            } else {
                assert_eq!(echo, None);
            }
            picks.insert(pick);
        }
        if !on {
            assert_eq!(picks.len(), 3, "round robin ignores the test header");
        }
    }
}

/// A picker as one of several replicas (`--peer`, as `kvgate serve`): what one books
/// the other counts, so requests that reach different pickers spread over the pool as
/// if they reached one; a booking that ends at one ends at the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picker_replicas_share_their_bookings() {
    let b_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    // kv_aware: with nothing cached anywhere, the least loaded endpoint of all (not
    // least_loaded's better of two drawn at random).
    let replica = |id: &str, port: u16, peer: String| {
        let mut cfg = config(PolicyKind::KvAware);
        cfg.models[0].tokenizer = Some(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3-tokenizer"),
        );
        // Engines' event endpoints nobody publishes on (kv_aware needs one each).
        for (i, w) in cfg.models[0].workers.iter_mut().enumerate() {
            w.kv_events = Some(format!("tcp://127.0.0.1:{}", 9 + i));
        }
        cfg.port = port;
        cfg.admin_token = Some("replicas-token".into());
        cfg.peers = kvgate_gateway::PeersConfig {
            replica_id: Some(id.into()),
            urls: vec![peer],
            ..kvgate_gateway::PeersConfig::default()
        };
        cfg
    };
    let b_url = format!("http://127.0.0.1:{b_port}");
    let a = picker_with(replica("a", 0, b_url), PickerOptions::default()).await;
    let b = picker_with(replica("b", b_port, a.gw.url()), PickerOptions::default()).await;
    let fleet_booked_on = |p: &Picker, endpoint: &str| {
        let m = p.gw.gateway().model("m").unwrap();
        let workers = m.workers();
        let w = workers.iter().find(|w| w.url.ends_with(endpoint)).unwrap();
        m.ledger().fleet_loads_of(&[w.id])[0].in_flight
    };
    let until = async |what: &str, check: &dyn Fn() -> bool| {
        let start = tokio::time::Instant::now();
        while !check() {
            assert!(start.elapsed() < Duration::from_secs(10), "{what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let connected = |p: &Picker| p.gw.gateway().metrics.peers_connected.get();
    until("the pickers follow each other", &|| {
        connected(&a) == 1 && connected(&b) == 1
    })
    .await;

    // Two requests held at a, on two endpoints: b counts them.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = a.open().await;
        c.send(request_headers("/v1/completions", &[], false)).await;
        c.send(body(&completion("held", true), true)).await;
        let picked = pick_of(&c.recv_whole().await).header;
        let _body = c.recv().await;
        held.push((c, picked));
    }
    assert_ne!(held[0].1, held[1].1, "a spreads its own");
    until("b counts a's bookings", &|| {
        held.iter().all(|(_, e)| fleet_booked_on(&b, e) == 1)
    })
    .await;
    // Every request reaching b goes to the endpoint a does not load (by chance: 1 in 3^5).
    let free = endpoints()
        .into_iter()
        .find(|e| held.iter().all(|(_, h)| h != e))
        .unwrap();
    for round in 0..5 {
        let mut c = b.open().await;
        c.send(request_headers("/v1/completions", &[], false)).await;
        c.send(body(&completion("q", false), true)).await;
        let loads: Vec<u32> = endpoints().iter().map(|e| fleet_booked_on(&b, e)).collect();
        assert_eq!(
            pick_of(&c.recv_whole().await).header,
            free,
            "round {round}, b's loads {loads:?}"
        );
        let _body = c.recv().await;
        c.send(response_headers(200, "application/json", None))
            .await;
        let _ = c.recv().await;
        c.send(response_body(b"{\"choices\":[]}", true)).await;
        let _ = c.recv().await;
        b.until_booked(0).await;
        // a, the leader, chose for b and holds that choice until b's next report.
        until("a lets go of b's ended request", &|| {
            fleet_booked_on(&a, &free) == 0
        })
        .await;
    }
    // a's requests end: b lets go of them too.
    drop(held);
    a.until_booked(0).await;
    until("b drops a's ended bookings", &|| {
        endpoints().iter().all(|e| fleet_booked_on(&b, e) == 0)
    })
    .await;
}
