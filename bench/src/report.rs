//! Results: what each run measured, the per-target summary (median, min–max, ratio to
//! `direct`, proxy÷HAProxy), the stdout table and the JSON file.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::stats::Summary;
use crate::target::{Skipped, Target};

/// What a figure measures, for formatting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    BytesPerSec,
    PerSec,
    Micros,
    Bytes,
    CpuSeconds,
    CpuSecondsPerGib,
    Count,
}

impl Unit {
    /// Human-readable value.
    pub fn format(self, value: f64) -> String {
        const KIB: f64 = 1024.0;
        match self {
            Unit::BytesPerSec => format!("{}/s", Unit::Bytes.format(value)),
            Unit::Bytes if value >= KIB * KIB * KIB => format!("{:.2} GiB", value / KIB.powi(3)),
            Unit::Bytes if value >= KIB * KIB => format!("{:.1} MiB", value / KIB.powi(2)),
            Unit::Bytes if value >= KIB => format!("{:.1} KiB", value / KIB),
            Unit::Bytes => format!("{value:.0} B"),
            Unit::PerSec if value >= 1e6 => format!("{:.2}M/s", value / 1e6),
            Unit::PerSec if value >= 1e3 => format!("{:.1}k/s", value / 1e3),
            Unit::PerSec => format!("{value:.0}/s"),
            Unit::Micros if value >= 1e6 => format!("{:.2} s", value / 1e6),
            Unit::Micros if value >= 1e3 => format!("{:.2} ms", value / 1e3),
            Unit::Micros => format!("{value:.0} µs"),
            Unit::CpuSeconds => format!("{value:.2} s"),
            Unit::CpuSecondsPerGib => format!("{value:.2} s/GiB"),
            Unit::Count => format!("{value:.0}"),
        }
    }
}

/// One figure a scenario reports.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MetricSpec {
    /// Key in the JSON `metrics` maps.
    pub key: &'static str,
    /// Label in the table and charts.
    pub label: &'static str,
    pub unit: Unit,
    /// Whether a larger value is better (for reading ratios).
    pub higher_is_better: bool,
    /// Whether the figure is drawn in the scenario's chart.
    pub chart: bool,
}

impl MetricSpec {
    /// A figure where lower is better, not charted.
    pub const fn new(key: &'static str, label: &'static str, unit: Unit) -> Self {
        Self {
            key,
            label,
            unit,
            higher_is_better: false,
            chart: false,
        }
    }

    /// The same figure, where higher is better.
    pub const fn higher_is_better(self) -> Self {
        Self {
            higher_is_better: true,
            ..self
        }
    }

    /// The same figure, drawn in the scenario's chart.
    pub const fn charted(self) -> Self {
        Self {
            chart: true,
            ..self
        }
    }
}

/// The figures every scenario adds: CPU used by each process during the measured window.
pub const CPU_METRICS: [MetricSpec; 3] = [
    MetricSpec::new("target_cpu_s", "target CPU", Unit::CpuSeconds),
    MetricSpec::new("loadgen_cpu_s", "load generator CPU", Unit::CpuSeconds),
    MetricSpec::new("backend_cpu_s", "backend CPU", Unit::CpuSeconds),
];

/// Figures of one run, by key.
pub type Metrics = BTreeMap<String, f64>;

/// One run: a target in one round.
#[derive(Debug, Clone, Serialize)]
pub struct RunRecord {
    pub target: Target,
    pub round: u32,
    pub metrics: Metrics,
}

/// One target's figure over all rounds.
#[derive(Debug, Clone, Serialize)]
pub struct TargetFigure {
    #[serde(flatten)]
    pub summary: Summary,
    /// Median ÷ direct's median (absent for direct itself and target-only figures).
    pub ratio_to_direct: Option<f64>,
}

/// One figure over all targets.
#[derive(Debug, Clone, Serialize)]
pub struct MetricSummary {
    #[serde(flatten)]
    pub spec: MetricSpec,
    pub targets: BTreeMap<Target, TargetFigure>,
    /// Proxy median ÷ HAProxy median (`vs_haproxy` of the proxy; kept for readers of the JSON).
    pub proxy_vs_haproxy: Option<f64>,
    /// Every other target's median ÷ HAProxy's (the proxy's too), where both were measured.
    pub vs_haproxy: BTreeMap<Target, f64>,
}

/// The machine and binaries a report was made with.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub kernel: String,
    pub proxy_bin: Option<String>,
    pub haproxy_version: Option<String>,
    pub haproxy_nbthread: usize,
}

impl Machine {
    /// Describes this machine.
    pub fn detect(
        proxy_bin: Option<&Path>,
        haproxy_version: Option<String>,
        nbthread: usize,
    ) -> Self {
        Self {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_owned())
                .unwrap_or_default(),
            proxy_bin: proxy_bin.map(|p| p.display().to_string()),
            haproxy_version,
            haproxy_nbthread: nbthread,
        }
    }
}

/// Everything one scenario measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    pub scenario: &'static str,
    pub description: String,
    pub parameters: serde_json::Value,
    pub rounds: u32,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub targets: Vec<Target>,
    pub skipped: Vec<Skipped>,
    pub machine: Machine,
    pub runs: Vec<RunRecord>,
    pub summary: Vec<MetricSummary>,
}

/// Summarises `runs` for each of `specs`.
pub fn summarise(specs: &[MetricSpec], runs: &[RunRecord]) -> Vec<MetricSummary> {
    specs
        .iter()
        .map(|spec| {
            let mut per_target: BTreeMap<Target, Vec<f64>> = BTreeMap::new();
            for run in runs {
                if let Some(&value) = run.metrics.get(spec.key) {
                    per_target.entry(run.target).or_default().push(value);
                }
            }
            let medians: BTreeMap<Target, Summary> = per_target
                .iter()
                .filter_map(|(&t, values)| Some((t, Summary::of(values)?)))
                .collect();
            let ratio = |a: Target, b: Target| -> Option<f64> {
                let (a, b) = (medians.get(&a)?.median, medians.get(&b)?.median);
                (b != 0.0).then(|| a / b)
            };
            let targets = medians
                .iter()
                .map(|(&t, &summary)| {
                    let ratio_to_direct = (t != Target::Direct)
                        .then(|| ratio(t, Target::Direct))
                        .flatten();
                    (
                        t,
                        TargetFigure {
                            summary,
                            ratio_to_direct,
                        },
                    )
                })
                .collect();
            let vs_haproxy: BTreeMap<Target, f64> = medians
                .keys()
                .filter(|t| !matches!(t, Target::Direct | Target::Haproxy))
                .filter_map(|&t| Some((t, ratio(t, Target::Haproxy)?)))
                .collect();
            MetricSummary {
                spec: *spec,
                targets,
                proxy_vs_haproxy: vs_haproxy.get(&Target::Proxy).copied(),
                vs_haproxy,
            }
        })
        .collect()
}

/// Prints the report as a table.
pub fn print_table(report: &ScenarioReport) {
    println!();
    println!(
        "== {}: {} — {} round(s) × {:.1}s ==",
        report.scenario, report.description, report.rounds, report.duration_s
    );
    for skipped in &report.skipped {
        println!("   ({} skipped: {})", skipped.target.name(), skipped.reason);
    }
    let mut rows: Vec<Vec<String>> = Vec::new();
    let mut header = vec!["metric".to_owned()];
    header.extend(report.targets.iter().map(|t| t.name().to_owned()));
    // A ratio column for each target compared with HAProxy.
    let compared: Vec<Target> = if report.targets.contains(&Target::Haproxy) {
        report
            .targets
            .iter()
            .copied()
            .filter(|t| !matches!(t, Target::Direct | Target::Haproxy))
            .collect()
    } else {
        Vec::new()
    };
    header.extend(compared.iter().map(|t| format!("{}÷haproxy", t.name())));
    rows.push(header);
    for metric in &report.summary {
        if metric.targets.is_empty() {
            continue;
        }
        let arrow = if metric.spec.higher_is_better {
            "↑"
        } else {
            "↓"
        };
        let mut row = vec![format!("{} {arrow}", metric.spec.label)];
        for target in &report.targets {
            row.push(match metric.targets.get(target) {
                None => "–".to_owned(),
                Some(figure) => {
                    let unit = metric.spec.unit;
                    let s = &figure.summary;
                    let mut cell = unit.format(s.median);
                    if report.rounds > 1 {
                        cell += &format!(" ({}–{})", unit.format(s.min), unit.format(s.max));
                    }
                    if let Some(ratio) = figure.ratio_to_direct {
                        cell += &format!(" ×{ratio:.2}");
                    }
                    cell
                }
            });
        }
        for target in &compared {
            row.push(
                metric
                    .vs_haproxy
                    .get(target)
                    .map_or("–".to_owned(), |r| format!("{r:.2}")),
            );
        }
        rows.push(row);
    }
    print_rows(&rows);
    println!(
        "   (median (min–max) over rounds; ×N = ratio to direct; ↑/↓ = higher/lower is better)"
    );
}

/// Prints rows with aligned columns.
pub fn print_rows(rows: &[Vec<String>]) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::from("   ");
        for (c, cell) in row.iter().enumerate() {
            line += cell;
            if c + 1 < row.len() {
                line += &" ".repeat(widths[c] - cell.chars().count() + 2);
            }
        }
        println!("{line}");
    }
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_units() {
        assert_eq!(
            Unit::BytesPerSec.format(2.5 * 1024.0 * 1024.0 * 1024.0),
            "2.50 GiB/s"
        );
        assert_eq!(Unit::PerSec.format(12_345.0), "12.3k/s");
        assert_eq!(Unit::Micros.format(1_500.0), "1.50 ms");
        assert_eq!(Unit::Bytes.format(3584.0), "3.5 KiB");
    }

    #[test]
    fn summarises_ratios() {
        const SPEC: MetricSpec = MetricSpec {
            key: "x",
            label: "x",
            unit: Unit::Count,
            higher_is_better: true,
            chart: true,
        };
        let run = |target, value| RunRecord {
            target,
            round: 0,
            metrics: [("x".to_owned(), value)].into(),
        };
        let runs = [
            run(Target::Direct, 10.0),
            run(Target::Haproxy, 4.0),
            run(Target::Proxy, 5.0),
            run(Target::Uring, 8.0),
        ];
        let summary = summarise(&[SPEC], &runs);
        let proxy = &summary[0].targets[&Target::Proxy];
        assert_eq!(proxy.ratio_to_direct, Some(0.5));
        assert_eq!(summary[0].proxy_vs_haproxy, Some(1.25));
        assert_eq!(summary[0].targets[&Target::Direct].ratio_to_direct, None);
        assert_eq!(summary[0].vs_haproxy[&Target::Uring], 2.0);
        assert!(!summary[0].vs_haproxy.contains_key(&Target::Direct));
    }
}
