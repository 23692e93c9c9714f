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
