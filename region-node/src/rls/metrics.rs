//! The RLS's metrics, in the node's registry.
//!
//! Labels are bounded by the configuration, never by request values:
//! `domain` is a configured domain or `_unknown`, `rule` a configured rule's
//! label (its `name`, else its key path) or `_none`. envoyproxy/ratelimit's
//! `detailed_metric` / `value_to_metric` put descriptor values into metric
//! names, which lets one client create unbounded series; here they are
//! accepted and change nothing.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

pub struct RlsMetrics {
    /// Requests by domain and overall code (`ok`, `over_limit`, `error`).
    pub requests: IntCounterVec,
    /// Descriptors by domain, rule, outcome and shadow.
    pub descriptors: IntCounterVec,
    /// Allowed descriptors whose rule has less than a fifth of its limit
    /// left (envoyproxy/ratelimit's near-limit ratio of 0.8).
    pub near_limit: IntCounterVec,
    /// Tenants' charges given back because another tenant of the request
    /// denied (`refunded`), or that could not be (`failed`: stays charged).
    pub compensations: IntCounterVec,
    pub seconds: Histogram,
}

impl RlsMetrics {
    pub fn new(r: &Registry) -> RlsMetrics {
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone()))
                .expect("metric names are unique");
            c
        }
        RlsMetrics {
            requests: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_rls_requests_total",
                        "Envoy rate limit service requests by domain and overall code",
                    ),
                    &["domain", "code"],
                )
                .unwrap(),
            ),
            descriptors: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_rls_descriptors_total",
                        "Envoy rate limit descriptors by domain, rule, outcome and shadow mode",
                    ),
                    &["domain", "rule", "outcome", "shadow"],
                )
                .unwrap(),
            ),
            near_limit: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_rls_near_limit_total",
                        "Allowed descriptors with less than 20% of their rule's limit left",
                    ),
                    &["domain", "rule"],
                )
                .unwrap(),
            ),
            compensations: reg(
                r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_rls_compensations_total",
                        "Charges of one tenant given back because another tenant of the request denied",
                    ),
                    &["outcome"],
                )
                .unwrap(),
            ),
            seconds: reg(
                r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "tierlimit_rls_request_seconds",
                        "Time to answer one ShouldRateLimit, gRPC excluded",
                    )
                    .buckets(vec![
                        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                        0.25, 1.0,
                    ]),
                )
                .unwrap(),
            ),
        }
    }
}
