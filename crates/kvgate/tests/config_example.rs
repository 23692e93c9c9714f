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
