//! `loadgen deltas`: simulated regions publishing wire-v2 deltas straight to
//! `tierlimit.deltas`, as their region-nodes would.
//!
//! Each record is built with the project's own code: a `Delta` keyed by
//! `Delta::key` (`tenant|day|actor|node`), sent to the partition
//! `partition_of` gives, encoded and HMAC-signed by the `DeltaSigner` the
//! configuration gives each simulated region (so the aggregator verifies
//! it with the keys it lists), through a producer configured as the
//! publisher's (`ordered_producer_config`).
//!
//! The tenant mix ([`Mix`]): `N` tenants, a fraction of them *near* their
//! global limit (named `{near_prefix}0 …`), the rest *far* from it
//! (`{far_prefix}0 …`). The plan ([`Plan`]) of a phase:
//!
//! - `far`: every far tenant gets one delta per round from one simulated
//!   region (round-robin over the regions), its count one unit more each
//!   round: a tenant seen today, far from its limit.
//! - `near`: every near tenant gets one delta per round from **every**
//!   simulated region, the regions together holding `near_share` of its
//!   global limit from the first round (at least the broadcast threshold,
//!   so the aggregator broadcasts it), each part one unit more each round.
//!   A tenant's records are adjacent, as regions flushing at the same time
//!   would send them.
//!
//! Records go out at `--rate` records/s (0: as fast as the broker takes
//! them), at most `--max-seconds` long; the JSON summary says what was sent
//! and delivered.

use std::collections::VecDeque;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use clap::{Args, ValueEnum};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use serde_json::json;
use tierlimit_shared::config::Loaded;
use tierlimit_shared::messages::{actor, now_ms, partition_of, Delta};
use tierlimit_shared::wire::DeltaSigner;
use tierlimit_shared::Config;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Phase {
    /// Far tenants, one simulated region each.
    Far,
    /// Near tenants, every simulated region.
    Near,
}

#[derive(Debug, Args)]
pub struct DeltaArgs {
    /// The tierlimit configuration the aggregator runs with: brokers,
    /// topic, partitions, the regions' delta keys, tenants' limits.
    #[arg(long)]
    pub config: PathBuf,
    /// The simulated regions, comma-separated (each must be in the
    /// configuration's `[regions]` with a `wire.delta_keys` entry).
    #[arg(long, value_delimiter = ',', required = true)]
    pub regions: Vec<String>,
    /// Tenants in all (near and far).
    #[arg(long)]
    pub tenants: u64,
    /// Fraction of them near their global limit.
    #[arg(long, default_value_t = 0.01)]
    pub near_fraction: f64,
    #[arg(long, default_value = "n")]
    pub near_prefix: String,
    #[arg(long, default_value = "f")]
    pub far_prefix: String,
    #[arg(long, value_enum)]
    pub phase: Phase,
    /// Rounds over the phase's tenants.
    #[arg(long, default_value_t = 1)]
    pub rounds: u64,
    /// Share of its global limit a near tenant's simulated parts hold
    /// together from the first round (≥ `aggregator.broadcast_fraction`,
    /// below the limit).
    #[arg(long, default_value_t = 0.4)]
    pub near_share: f64,
    /// Records per second (0: unpaced).
    #[arg(long, default_value_t = 5000.0)]
    pub rate: f64,
    /// Stop after this many seconds even if the rounds are not done.
    #[arg(long, default_value_t = 600.0)]
    pub max_seconds: f64,
    /// Seed of the simulated regions' epochs (the same seed gives the same
    /// actors, so phases run one after the other extend the same counters).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long, default_value = "")]
    pub label: String,
    /// Write the JSON summary here as well as to stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The tenant mix: `tenants` in all, `near` of them near their limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mix {
    pub tenants: u64,
    pub near: u64,
    pub near_prefix: String,
    pub far_prefix: String,
}

impl Mix {
    /// `round(tenants × near_fraction)` near tenants (at least one when the
    /// fraction is positive and there are tenants).
    pub fn new(tenants: u64, near_fraction: f64, near_prefix: &str, far_prefix: &str) -> Mix {
        let mut near = ((tenants as f64) * near_fraction.clamp(0.0, 1.0)).round() as u64;
        if near == 0 && near_fraction > 0.0 && tenants > 0 {
            near = 1;
        }
        Mix {
            tenants,
            near: near.min(tenants),
            near_prefix: near_prefix.into(),
            far_prefix: far_prefix.into(),
        }
    }

    pub fn far(&self) -> u64 {
        self.tenants - self.near
    }

    pub fn near_name(&self, i: u64) -> String {
        format!("{}{i}", self.near_prefix)
    }

    pub fn far_name(&self, j: u64) -> String {
        format!("{}{j}", self.far_prefix)
    }
}

/// One record of a plan: tenant, the index of its simulated region, the
/// cumulative count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub tenant: String,
    pub region: usize,
    pub p: u64,
}

/// What one phase sends, in order.
#[derive(Debug, Clone)]
pub struct Plan {
    pub mix: Mix,
    pub regions: usize,
    pub phase: Phase,
    pub rounds: u64,
    /// Near: each simulated part's count in round 0.
    pub near_p0: u64,
}

impl Plan {
    /// The plan of `phase` over `regions` simulated regions; a near
    /// tenant's parts hold `near_share × limit` together in round 0, which
    /// must reach `threshold` (the aggregator's broadcast threshold for
    /// `limit`) and, after every round, stay below the limit.
    pub fn new(
        mix: Mix,
        regions: usize,
        phase: Phase,
        rounds: u64,
        near_share: f64,
        limit: Option<u64>,
        threshold: u64,
    ) -> anyhow::Result<Plan> {
        ensure!(regions > 0, "no simulated region");
        let mut near_p0 = 0;
        if phase == Phase::Near && mix.near > 0 {
            let Some(limit) = limit else {
                bail!("near tenants need a global limit (their policy has none)");
            };
            let total = (near_share * limit as f64).ceil() as u64;
            near_p0 = total.div_ceil(regions as u64);
            let first = near_p0 * regions as u64;
            ensure!(
                first >= threshold,
                "near tenants' parts ({first}) stay below the broadcast threshold {threshold}: raise --near-share"
            );
            let last = (near_p0 + rounds.saturating_sub(1)) * regions as u64;
            ensure!(
                last < limit,
                "near tenants' parts ({last}) would reach their limit {limit}: lower --near-share"
            );
        }
        Ok(Plan {
            mix,
            regions,
            phase,
            rounds,
            near_p0,
        })
    }

    /// Records per round.
    pub fn per_round(&self) -> u64 {
        match self.phase {
            Phase::Far => self.mix.far(),
            Phase::Near => self.mix.near * self.regions as u64,
        }
    }

    pub fn len(&self) -> u64 {
        self.per_round() * self.rounds
    }

    /// Every record, round by round.
    pub fn records(&self) -> impl Iterator<Item = Planned> + '_ {
        (0..self.rounds).flat_map(move |round| self.round(round))
    }

    /// The records of round `round` (0-based).
    fn round(&self, round: u64) -> Box<dyn Iterator<Item = Planned> + '_> {
        match self.phase {
            Phase::Far => Box::new((0..self.mix.far()).map(move |j| Planned {
                tenant: self.mix.far_name(j),
                region: (j % self.regions as u64) as usize,
                p: round + 1,
            })),
            Phase::Near => Box::new((0..self.mix.near).flat_map(move |i| {
                let tenant = self.mix.near_name(i);
                (0..self.regions).map(move |region| Planned {
                    tenant: tenant.clone(),
                    region,
                    p: self.near_p0 + round,
                })
            })),
        }
    }
}

/// A simulated region's epoch: 16 hex digits like a region-node's, fixed
/// by the seed and the region's name.
pub fn epoch(seed: u64, region: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in region.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// One simulated region: its actor, publishing node and signer.
pub struct SimRegion {
    pub actor: String,
    pub node: String,
    pub signer: DeltaSigner,
}

impl SimRegion {
    pub fn new(config: &Loaded, name: &str, seed: u64) -> anyhow::Result<SimRegion> {
        ensure!(
            config.config.regions.contains_key(name),
            "region {name:?} is not in the configuration's [regions]"
        );
        let signer = DeltaSigner::new(&config.config, name)
            .map_err(|e| anyhow::anyhow!("region {name}: {e}"))?;
        Ok(SimRegion {
            actor: actor(name, &epoch(seed, name)),
            node: format!("{name}-sim"),
            signer,
        })
    }

    /// The delta of `p` for `tenant` and `day`: its Kafka key, partition and
    /// signed record, as a node of this region publishes it.
    pub fn record(
        &self,
        tenant: &str,
        day: u32,
        p: u64,
        partitions: i32,
    ) -> (String, i32, Vec<u8>) {
        let d = Delta::new(tenant, day, self.actor.clone(), p, 0, now_ms()).from_node(&self.node);
        (
            d.key(),
            partition_of(tenant, partitions),
            self.signer.encode(&d),
        )
    }
}

/// Runs the phase and prints its summary.
pub fn run(args: DeltaArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config)
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.config.display()))?;
    let mix = Mix::new(
        args.tenants,
        args.near_fraction,
        &args.near_prefix,
        &args.far_prefix,
    );
    let limit = config.policy(&mix.near_name(0)).and_then(|p| p.global);
    let threshold = limit.map_or(0, |l| config.config.aggregator.broadcast_threshold(l));
    let plan = Plan::new(
        mix,
        args.regions.len(),
        args.phase,
        args.rounds,
        args.near_share,
        limit,
        threshold,
    )?;
    let regions = args
        .regions
        .iter()
        .map(|r| SimRegion::new(&config, r, args.seed))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let kafka = &config.config.kafka;
    let mut cc = tierlimit_shared::kafka::ordered_producer_config(kafka);
    cc.set("message.timeout.ms", "300000")
        .set("queue.buffering.max.messages", "200000");
    let producer: FutureProducer = cc.create().context("Kafka producer")?;
    let day = tierlimit_shared::day::today();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let started = Instant::now();
    let sent = rt.block_on(send_all(
        &producer,
        &kafka.deltas_topic,
        kafka.partitions,
        &plan,
        &regions,
        day,
        args.rate,
        Duration::from_secs_f64(args.max_seconds),
    ))?;
    producer
        .flush(Timeout::After(Duration::from_secs(60)))
        .context("flush the producer")?;
    let elapsed = started.elapsed().as_secs_f64();
    let summary = json!({
        "label": args.label,
        "phase": format!("{:?}", args.phase).to_lowercase(),
        "tenants": plan.mix.tenants,
        "near": plan.mix.near,
        "far": plan.mix.far(),
        "regions": args.regions,
        "rounds": plan.rounds,
        "near_p0": plan.near_p0,
        "limit": limit,
        "broadcast_threshold": threshold,
        "planned": plan.len(),
        "sent": sent.sent,
        "delivered": sent.delivered,
        "failed": sent.failed,
        "bytes": sent.bytes,
        "elapsed_s": elapsed,
        "rate_asked": args.rate,
        "rate_achieved": sent.delivered as f64 / elapsed.max(1e-9),
        "completed": sent.sent == plan.len(),
    });
    let text = serde_json::to_string_pretty(&summary)?;
    if let Some(out) = &args.out {
        std::fs::write(out, format!("{text}\n"))
            .with_context(|| format!("write {}", out.display()))?;
    }
    writeln!(std::io::stdout().lock(), "{text}")?;
    ensure!(
        sent.failed == 0,
        "{} deltas were not delivered",
        sent.failed
    );
    Ok(())
}

#[derive(Debug, Default)]
struct Sent {
    sent: u64,
    delivered: u64,
    failed: u64,
    /// Key and value bytes of the records sent.
    bytes: u64,
}

/// Deliveries awaited at most this far behind the sends.
const IN_FLIGHT: usize = 50_000;

#[allow(clippy::too_many_arguments)]
async fn send_all(
    producer: &FutureProducer,
    topic: &str,
    partitions: i32,
    plan: &Plan,
    regions: &[SimRegion],
    day: u32,
    rate: f64,
    bound: Duration,
) -> anyhow::Result<Sent> {
    let mut s = Sent::default();
    let mut pending: VecDeque<DeliveryFuture> = VecDeque::new();
    let started = Instant::now();
    for planned in plan.records() {
        if started.elapsed() >= bound {
            break;
        }
        // Pacing: record i goes out no earlier than i / rate seconds in.
        if rate > 0.0 && s.sent % 64 == 0 {
            let due = started + Duration::from_secs_f64(s.sent as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let region = &regions[planned.region];
        let (key, partition, payload) = region.record(&planned.tenant, day, planned.p, partitions);
        s.bytes += (key.len() + payload.len()) as u64;
        loop {
            let record = FutureRecord::to(topic)
                .partition(partition)
                .key(&key)
                .payload(&payload);
            match producer.send_result(record) {
                Ok(f) => {
                    pending.push_back(f);
                    break;
                }
                // The local queue is full: wait for the oldest delivery.
                Err((e, _)) => match pending.pop_front() {
                    Some(f) => settle(&mut s, f.await),
                    None => bail!("produce: {e}"),
                },
            }
        }
        s.sent += 1;
        while pending.len() > IN_FLIGHT {
            let f = pending.pop_front().expect("not empty");
            settle(&mut s, f.await);
        }
    }
    for f in pending {
        settle(&mut s, f.await);
    }
    Ok(s)
}

fn settle<E>(s: &mut Sent, r: Result<rdkafka::producer::future_producer::OwnedDeliveryResult, E>) {
    match r {
        Ok(Ok(_)) => s.delivered += 1,
        _ => s.failed += 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierlimit_shared::wire::keys;
    use tierlimit_shared::wire::DeltaVerifier;

    fn mix() -> Mix {
        Mix::new(1000, 0.01, "n", "f")
    }

    #[test]
    fn the_mix_has_one_percent_near() {
        let m = mix();
        assert_eq!((m.near, m.far()), (10, 990));
        assert_eq!(m.near_name(3), "n3");
        assert_eq!(m.far_name(0), "f0");
        assert_eq!(Mix::new(50, 0.01, "n", "f").near, 1);
        assert_eq!(Mix::new(0, 0.01, "n", "f").near, 0);
        assert_eq!(Mix::new(10, 0.0, "n", "f").near, 0);
    }

    #[test]
    fn far_tenants_take_one_region_each_round_robin() {
        let plan = Plan::new(mix(), 19, Phase::Far, 2, 0.4, Some(1000), 250).unwrap();
        assert_eq!(plan.len(), 2 * 990);
        let all: Vec<Planned> = plan.records().collect();
        assert_eq!(all.len() as u64, plan.len());
        assert_eq!(
            all[20],
            Planned {
                tenant: "f20".into(),
                region: 1,
                p: 1
            }
        );
        // The second round counts one more for the same tenants.
        assert_eq!(all[990 + 20].p, 2);
        assert_eq!(all[990 + 20].tenant, "f20");
        // Every region gets its share.
        for r in 0..19 {
            assert!(all.iter().filter(|p| p.region == r).count() >= 2 * (990 / 19));
        }
    }

    #[test]
    fn near_tenants_are_in_every_region_past_the_threshold() {
        let limit = 1_000_000;
        let plan = Plan::new(mix(), 19, Phase::Near, 3, 0.4, Some(limit), 250_000).unwrap();
        assert_eq!(plan.len(), 3 * 10 * 19);
        let all: Vec<Planned> = plan.records().collect();
        // A tenant's records are adjacent, one per region.
        assert!(all[..19].iter().all(|p| p.tenant == "n0"));
        assert_eq!(
            all[..19].iter().map(|p| p.region).collect::<Vec<_>>(),
            (0..19).collect::<Vec<_>>()
        );
        // Round 0: together at least the share (hence the threshold).
        let first: u64 = all[..19].iter().map(|p| p.p).sum();
        assert!((400_000..400_000 + 19).contains(&first), "{first}");
        // Each round one unit more per part, still below the limit.
        let last: u64 = all[all.len() - 19..].iter().map(|p| p.p).sum();
        assert_eq!(last, first + 2 * 19);
        assert!(last < limit);
    }

    #[test]
    fn near_plans_that_would_not_be_broadcast_or_would_pass_the_limit_are_refused() {
        // Below the threshold: never broadcast, not near.
        assert!(Plan::new(mix(), 19, Phase::Near, 1, 0.1, Some(1000), 250).is_err());
        // At the limit.
        assert!(Plan::new(mix(), 19, Phase::Near, 1, 1.0, Some(1000), 250).is_err());
        // No global limit.
        assert!(Plan::new(mix(), 19, Phase::Near, 1, 0.4, None, 0).is_err());
        // Far tenants need none.
        assert!(Plan::new(mix(), 19, Phase::Far, 1, 0.4, None, 0).is_ok());
    }

    #[test]
    fn epochs_look_like_a_nodes_and_differ_by_region() {
        let e = epoch(1, "r01");
        assert_eq!(e.len(), 16);
        assert!(e
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(e, epoch(1, "r01"));
        assert_ne!(e, epoch(1, "r02"));
        assert_ne!(e, epoch(2, "r01"));
    }

    /// A configuration with the regions' delta keys, as the aggregator's.
    fn config(regions: &[&str]) -> Loaded {
        let mut s =
            String::from("cluster = \"t\"\n[kafka]\nbrokers = \"127.0.0.1:1\"\npartitions = 8\n");
        for r in regions {
            s.push_str(&format!(
                "[regions.{r}]\nredis_url = \"redis://127.0.0.1:1\"\n"
            ));
        }
        s.push_str("[plans.p]\nglobal = { limit = 1000 }\n[unknown_tenants]\npolicy = \"plan\"\nplan = \"p\"\n");
        let (private, public) = keys::ed25519_pair_from_seed([5; 32]);
        s.push_str(&format!(
            "[wire]\nbroadcast_key = \"a\"\nbroadcast_private_key = \"{private}\"\n[wire.broadcast_public_keys]\na = \"{public}\"\n"
        ));
        for (i, r) in regions.iter().enumerate() {
            let secret = keys::encode(&[i as u8 + 1; 32]);
            s.push_str(&format!(
                "[wire.delta_keys.{r}]\nsign_with = \"{r}-k\"\nkeys = {{ {r}-k = \"{secret}\" }}\n"
            ));
        }
        Config::from_toml(&s).unwrap_or_else(|e| panic!("{e}\n{s}"))
    }

    #[test]
    fn records_are_signed_keyed_and_partitioned_as_a_region_nodes() {
        let cfg = config(&["eu", "r01", "r02"]);
        let verifier = DeltaVerifier::new(&cfg.config).unwrap();
        let r01 = SimRegion::new(&cfg, "r01", 7).unwrap();
        let (key, partition, bytes) = r01.record("n3", 20_000, 42, 8);
        let d = verifier.decode(&bytes).expect("the aggregator accepts it");
        assert_eq!(d.tenant, "n3");
        assert_eq!((d.period.index, d.p, d.n), (20_000, 42, 0));
        assert_eq!(d.actor, format!("r01/{}", epoch(7, "r01")));
        assert_eq!(key, d.key());
        assert_eq!(key, format!("n3|20000|r01/{}|r01-sim", epoch(7, "r01")));
        assert_eq!(partition, partition_of("n3", 8));
        assert_eq!(bytes[0], tierlimit_shared::wire::codec::V3);
        // Another region's key does not vouch for r01's actor.
        let mut other = SimRegion::new(&cfg, "r02", 7).unwrap();
        other.actor = r01.actor.clone();
        let (_, _, forged) = other.record("n3", 20_000, 43, 8);
        assert!(verifier.decode(&forged).is_err());
        // A region the configuration does not list is refused.
        assert!(SimRegion::new(&cfg, "r09", 7).is_err());
    }
}
