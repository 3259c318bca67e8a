//! The PNG of `tandem bench serve`: TTFT and ITL percentiles (p50, p99), goodput and output token
//! throughput against the request rate (or the concurrency), one colour per configuration (one JSON
//! report each), drawn with plotters' bitmap backend.
//!
//! Invariants:
//! - Only reports of one load kind (all rates, or all concurrencies) share a plot; runs at an infinite
//!   rate have no place on a rate axis and are left out (the caller says so).
//! - Text needs a TrueType font (plotters draws none of its own): `--font`, else the first system
//!   font found; none is an error, never a plot without labels.

use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail, ensure};
use plotters::prelude::*;

use super::Report;

/// Where system fonts usually are, most likely first.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Finds a TrueType font: `explicit`, a usual DejaVu/Liberation path, or any .ttf under /usr/share/fonts.
fn find_font(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        ensure!(p.is_file(), "--font {}: no such file", p.display());
        return Ok(p.to_path_buf());
    }
    if let Some(p) = FONT_CANDIDATES.iter().map(Path::new).find(|p| p.is_file()) {
        return Ok(p.to_path_buf());
    }
    fn any_ttf(dir: &Path, depth: usize) -> Option<PathBuf> {
        let entries = std::fs::read_dir(dir).ok()?;
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        for p in &paths {
            if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("ttf")) {
                return Some(p.clone());
            }
        }
        paths.iter().filter(|p| p.is_dir() && depth < 4).find_map(|p| any_ttf(p, depth + 1))
    }
    any_ttf(Path::new("/usr/share/fonts"), 0)
        .ok_or_else(|| anyhow!("no TrueType font for the plot's text: install one (Debian: fonts-dejavu-core) or pass --font FILE.ttf"))
}

fn register_font(explicit: Option<&Path>) -> anyhow::Result<()> {
    let path = find_font(explicit)?;
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    // plotters keeps fonts for the process's life.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| anyhow!("{} is not a TrueType font", path.display()))
}

/// One figure of a run: its x (rate or concurrency) and a value.
type Metric = fn(&super::RunReport) -> Option<f64>;

struct Panel {
    title: &'static str,
    y_desc: &'static str,
    /// (name, value, dashed)
    series: &'static [(&'static str, Metric, bool)],
}

const PANELS: &[Panel] = &[
    Panel {
        title: "Time to first token",
        y_desc: "ms",
        series: &[("p50", |r| r.summary.ttft_ms.map(|d| d.p50), false), ("p99", |r| r.summary.ttft_ms.map(|d| d.p99), true)],
    },
    Panel {
        title: "Inter-token latency",
        y_desc: "ms",
        series: &[("p50", |r| r.summary.itl_ms.map(|d| d.p50), false), ("p99", |r| r.summary.itl_ms.map(|d| d.p99), true)],
    },
    Panel { title: "Goodput (requests within the SLOs)", y_desc: "req/s", series: &[("goodput", |r| Some(r.summary.goodput), false)] },
    Panel { title: "Output token throughput", y_desc: "tok/s", series: &[("tok/s", |r| Some(r.summary.output_token_throughput), false)] },
];

/// Draws `reports` into `out` (PNG). Returns how many runs had no place on the axis (infinite rate).
pub(crate) fn draw(reports: &[Report], out: &Path, font: Option<&Path>) -> anyhow::Result<usize> {
    ensure!(!reports.is_empty(), "nothing to plot");
    let kinds: Vec<&str> = reports.iter().flat_map(|r| r.runs.iter().map(|run| run.kind.as_str())).collect();
    let Some(&kind) = kinds.first() else { bail!("the reports hold no run") };
    ensure!(kinds.iter().all(|k| *k == kind), "the reports mix request-rate and concurrency runs: plot them apart");
    let skipped = reports.iter().flat_map(|r| &r.runs).filter(|run| run.x.is_none()).count();
    let xs: Vec<f64> = reports.iter().flat_map(|r| r.runs.iter().filter_map(|run| run.x)).collect();
    ensure!(!xs.is_empty(), "no run has a finite request rate to plot against");
    register_font(font)?;
    let x_max = xs.iter().copied().fold(0.0, f64::max) * 1.08;
    let x_desc = if kind == "rate" { "request rate (req/s)" } else { "concurrency" };

    let root = BitMapBackend::new(out, (1600, 1100)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let slo = &reports[0].slo;
    let slo_text = [("TTFT", slo.ttft_ms), ("ITL", slo.itl_ms), ("TPOT", slo.tpot_ms)]
        .iter()
        .filter_map(|(n, v)| v.map(|v| format!("{n} ≤ {v} ms")))
        .collect::<Vec<_>>()
        .join(", ");
    let title = format!(
        "tandem bench serve — {} (SLO: {})",
        reports.iter().map(|r| r.label.as_str()).collect::<Vec<_>>().join(" vs "),
        if slo_text.is_empty() { "none".into() } else { slo_text }
    );
    let root = root.titled(&title, ("sans-serif", 26)).map_err(plot_err)?;
    for (area, panel) in root.split_evenly((2, 2)).iter().zip(PANELS) {
        let y_max = reports
            .iter()
            .flat_map(|r| r.runs.iter().filter(|run| run.x.is_some()))
            .flat_map(|run| panel.series.iter().filter_map(move |(_, f, _)| f(run)))
            .fold(0.0, f64::max)
            .max(1e-3)
            * 1.1;
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(panel.y_desc)
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(plot_err)?;
        for (ci, report) in reports.iter().enumerate() {
            let color = Palette99::pick(ci).to_rgba();
            for (name, f, dashed) in panel.series {
                let mut pts: Vec<(f64, f64)> = report.runs.iter().filter_map(|run| Some((run.x?, f(run)?))).collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let style = color.stroke_width(2);
                let label = if panel.series.len() > 1 { format!("{} {name}", report.label) } else { report.label.clone() };
                // p50 (and single series): a solid line with dots; p99: dashed with triangles.
                if *dashed {
                    chart
                        .draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))
                        .map_err(plot_err)?
                        .label(label)
                        .legend(move |(x, y)| EmptyElement::at((x, y)) + TriangleMarker::new((10, 0), 5, color.filled()) + PathElement::new(vec![(0, 0), (6, 0)], color.stroke_width(2)));
                } else {
                    chart
                        .draw_series(LineSeries::new(pts.clone(), style))
                        .map_err(plot_err)?
                        .label(label)
                        .legend(move |(x, y)| EmptyElement::at((x, y)) + Circle::new((10, 0), 4, color.filled()) + PathElement::new(vec![(0, 0), (20, 0)], color.stroke_width(2)));
                }
                if *dashed {
                    chart.draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 5, color.filled()))).map_err(plot_err)?;
                } else {
                    chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(plot_err)?;
                }
            }
        }
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 15))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(skipped)
}

fn plot_err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("drawing the plot: {e}")
}
