//! PNG plots of the command line (plotters, bitmap backend): throughput against context
//! length, and decay-matrix heatmaps with the ACP pruning boundary drawn over them (as the
//! ACP paper's Figures 1 and 6). Text is drawn with an embedded font (`fonts/`, DejaVu Sans
//! cut to Basic Latin), so no system font is needed.

use foxedge::{Error, Result};
use plotters::prelude::*;
use plotters::style::colors::colormaps::ViridisRGB;
use plotters::style::{FontStyle, register_font};
use std::path::Path;
use std::sync::OnceLock;

/// DejaVu Sans, Basic Latin subset (license: `fonts/LICENSE`).
const FONT: &[u8] = include_bytes!("fonts/DejaVuSans-subset.ttf");

/// An RGB colour.
pub type Rgb = RGBColor;

/// Distinct line colours (Tableau-like palette).
pub const PALETTE: [Rgb; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// The ACP boundary's colour.
const BOUNDARY: Rgb = RGBColor(230, 30, 30);

/// Registers the embedded font as plotters' "sans-serif" (once per process).
fn font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    if *DONE.get_or_init(|| register_font("sans-serif", FontStyle::Normal, FONT).is_ok()) {
        Ok(())
    } else {
        Err(Error::Internal(
            "the embedded plot font does not parse".into(),
        ))
    }
}

/// A drawing error on `path` as an I/O error naming the file.
fn draw_err(path: &Path) -> impl Fn(&dyn std::fmt::Display) -> Error + '_ {
    move |e| Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(format!("drawing the plot: {e}")),
    }
}

/// One line of a [`line_chart`].
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub color: Rgb,
    pub dashed: bool,
    /// (x, y) points, drawn in x order.
    pub points: Vec<(f64, f64)>,
}

/// `1024` → `1K`, `65536` → `64K`; other lengths as they are.
fn tokens_label(x: f64) -> String {
    if x >= 1024.0 && (x / 1024.0).fract() == 0.0 {
        format!("{}K", x / 1024.0)
    } else {
        format!("{x:.0}")
    }
}

/// A line chart of `series` with a log2 x axis (a tick per power of two) and a
/// linear y axis from 0, a title, axis labels and a legend right of the plot (dashed lines
/// dashed there too). Points with a non-finite or non-positive x, or a non-finite y, are left
/// out. Errors: no point left, or I/O.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<()> {
    let ok = |&(x, y): &(f64, f64)| x.is_finite() && x > 0.0 && y.is_finite();
    let mut xs: Vec<f64> = Vec::new();
    let mut y_max = 0.0f64;
    for &(x, y) in series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|p| ok(p))
    {
        xs.push(x.log2());
        y_max = y_max.max(y);
    }
    if xs.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{}: no finite point to draw",
            path.display()
        )));
    }
    font()?;
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let (x0, x1) = (xs[0] - 0.3, xs[xs.len() - 1] + 0.3);
    let y1 = if y_max > 0.0 { y_max * 1.08 } else { 1.0 };
    let err = draw_err(path);
    let root = BitMapBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (plot_area, legend_area) = root.split_horizontally(760);
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, 0.0..y1)
        .map_err(|e| err(&e))?;
    // One tick per power of two (log2 steps of 1), labelled in tokens.
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels((x1 - x0).ceil() as usize + 1)
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|v| {
            if (v - v.round()).abs() < 1e-6 {
                tokens_label(v.round().exp2())
            } else {
                String::new()
            }
        })
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 14))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| err(&e))?;
    for s in series {
        let mut pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(ok)
            .map(|(x, y)| (x.log2(), y))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let style = s.color.stroke_width(3);
        if s.dashed {
            chart
                .draw_series(DashedLineSeries::new(pts.clone(), 10, 6, style))
                .map_err(|e| err(&e))?;
        } else {
            chart
                .draw_series(LineSeries::new(pts.clone(), style))
                .map_err(|e| err(&e))?;
        }
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, s.color.filled())))
            .map_err(|e| err(&e))?;
    }
    // The legend: one row per series, a line sample then the name.
    let text = ("sans-serif", 15).into_font().color(&BLACK);
    for (i, s) in series.iter().enumerate() {
        let y = 60 + 26 * i as i32;
        let style = s.color.stroke_width(3);
        if s.dashed {
            for x in [10, 30] {
                legend_area
                    .draw(&PathElement::new(vec![(x, y), (x + 12, y)], style))
                    .map_err(|e| err(&e))?;
            }
        } else {
            legend_area
                .draw(&PathElement::new(vec![(10, y), (42, y)], style))
                .map_err(|e| err(&e))?;
        }
        legend_area
            .draw(&Text::new(s.name.clone(), (52, y - 8), text.clone()))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

/// One head's decay matrix for [`decay_heatmaps`].
#[derive(Debug, Clone, PartialEq)]
pub struct DecayPanel {
    pub title: String,
    /// `c_i`, the cumulative log forget gates of the head (`t` values, non-increasing).
    pub c: Vec<f64>,
    /// First kept key block of each query block (ACP boundary), `block` tokens per block.
    pub start_blocks: Vec<u32>,
    pub block: usize,
}

/// The heatmap's colour for `D`: viridis from `clip` (dark, `D <= clip < 0`) to 0 (bright).
fn shade(d: f64, clip: f64) -> Rgb {
    let v = 1.0 - d / clip;
    let v = if v.is_nan() { 0.0 } else { v.clamp(0.0, 1.0) };
    ViridisRGB.get_color(v as f32)
}

/// Cells per side of a panel's heatmap: one per token up to this, coarser beyond.
const CELLS: usize = 256;

/// Heatmaps of `D_ij = c_i - c_j` (the log of the decay between key j and query i, `<= 0` on
/// `j <= i`; DESIGN "ACP"), query i down and key j across, in tokens, shaded from `clip`
/// (dark, `D <= clip < 0`) to 0 (bright); the upper triangle is left white. The ACP boundary
/// is drawn in red: key blocks left of it have `max D < delta` and are skipped. `per_row`
/// panels per row, `size` pixels square each, a colour bar for D and a legend at the right.
pub fn decay_heatmaps(
    path: &Path,
    title: &str,
    panels: &[DecayPanel],
    clip: f64,
    per_row: usize,
    size: usize,
) -> Result<()> {
    if panels.is_empty() || per_row == 0 || size < 16 {
        return Err(Error::InvalidArgument(
            "decay heatmaps: need panels, per_row > 0, size >= 16".into(),
        ));
    }
    if !(clip.is_finite() && clip < 0.0) {
        return Err(Error::InvalidArgument(
            "decay heatmaps: clip must be finite and < 0".into(),
        ));
    }
    if panels.iter().any(|p| p.c.is_empty() || p.block == 0) {
        return Err(Error::InvalidArgument("decay heatmaps: empty panel".into()));
    }
    font()?;
    let rows = panels.len().div_ceil(per_row);
    // A panel: its plot of `size` pixels plus room for its title, tick labels and axis names.
    let (pw, ph) = (size as u32 + 90, size as u32 + 90);
    let bar_w = 200u32;
    // Below the panels: room for the boundary's legend under the colour bar.
    let (w, h) = (per_row as u32 * pw + bar_w, rows as u32 * ph + 100);
    let err = draw_err(path);
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 18))
        .map_err(|e| err(&e))?;
    let (grid, side) = root.split_horizontally(per_row as u32 * pw);
    let cells = grid.split_evenly((rows, per_row));
    for (p, area) in panels.iter().zip(&cells) {
        let t = p.c.len() as f64;
        let mut chart = ChartBuilder::on(area)
            .caption(&p.title, ("sans-serif", 15))
            .margin(6)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..t, t..0.0)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("key j (tokens)")
            .y_desc("query i (tokens)")
            .x_labels(4)
            .y_labels(4)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .axis_desc_style(("sans-serif", 13))
            .label_style(("sans-serif", 12))
            .draw()
            .map_err(|e| err(&e))?;
        // Lower triangle in n x n cells of `step` tokens, each shaded by D at its centre.
        let n = p.c.len().min(CELLS);
        let step = t / n as f64;
        let at = |k: usize| (((k as f64 + 0.5) * step) as usize).min(p.c.len() - 1);
        let cells = (0..n).flat_map(|yi| {
            (0..=yi).map(move |xj| {
                let d = p.c[at(yi)] - p.c[at(xj)];
                let (x, y) = (xj as f64 * step, yi as f64 * step);
                Rectangle::new([(x, y), (x + step, y + step)], shade(d, clip).filled())
            })
        });
        chart.draw_series(cells).map_err(|e| err(&e))?;
        // The boundary: for each query block, a vertical at its first kept key.
        let mut stair: Vec<(f64, f64)> = Vec::with_capacity(2 * p.start_blocks.len());
        for (qb, &sb) in p.start_blocks.iter().enumerate() {
            let x = ((sb as usize).saturating_mul(p.block) as f64).min(t);
            let y0 = ((qb * p.block) as f64).min(t);
            let y1 = (((qb + 1) * p.block) as f64).min(t);
            stair.push((x, y0));
            stair.push((x, y1));
        }
        chart
            .draw_series(LineSeries::new(stair, BOUNDARY.stroke_width(2)))
            .map_err(|e| err(&e))?;
    }
    // Colour bar for D (0 at the top, `clip` at the bottom), then the boundary's legend.
    let (bar, legend) = side.split_vertically(size as u32 + 70);
    let mut chart = ChartBuilder::on(&bar)
        .margin_top(30)
        .margin_bottom(10)
        .margin_left(10)
        .margin_right(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..1.0, clip..0.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_desc("D = c_i - c_j (ln of the decay)")
        .y_labels(6)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .axis_desc_style(("sans-serif", 13))
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| err(&e))?;
    let steps = 128;
    chart
        .draw_series((0..steps).map(|k| {
            let d0 = clip * k as f64 / steps as f64;
            let d1 = clip * (k + 1) as f64 / steps as f64;
            Rectangle::new([(0.0, d0), (1.0, d1)], shade(d0, clip).filled())
        }))
        .map_err(|e| err(&e))?;
    let text = ("sans-serif", 13).into_font().color(&BLACK);
    legend
        .draw(&PathElement::new(
            vec![(12, 12), (40, 12)],
            BOUNDARY.stroke_width(2),
        ))
        .map_err(|e| err(&e))?;
    for (k, line) in ["ACP boundary:", "key blocks left", "of it are skipped"]
        .iter()
        .enumerate()
    {
        legend
            .draw(&Text::new(
                line.to_string(),
                (48, 5 + 17 * k as i32),
                text.clone(),
            ))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("foxedge-plot-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d.join(name)
    }

    /// Decodes an RGB8 PNG: (width, height, pixels).
    fn decode(path: &Path) -> (u32, u32, Vec<u8>) {
        let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    fn has(pixels: &[u8], c: Rgb) -> bool {
        pixels.chunks_exact(3).any(|p| p == [c.0, c.1, c.2])
    }

    #[test]
    fn shades_run_from_dark_at_clip_to_bright_at_zero() {
        assert_eq!(shade(-20.0, -20.0), RGBColor(68, 1, 84));
        assert_eq!(shade(-50.0, -20.0), shade(-20.0, -20.0));
        assert_eq!(shade(f64::NAN, -20.0), shade(-20.0, -20.0));
        let bright = shade(0.0, -20.0);
        assert!(bright.0 > 200 && bright.1 > 200, "{bright:?}");
        assert_eq!(shade(3.0, -20.0), bright);
    }

    #[test]
    fn line_chart_draws_every_series_and_rejects_no_points() {
        let p = temp("line.png");
        let series = [
            Series {
                name: "cpu dense".into(),
                color: PALETTE[0],
                dashed: true,
                points: vec![(1024.0, 10.0), (4096.0, 12.0), (f64::NAN, 1.0)],
            },
            Series {
                name: "cpu acp".into(),
                color: PALETTE[1],
                dashed: false,
                points: vec![(1024.0, 20.0), (4096.0, 35.0)],
            },
        ];
        line_chart(&p, "t", "context (tokens)", "GFLOP/s", &series).unwrap();
        let (w, h, px) = decode(&p);
        assert_eq!((w, h), (1000, 560));
        assert!(has(&px, PALETTE[0]) && has(&px, PALETTE[1]));
        let none = [Series {
            points: vec![(0.0, 1.0), (f64::INFINITY, 1.0)],
            ..series[0].clone()
        }];
        assert!(line_chart(&p, "t", "x", "y", &none).is_err());
        std::fs::remove_file(&p).ok();
    }

    /// A head that decays by 1 per token, all blocks of 16 before the previous one skipped:
    /// viridis cells and the red boundary are drawn; bad arguments are errors.
    #[test]
    fn heatmaps_draw_cells_and_the_boundary() {
        let p = temp("decay.png");
        let t = 64;
        let panel = DecayPanel {
            title: "L0 H0".into(),
            c: (0..t).map(|i| -(i as f64)).collect(),
            start_blocks: vec![0, 0, 1, 2],
            block: 16,
        };
        decay_heatmaps(&p, "D", &[panel.clone(), panel.clone()], -40.0, 2, 100).unwrap();
        let (_, _, px) = decode(&p);
        assert!(has(&px, BOUNDARY));
        assert!(has(&px, shade(0.0, -40.0)), "the diagonal is bright");
        assert!(has(&px, shade(-40.0, -40.0)), "far keys are dark");
        for (panels, clip, per_row, size) in [
            (vec![], -40.0, 2, 100),
            (vec![panel.clone()], 0.0, 2, 100),
            (vec![panel.clone()], f64::NAN, 2, 100),
            (vec![panel.clone()], -40.0, 0, 100),
            (vec![panel.clone()], -40.0, 2, 8),
            (
                vec![DecayPanel {
                    c: vec![],
                    ..panel.clone()
                }],
                -40.0,
                2,
                100,
            ),
        ] {
            assert!(decay_heatmaps(&p, "D", &panels, clip, per_row, size).is_err());
        }
        std::fs::remove_file(&p).ok();
    }
}
