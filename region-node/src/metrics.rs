//! Prometheus metrics of a region-node, in one registry so `/metrics` shows
//! exactly what this process exports (and the dashboard test can check names).

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

pub struct Metrics {
    pub registry: Registry,
    /// Decisions by tier that decided (`none` when allowed), outcome and mode.
    pub decisions: IntCounterVec,
    pub decision_seconds: Histogram,
    /// Of a check decided by one Redis call: its decision time minus that
    /// call's round trip, i.e. what region-node itself adds around the
    /// call (fine buckets: microseconds, where the others are for calls).
    pub decision_overhead_seconds: Histogram,
    pub redis_seconds: HistogramVec,
    pub redis_errors: IntCounterVec,
    /// Decisions taken in a fail mode, by mode.
    pub fail_mode: IntCounterVec,
    /// Decision calls Redis refused to write (OOM, MISCONF), by reason:
    /// a capacity alarm, decided without the fail mode (see
    /// `Decider::refused_writes`).
    pub store_writes_refused: IntCounterVec,
    /// 1 while Redis answers, 0 while the node runs in its fail mode.
    pub store_up: IntGauge,
    /// Times the node asked for the region's master again (READONLY behind
    /// Sentinel: a failover demoted the server it wrote to).
    pub master_resolutions: IntCounter,
    /// 1 when the master's maxmemory-policy can evict counters and the node
    /// runs anyway (`--allow-eviction`).
    pub eviction_allowed: IntGauge,
    pub refunds: IntCounterVec,
    /// Refunds by handle refused, by reason (`HandleError::reason`).
    pub refund_refusals: IntCounterVec,
    /// This node's clock minus its Redis', ms, as last learnt (0 until
    /// known). Set by the decision path (`Decider::clock_offset_ms`).
    pub clock_offset_ms: IntGauge,
    /// `node.max_clock_offset` in ms: the alert compares the offset with it.
    pub clock_offset_bound_ms: IntGauge,
    /// Checks the decision script refused because they were made for
    /// another day than Redis' (a node clock near midnight), sent again for
    /// Redis' day.
    pub day_retries: IntCounter,
    /// First sights of unknown tenants at the newcomer gate, by outcome.
    pub newcomers: IntCounterVec,
    /// Unknown tenants this node remembers as admitted today.
    pub newcomers_cached: IntGauge,
    /// Lease units by event: granted, returned, unreturned.
    pub lease_units: IntCounterVec,
    /// Units held in this node's live leases.
    pub lease_outstanding: IntGauge,
    /// Checks answered from a lease (no Redis call).
    pub lease_checks: IntCounter,
    /// Node-tier reservations (`reserve.rs`) by event, resolved once: the
    /// hot path bumps them on every decision it covers.
    pub reserve_covered: IntCounter,
    pub reserve_units: IntCounter,
    pub reserve_retried: IntCounter,
    /// Units held in this node's live node-tier reservations.
    pub reserve_held: IntGauge,
    /// Global-tier decisions that met a view not yet read to the end since
    /// the start, by outcome (resolved once).
    pub view_waited: IntCounter,
    pub view_shed: IntCounter,
    /// Limits from the topic (`limits.source = "topic"`).
    pub limits: tierlimit_shared::limits::metrics::LimitsMetrics,
    /// Decisions shed before the limits were read (`limits.not_ready`).
    pub limits_shed: IntCounter,
    /// 1 while the node serves the region's copy of the limits, not having
    /// read the topic to its end since it started (Kafka unreachable).
    pub limits_from_copy: IntGauge,
    pub view_blind: IntCounter,
    pub bad_requests: IntCounterVec,
    pub config_reloads: IntCounterVec,
    pub deltas_produced: IntCounter,
    pub deltas_failed: IntCounter,
    /// Dirty entries a flush left for later: neither urgent nor due.
    pub deltas_deferred: IntCounter,
    pub dirty_entries: IntGauge,
    pub dirty_oldest_seconds: prometheus::Gauge,
    pub counter_rollbacks: IntCounter,
    pub publish_seconds: Histogram,
    pub last_publish_ms: IntGauge,
    pub view_age_seconds: prometheus::Gauge,
    pub view_entries: IntGauge,
    pub view_caught_up: IntGauge,
    pub broadcasts_received: IntCounter,
    pub broadcasts_undecodable: IntCounter,
    /// Global-topic records refused by the wire layer, by reason.
    pub broadcasts_rejected: IntCounterVec,
    /// Signed aggregator heartbeats read.
    pub heartbeats_received: IntCounter,
    pub epoch_changes: IntCounter,
    /// Requests refused by admission (queue full, or waited too long),
    /// before anything was charged.
    pub shed: IntCounterVec,
    /// Requests holding an admission slot, and waiting for one.
    pub admission_in_flight: IntGauge,
    pub admission_queued: IntGauge,
    /// Times the breaker opened, by why (`connection`, `stalled`,
    /// `readonly`).
    pub breaker_opens: IntCounterVec,
    /// Replies to decisions the node had given up on (timed out), by what
    /// they turned out to be: `compensated` (Redis charged; the charge was
    /// refunded), `refused` (the script ran past its deadline and did
    /// nothing), `not_charged` (denied, or not a check).
    pub late_replies: IntCounterVec,
    /// Decision calls whose caller went away (the check's future dropped:
    /// a client that disconnected) before Redis answered; their reply goes
    /// the way of `late_replies`.
    pub abandoned_calls: IntCounter,
    /// Decisions given up on whose charge could not be undone: `no_reply`
    /// (the connection dropped or no reply came: Redis may have charged),
    /// `refund_failed` (a late reply said charged and the refund never got
    /// through).
    pub uncompensated: IntCounterVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let r = Registry::new();
        tierlimit_shared::register_build_info(&r);
        fn reg<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
            r.register(Box::new(c.clone()))
                .expect("metric names are unique");
            c
        }
        // Fine enough between 0.1 and 10 ms that a p99 read as a bucket
        // bound says something (a Redis call's p99 under load is there).
        let buckets = vec![
            0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.0035, 0.005, 0.0075,
            0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
        ];
        let node_reserve = reg(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "tierlimit_node_reserve_total",
                    "Node-tier reservations by event: covered (a decision whose node tier was decided in process, the script called without it), reserved_units (node-tier units charged ahead for later decisions), retried (a reservation the node tier could not take; the call repeated without one)",
                ),
                &["event"],
            )
            .unwrap(),
        );
        let view_not_ready = reg(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "tierlimit_view_not_ready_total",
                    "Global-tier decisions that came before the broadcast view was first read to its end, by outcome: waited (then decided with the view), shed (503 view-not-ready after store_timeout, nothing charged), blind (past node.view_wait: decided without the view)",
                ),
                &["outcome"],
            )
            .unwrap(),
        );
        let limits = tierlimit_shared::limits::metrics::LimitsMetrics::register(&r, "tierlimit");
        let limits_from_copy = reg(
            &r,
            IntGauge::new(
                "tierlimit_limits_from_region_copy",
                "1 while the node serves the region's copy of the limits (it has not read the limits topic to its end since it started: Kafka unreachable)",
            )
            .unwrap(),
        );
        let m = Metrics {
            limits_from_copy,
            limits_shed: limits.not_ready.clone(),
            limits,
            view_waited: view_not_ready.with_label_values(&["waited"]),
            view_shed: view_not_ready.with_label_values(&["shed"]),
            view_blind: view_not_ready.with_label_values(&["blind"]),
            decisions: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_decisions_total",
                        "Decisions by deciding tier, outcome and mode",
                    ),
                    &["tier", "outcome", "mode"],
                )
                .unwrap(),
            ),
            decision_seconds: reg(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "tierlimit_decision_seconds",
                        "Time to decide one check, HTTP excluded",
                    )
                    .buckets(buckets.clone()),
                )
                .unwrap(),
            ),
            decision_overhead_seconds: reg(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "tierlimit_decision_overhead_seconds",
                        "Of a check decided by one Redis call, the decision's time minus the call's round trip: what region-node adds around it, HTTP excluded",
                    )
                    .buckets(vec![
                        0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001,
                        0.0025, 0.005, 0.01, 0.1,
                    ]),
                )
                .unwrap(),
            ),
            redis_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "tierlimit_redis_seconds",
                        "Latency of Redis calls by operation",
                    )
                    .buckets(buckets.clone()),
                    &["op"],
                )
                .unwrap(),
            ),
            redis_errors: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_redis_errors_total",
                        "Failed Redis calls by operation and kind",
                    ),
                    &["op", "kind"],
                )
                .unwrap(),
            ),
            fail_mode: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_fail_mode_decisions_total",
                        "Decisions taken without Redis, by on_store_error mode",
                    ),
                    &["mode"],
                )
                .unwrap(),
            ),
            store_writes_refused: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_store_writes_refused_total",
                        "Decision calls the region's Redis refused to write (reason: oom = used memory over maxmemory under noeviction, misconf = a failed RDB save stops writes); each decided by the node's local limiter, or 503 for plans that fail closed",
                    ),
                    &["reason"],
                )
                .unwrap(),
            ),
            store_up: reg(
                &r,
                IntGauge::new("tierlimit_store_up", "1 while the region's Redis answers").unwrap(),
            ),
            master_resolutions: reg(
                &r,
                IntCounter::new(
                    "tierlimit_redis_master_resolutions_total",
                    "Times the node looked the region's master up again after a READONLY reply",
                )
                .unwrap(),
            ),
            eviction_allowed: reg(
                &r,
                IntGauge::new(
                    "tierlimit_redis_eviction_allowed",
                    "1 if the region's Redis may evict counters and --allow-eviction accepted it",
                )
                .unwrap(),
            ),
            refunds: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_refunds_total",
                        "Refunds by kind: handle (named a charge), duplicate (a handle used already: nothing given back), free_form (named no charge)",
                    ),
                    &["kind"],
                )
                .unwrap(),
            ),
            refund_refusals: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_refund_refusals_total",
                        "Refunds by handle refused, by reason: used (given back once already), expired (every window of the charge has ended), other_region (issued by another region), outdated (a previous release's handle past its grace), malformed, forged, disabled",
                    ),
                    &["reason"],
                )
                .unwrap(),
            ),
            clock_offset_ms: reg(
                &r,
                IntGauge::new(
                    "tierlimit_clock_offset_ms",
                    "This node's clock minus its Redis' (TIME), in ms, as last learnt from Redis' replies: the day of a decision is Redis' (see node.max_clock_offset)",
                )
                .unwrap(),
            ),
            clock_offset_bound_ms: reg(
                &r,
                IntGauge::new(
                    "tierlimit_clock_offset_bound_ms",
                    "node.max_clock_offset in ms: beyond it the node's clock is reported as off its Redis' (alert, /readyz)",
                )
                .unwrap(),
            ),
            day_retries: reg(
                &r,
                IntCounter::new(
                    "tierlimit_day_retries_total",
                    "Checks the decision script refused because the node built them for another day than Redis' clock says (near midnight), sent again for Redis' day",
                )
                .unwrap(),
            ),
            newcomers: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_newcomers_total",
                        "Unknown tenants at the region's newcomer gate, by outcome: admitted (first sight today in the region), known (admitted earlier by another node), refused_rate (unknown_tenants.max_new_per_second spent), refused_day (unknown_tenants.max_per_day spent), unchecked (Redis unavailable: left to the plan's fail mode)",
                    ),
                    &["outcome"],
                )
                .unwrap(),
            ),
            lease_units: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_lease_units_total",
                        "Lease units by event: granted (charged in Redis for this node to spend in process), returned (unused at the lease's end, given back to their windows), lost (unused, given back after a window or the day they were charged in ended: stranded there), unreturned (unused, could not be given back: stays charged)",
                    ),
                    &["event"],
                )
                .unwrap(),
            ),
            lease_outstanding: reg(
                &r,
                IntGauge::new(
                    "tierlimit_lease_outstanding_units",
                    "Units held in this node's live leases (charged in Redis, not yet spent)",
                )
                .unwrap(),
            ),
            lease_checks: reg(
                &r,
                IntCounter::new(
                    "tierlimit_lease_checks_total",
                    "Checks answered from a lease this node holds, without a Redis call",
                )
                .unwrap(),
            ),
            reserve_covered: node_reserve.with_label_values(&["covered"]),
            reserve_units: node_reserve.with_label_values(&["reserved_units"]),
            reserve_retried: node_reserve.with_label_values(&["retried"]),
            reserve_held: reg(
                &r,
                IntGauge::new(
                    "tierlimit_node_reserve_held_units",
                    "Node-tier units this node charged ahead in Redis and has not spent yet (live windows only)",
                )
                .unwrap(),
            ),
            newcomers_cached: reg(
                &r,
                IntGauge::new(
                    "tierlimit_newcomers_cached",
                    "Unknown tenants this node remembers as admitted today (at most unknown_tenants.max_per_day)",
                )
                .unwrap(),
            ),
            bad_requests: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_bad_requests_total",
                        "Requests refused as invalid, by problem type",
                    ),
                    &["problem"],
                )
                .unwrap(),
            ),
            config_reloads: reg(
                &r,
                IntCounterVec::new(
                    Opts::new("tierlimit_config_reloads_total", "SIGHUP reloads by result"),
                    &["result"],
                )
                .unwrap(),
            ),
            deltas_produced: reg(
                &r,
                IntCounter::new(
                    "tierlimit_deltas_produced_total",
                    "Deltas delivered to Kafka",
                )
                .unwrap(),
            ),
            deltas_failed: reg(
                &r,
                IntCounter::new(
                    "tierlimit_deltas_failed_total",
                    "Deltas Kafka did not accept (retried later)",
                )
                .unwrap(),
            ),
            deltas_deferred: reg(
                &r,
                IntCounter::new(
                    "tierlimit_deltas_deferred_total",
                    "Dirty entries a flush left for later: tenant not urgent, published less than relaxed_flush_interval ago",
                )
                .unwrap(),
            ),
            dirty_entries: reg(
                &r,
                IntGauge::new(
                    "tierlimit_dirty_entries",
                    "Unpublished (tenant, day) entries seen at the last flush",
                )
                .unwrap(),
            ),
            dirty_oldest_seconds: reg(
                &r,
                prometheus::Gauge::new(
                    "tierlimit_publish_backlog_seconds",
                    "How long the most overdue unpublished (tenant, day) has been due at the last flush: 0 while the publisher keeps up",
                )
                .unwrap(),
            ),
            counter_rollbacks: reg(
                &r,
                IntCounter::new(
                    "tierlimit_counter_rollbacks_total",
                    "Counters found in Redis below what the aggregator already has from the same actor (a partial Redis rollback), raised back",
                )
                .unwrap(),
            ),
            publish_seconds: reg(
                &r,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "tierlimit_publish_seconds",
                        "Time to publish one flush batch, until every delivery is acknowledged",
                    )
                    .buckets(vec![
                        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    ]),
                )
                .unwrap(),
            ),
            last_publish_ms: reg(
                &r,
                IntGauge::new(
                    "tierlimit_last_publish_timestamp_ms",
                    "Wall clock of the last fully acknowledged flush",
                )
                .unwrap(),
            ),
            view_age_seconds: reg(
                &r,
                prometheus::Gauge::new(
                    "tierlimit_view_age_seconds",
                    "Seconds since the broadcast view was last confirmed caught up with the broker",
                )
                .unwrap(),
            ),
            view_entries: reg(
                &r,
                IntGauge::new(
                    "tierlimit_view_entries",
                    "(tenant, day) entries in the broadcast view",
                )
                .unwrap(),
            ),
            view_caught_up: reg(
                &r,
                IntGauge::new(
                    "tierlimit_view_caught_up",
                    "1 once the broadcast follower has read the global topic to its end",
                )
                .unwrap(),
            ),
            broadcasts_received: reg(
                &r,
                IntCounter::new(
                    "tierlimit_broadcasts_received_total",
                    "Global updates applied to the view",
                )
                .unwrap(),
            ),
            heartbeats_received: reg(
                &r,
                IntCounter::new(
                    "tierlimit_heartbeats_received_total",
                    "Signed aggregator heartbeats read from the global topic (they date the view)",
                )
                .unwrap(),
            ),
            broadcasts_rejected: {
                let c = reg(
                    &r,
                    IntCounterVec::new(
                        prometheus::Opts::new(
                            "tierlimit_broadcasts_rejected_total",
                            "Global-topic records refused and skipped, by reason: corrupt, version, unsigned, unknown_key, bad_signature",
                        ),
                        &["reason"],
                    )
                    .unwrap(),
                );
                for reason in tierlimit_shared::wire::Reject::REASONS {
                    c.with_label_values(&[reason]);
                }
                c
            },
            broadcasts_undecodable: reg(
                &r,
                IntCounter::new(
                    "tierlimit_broadcasts_undecodable_total",
                    "Global-topic messages skipped as undecodable",
                )
                .unwrap(),
            ),
            epoch_changes: reg(
                &r,
                IntCounter::new(
                    "tierlimit_epoch_changes_total",
                    "Times a new region epoch appeared (Redis lost its data)",
                )
                .unwrap(),
            ),
            shed: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_shed_total",
                        "Requests shed (503, nothing charged), by reason: queue_full and queue_timeout (admission control), store_backlog (the Redis call waited past store_timeout behind others while Redis kept answering)",
                    ),
                    &["reason"],
                )
                .unwrap(),
            ),
            admission_in_flight: reg(
                &r,
                IntGauge::new(
                    "tierlimit_admission_in_flight",
                    "Requests holding an admission slot (at most node.max_in_flight)",
                )
                .unwrap(),
            ),
            admission_queued: reg(
                &r,
                IntGauge::new(
                    "tierlimit_admission_queued",
                    "Requests waiting for an admission slot (at most node.max_queue)",
                )
                .unwrap(),
            ),
            breaker_opens: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_breaker_opens_total",
                        "Times Redis was judged unavailable and decisions went to their fail mode, by reason: connection (an error of the connection), stalled (no reply for node.store_unavailable_after), readonly (a replica behind a fixed URL)",
                    ),
                    &["reason"],
                )
                .unwrap(),
            ),
            abandoned_calls: reg(
                &r,
                IntCounter::new(
                    "tierlimit_abandoned_calls_total",
                    "Decision calls whose caller went away (client disconnected) before Redis answered: the reply is awaited and a charge it made given back",
                )
                .unwrap(),
            ),
            late_replies: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_late_replies_total",
                        "Replies that arrived after the node gave up on the call, by outcome: compensated (charged, refunded), refused (past its deadline, did nothing), not_charged",
                    ),
                    &["outcome"],
                )
                .unwrap(),
            ),
            uncompensated: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "tierlimit_uncompensated_total",
                        "Timed-out checks whose possible charge in Redis could not be undone, by reason: no_reply (outcome unknown), refund_failed",
                    ),
                    &["reason"],
                )
                .unwrap(),
            ),
            registry: r,
        };
        m.init_labels();
        m
    }

    /// Creates the known label combinations at 0, so every family is in
    /// `/metrics` from the start: `rate()` then sees the first increment, and
    /// dashboards show 0 rather than "no data".
    fn init_labels(&self) {
        for mode in ["open", "closed", "local"] {
            self.fail_mode.with_label_values(&[mode]);
        }
        for reason in crate::storage::WRITE_REFUSALS {
            self.store_writes_refused.with_label_values(&[reason]);
        }
        for op in ["decide", "dirty_read", "dirty_counters", "ack"] {
            for kind in ["down", "timeout", "redis", "reply"] {
                self.redis_errors.with_label_values(&[op, kind]);
            }
        }
        for problem in [
            "invalid-field",
            "invalid-json",
            "unsupported-media-type",
            "unknown-tenant",
        ] {
            self.bad_requests.with_label_values(&[problem]);
        }
        for result in ["ok", "refused"] {
            self.config_reloads.with_label_values(&[result]);
        }
        for reason in ["queue_full", "queue_timeout", "store_backlog"] {
            self.shed.with_label_values(&[reason]);
        }
        for reason in ["connection", "stalled", "readonly"] {
            self.breaker_opens.with_label_values(&[reason]);
        }
        for outcome in ["compensated", "refused", "not_charged"] {
            self.late_replies.with_label_values(&[outcome]);
        }
        for reason in [
            "used",
            "expired",
            "other_region",
            "outdated",
            "malformed",
            "forged",
            "disabled",
        ] {
            self.refund_refusals.with_label_values(&[reason]);
        }
        for reason in ["no_reply", "refund_failed"] {
            self.uncompensated.with_label_values(&[reason]);
        }
    }

    /// Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
