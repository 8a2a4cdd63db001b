//! The soak's SVG timeline, four panels over the same time axis: failures per bucket (accepted
//! SIGKILL losses and unexplained ones, each SIGKILL marked), the instances running and Serving
//! with every action marked, and each instance's RSS and descriptor count.

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

use super::fleet::Life;
use super::policy::ActionKind;
use super::report::ChaosReport;
use crate::chart::{legend, legend_line, plot_err, Area, Panel, FONT};

const KILLED: RGBColor = RGBColor(214, 39, 40);
const UNEXPLAINED: RGBColor = RGBColor(0, 0, 0);
const START: RGBColor = RGBColor(44, 160, 44);
const TERM: RGBColor = RGBColor(255, 127, 14);
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];

/// Writes the timeline of `report` to `path`.
pub fn timeline(path: &Path, report: &ChaosReport) -> Result<()> {
    let root = SVGBackend::new(path, (1400, 1000)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let title = format!(
        "chaos: {} start / {} SIGTERM / {} SIGKILL; {} connections, {} lost in SIGKILLed \
         instances, {} unexplained",
        report.action_counts.start,
        report.action_counts.sigterm,
        report.action_counts.sigkill,
        report.connections.attempted,
        report.connections.killed.total(),
        report.unexplained()
    );
    let root = root.titled(&title, (FONT, 16)).map_err(plot_err)?;
    let panels = root.split_evenly((4, 1));
    let x_max = report
        .buckets
        .last()
        .map_or(1.0, |b| b.start_s)
        .max(report.chaos_end_s)
        .max(1.0);
    failures_panel(&panels[0], report, x_max)?;
    instances_panel(&panels[1], report, x_max)?;
    resource_panel(&panels[2], report, x_max, "RSS (MiB)", |s| {
        s.rss_bytes as f64 / (1024.0 * 1024.0)
    })?;
    resource_panel(&panels[3], report, x_max, "open descriptors", |s| {
        s.fds as f64
    })?;
    root.present().map_err(plot_err)?;
    Ok(())
}

fn failures_panel(area: &Area, report: &ChaosReport, x_max: f64) -> Result<()> {
    let bucket_s = report.parameters["bucket_s"].as_f64().unwrap_or(1.0);
    let y_max = report
        .buckets
        .iter()
        .map(|b| b.killed + b.unexplained)
        .max()
        .unwrap_or(0)
        .max(1) as f64
        * 1.2;
    let mut chart = Panel {
        margin: 10,
        x_label_area: 24,
        x_max,
        y_max,
        y_labels: 5,
        y_desc: &format!("failed per {bucket_s}s"),
        x_desc: None,
    }
    .draw(area)?;
    chart
        .draw_series(report.kills.iter().map(|k| {
            PathElement::new(
                vec![(k.signal_s, 0.0), (k.signal_s, y_max)],
                KILLED.mix(0.5).stroke_width(1),
            )
        }))
        .map_err(plot_err)?
        .label("SIGKILL")
        .legend(legend_line(KILLED.mix(0.5)));
    chart
        .draw_series(report.buckets.iter().filter(|b| b.killed > 0).map(|b| {
            Rectangle::new(
                [(b.start_s, 0.0), (b.start_s + bucket_s, b.killed as f64)],
                KILLED.filled(),
            )
        }))
        .map_err(plot_err)?
        .label("in flight in a SIGKILLed instance")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], KILLED.filled()));
    chart
        .draw_series(
            report
                .buckets
                .iter()
                .filter(|b| b.unexplained > 0)
                .map(|b| {
                    let base = b.killed as f64;
                    Rectangle::new(
                        [
                            (b.start_s, base),
                            (b.start_s + bucket_s, base + b.unexplained as f64),
                        ],
                        UNEXPLAINED.filled(),
                    )
                }),
        )
        .map_err(plot_err)?
        .label("not explained (a bug)")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], UNEXPLAINED.filled()));
    legend(&mut chart)
}

fn instances_panel(area: &Area, report: &ChaosReport, x_max: f64) -> Result<()> {
    let running = steps(&report.instances, |l| Some((l.started_s, l.end_s)));
    let serving = steps(&report.instances, |l| {
        let ready = l.ready_s?;
        let until = match (l.signal_s, l.end_s) {
            (Some(s), Some(e)) => Some(s.min(e)),
            (s, e) => s.or(e),
        };
        Some((ready, until))
    });
    let y_max = running.iter().map(|p| p.1).fold(1.0, f64::max) + 1.5;
    let mut chart = Panel {
        margin: 10,
        x_label_area: 24,
        x_max,
        y_max,
        y_labels: 6,
        y_desc: "instances",
        x_desc: None,
    }
    .draw(area)?;
    let grey = RGBColor(150, 150, 150);
    chart
        .draw_series(LineSeries::new(running, grey.stroke_width(2)))
        .map_err(plot_err)?
        .label("running")
        .legend(legend_line(grey.stroke_width(2)));
    let blue = PALETTE[0];
    chart
        .draw_series(LineSeries::new(serving, blue.stroke_width(2)))
        .map_err(plot_err)?
        .label("Serving")
        .legend(legend_line(blue.stroke_width(2)));
    let top = y_max - 0.6;
    for (kind, color, label) in [
        (ActionKind::Start, START, "start"),
        (ActionKind::Sigterm, TERM, "SIGTERM"),
        (ActionKind::Sigkill, KILLED, "SIGKILL"),
    ] {
        let y = match kind {
            ActionKind::Start => top,
            ActionKind::Sigterm => top - 0.3,
            ActionKind::Sigkill => top - 0.6,
        };
        chart
            .draw_series(
                report
                    .actions
                    .iter()
                    .filter(|a| a.kind == kind)
                    .map(|a| TriangleMarker::new((a.at_s, y), 4, color.filled())),
            )
            .map_err(plot_err)?
            .label(label)
            .legend(move |(x, y)| TriangleMarker::new((x + 6, y), 4, color.filled()));
    }
    legend(&mut chart)
}

fn resource_panel(
    area: &Area,
    report: &ChaosReport,
    x_max: f64,
    desc: &str,
    value: fn(&super::resources::Sample) -> f64,
) -> Result<()> {
    let y_max = report
        .instances
        .iter()
        .flat_map(|l| l.samples.iter().map(value))
        .fold(1.0, f64::max)
        * 1.15;
    let mut chart = Panel {
        margin: 10,
        x_label_area: 30,
        x_max,
        y_max,
        y_labels: 5,
        y_desc: desc,
        x_desc: Some("seconds (one line per instance)"),
    }
    .draw(area)?;
    for (i, life) in report.instances.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let points: Vec<(f64, f64)> = life.samples.iter().map(|s| (s.t_s, value(s))).collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(1)))
            .map_err(plot_err)?;
    }
    Ok(())
}

/// A step line counting the intervals `span` gives (an open end counts to the end).
fn steps(lives: &[Life], span: impl Fn(&Life) -> Option<(f64, Option<f64>)>) -> Vec<(f64, f64)> {
    let mut events: Vec<(f64, i32)> = Vec::new();
    for life in lives {
        if let Some((from, until)) = span(life) {
            events.push((from, 1));
            if let Some(until) = until {
                events.push((until, -1));
            }
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut count = 0i32;
    let mut points = vec![(0.0, 0.0)];
    for (t, delta) in events {
        points.push((t, f64::from(count)));
        count += delta;
        points.push((t, f64::from(count)));
    }
    points
}
