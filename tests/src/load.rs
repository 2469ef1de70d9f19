//! Traffic and observation during a fault: paced per-region load recorded
//! into the [`History`](crate::history::History), and samples of the
//! region-nodes' metrics that the fault checks ask questions of.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::cluster::{Cluster, FOLLOWER_FETCH_WAIT_MS, KAFKA_PORT, PROBE, WATCHED};
use crate::history::{now_us, Client, Outcome};
use crate::metric_value;

impl Cluster {
    // -----------------------------------------------------------------
    // Load
    // -----------------------------------------------------------------

    /// Clients, one per node of `regions` (all regions if empty).
    pub fn clients(&self, regions: &[&str]) -> Vec<Client> {
        self.nodes
            .iter()
            .filter(|n| regions.is_empty() || regions.contains(&n.region.as_str()))
            .map(|n| Client::new(self.history.clone(), &n.region, &n.id, &n.base))
            .collect()
    }

    /// Paced traffic: for each node of `regions` (all if empty), one client
    /// checking `tenant` (cost 1) `rate` times a second; if `refund_every` is
    /// n > 0, every n-th allowed check is followed by a refund of 1.
    pub fn load(&self, tenant: &str, regions: &[&str], rate: f64, refund_every: u32) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for c in self.clients(regions) {
            let (stop, tenant) = (stop.clone(), tenant.to_string());
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut allowed = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    match c.check(&tenant, 1).await {
                        Outcome::Ok { .. } => {
                            allowed += 1;
                            if refund_every > 0 && allowed.is_multiple_of(refund_every) {
                                c.refund(&tenant, 1).await;
                            }
                        }
                        Outcome::Unknown(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                        _ => {}
                    }
                }
            }));
        }
        Load { stop, tasks }
    }

    /// Samples [`WATCHED`] on every node every 200 ms until stopped.
    pub fn sample_metrics(self: &Cluster) -> Sampler {
        self.sample_metrics_and_view(None)
    }

    /// [`Cluster::sample_metrics`], and with `view_of` each node's view of
    /// that tenant's global total (`GET /v1/tenants/{tenant}`,
    /// `global_total`), recorded as [`VIEW_TOTAL`] when the view holds it:
    /// what the node decided with, to compare with the clients' history
    /// (see `history::view_lag_us`) instead of the node's own age metric.
    pub fn sample_metrics_and_view(self: &Cluster, view_of: Option<&str>) -> Sampler {
        let view_of = view_of.map(str::to_string);
        let stop = Arc::new(AtomicBool::new(false));
        let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
        let targets: Vec<(String, String, String)> = self
            .nodes
            .iter()
            .map(|n| (n.name(), n.admin.clone(), n.base.clone()))
            .collect();
        let http = self.http.clone();
        // The nodes stamp their publications with their own (maybe faked) clock.
        let offset_us = self.clock_offset_ms * 1000;
        let (s2, samples2) = (stop.clone(), samples.clone());
        // The views every 100 ms, one task per node: a view changes at
        // every broadcast, faster than the metrics sampler goes round.
        let mut probes = Vec::new();
        let (stop3, samples3) = (stop.clone(), samples.clone());
        let brokers = self.topo.host("core").addr(KAFKA_PORT);
        probes.push(tokio::task::spawn_blocking(move || {
            broker_probe(&brokers, &stop3, &samples3)
        }));
        if let Some(tenant) = view_of {
            for (name, _, api) in &targets {
                let (stop, samples, http) = (stop.clone(), samples.clone(), http.clone());
                let (name, url) = (name.clone(), format!("{api}/v1/tenants/{tenant}"));
                probes.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let t = now_us();
                        if let Some(v) = crate::try_json(&http, &url).await {
                            if let Some(total) = v["global_total"].as_u64() {
                                samples.lock().unwrap().push(Sample {
                                    t_us: t,
                                    node: name.clone(),
                                    metric: VIEW_TOTAL,
                                    value: total as f64,
                                });
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }));
            }
        }
        let task = tokio::spawn(async move {
            while !s2.load(Ordering::Relaxed) {
                for (name, base, _) in &targets {
                    let Ok(r) = http
                        .get(format!("{base}/metrics"))
                        .timeout(Duration::from_millis(500))
                        .send()
                        .await
                    else {
                        continue;
                    };
                    let Ok(text) = r.text().await else { continue };
                    let t = now_us();
                    let mut s = samples2.lock().unwrap();
                    for m in WATCHED {
                        let value = if m == "publish_lag_seconds" {
                            publish_lag(&text, t.saturating_add_signed(offset_us))
                        } else {
                            metric_value(&text, m)
                        };
                        s.push(Sample {
                            t_us: t,
                            node: name.clone(),
                            metric: m,
                            value,
                        });
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Sampler {
            stop,
            samples,
            task: Some(task),
            probes,
        }
    }
}

/// One hop through the real broker, timed by the test's own client: a
/// record produced (no linger) to [`PROBE`] every 100 ms and fetched back
/// with the follower's fetch wait. Recorded as [`BROKER_HOP`] (seconds,
/// node `broker`, at the time it was sent).
///
/// Why: the system under test sends a unit through the broker twice
/// (deltas to the aggregator, the broadcast back), and on a loaded 2-core
/// machine a hop takes far longer than on an idle one. The thresholds that
/// judge the system's lag add what this probe measured to what the
/// configuration allows, so they follow the machine and the broker, never
/// the system's own account of its staleness.
fn broker_probe(brokers: &str, stop: &AtomicBool, samples: &Mutex<Vec<Sample>>) {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
    use std::time::Instant;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "0")
        .set("message.timeout.ms", "5000")
        .create()
        .expect("the probe's producer");
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "partitions-broker-probe")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", FOLLOWER_FETCH_WAIT_MS.to_string())
        .create()
        .expect("the probe's consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(PROBE, 0, Offset::End)
        .expect("the probe's partition");
    consumer.assign(&tpl).expect("the probe's assignment");
    let period = Duration::from_millis(100);
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if Instant::now() >= next {
            let sent = now_us().to_be_bytes();
            // A full queue or a broker away: the next tick tries again.
            let _ = producer.send(BaseRecord::<(), [u8]>::to(PROBE).payload(&sent[..]));
            next += period;
        }
        producer.poll(Duration::ZERO);
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(10)) {
            let arrived = now_us();
            if let Some(sent) = m
                .payload()
                .and_then(|p| <[u8; 8]>::try_from(p).ok())
                .map(u64::from_be_bytes)
            {
                samples.lock().unwrap().push(Sample {
                    t_us: sent,
                    node: "broker".into(),
                    metric: BROKER_HOP,
                    value: arrived.saturating_sub(sent) as f64 / 1e6,
                });
            }
        }
    }
    let _ = producer.flush(Duration::from_millis(100));
}

/// The sample name of [`broker_probe`]'s hops (seconds).
pub const BROKER_HOP: &str = "broker_hop_seconds";

/// The sample name of a node's view of a tenant's global total (see
/// [`Cluster::sample_metrics_and_view`]); its time is when it was asked.
pub const VIEW_TOTAL: &str = "view_global_total";

/// Seconds since the node's last fully acknowledged flush, at `now_us`.
pub fn publish_lag(text: &str, now_us: u64) -> f64 {
    let last_ms = metric_value(text, "tierlimit_last_publish_timestamp_ms");
    if last_ms <= 0.0 {
        return f64::INFINITY;
    }
    (now_us as f64 / 1000.0 - last_ms).max(0.0) / 1000.0
}

/// Paced traffic started by [`Cluster::load`].
pub struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("load task panicked");
        }
    }
}

#[derive(Debug, Clone)]
pub struct Sample {
    pub t_us: u64,
    pub node: String,
    pub metric: &'static str,
    pub value: f64,
}

/// Metric samples taken by [`Cluster::sample_metrics`].
pub struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    task: Option<tokio::task::JoinHandle<()>>,
    probes: Vec<tokio::task::JoinHandle<()>>,
}

impl Sampler {
    pub async fn stop(mut self) -> Samples {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        for p in std::mem::take(&mut self.probes) {
            let _ = p.await;
        }
        Samples(self.samples.lock().unwrap().clone())
    }
}

/// The samples, with the questions the fault checks ask of them.
#[derive(Debug, Clone)]
pub struct Samples(pub Vec<Sample>);

impl Samples {
    fn of<'a>(&'a self, node: &'a str, metric: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.0
            .iter()
            .filter(move |s| s.node == node && s.metric == metric)
    }

    /// Largest value of `metric` on `node` sampled in `[from, to]` (µs).
    pub fn max_in(&self, node: &str, metric: &str, from: u64, to: u64) -> Option<f64> {
        self.of(node, metric)
            .filter(|s| s.t_us >= from && s.t_us <= to)
            .map(|s| s.value)
            .reduce(f64::max)
    }

    /// Median of `metric` on `node` sampled in `[from, to]` (µs): what
    /// the value was most of the time, whatever one stall did to the max.
    pub fn median_in(&self, node: &str, metric: &str, from: u64, to: u64) -> Option<f64> {
        let mut v: Vec<f64> = self
            .of(node, metric)
            .filter(|s| s.t_us >= from && s.t_us <= to)
            .map(|s| s.value)
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }

    /// Smallest value of `metric` on `node` sampled in `[from, to]` (µs).
    pub fn min_in(&self, node: &str, metric: &str, from: u64, to: u64) -> Option<f64> {
        self.of(node, metric)
            .filter(|s| s.t_us >= from && s.t_us <= to)
            .map(|s| s.value)
            .reduce(f64::min)
    }

    /// Last value of `metric` on `node` sampled at or before `at` (µs).
    pub fn at(&self, node: &str, metric: &str, at: u64) -> Option<f64> {
        self.of(node, metric)
            .filter(|s| s.t_us <= at)
            .last()
            .map(|s| s.value)
    }

    /// The last sample of `metric` on `node`.
    pub fn last(&self, node: &str, metric: &str) -> Option<f64> {
        self.of(node, metric).last().map(|s| s.value)
    }

    /// Per node: value before, max during, last value after — for the log.
    pub fn table(&self, metric: &str, fault: (u64, u64)) -> String {
        let mut nodes: BTreeMap<&str, ()> = BTreeMap::new();
        for s in &self.0 {
            nodes.insert(&s.node, ());
        }
        let mut out = format!("{metric} (before / max during fault / last):");
        for n in nodes.keys() {
            out += &format!(
                " {n}={:?}/{:?}/{:?}",
                self.at(n, metric, fault.0),
                self.max_in(n, metric, fault.0, fault.1),
                self.last(n, metric)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(values: &[f64]) -> Samples {
        Samples(
            values
                .iter()
                .enumerate()
                .map(|(i, v)| Sample {
                    t_us: i as u64 * 100,
                    node: "eu/a".into(),
                    metric: "m",
                    value: *v,
                })
                .collect(),
        )
    }

    #[test]
    fn the_median_ignores_one_stall_and_the_window_bounds_it() {
        let s = samples(&[0.5, 0.9, 5.7, 0.4, 0.8]);
        assert_eq!(s.median_in("eu/a", "m", 0, 400), Some(0.8));
        assert_eq!(s.max_in("eu/a", "m", 0, 400), Some(5.7));
        // Only the samples inside the window.
        assert_eq!(s.median_in("eu/a", "m", 200, 400), Some(0.8));
        assert_eq!(s.median_in("eu/a", "m", 150, 250), Some(5.7));
        assert_eq!(s.median_in("eu/b", "m", 0, 400), None);
        assert_eq!(s.median_in("eu/a", "m", 500, 900), None);
    }
}
