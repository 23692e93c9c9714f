//! Benchmark charts, drawn with plotters into SVG text: grouped bars (TTFT p50/p90/p99
//! per router) and line charts (a TTFT CDF per router, requests per second per worker
//! over time, a share over time per router in the scenario suite).
//!
//! Owns only chart drawing (deterministic output for the same input). It must not read
//! reports from disk or run anything.

use plotters::coord::ranged1d::SegmentValue;
pub use plotters::prelude::SeriesLabelPosition;
use plotters::prelude::*;

/// One group of bars: a router label and its values (same order as the series names).
#[derive(Debug, Clone, PartialEq)]
pub struct BarGroup {
    /// Label under the group.
    pub label: String,
    /// One value per series.
    pub values: Vec<f64>,
}

/// One line of a line chart: a label and `(x, y)` points in x order.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// An axis maximum a little above the largest finite value (1 when there is none).
fn axis_max(values: impl Iterator<Item = f64>) -> f64 {
    let max = values.filter(|v| v.is_finite()).fold(0.0, f64::max);
    if max > 0.0 {
        max * 1.08
    } else {
        1.0
    }
}

/// Draws into an SVG string; a drawing error (which the SVG backend does not produce
/// for finite input) leaves whatever was drawn so far.
fn svg(size: (u32, u32), draw: impl FnOnce(SvgArea<'_>) -> Result<(), String>) -> String {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        if let Err(e) = draw(root) {
            tracing::warn!("chart not fully drawn: {e}");
        }
    }
    out
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

type SvgArea<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// A white page with the chart's title; the chart goes in what is left.
fn titled<'a>(root: SvgArea<'a>, title: &str) -> Result<SvgArea<'a>, String> {
    root.fill(&WHITE).map_err(err)?;
    root.titled(title, ("sans-serif", 20)).map_err(err)
}

/// Every chart's frame: the subtitle as caption, margins, axis label areas.
fn frame<'a, 'b>(
    area: &'a SvgArea<'b>,
    subtitle: &'a str,
    x_label_area: u32,
) -> ChartBuilder<'a, 'a, SVGBackend<'b>> {
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(subtitle, ("sans-serif", 13))
        .margin(12)
        .x_label_area_size(x_label_area)
        .y_label_area_size(64);
    builder
}

fn draw_legend<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

/// A grouped bar chart: one group per router, one bar per series.
pub fn grouped_bars_svg(
    title: &str,
    subtitle: &str,
    y_label: &str,
    series: &[&str],
    groups: &[BarGroup],
) -> String {
    // Each group takes one unit per series plus one for the gap after it.
    let per_group = series.len().max(1) as u32 + 1;
    let units = (groups.len().max(1) as u32) * per_group;
    let width = (groups.len() as u32 * per_group * 44 + 120).max(640);
    // Headroom above the tallest bar for the legend.
    let vmax = 1.25 * axis_max(groups.iter().flat_map(|g| g.values.iter().copied()));
    svg((width, 480), |root| {
        let root = titled(root, title)?;
        let mut chart = frame(&root, subtitle, 40)
            .build_cartesian_2d((0..units).into_segmented(), 0f64..vmax)
            .map_err(err)?;
        let label_of = |v: &SegmentValue<u32>| -> String {
            match v {
                SegmentValue::CenterOf(u) if u % per_group == (per_group - 1) / 2 => groups
                    .get((u / per_group) as usize)
                    .map(|g| g.label.clone())
                    .unwrap_or_default(),
                _ => String::new(),
            }
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(units as usize)
            .x_label_formatter(&label_of)
            .x_label_style(("sans-serif", 13))
            .y_desc(y_label)
            .draw()
            .map_err(err)?;
        for (si, name) in series.iter().enumerate() {
            let c = color(si);
            let bars = groups.iter().enumerate().filter_map(move |(gi, g)| {
                let v = *g.values.get(si)?;
                let u = gi as u32 * per_group + si as u32;
                v.is_finite().then(|| {
                    Rectangle::new(
                        [
                            (SegmentValue::Exact(u), 0.0),
                            (SegmentValue::Exact(u + 1), v),
                        ],
                        c.filled(),
                    )
                })
            });
            chart
                .draw_series(bars)
                .map_err(err)?
                .label(*name)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        root.present().map_err(err)
    })
}

/// A line chart, with an optional dashed vertical marker (e.g. when the fleet changed)
/// and the legend where the lines are not (a CDF's lower right, a share's upper right).
pub fn line_chart_svg(
    title: &str,
    subtitle: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
    marker_x: Option<f64>,
    legend: SeriesLabelPosition,
) -> String {
    let points = || lines.iter().flat_map(|l| l.points.iter());
    let xmax = axis_max(points().map(|p| p.0).chain(marker_x));
    let ymax = axis_max(points().map(|p| p.1));
    svg((760, 480), |root| {
        let root = titled(root, title)?;
        let mut chart = frame(&root, subtitle, 44)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(y_label)
            .draw()
            .map_err(err)?;
        if let Some(x) = marker_x {
            chart
                .draw_series(DashedLineSeries::new(
                    [(x, 0.0), (x, ymax)],
                    6,
                    4,
                    BLACK.stroke_width(1),
                ))
                .map_err(err)?;
        }
        for (i, line) in lines.iter().enumerate() {
            let c = color(i);
            let finite = line
                .points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite());
            chart
                .draw_series(LineSeries::new(finite, c.stroke_width(2)))
                .map_err(err)?
                .label(line.label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                });
        }
        draw_legend(&mut chart, legend)?;
        root.present().map_err(err)
    })
}

/// `(value, share of values ≤ it)` for a cumulative distribution, at most `max_points`
/// points (evenly spaced ranks, always including the largest value).
pub fn cdf_points(values: &[f64], max_points: usize) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(max_points.max(1));
    let mut out: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (v[i], (i + 1) as f64 / n as f64))
        .collect();
    if out.last().map(|p| p.1) != Some(1.0) {
        out.push((v[n - 1], 1.0));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_are_drawn_with_labels_and_legend() {
        let svg = grouped_bars_svg(
            "TTFT",
            "sub",
            "ms",
            &["p50", "p90", "p99"],
            &[
                BarGroup {
                    label: "round_robin".into(),
                    values: vec![10.0, 20.0, 30.0],
                },
                BarGroup {
                    label: "a<b".into(),
                    values: vec![1.0, 2.0, f64::NAN],
                },
            ],
        );
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in ["round_robin", "p50", "p90", "p99", "TTFT"] {
            assert!(svg.contains(text), "{text} missing");
        }
        assert!(svg.contains("a&lt;b"));
        assert!(!svg.contains(">a<b<"));
        // Five finite values: five filled bars in the series colours, plus three legend
        // swatches.
        let bars = PALETTE[..3]
            .iter()
            .map(|c| {
                svg.matches(&format!("fill=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2))
                    .count()
            })
            .sum::<usize>();
        assert_eq!(bars, 5 + 3, "{svg}");
    }

    #[test]
    fn line_chart_has_every_line_and_the_marker() {
        let svg = line_chart_svg(
            "share",
            "sub",
            "s",
            "%",
            &[
                Line {
                    label: "kv_aware".into(),
                    points: vec![(0.0, 10.0), (1.0, 50.0)],
                },
                Line {
                    label: "round_robin".into(),
                    points: vec![(0.0, 50.0), (1.0, f64::NAN)],
                },
            ],
            Some(0.5),
            SeriesLabelPosition::UpperRight,
        );
        assert!(svg.contains("kv_aware") && svg.contains("round_robin"));
        let unmarked = line_chart_svg(
            "share",
            "sub",
            "s",
            "%",
            &[],
            None,
            SeriesLabelPosition::UpperRight,
        );
        let marked = line_chart_svg(
            "share",
            "sub",
            "s",
            "%",
            &[],
            Some(0.5),
            SeriesLabelPosition::UpperRight,
        );
        assert!(
            marked.matches("<polyline").count() > unmarked.matches("<polyline").count() + 2,
            "the marker is drawn as dashes"
        );
    }

    #[test]
    fn cdf_points_end_at_one_and_are_bounded() {
        let values: Vec<f64> = (0..1000).rev().map(f64::from).collect();
        let pts = cdf_points(&values, 100);
        assert!(pts.len() <= 101);
        assert_eq!(pts.first(), Some(&(0.0, 0.001)));
        assert_eq!(pts.last(), Some(&(999.0, 1.0)));
        assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert!(cdf_points(&[], 10).is_empty());
    }
}
