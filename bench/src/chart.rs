//! SVG charts (plotters): ratio bars per scenario, and the rollout timeline (latency and
//! failures over time, each replacement marked). The chaos soak's timeline lives with the soak
//! ([`crate::scenario::chaos::chart`]).

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

use crate::report::{ScenarioReport, Unit};
use crate::scenario::rollout::{Bucket, VariantReport};
use crate::target::Target;

/// Font family of every chart.
pub(crate) const FONT: &str = "sans-serif";

fn color(target: Target) -> RGBColor {
    match target {
        Target::Direct => RGBColor(140, 140, 140),
        Target::Haproxy => RGBColor(31, 119, 180),
        Target::Proxy => RGBColor(44, 160, 44),
        Target::ProxySockmap => RGBColor(148, 103, 189),
        Target::Uring => RGBColor(214, 39, 40),
        Target::ProxyTransparent => RGBColor(23, 190, 207),
        Target::HaproxyTransparent => RGBColor(127, 127, 127),
    }
}

/// One panel per charted figure: a bar per target, as the ratio to `direct` where there is a
/// direct figure (direct = 1.0), else the absolute median.
pub fn ratio_bars(path: &Path, report: &ScenarioReport) -> Result<()> {
    let metrics: Vec<_> = report
        .summary
        .iter()
        .filter(|m| m.spec.chart && !m.targets.is_empty())
        .collect();
    let width = (320 * metrics.len().max(1) as u32 + 40).max(640);
    let root = SVGBackend::new(path, (width, 380)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let title = format!("{}: {}", report.scenario, report.description);
    let root = root.titled(&title, (FONT, 16)).map_err(plot_err)?;
    if metrics.is_empty() {
        root.present().map_err(plot_err)?;
        return Ok(());
    }
    let panels = root.split_evenly((1, metrics.len()));
    for (panel, metric) in panels.iter().zip(metrics) {
        let ratios = metric.targets.values().any(|f| f.ratio_to_direct.is_some());
        let bars: Vec<(Target, f64, String)> = metric
            .targets
            .iter()
            .map(|(&target, figure)| {
                let value = if ratios {
                    figure.ratio_to_direct.unwrap_or(1.0)
                } else {
                    figure.summary.median
                };
                let label = if ratios {
                    format!("×{value:.2}")
                } else {
                    metric.spec.unit.format(value)
                };
                (target, value, label)
            })
            .collect();
        let top = bars.iter().map(|b| b.1).fold(0.0f64, f64::max).max(0.001) * 1.25;
        let top = if ratios { top.max(1.25) } else { top };
        let better = if metric.spec.higher_is_better {
            "higher is better"
        } else {
            "lower is better"
        };
        let caption = format!("{} ({better})", metric.spec.label);
        let y_desc = if ratios {
            "ratio to direct".to_owned()
        } else {
            unit_desc(metric.spec.unit).to_owned()
        };
        let names: Vec<&str> = bars.iter().map(|b| b.0.name()).collect();
        let mut chart = ChartBuilder::on(panel)
            .caption(caption, (FONT, 13))
            .margin(12)
            .x_label_area_size(28)
            .y_label_area_size(60)
            .build_cartesian_2d((0..bars.len() as i32 - 1).into_segmented(), 0f64..top)
            .map_err(plot_err)?;
        let unit = metric.spec.unit;
        let y_fmt = move |v: &f64| {
            if ratios {
                format!("{v:.1}")
            } else {
                unit.format(*v)
            }
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .y_labels(6)
            .y_desc(y_desc)
            .y_label_formatter(&y_fmt)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => names.get(*i as usize).copied().unwrap_or("").into(),
                _ => String::new(),
            })
            .draw()
            .map_err(plot_err)?;
        chart
            .draw_series(
                Histogram::vertical(&chart)
                    .margin(14)
                    .style_func(|x, _| {
                        let i = match x {
                            SegmentValue::Exact(i) | SegmentValue::CenterOf(i) => *i as usize,
                            SegmentValue::Last => 0,
                        };
                        color(bars[i].0).filled()
                    })
                    .data(bars.iter().enumerate().map(|(i, b)| (i as i32, b.1))),
            )
            .map_err(plot_err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, b)| {
                Text::new(
                    b.2.clone(),
                    (SegmentValue::CenterOf(i as i32), b.1 + top * 0.05),
                    TextStyle::from((FONT, 12).into_font()).pos(text_center()),
                )
            }))
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

fn text_center() -> plotters::style::text_anchor::Pos {
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    Pos::new(HPos::Center, VPos::Bottom)
}

fn unit_desc(unit: Unit) -> &'static str {
    match unit {
        Unit::BytesPerSec => "bytes/s",
        Unit::PerSec => "per second",
        Unit::Micros => "latency",
        Unit::Bytes => "bytes",
        Unit::CpuSeconds => "CPU seconds",
        Unit::CpuSecondsPerGib => "CPU s/GiB",
        Unit::Count => "count",
    }
}

/// Latency (p50, p99, max per bucket, log scale) above failures per bucket; a vertical line at
/// each replacement's signal, the span from new-instance start to old-instance exit shaded.
pub fn rollout_timeline(path: &Path, report: &VariantReport) -> Result<()> {
    let root = SVGBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let (upper, lower) = root.split_vertically(400);
    let x_max = report.duration_s.max(0.1);
    let bucket_s = report
        .buckets
        .get(1)
        .map_or(0.1, |b| b.start_s - report.buckets[0].start_s);
    let ms = |us: Option<u64>| us.map(|v| (v as f64 / 1000.0).max(0.01));
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
    let mut chart = ChartBuilder::on(&upper)
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
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], line_color.stroke_width(2))
            });
    }
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(0.0, y_min), (0.0, y_min)],
            RED.stroke_width(1),
        )))
        .map_err(plot_err)?
        .label("old instance signalled (shaded: new start → old exit)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED.stroke_width(1)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(plot_err)?;

    let f_max = report
        .buckets
        .iter()
        .map(|b| b.failed)
        .max()
        .unwrap_or(0)
        .max(1) as f64
        * 1.2;
    let mut chart = ChartBuilder::on(&lower)
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..f_max)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE)
        .y_labels(5)
        .x_desc("seconds since load started")
        .y_desc("failed per bucket")
        .draw()
        .map_err(plot_err)?;
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
    root.present().map_err(plot_err)?;
    Ok(())
}

/// Picks one latency figure of a timeline bucket.
type BucketValue = fn(&Bucket) -> Option<u64>;

/// Maps a plotters error.
pub(crate) fn plot_err<E: std::fmt::Display>(err: E) -> anyhow::Error {
    anyhow!("cannot draw chart: {err}")
}
