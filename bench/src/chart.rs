//! SVG line charts of named series, for BENCHMARKS.md (written to
//! `benchmarks/` beside it). Generic on purpose: a chart is a title, axis
//! descriptions and series of (x, y) points; later growth curves (memory
//! per tenant over time, say) are one more call.

use std::path::Path;

use anyhow::anyhow;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
        }
    }
}

/// How a chart looks.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    /// Categorical x axis: point `i` is labelled `x_labels[i]` (x values
    /// are then the indices 0, 1, …). Empty: a numeric x axis.
    pub x_labels: Vec<String>,
    /// Logarithmic y axis (values ≤ 0 are left out).
    pub log_y: bool,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draws `series` as lines with markers into the SVG file `path`.
pub fn line_chart(path: &Path, chart: &Chart, series: &[Series]) -> anyhow::Result<()> {
    let series: Vec<Series> = series
        .iter()
        .map(|s| Series {
            name: s.name.clone(),
            points: s
                .points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite() && (!chart.log_y || *y > 0.0))
                .collect(),
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    anyhow::ensure!(
        !series.is_empty(),
        "chart {:?}: nothing to draw",
        chart.title
    );
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (mut y0, mut y1) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if !chart.x_labels.is_empty() {
        x0 = -0.3;
        x1 = chart.x_labels.len() as f64 - 0.7;
    } else if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if chart.log_y {
        y0 /= 1.5;
        y1 *= 1.5;
    } else {
        y0 = y0.min(0.0);
        y1 = if y1 <= y0 { y0 + 1.0 } else { y1 * 1.05 };
    }
    if chart.log_y {
        draw(path, chart, &series, x0..x1, (y0..y1).log_scale())
    } else {
        draw(path, chart, &series, x0..x1, y0..y1)
    }
}

fn draw<Y>(
    path: &Path,
    chart: &Chart,
    series: &[Series],
    x: std::ops::Range<f64>,
    y: Y,
) -> anyhow::Result<()>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let err = |e: &dyn std::fmt::Display| anyhow!("chart {}: {e}", path.display());
    let root = SVGBackend::new(path, (900, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut ctx = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)
        .map_err(|e| err(&e))?;
    let labels = chart.x_labels.clone();
    let fmt_x = move |v: &f64| {
        if labels.is_empty() {
            crate::report::num((v * 100.0).round() / 100.0)
        } else {
            let i = v.round();
            if (v - i).abs() < 1e-6 && i >= 0.0 {
                labels.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        }
    };
    let mut mesh = ctx.configure_mesh();
    mesh.x_desc(chart.x_desc.as_str())
        .y_desc(chart.y_desc.as_str())
        .x_label_formatter(&fmt_x);
    if !chart.x_labels.is_empty() {
        mesh.x_labels(chart.x_labels.len() * 4 + 1);
    }
    mesh.draw().map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        ctx.draw_series(LineSeries::new(
            s.points.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label(s.name.as_str())
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        ctx.draw_series(s.points.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_is_an_svg_with_its_series() {
        let dir = testkit::temp_dir();
        let path = dir.path().join("c.svg");
        let chart = Chart {
            title: "t".into(),
            x_desc: "percentile".into(),
            y_desc: "ms".into(),
            x_labels: vec!["p50".into(), "p99".into()],
            log_y: true,
        };
        line_chart(
            &path,
            &chart,
            &[Series::new("alpha", vec![(0.0, 1.0), (1.0, 10.0)])],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("alpha") && svg.contains("p99"));
        let linear = Chart {
            log_y: false,
            x_labels: vec![],
            ..chart
        };
        line_chart(
            &path,
            &linear,
            &[Series::new("beta", vec![(0.0, 0.0), (5.0, 2.0)])],
        )
        .unwrap();
        assert!(line_chart(&path, &linear, &[]).is_err());
    }
}
