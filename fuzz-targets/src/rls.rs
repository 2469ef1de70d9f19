//! An envoyproxy/ratelimit YAML file (`rls.envoy_configs`, and
//! `region-node import-envoy-config`): parsed, turned into TOML, and
//! compiled into descriptor trees with the rest of a configuration.

use tierlimit_shared::config::Config;
use tierlimit_shared::rls::{DomainConfig, EnvoyFile};

use crate::fixture;

pub fn rls(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(file) = EnvoyFile::parse("fuzz.yaml", text) else {
        return false;
    };
    // The import's TOML, when it can be written (metadata TOML cannot
    // hold is refused), is valid TOML and holds the same domain.
    let Ok(toml_text) = file.to_toml("fuzz.yaml") else {
        return false;
    };
    let table: toml::Table = match toml_text.parse() {
        Ok(t) => t,
        Err(e) => panic!("import-envoy-config wrote invalid TOML: {e}\n{toml_text}"),
    };
    let domains = table["rls"]["domains"].as_array().expect("rls.domains");
    assert_eq!(domains.len(), 1);
    let domain: DomainConfig = domains[0].clone().try_into().expect("a domain");
    assert_eq!(domain, file.clone().into_domain());
    // Compiled with a configuration: accepted or refused, never a panic;
    // accepted, the domain is there to be looked up. The importer's check
    // (what `import-envoy-config` runs before printing) agrees with
    // loading: both roads refuse the same files.
    let name = file.domain.clone();
    let checked = file.check("fuzz.yaml");
    let config = format!("{}\n{toml_text}", fixture::config_text(false));
    match Config::from_toml(&config) {
        Ok(loaded) => {
            assert!(loaded.rls.domain(&name).is_some(), "{name:?}");
            assert!(
                checked.is_ok(),
                "the import refuses what loads: {checked:?}"
            );
            true
        }
        Err(e) => {
            assert!(
                checked.is_err(),
                "the import accepts what loading refuses: {e}"
            );
            false
        }
    }
}
