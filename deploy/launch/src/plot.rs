//! The loss and accuracy curves of a run as a self-contained SVG, drawn from shard 0's
//! `metrics.jsonl` (one JSON object per step: `step`, `loss`, `train_acc`, and
//! `test_acc_before_step` when the workers evaluated). No plotting library: two panels of
//! polylines, axes with a few ticks, steps averaged into at most 1000 points per curve.

use serde_json::Value;
use std::fmt::Write as _;

/// One panel's series: a name, a colour and its points.
struct Series {
    name: &'static str,
    colour: &'static str,
    points: Vec<(f64, f64)>,
    dots: bool,
}

/// Why a metrics file cannot be drawn ([`curves_svg`]); the line numbers count from 1.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// A line that is not JSON.
    #[error("line {line}: not JSON ({error})")]
    NotJson {
        /// The line.
        line: usize,
        /// The parser's error.
        error: serde_json::Error,
    },
    /// A record without a step.
    #[error("line {0}: no \"step\"")]
    NoStep(usize),
    /// No record has a loss.
    #[error("no step with a loss: expected metrics.jsonl lines with \"step\" and \"loss\"")]
    NoLoss,
}

/// The curves of `metrics` (the text of a metrics.jsonl) as an SVG document titled `title`;
/// an error names the first line that is not a step record.
pub fn curves_svg(metrics: &str, title: &str) -> Result<String, PlotError> {
    let (mut loss, mut train, mut test) = (Vec::new(), Vec::new(), Vec::new());
    for (i, line) in metrics
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: Value = serde_json::from_str(line)
            .map_err(|error| PlotError::NotJson { line: i + 1, error })?;
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        let step = num("step").ok_or(PlotError::NoStep(i + 1))?;
        if let Some(l) = num("loss").filter(|l| l.is_finite()) {
            loss.push((step, l));
        }
        if let Some(a) = num("train_acc") {
            train.push((step, a));
        }
        if let Some(a) = num("test_acc_before_step") {
            test.push((step, a));
        }
        // the closing line: the final evaluation, after the last step
        if let Some(a) = num("test_acc") {
            test.push((step, a));
        }
    }
    if loss.is_empty() {
        return Err(PlotError::NoLoss);
    }
    let panels = [
        (
            "training loss",
            vec![Series {
                name: "loss (mean over the global batch)",
                colour: "#1f77b4",
                points: downsample(&loss, 1000),
                dots: false,
            }],
        ),
        (
            "accuracy",
            vec![
                Series {
                    name: "train (global batch)",
                    colour: "#ff7f0e",
                    points: downsample(&train, 1000),
                    dots: false,
                },
                Series {
                    name: "test",
                    colour: "#2ca02c",
                    points: test,
                    dots: true,
                },
            ],
        ),
    ];
    // the legends sit right of the panels, over no curve
    let (w, panel_h, top) = (1080.0, 300.0, 40.0);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{}" font-family="sans-serif" font-size="12">"#,
        top + 2.0 * panel_h
    );
    let _ = write!(
        svg,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    let x_max = loss.last().map_or(1.0, |p| p.0).max(1.0);
    for (i, (label, series)) in panels.iter().enumerate() {
        let y0 = top + i as f64 * panel_h;
        draw_panel(&mut svg, label, series, y0, w, panel_h, x_max);
    }
    svg.push_str("</svg>\n");
    Ok(svg)
}

fn draw_panel(
    svg: &mut String,
    label: &str,
    series: &[Series],
    y0: f64,
    w: f64,
    h: f64,
    x_max: f64,
) {
    let (left, right, pad_top, pad_bottom) = (70.0, LEGEND_WIDTH, 20.0, 40.0);
    let (pw, ph) = (w - left - right, h - pad_top - pad_bottom);
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (mut lo, mut hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| {
        (a.min(y), b.max(y))
    });
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    if hi - lo < 1e-12 {
        hi = lo + 1.0;
    }
    // non-negative curves start at 0
    lo = lo.min(0.0);
    let px = |x: f64| left + pw * x / x_max;
    let py = |y: f64| y0 + pad_top + ph * (1.0 - (y - lo) / (hi - lo));
    let _ = write!(
        svg,
        r##"<rect x="{left}" y="{}" width="{pw}" height="{ph}" fill="none" stroke="#888"/><text x="{}" y="{}" text-anchor="middle" transform="rotate(-90 {} {})">{label}</text>"##,
        y0 + pad_top,
        18.0,
        y0 + pad_top + ph / 2.0,
        18.0,
        y0 + pad_top + ph / 2.0,
    );
    for k in 0..=4 {
        let y = lo + (hi - lo) * f64::from(k) / 4.0;
        let _ = write!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="end">{}</text>"##,
            left - 6.0,
            py(y) + 4.0,
            tick(y),
        );
    }
    for x in round_ticks(x_max) {
        let _ = write!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle">{x}</text>"##,
            px(x as f64),
            y0 + pad_top + ph + 16.0,
        );
    }
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">step</text>"#,
        left + pw / 2.0,
        y0 + pad_top + ph + 32.0
    );
    // a legend entry only for a curve with points
    for (i, s) in series.iter().filter(|s| !s.points.is_empty()).enumerate() {
        let _ = write!(
            svg,
            r#"<rect x="{}" y="{}" width="12" height="3" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            left + pw + 12.0,
            y0 + pad_top + 14.0 + 16.0 * i as f64,
            s.colour,
            left + pw + 30.0,
            y0 + pad_top + 18.0 + 16.0 * i as f64,
            escape(s.name)
        );
    }
    for s in series {
        if s.dots {
            for &(x, y) in &s.points {
                let _ = write!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{}"/>"#,
                    px(x),
                    py(y),
                    s.colour
                );
            }
        } else if !s.points.is_empty() {
            let pts: Vec<String> = s
                .points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                s.colour,
                pts.join(" ")
            );
        }
    }
}

/// Width of the legend column right of the panels.
const LEGEND_WIDTH: f64 = 200.0;

/// Step ticks from 0 to at most `max` at round numbers: multiples of 1, 2 or 5 times a power
/// of ten, at most 8 of them past 0.
fn round_ticks(max: f64) -> Vec<u64> {
    if max < 1.0 {
        return vec![0];
    }
    let mag = 10f64.powf((max / 8.0).log10().floor()).max(1.0);
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| max / s <= 8.0)
        .unwrap_or(10.0 * mag) as u64;
    (0..)
        .map(|k| k * step)
        .take_while(|&x| x as f64 <= max)
        .collect()
}

/// At most `max` points: consecutive points averaged in equal groups.
fn downsample(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max {
        return points.to_vec();
    }
    points
        .chunks(points.len().div_ceil(max))
        .map(|c| {
            let n = c.len() as f64;
            (
                c.iter().map(|p| p.0).sum::<f64>() / n,
                c.iter().map(|p| p.1).sum::<f64>() / n,
            )
        })
        .collect()
}

fn tick(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curves_from_metrics_lines() {
        let mut text = String::new();
        for step in 1..=3000 {
            let mut line = serde_json::json!({
                "step": step, "loss": 2.3 / f64::from(step).sqrt(), "train_acc": 0.5
            });
            if step % 1000 == 1 {
                line["test_acc_before_step"] = serde_json::json!(0.9);
            }
            text.push_str(&format!("{line}\n"));
        }
        let svg = curves_svg(&text, "a <run>").unwrap();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("a &lt;run&gt;"));
        assert_eq!(
            svg.matches("<polyline").count(),
            2,
            "loss and train accuracy"
        );
        assert_eq!(svg.matches("<circle").count(), 3, "three evaluations");
        // shard 0's closing line: the final evaluation is one more point
        let closing = "{\"step\": 3000, \"final\": true, \"test_acc\": 0.95}\n";
        let with_final = curves_svg(&format!("{text}{closing}"), "a <run>").unwrap();
        assert_eq!(
            with_final.matches("<circle").count(),
            4,
            "and the final one"
        );
        let points = svg
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(
            points.split(' ').count(),
            1000,
            "3000 steps averaged into 1000 points"
        );
        // legends right of the panels, ticks at round steps
        let panel_right = 1080.0 - LEGEND_WIDTH;
        let legend_x: Vec<f64> = svg
            .split("<rect x=\"")
            .skip(1)
            .filter(|r| r.contains("height=\"3\""))
            .map(|r| r.split('"').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(legend_x.len(), 3, "loss, train, test");
        assert!(legend_x.iter().all(|&x| x > panel_right), "{legend_x:?}");
        assert_eq!(
            round_ticks(1404.0),
            [0, 200, 400, 600, 800, 1000, 1200, 1400]
        );
        assert_eq!(round_ticks(12.0), [0, 2, 4, 6, 8, 10, 12]);
        assert_eq!(round_ticks(3000.0), [0, 500, 1000, 1500, 2000, 2500, 3000]);
        assert!(svg.contains(">1500</text>") && !svg.contains(">750</text>"));
        // no test entry without test points
        let no_test = curves_svg("{\"step\": 1, \"loss\": 1, \"train_acc\": 0.5}\n", "x").unwrap();
        assert!(!no_test.contains(">test</text>"), "{no_test}");
        let e = curves_svg("{\"loss\": 1}\n", "x").unwrap_err().to_string();
        assert!(e.contains("line 1: no \"step\""), "{e}");
        assert!(
            curves_svg("", "x")
                .unwrap_err()
                .to_string()
                .contains("no step with a loss")
        );
    }
}
