//! Hand-written SVG charts: a grouped bar chart (TTFT p50/p90/p99 per router) and a
//! line chart (a share over time per router, for the scenario suite).
//!
//! Owns only SVG text generation (no dependencies, deterministic output). It must not
//! read reports from disk or run anything.

use std::fmt::Write as _;

/// One group of bars: a router label and its values (same order as the series names).
#[derive(Debug, Clone, PartialEq)]
pub struct BarGroup {
    /// Label under the group.
    pub label: String,
    /// One value per series.
    pub values: Vec<f64>,
}

const COLORS: &[&str] = &["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f"];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" axis maximum ≥ `v` (1, 2, 2.5 or 5 × 10^k).
fn nice_max(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let exp = v.log10().floor();
    let base = 10f64.powf(exp);
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * base >= v {
            return m * base;
        }
    }
    10.0 * base
}

/// Render a grouped bar chart as an SVG document.
pub fn grouped_bars_svg(
    title: &str,
    subtitle: &str,
    y_label: &str,
    series: &[&str],
    groups: &[BarGroup],
) -> String {
    let (left, right, top, bottom) = (70.0, 20.0, 70.0, 110.0);
    let group_w = (series.len() as f64 * 22.0 + 24.0).max(60.0);
    let plot_w = (groups.len().max(1) as f64 * group_w).max(560.0);
    let plot_h = 320.0;
    let width = left + plot_w + right;
    let height = top + plot_h + bottom;
    let vmax = nice_max(
        groups
            .iter()
            .flat_map(|g| g.values.iter().copied())
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max),
    );
    let y = |v: f64| top + plot_h - (v.max(0.0) / vmax) * plot_h;
    let mut s = svg_open(width, height, title, subtitle);
    y_grid(&mut s, left, plot_w, vmax, y);
    let _ = writeln!(
        s,
        r#"<text transform="translate(16,{:.0}) rotate(-90)" text-anchor="middle">{}</text>"#,
        top + plot_h / 2.0,
        escape(y_label)
    );
    // Bars.
    let bar_w = 18.0;
    for (gi, g) in groups.iter().enumerate() {
        let gx = left + gi as f64 * group_w + (group_w - series.len() as f64 * (bar_w + 4.0)) / 2.0;
        for (si, v) in g.values.iter().enumerate() {
            if !v.is_finite() {
                continue;
            }
            let x = gx + si as f64 * (bar_w + 4.0);
            let yy = y(*v);
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{yy:.1}" width="{bar_w}" height="{:.1}" fill="{}"><title>{} {}: {:.1}</title></rect>"#,
                (top + plot_h - yy).max(0.0),
                COLORS[si % COLORS.len()],
                escape(&g.label),
                escape(series.get(si).copied().unwrap_or("")),
                v
            );
        }
        let cx = left + gi as f64 * group_w + group_w / 2.0;
        let ly = top + plot_h + 14.0;
        let _ = writeln!(
            s,
            r#"<text x="{cx:.1}" y="{ly:.1}" text-anchor="end" transform="rotate(-35 {cx:.1} {ly:.1})">{}</text>"#,
            escape(&g.label)
        );
    }
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#,
        top + plot_h,
        left + plot_w,
        top + plot_h
    );
    // Legend.
    for (si, name) in series.iter().enumerate() {
        let lx = left + 10.0 + si as f64 * 70.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.0}" y="52" width="10" height="10" fill="{}"/><text x="{:.0}" y="61">{}</text>"#,
            COLORS[si % COLORS.len()],
            lx + 14.0,
            escape(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// One line of a line chart: a label and `(x, y)` points in x order.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Render a line chart as an SVG document, with an optional dashed vertical marker
/// (e.g. when the fleet changed).
pub fn line_chart_svg(
    title: &str,
    subtitle: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
    marker_x: Option<f64>,
) -> String {
    let (left, right, top, bottom) = (70.0, 20.0, 90.0, 60.0);
    let (plot_w, plot_h) = (640.0, 320.0);
    let width = left + plot_w + right;
    let height = top + plot_h + bottom;
    let finite = |v: &f64| v.is_finite();
    let xs = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let xmax = nice_max(xs.filter(finite).fold(0.0, f64::max));
    let ys = lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
    let ymax = nice_max(ys.filter(finite).fold(0.0, f64::max));
    let x = |v: f64| left + (v.max(0.0) / xmax) * plot_w;
    let y = |v: f64| top + plot_h - (v.max(0.0) / ymax) * plot_h;
    let mut s = svg_open(width, height, title, subtitle);
    y_grid(&mut s, left, plot_w, ymax, y);
    for i in 0..=5 {
        let xv = xmax * f64::from(i) / 5.0;
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            x(xv),
            top + plot_h + 16.0,
            fmt_tick(xv)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.0}" y="{:.0}" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        top + plot_h + 36.0,
        escape(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(16,{:.0}) rotate(-90)" text-anchor="middle">{}</text>"#,
        top + plot_h / 2.0,
        escape(y_label)
    );
    if let Some(m) = marker_x.filter(finite) {
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="{top}" x2="{:.1}" y2="{:.1}" stroke="#888" stroke-dasharray="4 4"/>"##,
            x(m),
            x(m),
            top + plot_h
        );
    }
    for (li, line) in lines.iter().enumerate() {
        let pts: Vec<String> = line
            .points
            .iter()
            .filter(|(a, b)| a.is_finite() && b.is_finite())
            .map(|(a, b)| format!("{:.1},{:.1}", x(*a), y(*b)))
            .collect();
        let color = COLORS[li % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"><title>{}</title></polyline>"#,
            pts.join(" "),
            escape(&line.label)
        );
        // Legend: four entries a row.
        let lx = left + 10.0 + (li % 4) as f64 * 160.0;
        let ly = 52.0 + (li / 4) as f64 * 16.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.0}" y="{ly:.0}" width="10" height="10" fill="{color}"/><text x="{:.0}" y="{:.0}">{}</text>"#,
            lx + 14.0,
            ly + 9.0,
            escape(&line.label)
        );
    }
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#,
        top + plot_h,
        left + plot_w,
        top + plot_h
    );
    s.push_str("</svg>\n");
    s
}

/// The SVG's opening tag, white background, title and subtitle.
fn svg_open(width: f64, height: f64, title: &str, subtitle: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{:.0}" y="24" text-anchor="middle" font-size="16">{}</text>"#,
        width / 2.0,
        escape(title)
    );
    let _ = writeln!(
        s,
        r##"<text x="{:.0}" y="42" text-anchor="middle" font-size="11" fill="#555">{}</text>"##,
        width / 2.0,
        escape(subtitle)
    );
    s
}

/// Horizontal grid lines with y ticks at 0, 1/5, …, 5/5 of `vmax`.
fn y_grid(s: &mut String, left: f64, plot_w: f64, vmax: f64, y: impl Fn(f64) -> f64) {
    for i in 0..=5 {
        let v = vmax * f64::from(i) / 5.0;
        let yy = y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.0}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + plot_w,
            left - 6.0,
            yy + 4.0,
            fmt_tick(v)
        );
    }
}

fn fmt_tick(v: f64) -> String {
    if v >= 100.0 || v == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_max_rounds_up() {
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(7.0), 10.0);
        assert_eq!(nice_max(180.0), 200.0);
        assert_eq!(nice_max(2100.0), 2500.0);
    }

    #[test]
    fn svg_has_one_bar_per_value_and_escapes_labels() {
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
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<title>").count(), 5);
        assert!(svg.contains("a&lt;b"));
        assert!(!svg.contains("a<b"));
    }
}
