//! The Endpoint Picker protocol's messages (gateway-api-inference-extension,
//! docs/proposals/004-endpoint-picker-protocol) as Envoy ext_proc protobufs: reading a
//! request's headers, the subset hint and the served endpoint, and building the pick,
//! the re-sent body chunks, the echoed response chunks and immediate responses.
//!
//! Owns the wire shapes and names. Must not pick, book or hold state (stream.rs).

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as PbHeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use kvgate_gateway::ApiError;

/// The namespace and key of the pick, in dynamic metadata and as a request header.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The endpoint that served, from gateways that report it (in `envoy.lb`).
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The gateway's subset hint: the endpoints a pick must come from.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Plain Envoy's served host, with `response_attributes: ["upstream.address"]`.
pub const EXT_PROC_ATTRIBUTES: &str = "envoy.filters.http.ext_proc";
pub const UPSTREAM_ADDRESS: &str = "upstream.address";
/// The largest body chunk sent back (some gateways refuse chunks over 64 KiB).
pub const BODY_CHUNK_LIMIT: usize = 62_000;
/// The conformance suite's hooks (off by default): a header that names the
/// endpoints to pick from, and the header its echo server returns the pick in.
pub const CONFORMANCE_SELECTION_HEADER: &str = "test-epp-endpoint-selection";
pub const CONFORMANCE_ECHO_HEADER: &str = "x-echo-set-header";
pub const CONFORMANCE_RESULT_HEADER: &str = "x-conformance-test-served-endpoint";

/// A header's value: `raw_value` (what Envoy sends), else `value`.
pub fn header_value(h: &HeaderValue) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

/// A request's head as Envoy sends it: the pseudo-headers apart, the rest as an
/// `http::HeaderMap` (headers that are not valid HTTP are skipped).
#[derive(Debug, Default)]
pub struct Head {
    pub method: String,
    pub path: String,
    pub status: Option<u16>,
    pub headers: http::HeaderMap,
}

pub fn read_head(map: Option<&PbHeaderMap>) -> Head {
    let mut head = Head::default();
    for h in map.map(|m| m.headers.as_slice()).unwrap_or_default() {
        let value = header_value(h);
        match h.key.as_str() {
            ":method" => head.method = value,
            ":path" => head.path = value,
            ":status" => head.status = value.parse().ok(),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(name), Ok(v)) = (
                    http::HeaderName::from_bytes(k.as_bytes()),
                    http::HeaderValue::from_str(&value),
                ) {
                    head.headers.append(name, v);
                }
            }
        }
    }
    head
}

/// The endpoints of a list value: each string may itself be `ip:port,ip:port`.
fn endpoints_of(v: &Value) -> Vec<String> {
    let strings: Vec<&str> = match &v.kind {
        Some(Kind::StringValue(s)) => vec![s.as_str()],
        Some(Kind::ListValue(l)) => l
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.as_str()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    strings
        .iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The gateway's subset hint, when it sends one (`Some(empty)`: it allows nothing).
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let ns = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
    ns.fields.get(SUBSET_KEY).map(endpoints_of)
}

/// The endpoint that served, from the gateway's `envoy.lb` metadata, or from plain
/// Envoy's `upstream.address` attribute (in the message's or its headers' attributes).
pub fn served_endpoint(
    metadata: Option<&Metadata>,
    attributes: &[&HashMap<String, Struct>],
) -> Option<String> {
    let from_metadata = metadata
        .and_then(|m| m.filter_metadata.get(DESTINATION_NAMESPACE))
        .and_then(|ns| ns.fields.get(SERVED_KEY))
        .and_then(|v| endpoints_of(v).into_iter().next());
    from_metadata.or_else(|| {
        attributes.iter().find_map(|a| {
            let v = a.get(EXT_PROC_ATTRIBUTES)?.fields.get(UPSTREAM_ADDRESS)?;
            endpoints_of(v).into_iter().next()
        })
    })
}

fn string_value(s: impl Into<String>) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What a pick tells the gateway: the destination (the endpoint picked, then any
/// fallbacks, comma-separated) as a header and as `envoy.lb` dynamic metadata, the same
/// value in both; headers a client sent in the picker's namespace removed; the route
/// cache cleared so the gateway routes on the new header.
pub struct PickMessage<'a> {
    pub destination: &'a str,
    /// `x-data-parallel-rank` for an engine with several ranks.
    pub rank: Option<u32>,
    /// Client-sent headers to strip (`x-gateway-destination-endpoint*`).
    pub remove: Vec<String>,
    /// The conformance echo header (only with the hooks on).
    pub conformance_echo: bool,
}

impl PickMessage<'_> {
    fn common(&self) -> CommonResponse {
        let mut set = vec![set_header(DESTINATION_KEY, self.destination)];
        if let Some(rank) = self.rank {
            set.push(set_header("x-data-parallel-rank", &rank.to_string()));
        }
        if self.conformance_echo {
            let first = self.destination.split(',').next().unwrap_or_default();
            set.push(set_header(
                CONFORMANCE_ECHO_HEADER,
                &format!("{CONFORMANCE_RESULT_HEADER}:{first}"),
            ));
        }
        CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: set,
                remove_headers: self.remove.clone(),
            }),
            clear_route_cache: true,
            ..Default::default()
        }
    }

    fn metadata(&self) -> Struct {
        let inner = Struct {
            fields: [(DESTINATION_KEY.to_owned(), string_value(self.destination))]
                .into_iter()
                .collect(),
        };
        Struct {
            fields: [(
                DESTINATION_NAMESPACE.to_owned(),
                Value {
                    kind: Some(Kind::StructValue(inner)),
                },
            )]
            .into_iter()
            .collect(),
        }
    }

    /// The pick as the answer to the request headers (duplex mode: sent once the body
    /// has been read).
    pub fn headers_response(&self) -> ProcessingResponse {
        ProcessingResponse {
            dynamic_metadata: Some(self.metadata()),
            ..headers_answer(
                Half::Request,
                HeadersResponse {
                    response: Some(self.common()),
                },
            )
        }
    }

    /// The pick as the answer to a buffered request body (the headers were answered
    /// before the body came).
    pub fn body_response(&self) -> ProcessingResponse {
        ProcessingResponse {
            dynamic_metadata: Some(self.metadata()),
            ..body_answer(
                Half::Request,
                BodyResponse {
                    response: Some(self.common()),
                },
            )
        }
    }
}

/// The response header that names the endpoint picked (a client can compare it with
/// the one its gateway says served).
pub const PICKED_HEADER: &str = "x-kvgate-picked";

/// Which half of the exchange a message answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    Request,
    Response,
}

fn message(response: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

fn headers_answer(half: Half, r: HeadersResponse) -> ProcessingResponse {
    message(match half {
        Half::Request => processing_response::Response::RequestHeaders(r),
        Half::Response => processing_response::Response::ResponseHeaders(r),
    })
}

fn body_answer(half: Half, r: BodyResponse) -> ProcessingResponse {
    message(match half {
        Half::Request => processing_response::Response::RequestBody(r),
        Half::Response => processing_response::Response::ResponseBody(r),
    })
}

/// The response's headers, with the endpoint picked named in [`PICKED_HEADER`].
pub fn response_headers_naming(picked: &str) -> ProcessingResponse {
    headers_answer(
        Half::Response,
        HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: vec![set_header(PICKED_HEADER, picked)],
                    remove_headers: Vec::new(),
                }),
                ..Default::default()
            }),
        },
    )
}

/// Headers let through unchanged.
pub fn continue_headers(half: Half) -> ProcessingResponse {
    headers_answer(half, HeadersResponse { response: None })
}

/// A body message let through unchanged (modes other than duplex).
pub fn continue_body(half: Half) -> ProcessingResponse {
    body_answer(half, BodyResponse { response: None })
}

/// Trailers let through unchanged.
pub fn continue_trailers(half: Half) -> ProcessingResponse {
    let r = TrailersResponse::default();
    message(match half {
        Half::Request => processing_response::Response::RequestTrailers(r),
        Half::Response => processing_response::Response::ResponseTrailers(r),
    })
}

/// A body chunk sent as the gateway's body in duplex mode.
fn streamed(half: Half, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    body_answer(
        half,
        BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(
                        StreamedBodyResponse {
                            body,
                            end_of_stream,
                            ..Default::default()
                        },
                    )),
                }),
                ..Default::default()
            }),
        },
    )
}

/// A buffered request body sent back in duplex mode: chunks of at most
/// [`BODY_CHUNK_LIMIT`] bytes, the last with `end_of_stream` (unless trailers follow);
/// an empty body is one empty chunk.
pub fn request_body_chunks(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    if body.is_empty() {
        return vec![streamed(Half::Request, Vec::new(), end_of_stream)];
    }
    let chunks: Vec<&[u8]> = body.chunks(BODY_CHUNK_LIMIT).collect();
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| streamed(Half::Request, c.to_vec(), end_of_stream && i == last))
        .collect()
}

/// A response chunk echoed back unchanged in duplex mode.
pub fn response_chunk(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    streamed(Half::Response, body, end_of_stream)
}

/// An error answered to the client by the gateway: the status, OpenAI-style JSON,
/// and `Retry-After` where waiting helps.
pub fn immediate(err: &ApiError) -> ProcessingResponse {
    let mut set = vec![set_header("content-type", "application/json")];
    if let Some(secs) = err.retry_after {
        set.push(set_header("retry-after", &secs.to_string()));
    }
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(err.status.as_u16()),
                }),
                headers: Some(HeaderMutation {
                    set_headers: set,
                    remove_headers: Vec::new(),
                }),
                body: err.json_body(),
                details: err.code.to_owned(),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

/// A list value of strings (tests and the subset hint's shape).
pub fn string_list(items: &[&str]) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue {
            values: items.iter().map(|s| string_value(*s)).collect(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(ns: &str, key: &str, v: Value) -> Metadata {
        let inner = Struct {
            fields: [(key.to_owned(), v)].into_iter().collect(),
        };
        Metadata {
            filter_metadata: [(ns.to_owned(), inner)].into_iter().collect(),
            ..Default::default()
        }
    }

    #[test]
    fn subset_hints_as_lists_or_comma_strings() {
        let m = metadata(
            SUBSET_NAMESPACE,
            SUBSET_KEY,
            string_list(&["a:1", "b:2,c:3"]),
        );
        assert_eq!(subset_hint(Some(&m)).unwrap(), ["a:1", "b:2", "c:3"]);
        let m = metadata(SUBSET_NAMESPACE, SUBSET_KEY, string_value("a:1, b:2"));
        assert_eq!(subset_hint(Some(&m)).unwrap(), ["a:1", "b:2"]);
        let m = metadata(SUBSET_NAMESPACE, SUBSET_KEY, string_list(&[]));
        assert_eq!(subset_hint(Some(&m)).unwrap(), Vec::<String>::new());
        assert_eq!(subset_hint(None), None);
        let m = metadata("other", SUBSET_KEY, string_list(&["a:1"]));
        assert_eq!(subset_hint(Some(&m)), None);
    }

    #[test]
    fn served_from_metadata_or_upstream_address() {
        let m = metadata(DESTINATION_NAMESPACE, SERVED_KEY, string_value("a:1"));
        assert_eq!(served_endpoint(Some(&m), &[]).as_deref(), Some("a:1"));
        let attrs: HashMap<String, Struct> = [(
            EXT_PROC_ATTRIBUTES.to_owned(),
            Struct {
                fields: [(UPSTREAM_ADDRESS.to_owned(), string_value("b:2"))]
                    .into_iter()
                    .collect(),
            },
        )]
        .into_iter()
        .collect();
        assert_eq!(served_endpoint(None, &[&attrs]).as_deref(), Some("b:2"));
        assert_eq!(served_endpoint(None, &[]), None);
    }

    #[test]
    fn bodies_are_rechunked_byte_exact() {
        let body: Vec<u8> = (0..150_001u32).map(|i| (i % 251) as u8).collect();
        let chunks = request_body_chunks(&body, true);
        assert_eq!(chunks.len(), 3);
        let mut joined = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let Some(processing_response::Response::RequestBody(b)) = &c.response else {
                panic!("not a body response")
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) = &b
                .response
                .as_ref()
                .and_then(|r| r.body_mutation.as_ref())
                .and_then(|m| m.mutation.clone())
            else {
                panic!("not streamed")
            };
            assert!(s.body.len() <= BODY_CHUNK_LIMIT);
            assert_eq!(s.end_of_stream, i == 2);
            joined.extend_from_slice(&s.body);
        }
        assert_eq!(joined, body);
        assert_eq!(request_body_chunks(&[], true).len(), 1);
    }
}
