//! The configuration model: one TOML file, overridable by environment
//! variables, validated as a whole before anything uses it.
//!
//! Loading is three steps, each with errors that name the offending key:
//! 1. parse the TOML into a generic tree and apply `TIERLIMIT__A__B=value`
//!    overrides (so operators can inject secrets and per-host settings without
//!    templating the file);
//! 2. deserialize into the typed model with `deny_unknown_fields`, tracking the
//!    path so a typo is reported as `plans.free.regoin: unknown field`;
//! 3. [`Config::validate`] checks what types cannot: positive limits, plans
//!    that exist, windows within range.
//!
//! Policies are resolved per tenant once at load ([`Config::policy`]), so the
//! decision hot path does a single map lookup.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::duration::serde_human;
use crate::period::PeriodKind;
use crate::validate;
use crate::zone::Zone;

/// A configuration that could not be loaded, naming the key and the reason.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config is not valid TOML: {0}")]
    Syntax(String),
    #[error("environment override {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("config key `{key}`: {reason}")]
    Invalid { key: String, reason: String },
}

impl ConfigError {
    fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// The dotted key the error is about, when there is one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Name of this deployment; prefixes nothing, but appears in logs and the
    /// aggregator's consumer group default.
    pub cluster: String,
    pub kafka: KafkaConfig,
    #[serde(default)]
    pub node: NodeSettings,
    #[serde(default)]
    pub aggregator: AggregatorSettings,
    pub regions: BTreeMap<String, RegionConfig>,
    /// Required with `limits.source = "file"`; may be empty when every plan
    /// is on the limits topic.
    #[serde(default)]
    pub plans: BTreeMap<String, PlanConfig>,
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantConfig>,
    /// Where tenants (and plans beyond this file's) come from: this file,
    /// or the limits topic (`crate::limits`).
    #[serde(default)]
    pub limits: LimitsSettings,
    #[serde(default)]
    pub unknown_tenants: UnknownTenants,
    /// Envoy's rate limit service: descriptor rules per domain (see
    /// [`crate::rls`]).
    #[serde(default)]
    pub rls: crate::rls::RlsConfig,
    /// The gRPC listener (`--grpc-listen`): TLS.
    #[serde(default)]
    pub grpc: GrpcSettings,
    /// Wire format and message authentication of both topics.
    #[serde(default)]
    pub wire: WireSettings,
    /// API keys, client certificates and open scopes (see [`crate::auth`]).
    #[serde(default)]
    pub auth: crate::auth::AuthConfig,
    /// The HTTP listeners: TLS, timeouts and size limits.
    #[serde(default)]
    pub http: HttpSettings,
}

/// `[http]`: how both binaries' HTTP listeners protect themselves.
///
/// TLS applies to the main listener (the API); the admin listener
/// (`/metrics`, dashboard) is plain HTTP on a loopback address by default.
/// The limits hold for both.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSettings {
    /// PEM certificate chain of the main listener; with `tls_key`, the
    /// listener speaks only TLS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<std::path::PathBuf>,
    /// PEM CA bundle for client certificates (mTLS). Set: a client may
    /// present a certificate signed by it and is identified by its DNS
    /// SANs (`auth.clients`); one signed by anyone else is refused in the
    /// handshake. A client without a certificate may still use a key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// A connection must send a request's complete headers within this
    /// (slow-loris connections are closed, not kept). The clock also runs
    /// while a keep-alive connection waits for its next request, so this is
    /// the idle timeout of keep-alive connections too.
    #[serde(with = "serde_human")]
    pub header_read_timeout: Duration,
    /// A request (body included) must be answered within this; past it
    /// 408 problem+json.
    #[serde(with = "serde_human")]
    pub request_timeout: Duration,
    /// Largest sum of header names and values accepted (431 past it).
    pub max_header_bytes: usize,
    /// Longest request target (path and query) accepted (414 past it).
    pub max_uri_bytes: usize,
    /// Aggregator only: requests served at once; more are shed with 503
    /// and `Retry-After` (the shared admission gate with no queue; the
    /// region-node sizes the same gate by `node.max_in_flight`,
    /// `max_queue` and `queue_timeout`).
    pub max_concurrent_requests: usize,
}

impl HttpSettings {
    /// TLS certificate and key, when both are set.
    pub fn tls(&self) -> Option<(&Path, &Path)> {
        Some((self.tls_cert.as_deref()?, self.tls_key.as_deref()?))
    }
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            header_read_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_uri_bytes: 4 * 1024,
            max_concurrent_requests: 256,
        }
    }
}

/// `[grpc]`: the RLS listener's TLS. Both or neither: with both, the
/// listener speaks only TLS.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpcSettings {
    /// PEM certificate chain.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<String>,
    /// PEM private key. Never serialised back.
    #[serde(skip_serializing)]
    pub tls_key: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers` for librdkafka.
    pub brokers: String,
    #[serde(default = "default_deltas_topic")]
    pub deltas_topic: String,
    #[serde(default = "default_global_topic")]
    pub global_topic: String,
    /// Tenants and plans as records (`limits.source = "topic"`): compacted,
    /// one partition, so every process applies them in one order.
    #[serde(default = "default_limits_topic")]
    pub limits_topic: String,
    /// Partitions of both topics (used when the scripts create them, and to
    /// pick the partition of a tenant: it must match the real topic).
    #[serde(default = "default_partitions")]
    pub partitions: i32,
    #[serde(default = "default_replication")]
    pub replication_factor: i32,
    /// Passed through to librdkafka verbatim (`security.protocol`,
    /// `sasl.mechanisms`, `ssl.ca.location`, …).
    #[serde(default)]
    pub client: BTreeMap<String, String>,
}

fn default_deltas_topic() -> String {
    "tierlimit.deltas".into()
}
fn default_global_topic() -> String {
    "tierlimit.global".into()
}
fn default_limits_topic() -> String {
    "tierlimit.limits".into()
}
fn default_partitions() -> i32 {
    8
}
fn default_replication() -> i32 {
    1
}

/// `[limits]`: where tenants and plans come from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsSettings {
    /// `file` (the default): `[plans]` and `[tenants]` of this file, reloaded
    /// on SIGHUP. `topic`: tenants are records of `kafka.limits_topic`,
    /// which every region-node and aggregator follows; plans are this
    /// file's `[plans]` and the topic's, the topic's winning for a name both
    /// hold; `[tenants]` must be empty (two sources for one tenant would be
    /// ambiguous).
    pub source: LimitsSource,
    /// How long a node may lag the newest limits version before the
    /// aggregator reports it lagging (`tierlimit_limits_lagging_nodes`).
    #[serde(with = "serde_human")]
    pub lag_alert_after: Duration,
    /// How often a node writes its applied limits version to the deltas
    /// topic (`topic` only).
    #[serde(with = "serde_human")]
    pub status_interval: Duration,
}

impl Default for LimitsSettings {
    fn default() -> Self {
        LimitsSettings {
            source: LimitsSource::File,
            lag_alert_after: Duration::from_secs(30),
            status_interval: Duration::from_secs(1),
        }
    }
}

/// Where tenants come from (`limits.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LimitsSource {
    #[default]
    File,
    Topic,
}

/// Settings of every region-node process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSettings {
    /// How often the publisher drains the region's dirty set to Kafka.
    #[serde(with = "serde_human")]
    pub flush_interval: Duration,
    /// Upper bound on one Redis call of the decision path; past it the plan's
    /// `on_store_error` applies.
    #[serde(with = "serde_human")]
    pub store_timeout: Duration,
    /// While Redis is failing, how often one probe checks whether it is back
    /// (decisions in between go straight to the fail mode, without waiting).
    #[serde(with = "serde_human")]
    pub store_retry_interval: Duration,
    /// When the broadcast view is older than this, the region spends at most
    /// its share (1 / number of regions) of what globally remained. Unset:
    /// always trust the last view.
    #[serde(with = "opt_human", skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<Duration>,
    /// How long after its start a node holds the decisions of tenants with
    /// a global tier until its broadcast view has first been read to the
    /// end. Before that the view holds nothing, and a missing entry would
    /// read as "below the broadcast threshold" (a restarted node re-admitted
    /// tenants already over their limit: issue 10). Meanwhile such a check
    /// waits up to `store_timeout` for the view, then is shed (503
    /// `view-not-ready`, `Retry-After`, nothing charged). Past it (the
    /// broker unreachable since the start) they are decided with what the
    /// node has: the empty view and, if set, `max_staleness`'s cap. 0 =
    /// never wait.
    #[serde(with = "serde_human")]
    pub view_wait: Duration,
    /// How far this node's clock may be from its Redis' (`TIME`) before the
    /// node says so: `tierlimit_clock_offset_ms` beside
    /// `tierlimit_clock_offset_bound_ms` (the alert rule), a warning in the
    /// log and `/readyz`'s `clock` detail. Decisions do not depend on it:
    /// the day of a decision is Redis' (the node's estimate of Redis'
    /// clock picks the view's day, and the script refuses a call made for
    /// another day, which the node then sends again for Redis' day).
    #[serde(with = "serde_human")]
    pub max_clock_offset: Duration,
    /// Most dirty entries published per flush (the rest wait for the next).
    pub publish_batch: usize,
    /// A dirty (tenant, day) whose tenant is far from its global limit is
    /// published at least this often, not at every flush: the other regions
    /// need its exact count only once the tenant gets near the limit, and
    /// publishing a quiet half of the tenants every `flush_interval` is what
    /// made Kafka messages grow with time instead of with information. Equal
    /// to `flush_interval`: every dirty entry at every flush. Unset: 2 s, or
    /// `flush_interval` if that is longer (see
    /// [`NodeSettings::relaxed_flush_interval`]).
    #[serde(
        rename = "relaxed_flush_interval",
        with = "opt_human",
        skip_serializing_if = "Option::is_none"
    )]
    pub relaxed_flush_interval_setting: Option<Duration>,
    /// A tenant is *urgent* (published at every flush) once its estimated
    /// global spend reaches this fraction of its global limit. The estimate
    /// is the last broadcast total plus this region's unbroadcast spend
    /// times the number of regions (as if every region had spent like this
    /// one since the broadcast), so a burst turns a tenant urgent early.
    pub urgent_fraction: f64,
    /// The secret (at least 32 bytes, the same on every node of a region)
    /// that signs refund handles. Unset: checks answer no handle and only
    /// free-form refunds exist. Never serialised back.
    #[serde(skip_serializing)]
    pub refund_secret: Option<String>,
    /// Whether `POST /v1/refund` accepts a refund that names no handle
    /// (tenant, key, cost), tied to no charge. Each one is logged and
    /// counted (`tierlimit_refunds_total{kind="free_form"}`).
    pub free_form_refunds: bool,
    /// Leases (region-node's `lease.rs`), on by default: an allowed check
    /// may also charge more units, which the node then spends in process
    /// for a short while (at most 2 s, and gone before the first of the
    /// tiers' windows or the day ends). Each lease is sized from the
    /// tenant's recent rate at this node and what the tiers leave (at most
    /// 1/(2 × expected_nodes) of it, none near the limit); this caps it.
    /// 0 = no leases: every decision goes to Redis. Only plans whose
    /// windowed tiers are all fixed or sliding windows lease; a plan's own
    /// `lease_max` caps (or, at 0, switches off) its leases further.
    pub lease_max: u64,
    /// Node-tier reservations (region-node's `reserve.rs`): a check that
    /// runs the decision script may also charge the node tier up to this
    /// fraction of its limit more, which later checks of this node spend
    /// in process, calling the script without the node tier (a fifth fewer
    /// Redis instructions). Only fixed and sliding windows reserve. What it
    /// costs: a node that crashes strands what it reserved and had not
    /// spent, at most this fraction of the limit, for the rest of that
    /// window, on that node only. 0 = the node tier is decided in Redis on
    /// every call.
    pub reserve_fraction: f64,
    /// Most API requests (checks, refunds, usage reads: each one Redis call)
    /// a node runs at once. A request beyond it waits in the admission
    /// queue. Bounding what is in flight keeps every call's time in Redis
    /// short under any load, so `store_timeout` measures Redis, not a
    /// backlog the node built itself.
    pub max_in_flight: usize,
    /// Most requests waiting for an in-flight slot; one more is shed at once
    /// (503 problem+json with `Retry-After`, `tierlimit_shed_total`), before
    /// anything is charged.
    pub max_queue: usize,
    /// Longest a request waits in the admission queue before it is shed.
    #[serde(with = "serde_human")]
    pub queue_timeout: Duration,
    /// Redis is judged unavailable (the breaker opens: every decision goes
    /// to its plan's `on_store_error` without waiting) when calls are
    /// outstanding and nothing has come back for this long, or on a
    /// connection error. A Redis that is merely busy keeps answering, so
    /// queueing cannot trip it; a single slow call takes its fail mode
    /// alone. Checked when a call times out, so in effect at least
    /// `store_timeout`.
    #[serde(with = "serde_human")]
    pub store_unavailable_after: Duration,
}

impl NodeSettings {
    /// The relaxed interval in effect: as set, else 2 s but never shorter
    /// than `flush_interval`.
    pub fn relaxed_flush_interval(&self) -> Duration {
        self.relaxed_flush_interval_setting
            .unwrap_or_else(|| Duration::from_secs(2).max(self.flush_interval))
    }
}

impl Default for NodeSettings {
    fn default() -> Self {
        NodeSettings {
            flush_interval: Duration::from_millis(250),
            store_timeout: Duration::from_millis(50),
            store_retry_interval: Duration::from_millis(500),
            max_staleness: None,
            view_wait: Duration::from_secs(30),
            max_clock_offset: Duration::from_secs(1),
            publish_batch: 5000,
            relaxed_flush_interval_setting: None,
            urgent_fraction: 0.5,
            refund_secret: None,
            free_form_refunds: true,
            lease_max: 256,
            reserve_fraction: 0.125,
            max_in_flight: 64,
            max_queue: 512,
            queue_timeout: Duration::from_millis(50),
            store_unavailable_after: Duration::from_millis(250),
        }
    }
}

mod opt_human {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let s = String::deserialize(d)?;
        crate::duration::parse(&s)
            .map(Some)
            .map_err(serde::de::Error::custom)
    }

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&crate::duration::format(*d)),
            None => s.serialize_none(),
        }
    }
}

/// Wire format and message authentication of both Kafka topics (see
/// `crate::wire`).
///
/// Safe by default: records are written as signed v2 and unsigned records
/// are refused, so a configuration must name every region's delta key and
/// the aggregator's broadcast public key(s), or opt out explicitly with
/// `accept_unsigned = true` (only for a rolling upgrade from the JSON
/// release, whose nodes and aggregators cannot sign).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WireSettings {
    /// What producers write: 3 (binary, signed, with periods, enforced
    /// limits and limits versions), 2 (the previous release's binary: keep
    /// it on every process until none of the previous release runs, since
    /// that release reads no v3) or 1 (JSON, unsigned). Decoders read all
    /// three.
    pub version: u8,
    /// Accept records without a signature (v1 JSON, unsigned v2). A record
    /// whose signature is wrong is refused whatever this says.
    pub accept_unsigned: bool,
    /// Delta HMAC keys per region: the region's nodes sign with
    /// `sign_with`, the aggregator accepts any listed key of the region.
    pub delta_keys: BTreeMap<String, RegionKeys>,
    /// Ed25519 public keys of the aggregators by key id (base64, 32 bytes):
    /// region-nodes accept broadcasts signed by any of them.
    pub broadcast_public_keys: BTreeMap<String, String>,
    /// Key id the aggregator signs broadcasts with (in
    /// `broadcast_public_keys`).
    pub broadcast_key: Option<String>,
    /// The aggregator's Ed25519 private key (base64 of the 32-byte seed).
    /// Only aggregators need it: set it with
    /// `TIERLIMIT__WIRE__BROADCAST_PRIVATE_KEY`, not in a file the nodes
    /// share.
    pub broadcast_private_key: Option<String>,
    /// Ed25519 public keys of the limits writers by key id: every process
    /// that follows the limits topic accepts records signed by any of them
    /// (two during a rotation). Not the broadcast keys: an aggregator's key
    /// must not be able to write limits.
    pub limits_public_keys: BTreeMap<String, String>,
    /// Key id the limits writer signs with (in `limits_public_keys`).
    pub limits_key: Option<String>,
    /// The limits writer's Ed25519 private key (base64 of the 32-byte
    /// seed): only the writer needs it
    /// (`TIERLIMIT__WIRE__LIMITS_PRIVATE_KEY`).
    pub limits_private_key: Option<String>,
}

impl Default for WireSettings {
    fn default() -> Self {
        WireSettings {
            version: 3,
            accept_unsigned: false,
            delta_keys: BTreeMap::new(),
            broadcast_public_keys: BTreeMap::new(),
            broadcast_key: None,
            broadcast_private_key: None,
            limits_public_keys: BTreeMap::new(),
            limits_key: None,
            limits_private_key: None,
        }
    }
}

/// One region's delta HMAC-SHA256 keys.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionKeys {
    /// The key id this region's nodes sign with.
    pub sign_with: String,
    /// Secrets by key id (base64, at least 32 bytes). Two during a
    /// rotation. Key ids are unique across regions.
    pub keys: BTreeMap<String, String>,
}

/// Settings of the aggregator.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AggregatorSettings {
    /// Consumer group id; default `tierlimit-aggregator-cooperative`.
    /// Changing `assignment` needs a new one: a broker fixes a group's
    /// protocol from its first member. It costs nothing, since the
    /// aggregator commits no offsets.
    pub group_id: String,
    /// How the group spreads the deltas partitions over the instances.
    pub assignment: Assignment,
    /// Broadcasts are coalesced per this interval (a tenant crossing its
    /// limit is broadcast at once).
    #[serde(with = "serde_human")]
    pub broadcast_interval: Duration,
    /// Which counters are broadcast: those of tenants with a global limit
    /// `L` whose merged total reached `broadcast_fraction × L` (and, from
    /// then on, every change of them). A region-node that holds no entry
    /// for a limited tenant takes the others' spend to be at most
    /// `⌈broadcast_fraction × L⌉ − 1`, so the view and the global topic's
    /// traffic grow with the tenants near their limit, not with all
    /// tenants. At most ½: a tenant whose traffic is all in one region
    /// must reach the fraction before that region's budget
    /// `(1 − fraction) × L` runs out. 0 broadcasts every limited tenant.
    /// Read by the aggregator and the region-nodes alike, so all must agree
    /// (README, "Upgrading").
    pub broadcast_fraction: f64,
    /// Days kept in memory and answered over HTTP; older days are dropped.
    pub retention_days: u32,
    /// Consumer-group session timeout: how long a crashed aggregator keeps
    /// its partitions before the group hands them to another instance. Short,
    /// because a restarted instance cannot rejoin before the old session
    /// ends; 6s is Apache Kafka's default minimum.
    #[serde(with = "serde_human")]
    pub session_timeout: Duration,
    /// The API URLs of the aggregators (this one may be listed too), for
    /// the limits API: one aggregator writes limits at a time (the one
    /// holding deltas partition 0), and the others forward writes to it
    /// through these. Empty: writes are served only by the aggregator that
    /// holds the place (enough for one aggregator). `http://` only.
    pub peers: Vec<String>,
}

impl Default for AggregatorSettings {
    fn default() -> Self {
        AggregatorSettings {
            group_id: "tierlimit-aggregator-cooperative".into(),
            assignment: Assignment::CooperativeSticky,
            broadcast_interval: Duration::from_millis(250),
            broadcast_fraction: 0.25,
            retention_days: 2,
            session_timeout: Duration::from_secs(6),
            peers: Vec::new(),
        }
    }
}

impl AggregatorSettings {
    /// The merged total from which a tenant with global limit `limit` is
    /// broadcast: `θ = ⌈broadcast_fraction × limit⌉`. The aggregator's rule;
    /// a region-node bounds an unbroadcast tenant by
    /// [`AggregatorSettings::unbroadcast_bound`], derived from it here so
    /// both sides agree.
    pub fn broadcast_threshold(&self, limit: u64) -> u64 {
        // A float-to-int cast saturates; the fraction is at most ½, so the
        // threshold never exceeds the limit.
        ((self.broadcast_fraction * limit as f64).ceil() as u64).min(limit)
    }

    /// What a region-node takes as the merged total of a limited tenant it
    /// holds no broadcast entry for: `θ − 1` (0 when `θ` is 0).
    ///
    /// Sound: the aggregator broadcasts every counter whose merged total
    /// reached `θ`, so a counter it has not broadcast is at most `θ − 1`
    /// (totals are whole units). Not `θ`: taking the others to hold `θ`
    /// lets a region alone spend only `L − θ`, and when that is below `θ`
    /// (L = 1 at any fraction: the first request ever was denied; L = 5 at
    /// ½: 2 admitted, 3 never reachable) the tenant never reaches `θ`, is
    /// never broadcast, and stays short all day (issue 29, item 3). With
    /// `θ − 1` a region alone reaches `L − θ + 1 ≥ θ` (as `θ ≤ ⌈L/2⌉`), so
    /// its crossing of `θ` is always broadcast, after which it reaches `L`.
    /// The previous release took `θ` itself, which is more cautious, so a
    /// deployment mixing both releases stays sound whichever upgrades first
    /// (README, "Upgrading").
    pub fn unbroadcast_bound(&self, limit: u64) -> u64 {
        self.broadcast_threshold(limit).saturating_sub(1)
    }
}

/// The consumer group's partition assignment strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Assignment {
    /// `cooperative-sticky`: a member joining or leaving moves only the
    /// partitions that must move; the others keep their rebuilt state and
    /// go on broadcasting through a rolling deploy.
    CooperativeSticky,
    /// `range` with the eager protocol: every rebalance revokes every
    /// partition of every member, which then rebuilds all it is given (the
    /// previous release's behaviour, for brokers whose group coordinator
    /// cannot run the cooperative protocol).
    Eager,
}

impl Assignment {
    /// librdkafka's `partition.assignment.strategy`.
    pub fn strategy(self) -> &'static str {
        match self {
            Assignment::CooperativeSticky => "cooperative-sticky",
            Assignment::Eager => "range",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionConfig {
    /// `redis://`, `rediss://` (TLS) or `unix://` URL of the region's Redis,
    /// `redis+sentinel://host:port[,host:port…]/<master name>` to follow
    /// the master that Sentinel names, or `redis+cluster://host:port[,…]`
    /// for a Redis Cluster (any of its nodes; the rest are discovered).
    pub redis_url: String,
    /// Nodes expected in this region; `local` fail mode gives each node
    /// `region limit / expected_nodes`.
    #[serde(default = "one")]
    pub expected_nodes: u32,
}

fn one() -> u32 {
    1
}

/// Rate-limiting algorithm of one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Counter per aligned window. Cheapest; allows 2× at a window edge.
    FixedWindow,
    /// Two fixed windows weighted by overlap (Cloudflare's approximation):
    /// O(1) memory, no edge burst.
    SlidingWindow,
    /// GCRA: `limit` per `window` sustained, up to `burst` at once.
    #[serde(alias = "gcra")]
    TokenBucket,
    /// Exact log of timestamps; memory O(limit), so limited to small limits.
    SlidingLog,
}

impl Algorithm {
    /// The code the Lua script switches on.
    pub fn code(self) -> u8 {
        match self {
            Algorithm::FixedWindow => 1,
            Algorithm::SlidingWindow => 2,
            Algorithm::TokenBucket => 3,
            Algorithm::SlidingLog => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::SlidingLog => "sliding_log",
        }
    }
}

/// Most entries a sliding log may hold (its memory is O(limit)).
pub const MAX_SLIDING_LOG_LIMIT: u64 = 10_000;
/// Longest window of a node or region tier.
pub const MAX_WINDOW: Duration = Duration::from_secs(7 * 86_400);
/// Largest cost a single check may carry, and largest configured limit.
pub const MAX_LIMIT: u64 = 1_000_000_000_000;

/// What a decision does when the region's Redis cannot answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum StoreErrorMode {
    /// Allow, unlimited by node and region tiers.
    Open,
    /// Deny with 503.
    Closed,
    /// Enforce in-process: node tier as configured, region tier divided by
    /// the region's expected node count.
    #[default]
    Local,
}

impl StoreErrorMode {
    pub fn name(self) -> &'static str {
        match self {
            StoreErrorMode::Open => "open",
            StoreErrorMode::Closed => "closed",
            StoreErrorMode::Local => "local",
        }
    }
}

/// One windowed limit (node or region tier) as written in a plan.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitConfig {
    pub limit: u64,
    #[serde(with = "serde_human")]
    pub window: Duration,
    #[serde(default = "default_algorithm")]
    pub algorithm: Algorithm,
    /// Token bucket only: most units spendable at once (default `limit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
}

fn default_algorithm() -> Algorithm {
    Algorithm::SlidingWindow
}

/// Partial override of a [`LimitConfig`] for one tenant.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitOverride {
    pub limit: Option<u64>,
    #[serde(default, with = "opt_human", skip_serializing_if = "Option::is_none")]
    pub window: Option<Duration>,
    pub algorithm: Option<Algorithm>,
    pub burst: Option<u64>,
}

/// The global tiers: units per tenant across every region, per calendar
/// period (UTC). `limit` is the day's, as before periods existed
/// (`global = { limit = N }` keeps meaning one UTC day); `hour`, `day`,
/// `week` (ISO, from Monday) and `month` (calendar) each add a tier, and a
/// check must fit in all of them (`global = { month = 2000000, hour =
/// 10000 }`). A tenant's `global` overrides the kinds it names and inherits
/// the others from its plan.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GlobalLimitConfig {
    /// The day's limit (the same as `day`; give one of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hour: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub day: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub week: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub month: Option<u64>,
}

impl GlobalLimitConfig {
    /// One tier per UTC day: what `global = { limit = N }` has always meant.
    pub fn daily(limit: u64) -> Self {
        GlobalLimitConfig {
            limit: Some(limit),
            ..Default::default()
        }
    }

    /// The limit of `kind`, if this table names one.
    pub fn of(&self, kind: PeriodKind) -> Option<u64> {
        match kind {
            PeriodKind::Hour => self.hour,
            PeriodKind::Day => self.day.or(self.limit),
            PeriodKind::Week => self.week,
            PeriodKind::Month => self.month,
        }
    }

    /// Checks the table alone (`at` names it, e.g. `plans.pro.global`).
    fn check(&self, at: &str) -> Result<(), ConfigError> {
        if self.limit.is_some() && self.day.is_some() {
            return Err(ConfigError::invalid(
                format!("{at}.day"),
                "give the day's limit once: `limit` and `day` are the same tier",
            ));
        }
        if PeriodKind::ALL.iter().all(|k| self.of(*k).is_none()) {
            return Err(ConfigError::invalid(
                at,
                "a global table needs at least one limit (limit, hour, day, week or month)",
            ));
        }
        Ok(())
    }
}

/// One global tier of a resolved [`Policy`] other than the UTC day's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GlobalTier {
    pub kind: PeriodKind,
    pub limit: u64,
    /// The calendar its periods follow (the policy's `time_zone`).
    #[serde(skip_serializing_if = "Zone::is_utc_ref")]
    pub zone: Zone,
}

impl GlobalTier {
    /// The period of this tier containing `ms`.
    pub fn at(&self, ms: u64) -> crate::period::Period {
        self.kind.at_in(self.zone, ms)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanConfig {
    /// Per region-node process. Absent: no node tier.
    pub node: Option<LimitConfig>,
    /// Across all nodes of one region. Absent: no region tier.
    pub region: Option<LimitConfig>,
    /// Across every region, per UTC day. Absent: no global tier.
    pub global: Option<GlobalLimitConfig>,
    #[serde(default)]
    pub on_store_error: StoreErrorMode,
    /// Count node and region tiers per (tenant, key) instead of per tenant.
    /// The global tier is always per tenant.
    #[serde(default)]
    pub key_scoped: bool,
    /// Through Envoy's rate limit service: decide and count, but answer OK
    /// (metrics carry `shadow="true"`).
    #[serde(default)]
    pub shadow_mode: bool,
    /// Caps the leases of this plan's checks below `node.lease_max`; 0
    /// switches leasing off for the plan. Absent: `node.lease_max` alone.
    #[serde(default)]
    pub lease_max: Option<u64>,
    /// The IANA zone whose calendar the global tiers count in (`"UTC"`
    /// when absent): a day starts at local midnight and lasts 23 or 25
    /// hours when clocks change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub plan: String,
    pub node: Option<LimitOverride>,
    pub region: Option<LimitOverride>,
    pub global: Option<GlobalLimitConfig>,
    pub on_store_error: Option<StoreErrorMode>,
    /// The zone of the tenant's global tiers, over its plan's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// Extra units for one period of a global tier (the limits API's
    /// support operation; `limits.source = "topic"` only). Absent from a
    /// record without grants, so such records read as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grants: Vec<Grant>,
}

/// Extra units granted to a tenant for one period of one of its global
/// tiers: that period's limit is raised by `extra`, and the grant ends
/// with the period. A PN-counter cannot be reset safely (a reset is a
/// decrement that another region's merge would undo or double), so a
/// support case raises the limit instead.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// The tier: `hour`, `day`, `week` or `month` (UTC).
    pub period: PeriodKind,
    /// The start of the period it is for (Unix ms): it never outlives it.
    pub period_start_ms: u64,
    pub extra: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Grant {
    /// The period the grant is for, on the calendar of `zone` (the
    /// tenant's `time_zone`).
    pub fn period_in(&self, zone: Zone) -> crate::period::Period {
        self.period.at_in(zone, self.period_start_ms)
    }

    /// The end (exclusive, Unix ms) of the period the grant is for.
    pub fn until_ms(&self, zone: Zone) -> u64 {
        self.period_in(zone).end_ms().max(0) as u64
    }

    /// Whether it raises the limit at `now_ms`.
    pub fn active_at(&self, zone: Zone, now_ms: u64) -> bool {
        self.period_in(zone).contains(now_ms)
    }
}

impl Policy {
    /// This policy with the grants active at `now_ms` added to their
    /// tiers' limits, and until when that holds (the earliest end of those
    /// grants, or of a grant still to start); `None`: no grant is active.
    pub fn with_grants(&self, grants: &[Grant], now_ms: u64) -> Option<(Policy, u64)> {
        let mut p = self.clone();
        let mut until = u64::MAX;
        let mut any = false;
        let zone = self.time_zone;
        for g in grants {
            let start = g.period_in(zone).start_ms().max(0) as u64;
            if now_ms < start {
                until = until.min(start);
                continue;
            }
            if !g.active_at(zone, now_ms) {
                continue;
            }
            let raised = match g.period {
                PeriodKind::Day if zone.is_utc() => p.global.as_mut(),
                kind => p
                    .global_periods
                    .iter_mut()
                    .find(|t| t.kind == kind)
                    .map(|t| &mut t.limit),
            };
            if let Some(limit) = raised {
                *limit = limit.saturating_add(g.extra);
                any = true;
                until = until.min(g.until_ms(zone));
            }
        }
        any.then_some((p, until))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum UnknownPolicy {
    /// Unknown tenants are refused (403).
    Deny,
    /// Unknown tenants get `unknown_tenants.plan`.
    #[default]
    Plan,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnknownTenants {
    #[serde(default)]
    pub policy: UnknownPolicy,
    /// Plan for unknown tenants when `policy = "plan"`.
    pub plan: Option<String>,
    /// How many tenants the region admits for the first time per second,
    /// across all its nodes (a 1 s window in the region's Redis). A caller
    /// inventing ids can make the region pay for at most this many new
    /// tenants a second; known and already-admitted tenants never wait.
    #[serde(default = "default_new_per_second")]
    pub max_new_per_second: u64,
    /// How many unknown tenants the region admits per UTC day, across all
    /// its nodes. Together with the counter TTL this bounds what unknown
    /// tenants can cost in Redis, on Kafka and in every view.
    #[serde(default = "default_unknown_per_day")]
    pub max_per_day: u64,
}

fn default_new_per_second() -> u64 {
    100
}

fn default_unknown_per_day() -> u64 {
    100_000
}

impl Default for UnknownTenants {
    fn default() -> Self {
        UnknownTenants {
            policy: UnknownPolicy::Deny,
            plan: None,
            max_new_per_second: default_new_per_second(),
            max_per_day: default_unknown_per_day(),
        }
    }
}

/// One tier's limit, resolved and ready for the decision path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Limit {
    pub limit: u64,
    pub window_ms: u64,
    pub algorithm: Algorithm,
    /// Token bucket burst; equals `limit` for other algorithms.
    pub burst: u64,
}

impl Limit {
    fn from_config(c: &LimitConfig) -> Limit {
        Limit {
            limit: c.limit,
            window_ms: c.window.as_millis() as u64,
            algorithm: c.algorithm,
            burst: c.burst.unwrap_or(c.limit),
        }
    }

    fn with_override(&self, o: &LimitOverride) -> Limit {
        let limit = o.limit.unwrap_or(self.limit);
        let algorithm = o.algorithm.unwrap_or(self.algorithm);
        Limit {
            limit,
            window_ms: o
                .window
                .map(|w| w.as_millis() as u64)
                .unwrap_or(self.window_ms),
            algorithm,
            // A new limit takes the burst along, and only a token bucket
            // keeps a burst of its own (others have burst = limit).
            burst: o.burst.unwrap_or(
                if o.limit.is_some() || algorithm != Algorithm::TokenBucket {
                    limit
                } else {
                    self.burst
                },
            ),
        }
    }

    /// The `local` fail-mode share of a region limit for one of `nodes`.
    pub fn share(&self, nodes: u32) -> Limit {
        let n = u64::from(nodes.max(1));
        Limit {
            limit: (self.limit / n).max(1),
            burst: (self.burst / n).max(1),
            ..self.clone()
        }
    }
}

/// Everything the decision path needs to know about one tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Policy {
    pub plan: String,
    pub node: Option<Limit>,
    pub region: Option<Limit>,
    /// Units per UTC day across all regions: the day's global tier, whose
    /// counter every tenant has (it is the usage the dashboard shows).
    /// `None` in a zone other than UTC, whose day is in `global_periods`.
    pub global: Option<u64>,
    /// The other global tiers (hour, week, month; and the day in a zone
    /// other than UTC), hour → month: each a counter of its own, decided
    /// together with the UTC day's.
    pub global_periods: Vec<GlobalTier>,
    /// The zone of the global tiers' calendar.
    #[serde(skip_serializing_if = "Zone::is_utc_ref")]
    pub time_zone: Zone,
    pub on_store_error: StoreErrorMode,
    pub key_scoped: bool,
    /// The plan's cap on leases (`plans.<name>.lease_max`; 0 = none).
    pub lease_max: Option<u64>,
}

impl Policy {
    /// The global limit of this policy's tier of `kind`: the day's
    /// [`Policy::global`], another kind's [`Policy::global_periods`] entry;
    /// `None` without such a tier.
    pub fn global_limit(&self, kind: PeriodKind) -> Option<u64> {
        match kind {
            PeriodKind::Day if self.time_zone.is_utc() => self.global,
            kind => self
                .global_periods
                .iter()
                .find(|t| t.kind == kind)
                .map(|t| t.limit),
        }
    }

    /// Every global tier with its limit, the day's first, in the policy's
    /// zone.
    pub fn global_tiers(&self) -> impl Iterator<Item = GlobalTier> + '_ {
        let day = self.global.map(|limit| GlobalTier {
            kind: PeriodKind::Day,
            limit,
            zone: Zone::UTC,
        });
        day.into_iter().chain(self.global_periods.iter().copied())
    }

    /// Places the global tiers `limits` (by kind) on `zone`'s calendar: in
    /// UTC the day's is [`Policy::global`] (its Redis fields and Kafka keys
    /// unchanged since before periods), in another zone every tier is a
    /// [`GlobalTier`] of that zone.
    fn place_global(&mut self, limits: &[(PeriodKind, u64)], zone: Zone) {
        self.time_zone = zone;
        self.global = None;
        self.global_periods.clear();
        let mut kinds: Vec<_> = limits.to_vec();
        kinds.sort();
        for (kind, limit) in kinds {
            if kind == PeriodKind::Day && zone.is_utc() {
                self.global = Some(limit);
            } else {
                self.global_periods.push(GlobalTier { kind, limit, zone });
            }
        }
    }
}

/// A validated configuration with policies resolved per tenant.
#[derive(Debug)]
pub struct Loaded {
    pub config: Config,
    tenants: BTreeMap<String, Arc<Policy>>,
    unknown: Option<Arc<Policy>>,
    /// `[rls]`, compiled (descriptor trees, rule ids).
    pub rls: crate::rls::Compiled,
    /// Plans as shared policies, for tenants an RLS domain assigns a plan.
    plan_arcs: BTreeMap<String, Arc<Policy>>,
    /// With `limits.source = "topic"`: the applied records, shared by every
    /// configuration this process loads (a reload keeps the table).
    limits: Option<Arc<crate::limits::LimitsTable>>,
}

impl Loaded {
    /// The policy of `tenant`, or `None` when unknown tenants are denied.
    pub fn policy(&self, tenant: &str) -> Option<Arc<Policy>> {
        match &self.limits {
            Some(table) => table.tenant(tenant).or_else(|| self.unknown()),
            None => self
                .tenants
                .get(tenant)
                .cloned()
                .or_else(|| self.unknown.clone()),
        }
    }

    /// Policies of every tenant the file configures (none with
    /// `limits.source = "topic"`).
    pub fn policies(&self) -> impl Iterator<Item = (&str, &Arc<Policy>)> {
        self.tenants.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// True when `tenant` is not registered: it runs under
    /// `unknown_tenants` (or is refused) and its first sight of the day
    /// passes the region's newcomer gate.
    pub fn is_unknown(&self, tenant: &str) -> bool {
        match &self.limits {
            Some(table) => !table.contains(tenant),
            None => !self.tenants.contains_key(tenant),
        }
    }

    /// The unknown-tenant policy (with the topic: its plan as the topic
    /// defines it, if it does).
    fn unknown(&self) -> Option<Arc<Policy>> {
        let file = self.unknown.as_ref()?;
        match &self.limits {
            Some(table) => table.plan(&file.plan).or_else(|| Some(Arc::clone(file))),
            None => Some(Arc::clone(file)),
        }
    }

    pub fn unknown_policy(&self) -> Option<Arc<Policy>> {
        self.unknown()
    }

    /// The resolved policy of a plan (before any tenant override): the
    /// topic's if it defines one, else the file's.
    pub fn plan_policy(&self, plan: &str) -> Option<Arc<Policy>> {
        self.limits
            .as_ref()
            .and_then(|t| t.plan(plan))
            .or_else(|| self.plan_arcs.get(plan).cloned())
    }

    /// The policy of `tenant` when an RLS domain names `plan` for tenants
    /// that are not registered: the tenant's own, else the plan's,
    /// else the unknown-tenant policy.
    pub fn policy_with_plan(&self, tenant: &str, plan: Option<&str>) -> Option<Arc<Policy>> {
        let own = match &self.limits {
            Some(table) => table.tenant(tenant),
            None => self.tenants.get(tenant).cloned(),
        };
        own.or_else(|| plan.and_then(|p| self.plan_policy(p)))
            .or_else(|| self.unknown())
    }

    /// The limits table this configuration reads tenants from
    /// (`limits.source = "topic"`).
    pub fn limits(&self) -> Option<&Arc<crate::limits::LimitsTable>> {
        self.limits.as_ref()
    }

    /// Reads tenants from `table` (with `limits.source = "topic"`; a file
    /// source keeps its `[tenants]`) and hands it this file's plans.
    pub fn attach_limits(&mut self, table: Arc<crate::limits::LimitsTable>) {
        if self.config.limits.source == LimitsSource::Topic {
            table.set_file_plans(&self.plan_arcs);
            self.limits = Some(table);
        }
    }

    /// Whether the plan `name` is in shadow mode for the RLS.
    pub fn plan_shadow(&self, name: &str) -> bool {
        self.config.plans.get(name).is_some_and(|p| p.shadow_mode)
    }
}

/// Refuses a plan that only the gateway names (`rls.plan`, a domain's
/// `plan`) when it has a global tier the aggregator would not enforce.
///
/// Such a plan reaches the tenants `[tenants]` does not list (through
/// `Loaded::policy_with_plan`): the nodes enforce its global limit, while
/// the aggregator, which sees only tenant ids, resolves those tenants
/// through `unknown_tenants`. When that gives no global limit (or another
/// one) the aggregator never broadcasts them (or at another threshold), so
/// every region keeps assuming the unbroadcast bound for the others and
/// admits up to `L` minus it: about `regions × L` in all (issue 29,
/// item 4). Until deltas carry the limit they were enforced under, the
/// configuration is refused, naming the key, the plan and the fixes.
/// A policy's global tiers in words: `1000 a day, 20000 a month`.
fn describe_global(p: &Policy) -> String {
    p.global
        .map(|l| format!("{l} a day"))
        .into_iter()
        .chain(
            p.global_periods
                .iter()
                .map(|t| format!("{} a {}", t.limit, t.kind)),
        )
        .collect::<Vec<_>>()
        .join(", ")
}

fn check_gateway_plans(
    config: &crate::rls::RlsConfig,
    rls: &crate::rls::Compiled,
    plans: &BTreeMap<String, Policy>,
    tenants: &BTreeMap<String, Arc<Policy>>,
    unknown: Option<&Policy>,
) -> Result<(), ConfigError> {
    let aggregator_limit = unknown.and_then(|u| u.global);
    let mut domains: Vec<&crate::rls::Domain> = rls.domains.values().collect();
    domains.sort_by(|a, b| a.name.cmp(&b.name));
    for d in domains {
        let Some(plan) = d.plan.as_deref() else {
            continue;
        };
        let Some(gateway_plan) = plans
            .get(plan)
            .filter(|p| p.global.is_some() || !p.global_periods.is_empty())
        else {
            continue;
        };
        let same = |u: &Policy| {
            u.global == gateway_plan.global && u.global_periods == gateway_plan.global_periods
        };
        if unknown.is_some_and(same) {
            continue;
        }
        let limit = describe_global(gateway_plan);
        // Tenants named by an entry may be any id; without one, the domain
        // itself is the tenant, which `[tenants]` may list.
        if d.tenant_entry.is_none() && tenants.contains_key(&d.name) {
            continue;
        }
        let key = match config
            .domains
            .iter()
            .position(|c| c.domain == d.name && c.plan.is_some())
        {
            Some(i) => format!("rls.domains[{i}].plan"),
            None => "rls.plan".to_string(),
        };
        let aggregator = match (aggregator_limit, unknown) {
            (None, None) => "denies them (unknown_tenants.policy = \"deny\")".to_string(),
            (None, Some(u)) => format!(
                "resolves them through unknown_tenants.plan {:?}, which has no global tier",
                u.plan
            ),
            (Some(l), Some(u)) => format!(
                "resolves them through unknown_tenants.plan {:?}, whose global limit is {l}",
                u.plan
            ),
            (Some(l), None) => format!("gives them a global limit of {l}"),
        };
        let listing = match &d.tenant_entry {
            Some(_) => String::new(),
            None => format!(", or list tenant {:?} under [tenants]", d.name),
        };
        return Err(ConfigError::invalid(
            key,
            format!(
                "plan {plan:?} has a global tier ({limit}) that the region-nodes would \
                 enforce for the tenants of RLS domain {:?} that [tenants] does not list, but \
                 the aggregator knows tenants only by id and {aggregator}: it would never \
                 broadcast their global count, and every region would admit up to the whole \
                 limit. Fix: set unknown_tenants.policy = \"plan\" and unknown_tenants.plan = \
                 {plan:?} (or a plan with the same global limit), or name a plan without a \
                 global tier here{listing}",
                d.name
            ),
        ));
    }
    Ok(())
}

/// A plan resolved into the policy of its tenants without overrides,
/// checked as a file's `[plans.<name>]` is (errors name `plans.<name>…`).
/// The limits topic's plans go through the same function.
pub fn resolve_plan(name: &str, p: &PlanConfig) -> Result<Policy, ConfigError> {
    validate::name("plan name", name)
        .map_err(|e| ConfigError::invalid(format!("plans.{name}"), e.to_string()))?;
    if let Some(g) = &p.global {
        g.check(&format!("plans.{name}.global"))?;
    }
    let zone = time_zone(&format!("plans.{name}.time_zone"), p.time_zone.as_deref())?;
    let mut policy = Policy {
        plan: name.to_owned(),
        node: p.node.as_ref().map(Limit::from_config),
        region: p.region.as_ref().map(Limit::from_config),
        global: None,
        global_periods: Vec::new(),
        time_zone: Zone::UTC,
        on_store_error: p.on_store_error,
        key_scoped: p.key_scoped,
        lease_max: p.lease_max,
    };
    policy.place_global(&global_limits(p.global.as_ref(), &[]), zone);
    check_zone(&format!("plans.{name}.time_zone"), &policy)?;
    if p.lease_max.is_some_and(|m| m > 1_000_000) {
        return Err(ConfigError::invalid(
            format!("plans.{name}.lease_max"),
            "must be at most 1000000 (0 turns this plan's leases off)",
        ));
    }
    check_policy(&format!("plans.{name}"), &policy)?;
    Ok(policy)
}

/// A tenant's policy: its plan's (`base`) with the tenant's overrides,
/// checked as a file's `[tenants.<id>]` is (`at` names it). The limits
/// topic's tenants go through the same function.
pub fn resolve_tenant(at: &str, t: &TenantConfig, base: &Policy) -> Result<Policy, ConfigError> {
    let mut policy = base.clone();
    for (tier, ov, slot) in [
        ("node", &t.node, &mut policy.node),
        ("region", &t.region, &mut policy.region),
    ] {
        if let Some(ov) = ov {
            *slot = match slot.as_ref() {
                Some(l) => Some(l.with_override(ov)),
                None => Some(full_override(&format!("{at}.{tier}"), ov)?),
            };
        }
    }
    if let Some(g) = &t.global {
        g.check(&format!("{at}.global"))?;
    }
    let zone = match &t.time_zone {
        Some(z) => time_zone(&format!("{at}.time_zone"), Some(z))?,
        None => base.time_zone,
    };
    let inherited: Vec<_> = base.global_tiers().map(|t| (t.kind, t.limit)).collect();
    policy.place_global(&global_limits(t.global.as_ref(), &inherited), zone);
    check_zone(&format!("{at}.time_zone"), &policy)?;
    if let Some(m) = t.on_store_error {
        policy.on_store_error = m;
    }
    check_policy(at, &policy)?;
    Ok(policy)
}

impl TenantConfig {
    /// True when the tenant has nothing but its plan: it shares the plan's
    /// policy (one pointer) instead of a policy of its own.
    pub fn is_plain(&self) -> bool {
        self.node.is_none()
            && self.region.is_none()
            && self.global.is_none()
            && self.on_store_error.is_none()
            && self.time_zone.is_none()
            && self.grants.is_empty()
    }
}

impl Config {
    /// Reads, overrides from the process environment, parses and validates.
    pub fn load(path: &Path) -> Result<Loaded, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml_with_env(&text, std::env::vars())
    }

    /// Parses `text`, applies `TIERLIMIT__…` overrides from `env`, validates.
    pub fn from_toml_with_env(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Loaded, ConfigError> {
        let mut tree: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Syntax(e.to_string()))?;
        for (var, value) in env {
            apply_env_override(&mut tree, &var, &value)?;
        }
        let config: Config =
            serde_path_to_error::deserialize(toml::Value::Table(tree)).map_err(|e| {
                let key = e.path().to_string();
                // `message()`, not `to_string()`: the latter appends a newline and
                // an `in <path>` of its own (the parent's, for unknown fields).
                ConfigError::invalid(
                    if key == "." { "(root)".into() } else { key },
                    e.into_inner().message(),
                )
            })?;
        config.validate()
    }

    /// Parses and validates without environment overrides.
    pub fn from_toml(text: &str) -> Result<Loaded, ConfigError> {
        Self::from_toml_with_env(text, std::iter::empty())
    }

    /// Checks everything serde's types cannot and resolves tenant policies.
    pub fn validate(self) -> Result<Loaded, ConfigError> {
        validate::name("cluster", &self.cluster)
            .map_err(|e| ConfigError::invalid("cluster", e.to_string()))?;
        self.validate_kafka()?;
        self.validate_settings()?;
        if self.regions.is_empty() {
            return Err(ConfigError::invalid(
                "regions",
                "at least one region is required",
            ));
        }
        for (name, r) in &self.regions {
            let key = |k: &str| format!("regions.{name}.{k}");
            validate::name("region name", name)
                .map_err(|e| ConfigError::invalid(format!("regions.{name}"), e.to_string()))?;
            if ![
                "redis://",
                "rediss://",
                "unix://",
                "redis+unix://",
                "redis+sentinel://",
                "rediss+sentinel://",
                "redis+cluster://",
            ]
            .iter()
            .any(|p| r.redis_url.starts_with(p))
            {
                return Err(ConfigError::invalid(
                    key("redis_url"),
                    format!(
                        "{:?} is not a redis://, rediss://, unix://, redis+sentinel:// or redis+cluster:// URL",
                        r.redis_url
                    ),
                ));
            }
            if r.expected_nodes == 0 {
                return Err(ConfigError::invalid(
                    key("expected_nodes"),
                    "must be at least 1",
                ));
            }
        }
        let topic = self.limits.source == LimitsSource::Topic;
        if self.plans.is_empty() && !topic {
            return Err(ConfigError::invalid(
                "plans",
                "at least one plan is required",
            ));
        }
        if topic && !self.tenants.is_empty() {
            return Err(ConfigError::invalid(
                "tenants",
                "with limits.source = \"topic\" tenants are records of the limits topic: \
                 move them there (`aggregator limits import`) and remove [tenants], or set \
                 limits.source = \"file\"",
            ));
        }
        let mut plans = BTreeMap::new();
        for (name, p) in &self.plans {
            plans.insert(name.clone(), resolve_plan(name, p)?);
        }
        let mut tenants = BTreeMap::new();
        for (id, t) in &self.tenants {
            let at = format!("tenants.{id}");
            if !t.grants.is_empty() {
                return Err(ConfigError::invalid(
                    format!("{at}.grants"),
                    "grants are written through the limits API (limits.source = \"topic\"), not in a file",
                ));
            }
            validate::tenant(id).map_err(|e| ConfigError::invalid(&at, e.to_string()))?;
            let base = plans.get(&t.plan).ok_or_else(|| {
                ConfigError::invalid(
                    format!("{at}.plan"),
                    format!("no plan named {:?} (plans: {})", t.plan, names(&plans)),
                )
            })?;
            tenants.insert(id.clone(), Arc::new(resolve_tenant(&at, t, base)?));
        }
        for (key, v) in [
            (
                "unknown_tenants.max_new_per_second",
                self.unknown_tenants.max_new_per_second,
            ),
            (
                "unknown_tenants.max_per_day",
                self.unknown_tenants.max_per_day,
            ),
        ] {
            if v == 0 || v > MAX_LIMIT {
                return Err(ConfigError::invalid(
                    key,
                    format!("must be between 1 and {MAX_LIMIT}"),
                ));
            }
        }
        let unknown = match (self.unknown_tenants.policy, &self.unknown_tenants.plan) {
            (UnknownPolicy::Deny, _) => None,
            (UnknownPolicy::Plan, None) => {
                return Err(ConfigError::invalid(
                    "unknown_tenants.plan",
                    "required when unknown_tenants.policy = \"plan\"",
                ))
            }
            (UnknownPolicy::Plan, Some(p)) => Some(Arc::new(
                plans
                    .get(p)
                    .ok_or_else(|| {
                        ConfigError::invalid(
                            "unknown_tenants.plan",
                            format!("no plan named {p:?} (plans: {})", names(&plans)),
                        )
                    })?
                    .clone(),
            )),
        };
        self.validate_wire()?;
        let rls = crate::rls::compile(&self.rls, |p| plans.contains_key(p))?;
        check_gateway_plans(&self.rls, &rls, &plans, &tenants, unknown.as_deref())?;
        if self.grpc.tls_cert.is_some() != self.grpc.tls_key.is_some() {
            return Err(ConfigError::invalid(
                if self.grpc.tls_cert.is_some() {
                    "grpc.tls_key"
                } else {
                    "grpc.tls_cert"
                },
                "grpc.tls_cert and grpc.tls_key go together",
            ));
        }
        let plan_arcs = plans
            .iter()
            .map(|(k, v)| (k.clone(), Arc::new(v.clone())))
            .collect();
        Ok(Loaded {
            config: self,
            tenants,
            unknown,
            rls,
            plan_arcs,
            limits: None,
        })
    }

    fn validate_kafka(&self) -> Result<(), ConfigError> {
        let k = &self.kafka;
        if k.brokers.trim().is_empty() {
            return Err(ConfigError::invalid("kafka.brokers", "must not be empty"));
        }
        for (key, topic) in [
            ("kafka.deltas_topic", &k.deltas_topic),
            ("kafka.global_topic", &k.global_topic),
            ("kafka.limits_topic", &k.limits_topic),
        ] {
            if topic.is_empty()
                || topic.len() > 249
                || !topic
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
            {
                return Err(ConfigError::invalid(
                    key,
                    format!("{topic:?} is not a valid Kafka topic name ([A-Za-z0-9._-], 1..249)"),
                ));
            }
        }
        if k.deltas_topic == k.global_topic {
            return Err(ConfigError::invalid(
                "kafka.global_topic",
                "must differ from kafka.deltas_topic",
            ));
        }
        if k.limits_topic == k.deltas_topic || k.limits_topic == k.global_topic {
            return Err(ConfigError::invalid(
                "kafka.limits_topic",
                "must differ from kafka.deltas_topic and kafka.global_topic",
            ));
        }
        if !(1..=10_000).contains(&k.partitions) {
            return Err(ConfigError::invalid(
                "kafka.partitions",
                "must be between 1 and 10000",
            ));
        }
        if !(1..=16).contains(&k.replication_factor) {
            return Err(ConfigError::invalid(
                "kafka.replication_factor",
                "must be between 1 and 16",
            ));
        }
        for reserved in [
            "bootstrap.servers",
            "group.id",
            "enable.idempotence",
            "enable.auto.commit",
        ] {
            if k.client.contains_key(reserved) {
                return Err(ConfigError::invalid(
                    format!("kafka.client.{reserved}"),
                    "is set by tierlimit itself and cannot be overridden",
                ));
            }
        }
        Ok(())
    }

    fn validate_wire(&self) -> Result<(), ConfigError> {
        use crate::wire::keys;
        let w = &self.wire;
        match w.version {
            1 if !w.accept_unsigned => {
                return Err(ConfigError::invalid(
                    "wire.version",
                    "version 1 (JSON) cannot be signed: it needs wire.accept_unsigned = true (only during an upgrade from the JSON release)",
                ))
            }
            1..=3 => {}
            v => {
                return Err(ConfigError::invalid(
                    "wire.version",
                    format!("must be 1, 2 or 3, got {v}"),
                ))
            }
        }
        if w.version < 3 {
            let periodic = self.plans.iter().find_map(|(name, p)| {
                let g = p.global.as_ref()?;
                PeriodKind::ALL
                    .into_iter()
                    .find(|k| *k != PeriodKind::Day && g.of(*k).is_some())
                    .map(|k| format!("plans.{name}.global.{k}"))
            });
            let periodic = periodic.or_else(|| {
                self.tenants.iter().find_map(|(id, t)| {
                    let g = t.global.as_ref()?;
                    PeriodKind::ALL
                        .into_iter()
                        .find(|k| *k != PeriodKind::Day && g.of(*k).is_some())
                        .map(|k| format!("tenants.{id}.global.{k}"))
                })
            });
            let zoned = || {
                let plans = self.plans.iter().filter(|(_, p)| p.global.is_some());
                let plans = plans
                    .filter_map(|(n, p)| Some((format!("plans.{n}"), p.time_zone.as_deref()?)));
                let tenants = self
                    .tenants
                    .iter()
                    .filter_map(|(id, t)| Some((format!("tenants.{id}"), t.time_zone.as_deref()?)));
                plans
                    .chain(tenants)
                    .find(|(_, z)| !Zone::named(z).is_ok_and(Zone::is_utc))
                    .map(|(at, _)| format!("{at}.time_zone"))
            };
            if let Some(at) = periodic.or_else(zoned) {
                return Err(ConfigError::invalid(
                    "wire.version",
                    format!(
                        "{at} is a global tier of a period other than a UTC day (or in a time zone), \
                         which only wire version 3 carries: set wire.version = 3 (once no process of the previous \
                         release runs) or remove the tier"
                    ),
                ));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for (region, rk) in &w.delta_keys {
            let at = format!("wire.delta_keys.{region}");
            if !self.regions.contains_key(region) {
                return Err(ConfigError::invalid(
                    &at,
                    format!(
                        "no region named {region:?} (regions: {})",
                        names(&self.regions)
                    ),
                ));
            }
            if rk.keys.is_empty() {
                return Err(ConfigError::invalid(
                    format!("{at}.keys"),
                    "at least one key is required",
                ));
            }
            for (id, secret) in &rk.keys {
                let key = format!("{at}.keys.{id}");
                validate::name("key id", id)
                    .map_err(|e| ConfigError::invalid(&key, e.to_string()))?;
                if !seen.insert(id.as_str()) {
                    return Err(ConfigError::invalid(
                        &key,
                        "key ids must be unique across regions (a key id names its region)",
                    ));
                }
                keys::hmac_secret(secret).map_err(|e| ConfigError::invalid(&key, e))?;
            }
            if !rk.keys.contains_key(&rk.sign_with) {
                return Err(ConfigError::invalid(
                    format!("{at}.sign_with"),
                    format!(
                        "no key {:?} in {at}.keys (keys: {})",
                        rk.sign_with,
                        names(&rk.keys)
                    ),
                ));
            }
        }
        for (id, public) in &w.broadcast_public_keys {
            let key = format!("wire.broadcast_public_keys.{id}");
            validate::name("key id", id).map_err(|e| ConfigError::invalid(&key, e.to_string()))?;
            keys::ed25519_public(public).map_err(|e| ConfigError::invalid(&key, e))?;
        }
        if let Some(id) = &w.broadcast_key {
            if !w.broadcast_public_keys.contains_key(id) {
                return Err(ConfigError::invalid(
                    "wire.broadcast_key",
                    format!("no key {id:?} in wire.broadcast_public_keys"),
                ));
            }
        }
        if let Some(private) = &w.broadcast_private_key {
            let signing = keys::ed25519_private(private)
                .map_err(|e| ConfigError::invalid("wire.broadcast_private_key", e))?;
            let Some(id) = &w.broadcast_key else {
                return Err(ConfigError::invalid(
                    "wire.broadcast_key",
                    "required with wire.broadcast_private_key (the key id it signs as)",
                ));
            };
            let public = keys::ed25519_public(&w.broadcast_public_keys[id])
                .map_err(|e| ConfigError::invalid(format!("wire.broadcast_public_keys.{id}"), e))?;
            if signing.verifying_key() != public {
                return Err(ConfigError::invalid(
                    "wire.broadcast_private_key",
                    format!("does not match wire.broadcast_public_keys.{id}"),
                ));
            }
        }
        for (id, public) in &w.limits_public_keys {
            let key = format!("wire.limits_public_keys.{id}");
            validate::name("key id", id).map_err(|e| ConfigError::invalid(&key, e.to_string()))?;
            keys::ed25519_public(public).map_err(|e| ConfigError::invalid(&key, e))?;
            if w.broadcast_public_keys.values().any(|b| b == public) {
                return Err(ConfigError::invalid(
                    &key,
                    "is a broadcast key: limits need a key of their own, so an aggregator's key cannot write limits",
                ));
            }
        }
        if let Some(id) = &w.limits_key {
            if !w.limits_public_keys.contains_key(id) {
                return Err(ConfigError::invalid(
                    "wire.limits_key",
                    format!("no key {id:?} in wire.limits_public_keys"),
                ));
            }
        }
        if let Some(private) = &w.limits_private_key {
            let signing = keys::ed25519_private(private)
                .map_err(|e| ConfigError::invalid("wire.limits_private_key", e))?;
            let Some(id) = &w.limits_key else {
                return Err(ConfigError::invalid(
                    "wire.limits_key",
                    "required with wire.limits_private_key (the key id it signs as)",
                ));
            };
            let public = keys::ed25519_public(&w.limits_public_keys[id])
                .map_err(|e| ConfigError::invalid(format!("wire.limits_public_keys.{id}"), e))?;
            if signing.verifying_key() != public {
                return Err(ConfigError::invalid(
                    "wire.limits_private_key",
                    format!("does not match wire.limits_public_keys.{id}"),
                ));
            }
        }
        if self.limits.source == LimitsSource::Topic {
            if w.version < 3 {
                return Err(ConfigError::invalid(
                    "limits.source",
                    "\"topic\" needs wire.version = 3 (limits versions travel in v3 records)",
                ));
            }
            if w.limits_public_keys.is_empty() && !w.accept_unsigned {
                return Err(ConfigError::invalid(
                    "wire.limits_public_keys",
                    "at least one key is required with limits.source = \"topic\": limits records are signed",
                ));
            }
        }
        if !w.accept_unsigned {
            if let Some(region) = self.regions.keys().find(|r| !w.delta_keys.contains_key(*r)) {
                return Err(ConfigError::invalid(
                    format!("wire.delta_keys.{region}"),
                    "required: deltas are signed (or set wire.accept_unsigned = true during an upgrade from the JSON release)",
                ));
            }
            if w.broadcast_public_keys.is_empty() {
                return Err(ConfigError::invalid(
                    "wire.broadcast_public_keys",
                    "at least one key is required: broadcasts are signed (or set wire.accept_unsigned = true during an upgrade from the JSON release)",
                ));
            }
            if w.broadcast_key.is_none() {
                return Err(ConfigError::invalid(
                    "wire.broadcast_key",
                    "required: the key id aggregators sign broadcasts with",
                ));
            }
        }
        Ok(())
    }

    fn validate_settings(&self) -> Result<(), ConfigError> {
        let n = &self.node;
        let range = |key: &str, d: Duration, lo: Duration, hi: Duration| {
            if d < lo || d > hi {
                Err(ConfigError::invalid(
                    key,
                    format!(
                        "{} is out of range {}..{}",
                        crate::duration::format(d),
                        crate::duration::format(lo),
                        crate::duration::format(hi)
                    ),
                ))
            } else {
                Ok(())
            }
        };
        if n.lease_max > 1_000_000 {
            return Err(ConfigError::invalid(
                "node.lease_max",
                "must be at most 1000000 (0 turns leases off)",
            ));
        }
        if !(0.0..=1.0).contains(&n.reserve_fraction) {
            return Err(ConfigError::invalid(
                "node.reserve_fraction",
                "must be between 0 and 1 (0 turns node-tier reservations off)",
            ));
        }
        let ms = Duration::from_millis;
        range("node.flush_interval", n.flush_interval, ms(10), ms(60_000))?;
        range("node.store_timeout", n.store_timeout, ms(1), ms(10_000))?;
        range(
            "node.store_retry_interval",
            n.store_retry_interval,
            ms(10),
            ms(60_000),
        )?;
        if let Some(s) = n.max_staleness {
            range("node.max_staleness", s, ms(100), ms(86_400_000))?;
        }
        range("node.view_wait", n.view_wait, ms(0), ms(3_600_000))?;
        let l = &self.limits;
        range(
            "limits.lag_alert_after",
            l.lag_alert_after,
            ms(100),
            ms(86_400_000),
        )?;
        range(
            "limits.status_interval",
            l.status_interval,
            ms(100),
            ms(60_000),
        )?;
        range(
            "node.max_clock_offset",
            n.max_clock_offset,
            ms(1),
            ms(3_600_000),
        )?;
        if !(1..=65_536).contains(&n.max_in_flight) {
            return Err(ConfigError::invalid(
                "node.max_in_flight",
                format!("must be within 1..65536, got {}", n.max_in_flight),
            ));
        }
        if n.max_queue > 1_000_000 {
            return Err(ConfigError::invalid(
                "node.max_queue",
                format!("must be within 0..1000000, got {}", n.max_queue),
            ));
        }
        range("node.queue_timeout", n.queue_timeout, ms(0), ms(60_000))?;
        range(
            "node.store_unavailable_after",
            n.store_unavailable_after,
            ms(10),
            ms(60_000),
        )?;
        if n.publish_batch == 0 {
            return Err(ConfigError::invalid(
                "node.publish_batch",
                "must be at least 1",
            ));
        }
        if n.refund_secret.as_ref().is_some_and(|s| s.len() < 32) {
            return Err(ConfigError::invalid(
                "node.refund_secret",
                "must be at least 32 bytes (e.g. `openssl rand -hex 32`)",
            ));
        }
        let relaxed = n.relaxed_flush_interval();
        if relaxed < n.flush_interval {
            return Err(ConfigError::invalid(
                "node.relaxed_flush_interval",
                format!(
                    "{} is shorter than node.flush_interval ({}); use the same value to publish every entry at every flush",
                    crate::duration::format(relaxed),
                    crate::duration::format(n.flush_interval)
                ),
            ));
        }
        range("node.relaxed_flush_interval", relaxed, ms(10), ms(600_000))?;
        if !(0.0..=1.0).contains(&n.urgent_fraction) {
            return Err(ConfigError::invalid(
                "node.urgent_fraction",
                format!("must be within 0..1, got {}", n.urgent_fraction),
            ));
        }
        let h = &self.http;
        if h.tls_cert.is_some() != h.tls_key.is_some() {
            return Err(ConfigError::invalid(
                if h.tls_cert.is_some() {
                    "http.tls_key"
                } else {
                    "http.tls_cert"
                },
                "http.tls_cert and http.tls_key are set together",
            ));
        }
        if h.tls_client_ca.is_some() && h.tls_cert.is_none() {
            return Err(ConfigError::invalid(
                "http.tls_client_ca",
                "client certificates need TLS: set http.tls_cert and http.tls_key",
            ));
        }
        range(
            "http.header_read_timeout",
            h.header_read_timeout,
            ms(100),
            ms(600_000),
        )?;
        range(
            "http.request_timeout",
            h.request_timeout,
            ms(100),
            ms(600_000),
        )?;
        if !(1024..=1024 * 1024).contains(&h.max_header_bytes) {
            return Err(ConfigError::invalid(
                "http.max_header_bytes",
                "must be between 1024 and 1048576",
            ));
        }
        if !(256..=64 * 1024).contains(&h.max_uri_bytes) {
            return Err(ConfigError::invalid(
                "http.max_uri_bytes",
                "must be between 256 and 65536",
            ));
        }
        if h.max_concurrent_requests == 0 {
            return Err(ConfigError::invalid(
                "http.max_concurrent_requests",
                "must be at least 1",
            ));
        }
        self.auth
            .validate()
            .map_err(|(key, reason)| ConfigError::invalid(key, reason))?;
        let a = &self.aggregator;
        if a.group_id.is_empty() {
            return Err(ConfigError::invalid(
                "aggregator.group_id",
                "must not be empty",
            ));
        }
        range(
            "aggregator.broadcast_interval",
            a.broadcast_interval,
            ms(10),
            ms(60_000),
        )?;
        if !(0.0..=0.5).contains(&a.broadcast_fraction) {
            return Err(ConfigError::invalid(
                "aggregator.broadcast_fraction",
                format!("must be within 0..0.5, got {}", a.broadcast_fraction),
            ));
        }
        if !(1..=31).contains(&a.retention_days) {
            return Err(ConfigError::invalid(
                "aggregator.retention_days",
                "must be between 1 and 31",
            ));
        }
        for (i, peer) in a.peers.iter().enumerate() {
            let rest = peer.strip_prefix("http://").unwrap_or("");
            if rest.is_empty() || rest.contains(char::is_whitespace) {
                return Err(ConfigError::invalid(
                    format!("aggregator.peers[{i}]"),
                    format!("{peer:?} is not an http:// URL of an aggregator's API"),
                ));
            }
        }
        Ok(())
    }
}

fn names<V>(m: &BTreeMap<String, V>) -> String {
    m.keys().cloned().collect::<Vec<_>>().join(", ")
}

fn full_override(at: &str, o: &LimitOverride) -> Result<Limit, ConfigError> {
    let limit = o.limit.ok_or_else(|| {
        ConfigError::invalid(
            format!("{at}.limit"),
            "required: the plan has no such tier to override",
        )
    })?;
    let window = o.window.ok_or_else(|| {
        ConfigError::invalid(
            format!("{at}.window"),
            "required: the plan has no such tier to override",
        )
    })?;
    Ok(Limit {
        limit,
        window_ms: window.as_millis() as u64,
        algorithm: o.algorithm.unwrap_or(Algorithm::SlidingWindow),
        burst: o.burst.unwrap_or(limit),
    })
}

fn check_policy(at: &str, p: &Policy) -> Result<(), ConfigError> {
    for (tier, l) in [("node", &p.node), ("region", &p.region)] {
        let Some(l) = l else { continue };
        let key = |k: &str| format!("{at}.{tier}.{k}");
        if l.limit == 0 || l.limit > MAX_LIMIT {
            return Err(ConfigError::invalid(
                key("limit"),
                format!("must be between 1 and {MAX_LIMIT}"),
            ));
        }
        if l.window_ms == 0 || l.window_ms > MAX_WINDOW.as_millis() as u64 {
            return Err(ConfigError::invalid(
                key("window"),
                "must be between 1ms and 7d",
            ));
        }
        match l.algorithm {
            Algorithm::SlidingLog if l.limit > MAX_SLIDING_LOG_LIMIT => {
                return Err(ConfigError::invalid(
                    key("limit"),
                    format!(
                        "sliding_log keeps one entry per unit; limit {} exceeds {MAX_SLIDING_LOG_LIMIT} (use sliding_window)",
                        l.limit
                    ),
                ))
            }
            Algorithm::TokenBucket => {
                if l.burst == 0 || l.burst > MAX_LIMIT {
                    return Err(ConfigError::invalid(key("burst"), format!("must be between 1 and {MAX_LIMIT}")));
                }
                // GCRA works in whole microseconds per unit.
                if l.window_ms.saturating_mul(1000) / l.limit == 0 {
                    return Err(ConfigError::invalid(
                        key("limit"),
                        "more than one unit per microsecond cannot be expressed; lengthen the window",
                    ));
                }
            }
            _ if l.burst != l.limit => {
                return Err(ConfigError::invalid(key("burst"), "only token_bucket takes a burst"));
            }
            _ => {}
        }
    }
    if let Some(g) = p.global {
        if g == 0 || g > MAX_LIMIT {
            return Err(ConfigError::invalid(
                format!("{at}.global.limit"),
                format!("must be between 1 and {MAX_LIMIT}"),
            ));
        }
    }
    for t in &p.global_periods {
        if t.limit == 0 || t.limit > MAX_LIMIT {
            return Err(ConfigError::invalid(
                format!("{at}.global.{}", t.kind),
                format!("must be between 1 and {MAX_LIMIT}"),
            ));
        }
    }
    Ok(())
}

/// The global limits of `table` over `inherited` (a tenant's override
/// names some kinds; the plan's others stay), hour → month.
fn global_limits(
    table: Option<&GlobalLimitConfig>,
    inherited: &[(PeriodKind, u64)],
) -> Vec<(PeriodKind, u64)> {
    PeriodKind::ALL
        .into_iter()
        .filter_map(|kind| {
            let limit = table
                .and_then(|t| t.of(kind))
                .or_else(|| inherited.iter().find(|t| t.0 == kind).map(|t| t.1))?;
            Some((kind, limit))
        })
        .collect()
}

/// A `time_zone` key's zone (`at` names the key).
fn time_zone(at: &str, name: Option<&str>) -> Result<Zone, ConfigError> {
    match name {
        None => Ok(Zone::UTC),
        Some(n) => Zone::named(n).map_err(|e| ConfigError::invalid(at, e.to_string())),
    }
}

/// An hour tier counts the zone's clock hours, which have one length only
/// where the zone never shifts by part of an hour.
fn check_zone(at: &str, p: &Policy) -> Result<(), ConfigError> {
    let hourly = p.global_periods.iter().any(|t| t.kind == PeriodKind::Hour);
    if hourly && !p.time_zone.has_whole_hour_shifts() {
        return Err(ConfigError::invalid(
            at,
            format!(
                "{} shifts its clocks by part of an hour, so its clock hours differ in length: \
                 an hour tier cannot count in it (count the hour in UTC, or drop the hour tier)",
                p.time_zone
            ),
        ));
    }
    Ok(())
}

/// Applies one `TIERLIMIT__A__B__C=value` variable to the TOML tree.
///
/// Path segments are lower-cased; `__` separates them so that keys with a
/// single underscore (`redis_url`) survive. The value is read as a TOML value
/// when it parses as one (`42`, `true`, `"x"`), else taken as a plain string.
fn apply_env_override(tree: &mut toml::Table, var: &str, value: &str) -> Result<(), ConfigError> {
    let Some(rest) = var.strip_prefix("TIERLIMIT__") else {
        return Ok(());
    };
    let path: Vec<String> = rest.split("__").map(|s| s.to_ascii_lowercase()).collect();
    if path.iter().any(|s| s.is_empty()) {
        return Err(ConfigError::Env {
            var: var.into(),
            reason: "empty path segment".into(),
        });
    }
    let parsed = format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let mut node = tree;
    for seg in &path[..path.len() - 1] {
        let entry = node
            .entry(seg.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        node = entry.as_table_mut().ok_or_else(|| ConfigError::Env {
            var: var.into(),
            reason: format!("`{seg}` is not a table"),
        })?;
    }
    node.insert(path[path.len() - 1].clone(), parsed);
    Ok(())
}
