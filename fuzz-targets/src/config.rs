//! The configuration file (TOML → `Config`, then validation and policy
//! resolution), read at start and on every SIGHUP reload.
//!
//! An operator writes it, but it is parsed by a process holding every
//! secret, a reload must refuse rather than crash, and `[rls]` takes
//! descriptor trees of any shape. A configuration that validates must also
//! survive its own serialisation (`check-config` shows it, tools rewrite
//! it): written back as TOML it loads to the same policies.

use tierlimit_shared::config::Config;
use tierlimit_shared::describe::describe;

pub fn config(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    // `rls.envoy_configs` names files to read: the fuzzer must not make it
    // read /dev/zero. Their contents are the `rls` target's input.
    if let Ok(table) = text.parse::<toml::Table>() {
        let reads_files = table
            .get("rls")
            .and_then(|r| r.as_table())
            .is_some_and(|r| r.contains_key("envoy_configs"));
        if reads_files {
            return false;
        }
    }
    let Ok(loaded) = Config::from_toml(text) else {
        return false;
    };
    let described = describe(&loaded);
    let written = toml::to_string(&loaded.config).expect("a valid Config serialises");
    let again = match Config::from_toml(&written) {
        Ok(l) => l,
        Err(e) => panic!("a valid config does not load from its own TOML: {e}\n{written}"),
    };
    assert_eq!(describe(&again), described);
    true
}
