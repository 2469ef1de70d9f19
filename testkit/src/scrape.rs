//! Reading what servers say: JSON over HTTP and Prometheus text.

/// GETs `url` and parses its JSON body; panics naming the URL if either
/// fails (a test's precondition, not its subject).
pub async fn get_json(http: &reqwest::Client, url: &str) -> serde_json::Value {
    http.get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: not JSON: {e}"))
}

/// GETs a Prometheus endpoint and sums metric `name` over its label sets
/// (see [`metric_value`]).
pub async fn scrape_metric(http: &reqwest::Client, url: &str, name: &str) -> f64 {
    let text = http
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .text()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    metric_value(&text, name)
}

/// GETs `url` and returns its body; panics naming the URL if that fails.
pub async fn get_text(http: &reqwest::Client, url: &str) -> String {
    try_text(http, url)
        .await
        .unwrap_or_else(|| panic!("GET {url}: no answer or no text body"))
}

/// GETs `url` and parses its JSON body, or `None` if either fails: for
/// polling (see [`try_text`]).
pub async fn try_json(http: &reqwest::Client, url: &str) -> Option<serde_json::Value> {
    http.get(url).send().await.ok()?.json().await.ok()
}

/// GETs `url` and returns its body, or `None` if the request fails: for
/// polling a server that may be down (a wait condition), where
/// [`get_json`]'s panic would end the wait.
pub async fn try_text(http: &reqwest::Client, url: &str) -> Option<String> {
    http.get(url).send().await.ok()?.text().await.ok()
}

/// Sum of every sample of metric `name` (exact name, any labels) in a
/// Prometheus text exposition; 0 if absent.
pub fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The value of one sample of a Prometheus text exposition, named exactly
/// as written, labels included (`x_total`, or `x_total{reason="future"}`);
/// `None` if there is no such line. Unlike [`metric_value`] it tells an
/// absent metric from a zero.
pub fn metric_sample(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == sample).then(|| value.parse::<f64>().ok())?
        })
        .next_back()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sample_matches_name_and_labels_exactly() {
        let text = "# TYPE x_total counter\nx_total{reason=\"future\"} 2\nx_total{reason=\"expired\"} 3\ny 0\n";
        assert_eq!(
            metric_sample(text, "x_total{reason=\"expired\"}"),
            Some(3.0)
        );
        assert_eq!(metric_sample(text, "y"), Some(0.0));
        assert_eq!(metric_sample(text, "x_total"), None);
    }

    #[test]
    fn metric_value_sums_label_sets_of_the_exact_name() {
        let text = "# HELP x_total x\nx_total{a=\"1\"} 2\nx_total{a=\"2\"} 3\nx_total_other 7\n";
        assert_eq!(metric_value(text, "x_total"), 5.0);
        assert_eq!(metric_value(text, "absent"), 0.0);
    }
}
