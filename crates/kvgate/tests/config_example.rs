//! The YAML example the README points to must parse and validate, so the docs and the
//! configuration code cannot drift apart.

use kvgate_core::PolicyKind;
use kvgate_gateway::Config;

#[test]
fn readme_yaml_example_parses_and_validates() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/kvgate.yaml");
    let config = Config::from_yaml_file(std::path::Path::new(path)).expect("example parses");
    config.validate().expect("example validates");
    assert_eq!(config.models.len(), 2);
    let kv = &config.models[0];
    assert_eq!(kv.policy, PolicyKind::KvAware);
    assert_eq!(kv.workers.len(), 2);
    assert_eq!(
        kv.workers[0].kv_events.as_deref(),
        Some("tcp://10.0.0.11:5557")
    );
    assert_eq!(config.models[1].workers[1].url, "http://10.0.0.22:8000");
    assert!(config.peers.enabled());
}

/// The Kubernetes manifest's kvgate config (its ConfigMap) parses and validates, and
/// the Deployment runs several replicas that find each other through the headless
/// Service its config names.
#[test]
fn kubernetes_manifest_config_validates() {
    use serde::Deserialize;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/kubernetes/kvgate.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let docs: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .collect();
    let kind = |k: &'static str| docs.iter().filter(move |d| d["kind"] == k);
    let config_map = kind("ConfigMap").next().expect("a ConfigMap");
    let config = Config::from_yaml_str(config_map["data"]["kvgate.yaml"].as_str().unwrap())
        .expect("the ConfigMap's kvgate.yaml validates");
    let dns = config.peers.dns.clone().expect("peers found through DNS");
    let engines = config.models[0]
        .workers_dns
        .as_ref()
        .expect("engines found through DNS");
    assert!(engines.kv_events_port.is_some() && engines.kv_events_replay_port.is_some());
    let deployment = kind("Deployment").next().expect("a Deployment");
    assert!(deployment["spec"]["replicas"].as_u64().unwrap() >= 2);
    let headless = kind("Service")
        .find(|s| s["spec"]["clusterIP"] == "None")
        .expect("a headless Service for the peers");
    let name = headless["metadata"]["name"].as_str().unwrap();
    assert!(dns.starts_with(&format!("{name}.")), "{dns} names {name}");
}

/// The Envoy configuration docs/operations.md shows (`deploy/envoy/envoy.yaml`) is the
/// one the Endpoint Picker's tests and benchmarks run (kvgate-bench's envoy.rs), for
/// the placeholder addresses its header names. Regenerate it with
/// `KVGATE_WRITE_ENVOY_EXAMPLE=1 cargo test -p kvgate --test config_example`.
#[test]
fn the_documented_envoy_config_is_the_tested_one() {
    use kvgate_bench::envoy::{config, EnvoyConfig, PickerAddr};
    let header = "# deploy/envoy/envoy.yaml: Envoy in front of two vLLM pods (10.0.0.11:8000, 10.0.0.12:8000)\n\
# following the picks of kvgate epp at 10.0.0.5:9002 (TLS). Written by kvgate-bench's envoy.rs,\n\
# the configuration tests/epp_envoy_e2e.rs runs and validates with a real Envoy.\n";
    let text = format!(
        "{header}{}",
        config(&EnvoyConfig {
            port: 8080,
            admin_port: 9901,
            endpoints: vec!["10.0.0.11:8000".into(), "10.0.0.12:8000".into()],
            picker: Some(PickerAddr {
                addr: "10.0.0.5:9002".into(),
                tls: true,
            }),
            subset_hint: None,
        })
    );
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/envoy/envoy.yaml");
    if std::env::var_os("KVGATE_WRITE_ENVOY_EXAMPLE").is_some() {
        std::fs::write(path, &text).unwrap();
    }
    assert_eq!(
        std::fs::read_to_string(path).unwrap(),
        text,
        "deploy/envoy/envoy.yaml is not what envoy.rs writes (regenerate it: see this test)"
    );
}

/// The Endpoint Picker's manifest: the InferencePool names the picker's Service and its
/// ext_proc port, the HTTPRoute routes to the pool, the Deployment's arguments are a
/// valid `kvgate epp` command line naming the pool and those ports, its probes ask the
/// gRPC health services on the health port, and its Role reads the pool and its pods.
#[test]
fn the_endpoint_picker_manifest_holds_together() {
    use clap::Parser;
    use serde::Deserialize;
    #[derive(Parser)]
    struct Epp {
        #[command(flatten)]
        args: kvgate_epp::cli::EppArgs,
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/kubernetes/kvgate-epp.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let docs: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .collect();
    let one = |k: &str| {
        let found: Vec<&serde_json::Value> = docs.iter().filter(|d| d["kind"] == k).collect();
        assert_eq!(found.len(), 1, "one {k}");
        found[0]
    };
    let pool = one("InferencePool");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    let pool_name = pool["metadata"]["name"].as_str().unwrap();
    assert!(!pool["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
        .is_empty());
    let route = one("HTTPRoute");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(
        (&backend["kind"], &backend["name"]),
        (&"InferencePool".into(), &pool_name.into())
    );

    let container = &one("Deployment")["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "epp");
    let epp = Epp::try_parse_from(std::iter::once("kvgate epp").chain(args[1..].iter().copied()))
        .expect("the Deployment's arguments are a kvgate epp command line")
        .args;
    assert_eq!(epp.pool_name.as_deref(), Some(pool_name));
    let picker_ref = &pool["spec"]["endpointPickerRef"];
    let service = one("Service");
    assert_eq!(picker_ref["name"], service["metadata"]["name"]);
    assert_eq!(picker_ref["port"]["number"], epp.grpc_port);
    assert!(service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["port"] == epp.grpc_port));
    for (probe, service) in [
        ("livenessProbe", "liveness"),
        ("readinessProbe", "readiness"),
    ] {
        assert_eq!(
            container[probe]["grpc"]["port"], epp.grpc_health_port,
            "{probe}"
        );
        assert_eq!(container[probe]["grpc"]["service"], service, "{probe}");
    }
    let rules = one("Role")["rules"].as_array().unwrap().clone();
    let grants = |resource: &str, verb: &str| {
        rules.iter().any(|r| {
            r["resources"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x == resource)
                && r["verbs"].as_array().unwrap().iter().any(|x| x == verb)
        })
    };
    // The discovery watches both (a list, then the change stream).
    for (resource, verb) in [
        ("inferencepools", "list"),
        ("inferencepools", "watch"),
        ("pods", "list"),
        ("pods", "watch"),
    ] {
        assert!(grants(resource, verb), "the picker may {verb} {resource}");
    }
    let account = &one("ServiceAccount")["metadata"]["name"];
    assert_eq!(&one("RoleBinding")["subjects"][0]["name"], account);
    assert_eq!(
        &one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"],
        account
    );
}
