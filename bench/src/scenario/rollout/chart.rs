//! The rollout's SVG timeline: latency (p50, p99, max per bucket, log scale) above failures per
//! bucket; a vertical line at each replacement's signal, the span from new-instance start to
//! old-instance exit shaded.

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

use super::{Bucket, VariantReport};
use crate::chart::{legend, legend_line, plot_err, Area, Panel, FONT};

/// Picks one latency figure of a timeline bucket.
type BucketValue = fn(&Bucket) -> Option<u64>;

/// Writes the timeline of one variant to `path`.
pub fn timeline(path: &Path, report: &VariantReport) -> Result<()> {
    let root = SVGBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (upper, lower) = root.split_vertically(400);
    let x_max = report.duration_s.max(0.1);
    let bucket_s = report
        .buckets
        .get(1)
        .map_or(0.1, |b| b.start_s - report.buckets[0].start_s);
    latency_panel(&upper, report, x_max, bucket_s)?;
    failures_panel(&lower, report, x_max, bucket_s)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

/// Milliseconds of a latency in microseconds, at least 0.01 (the axis is logarithmic).
fn ms(us: Option<u64>) -> Option<f64> {
    us.map(|v| (v as f64 / 1000.0).max(0.01))
}

fn latency_panel(area: &Area, report: &VariantReport, x_max: f64, bucket_s: f64) -> Result<()> {
    let y_max = report
        .buckets
        .iter()
        .filter_map(|b| ms(b.max_us))
        .fold(1.0f64, f64::max)
        * 2.0;
    let y_min = report
        .buckets
        .iter()
        .filter_map(|b| ms(b.p50_us))
        .fold(f64::MAX, f64::min)
        .min(y_max / 4.0)
        / 2.0;
    let caption = format!(
        "rollout {}: {} replacements, {} requests, {} failed",
        report.variant,
        report.handoffs.len(),
        report.requests,
        report.failed
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 16))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, (y_min..y_max).log_scale())
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .light_line_style(RGBColor(235, 235, 235))
        .y_desc("new-connection request latency (ms)")
        .draw()
        .map_err(plot_err)?;
    for handoff in &report.handoffs {
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(handoff.spawn_s, y_min), (handoff.exit_s, y_max)],
                RGBColor(255, 200, 120).mix(0.25).filled(),
            )))
            .map_err(plot_err)?;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(handoff.signal_s, y_min), (handoff.signal_s, y_max)],
                RED.stroke_width(1),
            )))
            .map_err(plot_err)?;
    }
    let lines: [(&str, RGBColor, BucketValue); 3] = [
        ("max", RGBColor(170, 170, 170), |b| b.max_us),
        ("p99", RGBColor(255, 127, 14), |b| b.p99_us),
        ("p50", RGBColor(31, 119, 180), |b| b.p50_us),
    ];
    for (name, line_color, get) in lines {
        let points: Vec<(f64, f64)> = report
            .buckets
            .iter()
            .filter_map(|b| Some((b.start_s + bucket_s / 2.0, ms(get(b))?)))
            .collect();
        chart
            .draw_series(LineSeries::new(points, line_color.stroke_width(2)))
            .map_err(plot_err)?
            .label(name)
            .legend(legend_line(line_color.stroke_width(2)));
    }
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, y_min), (0.0, y_min)],
            RED.stroke_width(1),
        )))
        .map_err(plot_err)?
        .label("old instance signalled (shaded: new start → old exit)")
        .legend(legend_line(RED.stroke_width(1)));
    legend(&mut chart)
}

fn failures_panel(area: &Area, report: &VariantReport, x_max: f64, bucket_s: f64) -> Result<()> {
    let f_max = report
        .buckets
        .iter()
        .map(|b| b.failed)
        .max()
        .unwrap_or(0)
        .max(1) as f64
        * 1.2;
    let mut chart = Panel {
        margin: 12,
        x_label_area: 32,
        x_max,
        y_max: f_max,
        y_labels: 5,
        y_desc: "failed per bucket",
        x_desc: Some("seconds since load started"),
    }
    .draw(area)?;
    for handoff in &report.handoffs {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(handoff.signal_s, 0.0), (handoff.signal_s, f_max)],
                RED.stroke_width(1),
            )))
            .map_err(plot_err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                format!("#{}", handoff.index),
                (handoff.signal_s, f_max),
                (FONT, 11).into_font(),
            )))
            .map_err(plot_err)?;
    }
    chart
        .draw_series(report.buckets.iter().filter(|b| b.failed > 0).map(|b| {
            Rectangle::new(
                [(b.start_s, 0.0), (b.start_s + bucket_s, b.failed as f64)],
                RED.mix(0.8).filled(),
            )
        }))
        .map_err(plot_err)?;
    Ok(())
}
