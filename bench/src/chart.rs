//! SVG charts (plotters): ratio bars per scenario, and what the timelines of the rollout and
//! the chaos soak share (the panel frame, the legend); those timelines live with their
//! scenarios.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::SegmentValue;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::report::{MetricSummary, ScenarioReport, Unit};
use crate::target::Target;

/// Font family of every chart.
pub(crate) const FONT: &str = "sans-serif";

fn color(target: Target) -> RGBColor {
    match target {
        Target::Direct => RGBColor(140, 140, 140),
        Target::Haproxy => RGBColor(31, 119, 180),
        Target::Proxy => RGBColor(44, 160, 44),
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
        bar_panel(panel, metric)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

/// One figure's panel of [`ratio_bars`].
fn bar_panel(panel: &Area, metric: &MetricSummary) -> Result<()> {
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

/// A drawing area of an SVG chart.
pub(crate) type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

/// A chart with linear axes: seconds across, a count or size up.
pub(crate) type LinearChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The frame of one panel of a timeline: `0..x_max` seconds across, `0..y_max` up.
pub(crate) struct Panel<'t> {
    pub margin: u32,
    /// Height of the area under the x axis, for its labels.
    pub x_label_area: u32,
    pub x_max: f64,
    pub y_max: f64,
    pub y_labels: usize,
    pub y_desc: &'t str,
    pub x_desc: Option<&'t str>,
}

impl Panel<'_> {
    /// Builds the chart on `area` and draws its axes and mesh (horizontal lines only).
    pub(crate) fn draw<'a, 'b>(&self, area: &'a Area<'b>) -> Result<LinearChart<'a, 'b>> {
        let mut chart = ChartBuilder::on(area)
            .margin(self.margin)
            .x_label_area_size(self.x_label_area)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..self.x_max, 0f64..self.y_max)
            .map_err(plot_err)?;
        let mut mesh = chart.configure_mesh();
        mesh.light_line_style(WHITE)
            .y_labels(self.y_labels)
            .y_desc(self.y_desc);
        if let Some(x_desc) = self.x_desc {
            mesh.x_desc(x_desc);
        }
        mesh.draw().map_err(plot_err)?;
        Ok(chart)
    }
}

/// Draws the series labels of `chart` in its upper right corner.
pub(crate) fn legend<'a, DB: DrawingBackend + 'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
) -> Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

/// A legend entry: a short line in `style`.
pub(crate) fn legend_line<S: Into<ShapeStyle>>(
    style: S,
) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    let style = style.into();
    move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], style)
}

/// Maps a plotters error.
pub(crate) fn plot_err<E: std::fmt::Display>(err: E) -> anyhow::Error {
    anyhow!("cannot draw chart: {err}")
}
