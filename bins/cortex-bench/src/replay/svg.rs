//! The replay's plots, written as SVG by hand: hit ratio per policy (bars, with the
//! infinite-cache bound), simulated TTFT CDF per policy (log time axis), and per-worker routed
//! load over trace time (one panel per policy).
//!
//! Key decision: no plotting crate. Three chart shapes are a few hundred lines of string
//! formatting, and an SVG opens in any browser and diffs as text.

use std::fmt::Write as _;

use super::metrics::PolicyResult;

const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

struct Svg {
    out: String,
}

impl Svg {
    fn new(w: u32, h: u32, title: &str) -> Svg {
        let mut out = String::new();
        let _ = write!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = write!(out, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = write!(
            out,
            r#"<text x="{}" y="20" text-anchor="middle" font-size="14">{}</text>"#,
            w / 2,
            esc(title)
        );
        Svg { out }
    }

    fn text(&mut self, x: f64, y: f64, anchor: &str, s: &str) {
        let _ = write!(self.out, r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}">{}</text>"#, esc(s));
    }

    fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, style: &str) {
        let _ = write!(self.out, r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" {style}/>"#);
    }

    fn polyline(&mut self, pts: &[(f64, f64)], color: &str, width: f64) {
        let mut p = String::new();
        for (x, y) in pts {
            let _ = write!(p, "{x:.1},{y:.1} ");
        }
        let _ = write!(
            self.out,
            r#"<polyline points="{p}" fill="none" stroke="{color}" stroke-width="{width}"/>"#
        );
    }

    fn finish(mut self) -> String {
        self.out.push_str("</svg>\n");
        self.out
    }
}

/// A rectangle of the canvas holding a chart.
#[derive(Clone, Copy)]
struct Frame {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

impl Frame {
    fn axes(&self, svg: &mut Svg) {
        let axis = r##"stroke="#333" stroke-width="1""##;
        svg.line(self.x, self.y + self.h, self.x + self.w, self.y + self.h, axis);
        svg.line(self.x, self.y, self.x, self.y + self.h, axis);
    }
}

fn legend(svg: &mut Svg, x: f64, y: f64, labels: &[&str]) {
    for (i, l) in labels.iter().enumerate() {
        let yy = y + i as f64 * 16.0;
        svg.line(
            x,
            yy - 4.0,
            x + 18.0,
            yy - 4.0,
            &format!(r#"stroke="{}" stroke-width="3""#, PALETTE[i % PALETTE.len()]),
        );
        svg.text(x + 24.0, yy, "start", l);
    }
}

/// The smallest of 1, 2, 2.5, 5 × 10^k (as a share) at or above `v`.
fn nice_top(v: f64) -> f64 {
    let v = v.max(0.01);
    let mag = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * mag).find(|t| *t >= v - 1e-12).unwrap_or(10.0 * mag)
}

/// Bars of the hit ratio per policy, the bound as a dashed line.
#[must_use]
pub fn hit_ratio(title: &str, results: &[PolicyResult], bound: f64) -> String {
    let (w, h) = (760u32, 420u32);
    let mut svg = Svg::new(w, h, title);
    let f = Frame { x: 60.0, y: 40.0, w: f64::from(w) - 90.0, h: f64::from(h) - 140.0 };
    let top = nice_top(results.iter().map(|r| r.hit_ratio).fold(bound, f64::max) * 1.1).min(1.0);
    let y = |v: f64| f.y + f.h - v / top * f.h;
    for k in 0..=5 {
        let v = top * f64::from(k) / 5.0;
        svg.line(f.x, y(v), f.x + f.w, y(v), r##"stroke="#ddd""##);
        svg.text(f.x - 6.0, y(v) + 4.0, "end", &format!("{:.0}%", v * 100.0));
    }
    f.axes(&mut svg);
    let n = results.len().max(1) as f64;
    let slot = f.w / n;
    for (i, r) in results.iter().enumerate() {
        let x = f.x + slot * i as f64 + slot * 0.2;
        let _ = write!(
            svg.out,
            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
            y(r.hit_ratio),
            slot * 0.6,
            f.y + f.h - y(r.hit_ratio),
            PALETTE[i % PALETTE.len()]
        );
        svg.text(x + slot * 0.3, y(r.hit_ratio) - 4.0, "middle", &format!("{:.1}%", r.hit_ratio * 100.0));
        // Two lines: the router, then the policy.
        let (first, rest) = r.label.split_once(' ').unwrap_or((r.label.as_str(), ""));
        svg.text(x + slot * 0.3, f.y + f.h + 16.0, "middle", first);
        svg.text(x + slot * 0.3, f.y + f.h + 30.0, "middle", rest);
    }
    svg.line(f.x, y(bound), f.x + f.w, y(bound), r##"stroke="#000" stroke-dasharray="6,4""##);
    svg.text(
        f.x + f.w / 2.0,
        f64::from(h) - 50.0,
        "middle",
        "share of prompt tokens served from cache (workers' cached_tokens)",
    );
    // The bound's label sits under the chart: above the line it would collide with bar labels.
    svg.text(
        f.x + f.w / 2.0,
        f64::from(h) - 32.0,
        "middle",
        &format!("dashed line: infinite-cache bound of the same requests, {:.1}%", bound * 100.0),
    );
    svg.finish()
}

/// The CDF of simulated TTFT per policy, log time axis.
#[must_use]
pub fn ttft_cdf(title: &str, results: &[PolicyResult]) -> String {
    let (w, h) = (760u32, 470u32 + 16 * results.len() as u32);
    let mut svg = Svg::new(w, h, title);
    let f = Frame { x: 60.0, y: 40.0, w: f64::from(w) - 90.0, h: 360.0 };
    let all = results.iter().flat_map(|r| r.ttft_sorted.iter().copied());
    let (lo, hi) = all.fold((f64::MAX, 0.0f64), |(lo, hi), t| (lo.min(t.max(0.1)), hi.max(t)));
    let (lo, hi) =
        if hi <= 0.0 { (1.0, 10.0) } else { (10f64.powf(lo.log10().floor()), 10f64.powf(hi.log10().ceil())) };
    let (llo, lhi) = (lo.log10(), hi.log10().max(lo.log10() + 1.0));
    let x = |t: f64| f.x + (t.max(lo).log10() - llo) / (lhi - llo) * f.w;
    let y = |p: f64| f.y + f.h - p * f.h;
    for k in 0..=4 {
        let p = f64::from(k) / 4.0;
        svg.line(f.x, y(p), f.x + f.w, y(p), r##"stroke="#ddd""##);
        svg.text(f.x - 6.0, y(p) + 4.0, "end", &format!("{:.0}%", p * 100.0));
    }
    let mut d = llo;
    while d <= lhi + 1e-9 {
        let t = 10f64.powf(d);
        svg.line(x(t), f.y, x(t), f.y + f.h, r##"stroke="#ddd""##);
        svg.text(
            x(t),
            f.y + f.h + 16.0,
            "middle",
            &if t >= 1000.0 { format!("{}s", t / 1000.0) } else { format!("{t}ms") },
        );
        d += 1.0;
    }
    f.axes(&mut svg);
    for (i, r) in results.iter().enumerate() {
        let n = r.ttft_sorted.len();
        let step = (n / 400).max(1);
        let mut pts: Vec<(f64, f64)> = r
            .ttft_sorted
            .iter()
            .enumerate()
            .step_by(step)
            .map(|(k, &t)| (x(t), y((k + 1) as f64 / n as f64)))
            .collect();
        if let Some(&t) = r.ttft_sorted.last() {
            pts.push((x(t), y(1.0)));
        }
        svg.polyline(&pts, PALETTE[i % PALETTE.len()], 2.0);
    }
    let labels: Vec<String> =
        results.iter().map(|r| format!("{} (p99 {:.0} ms)", r.label, r.ttft.p99)).collect();
    let refs: Vec<&str> = labels.iter().map(String::as_str).collect();
    svg.text(f.x + f.w / 2.0, f.y + f.h + 34.0, "middle", "simulated time to first token (trace time)");
    legend(&mut svg, f.x + 10.0, f.y + f.h + 58.0, &refs);
    svg.finish()
}

/// Routed prompt tokens per worker per window over trace time, one panel per policy.
#[must_use]
pub fn load(title: &str, results: &[PolicyResult]) -> String {
    let panel_h = 180.0;
    let (w, h) = (760u32, (60.0 + panel_h * results.len().max(1) as f64) as u32);
    let mut svg = Svg::new(w, h, title);
    let top = results
        .iter()
        .flat_map(|r| r.load.windows.iter().flat_map(|win| win.iter().copied()))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    for (p, r) in results.iter().enumerate() {
        let f = Frame { x: 70.0, y: 40.0 + panel_h * p as f64, w: f64::from(w) - 100.0, h: panel_h - 50.0 };
        let n = r.load.windows.len().max(2);
        let secs = r.load.window.as_secs_f64();
        let x = |k: usize| f.x + k as f64 / (n - 1) as f64 * f.w;
        let y = |v: f64| f.y + f.h - v / top * f.h;
        svg.line(f.x, y(top), f.x + f.w, y(top), r##"stroke="#ddd""##);
        svg.text(f.x - 6.0, y(top) + 4.0, "end", &format!("{:.0}k", top / 1000.0));
        svg.text(f.x - 6.0, y(0.0) + 4.0, "end", "0");
        f.axes(&mut svg);
        let workers = r.load.windows.first().map_or(0, Vec::len);
        for k in 0..workers {
            let pts: Vec<(f64, f64)> =
                r.load.windows.iter().enumerate().map(|(i, win)| (x(i), y(win[k] as f64))).collect();
            svg.polyline(&pts, PALETTE[k % PALETTE.len()], 1.0);
        }
        svg.text(
            f.x + 8.0,
            f.y + 12.0,
            "start",
            &format!(
                "{}: tokens routed per worker per {:.0} s window (CoV {:.2}, max/mean {:.2})",
                r.label, secs, r.load.cov, r.load.max_over_mean
            ),
        );
        svg.text(
            f.x + f.w,
            f.y + f.h + 16.0,
            "end",
            &format!("{:.0} s of trace time", (n - 1) as f64 * secs),
        );
    }
    svg.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed() {
        let mut r = PolicyResult { label: "a<b".to_owned(), hit_ratio: 0.2, ..PolicyResult::default() };
        r.ttft_sorted = vec![1.0, 20.0, 300.0];
        r.load.windows = vec![vec![1, 2], vec![3, 4]];
        r.load.window = std::time::Duration::from_secs(10);
        for s in [hit_ratio("t", &[r.clone()], 0.3), ttft_cdf("t", &[r.clone()]), load("t", &[r])] {
            assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"), "{s}");
            assert!(s.contains("a&lt;b"));
            assert!(!s.contains("NaN"), "{s}");
        }
    }
}
