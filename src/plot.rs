//! Small PNG plots drawn pixel by pixel (no font or system dependency): a line chart
//! (throughput against context length) and decay-matrix heatmaps with the ACP pruning
//! boundary drawn over them (as the ACP paper's Figures 1 and 6). Encoding: the `png` crate.

use crate::error::{Error, Result};
use std::path::Path;

/// An RGB colour.
pub type Rgb = [u8; 3];

pub const WHITE: Rgb = [255, 255, 255];
pub const BLACK: Rgb = [0, 0, 0];
pub const GREY: Rgb = [200, 200, 200];
pub const RED: Rgb = [230, 30, 30];

/// Distinct line colours (Tableau-like palette).
pub const PALETTE: [Rgb; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
];

/// 5x7 glyphs, one byte per row (bit 4 = leftmost column). Lowercase letters use the
/// uppercase glyphs; unknown characters draw an outlined box.
fn glyph(ch: char) -> [u8; 7] {
    let c = ch.to_ascii_uppercase();
    match c {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        ' ' => [0; 7],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        ';' => [0, 0x0C, 0x0C, 0, 0x0C, 0x04, 0x08],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '+' => [0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0],
        '/' => [0, 0x01, 0x02, 0x04, 0x08, 0x10, 0],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        '<' => [0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02],
        '>' => [0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08],
        '[' => [0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E],
        ']' => [0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E],
        '|' => [0x04; 7],
        '*' => [0, 0x04, 0x15, 0x0E, 0x15, 0x04, 0],
        '^' => [0x04, 0x0A, 0x11, 0, 0, 0, 0],
        _ => [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F],
    }
}

/// An RGB image in memory; drawing outside it is clipped.
#[derive(Debug, Clone)]
pub struct Canvas {
    pub width: usize,
    pub height: usize,
    px: Vec<Rgb>,
}

impl Canvas {
    /// A `width` x `height` canvas filled with `bg`.
    pub fn new(width: usize, height: usize, bg: Rgb) -> Canvas {
        Canvas {
            width,
            height,
            px: vec![bg; width * height],
        }
    }

    /// The pixel at (x, y), if inside.
    pub fn get(&self, x: usize, y: usize) -> Option<Rgb> {
        (x < self.width && y < self.height).then(|| self.px[y * self.width + x])
    }

    /// Sets one pixel (ignored outside the canvas).
    pub fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < self.width && (y as usize) < self.height {
            self.px[y as usize * self.width + x as usize] = c;
        }
    }

    /// Fills `[x, x + w) x [y, y + h)`.
    pub fn fill_rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.set(xx, yy, c);
            }
        }
    }

    /// Outline of `[x, x + w) x [y, y + h)`.
    pub fn rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        self.line(x, y, x + w - 1, y, c, 1);
        self.line(x, y + h - 1, x + w - 1, y + h - 1, c, 1);
        self.line(x, y, x, y + h - 1, c, 1);
        self.line(x + w - 1, y, x + w - 1, y + h - 1, c, 1);
    }

    /// A line from (x0, y0) to (x1, y1), `thick` pixels wide (Bresenham, square pen).
    pub fn line(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb, thick: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        let r0 = -(thick - 1) / 2;
        loop {
            for oy in r0..r0 + thick {
                for ox in r0..r0 + thick {
                    self.set(x + ox, y + oy, c);
                }
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Text with its top-left corner at (x, y); glyphs are 5x7 cells of `scale` pixels
    /// with one cell of spacing. Returns the width drawn (pixels).
    pub fn text(&mut self, x: i64, y: i64, s: &str, c: Rgb, scale: i64) -> i64 {
        let mut cx = x;
        for ch in s.chars() {
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0x10 >> col) != 0 {
                        self.fill_rect(cx + col * scale, y + row as i64 * scale, scale, scale, c);
                    }
                }
            }
            cx += 6 * scale;
        }
        cx - x
    }

    /// Width in pixels of `s` drawn at `scale`.
    pub fn text_width(s: &str, scale: i64) -> i64 {
        s.chars().count() as i64 * 6 * scale
    }

    /// Writes the canvas as an 8-bit RGB PNG.
    pub fn save_png(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error| Error::Io {
            path: path.to_path_buf(),
            source: e,
        };
        let enc_err =
            |e: png::EncodingError| io(std::io::Error::other(format!("PNG encoding: {e}")));
        let f = std::fs::File::create(path).map_err(io)?;
        let w = std::io::BufWriter::new(f);
        let (wi, hi) = (
            u32::try_from(self.width).map_err(|_| Error::invalid("image too wide"))?,
            u32::try_from(self.height).map_err(|_| Error::invalid("image too tall"))?,
        );
        let mut enc = png::Encoder::new(w, wi, hi);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut wr = enc.write_header().map_err(enc_err)?;
        let data: Vec<u8> = self.px.iter().flat_map(|p| p.iter().copied()).collect();
        wr.write_image_data(&data).map_err(enc_err)?;
        wr.finish().map_err(enc_err)
    }
}

/// A perceptually ordered colour for `v` in [0, 1] (dark purple → teal → yellow, piecewise
/// linear through five anchor colours of the viridis map).
pub fn colormap(v: f64) -> Rgb {
    const ANCHORS: [[f64; 3]; 5] = [
        [68.0, 1.0, 84.0],
        [59.0, 82.0, 139.0],
        [33.0, 145.0, 140.0],
        [94.0, 201.0, 98.0],
        [253.0, 231.0, 37.0],
    ];
    let v = if v.is_nan() { 0.0 } else { v.clamp(0.0, 1.0) };
    let x = v * (ANCHORS.len() - 1) as f64;
    let i = (x.floor() as usize).min(ANCHORS.len() - 2);
    let f = x - i as f64;
    let mut o = [0u8; 3];
    for (k, ok) in o.iter_mut().enumerate() {
        *ok = (ANCHORS[i][k] * (1.0 - f) + ANCHORS[i + 1][k] * f).round() as u8;
    }
    o
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

/// "Nice" tick step near `span / 5` (1, 2 or 5 times a power of ten).
fn nice_step(span: f64) -> f64 {
    let raw = (span / 5.0).max(f64::MIN_POSITIVE);
    let p = 10f64.powf(raw.log10().floor());
    let m = raw / p;
    p * if m < 1.5 {
        1.0
    } else if m < 3.5 {
        2.0
    } else if m < 7.5 {
        5.0
    } else {
        10.0
    }
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 1024.0 && (v / 1024.0).fract() == 0.0 {
        format!("{}K", v / 1024.0)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v.abs() >= 0.1 {
        format!("{v:.1}")
    } else {
        format!("{v:.2e}")
    }
}

/// A line chart with a log2 x axis (ticks at the data's x values) and a linear y axis
/// from 0, a title, axis labels and a legend. Errors: no finite point, or I/O.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<()> {
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && *x > 0.0 && y.is_finite())
        .collect();
    if pts.is_empty() {
        return Err(Error::invalid("line chart: no finite point to draw"));
    }
    let (w, h) = (900i64, 560i64);
    let (ml, mr, mt, mb) = (90i64, 230i64, 50i64, 70i64);
    let mut cv = Canvas::new(w as usize, h as usize, WHITE);
    let lx = |x: f64| x.log2();
    let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
    let mut y1 = 0.0f64;
    for &(x, y) in &pts {
        x0 = x0.min(lx(x));
        x1 = x1.max(lx(x));
        y1 = y1.max(y);
    }
    if x1 - x0 < 1e-9 {
        x0 -= 1.0;
        x1 += 1.0;
    }
    let step = nice_step(if y1 > 0.0 { y1 } else { 1.0 });
    let ytop = ((y1 / step).ceil() * step).max(step);
    let (pw, ph) = (w - ml - mr, h - mt - mb);
    let px = |x: f64| ml + ((lx(x) - x0) / (x1 - x0) * (pw - 20) as f64).round() as i64 + 10;
    let py = |y: f64| mt + ph - (y / ytop * ph as f64).round() as i64;
    // Grid and y ticks.
    let mut yv = 0.0;
    while yv <= ytop + step * 0.01 {
        let y = py(yv);
        cv.line(ml, y, ml + pw, y, GREY, 1);
        let s = fmt_tick(yv);
        cv.text(ml - 8 - Canvas::text_width(&s, 2), y - 7, &s, BLACK, 2);
        yv += step;
    }
    let mut xs: Vec<f64> = pts.iter().map(|p| p.0).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    for &x in &xs {
        let xp = px(x);
        cv.line(xp, mt, xp, mt + ph, GREY, 1);
        let s = fmt_tick(x);
        cv.text(
            xp - Canvas::text_width(&s, 2) / 2,
            mt + ph + 10,
            &s,
            BLACK,
            2,
        );
    }
    cv.rect(ml, mt, pw, ph, BLACK);
    cv.text(ml, 15, title, BLACK, 2);
    cv.text(
        ml + pw / 2 - Canvas::text_width(x_label, 2) / 2,
        h - 30,
        x_label,
        BLACK,
        2,
    );
    // Vertical y label: one character per line.
    for (i, ch) in y_label.chars().enumerate() {
        cv.text(12, mt + 10 + i as i64 * 16, &ch.to_string(), BLACK, 2);
    }
    for (si, s) in series.iter().enumerate() {
        let mut p: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && *x > 0.0 && y.is_finite())
            .collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        for win in p.windows(2) {
            let (a, b) = (win[0], win[1]);
            let (ax, ay, bx, by) = (px(a.0), py(a.1), px(b.0), py(b.1));
            if s.dashed {
                let n = (((bx - ax).pow(2) + (by - ay).pow(2)) as f64).sqrt() / 8.0;
                let n = n.max(1.0) as i64;
                for k in (0..n).step_by(2) {
                    let f0 = k as f64 / n as f64;
                    let f1 = ((k + 1) as f64 / n as f64).min(1.0);
                    let l = |f: f64, u: i64, v: i64| u + ((v - u) as f64 * f).round() as i64;
                    cv.line(
                        l(f0, ax, bx),
                        l(f0, ay, by),
                        l(f1, ax, bx),
                        l(f1, ay, by),
                        s.color,
                        3,
                    );
                }
            } else {
                cv.line(ax, ay, bx, by, s.color, 3);
            }
        }
        for &(x, y) in &p {
            cv.fill_rect(px(x) - 4, py(y) - 4, 9, 9, s.color);
        }
        let ly = mt + 10 + si as i64 * 24;
        let lx0 = ml + pw + 15;
        if s.dashed {
            cv.line(lx0, ly + 7, lx0 + 8, ly + 7, s.color, 3);
            cv.line(lx0 + 16, ly + 7, lx0 + 24, ly + 7, s.color, 3);
        } else {
            cv.line(lx0, ly + 7, lx0 + 24, ly + 7, s.color, 3);
        }
        cv.text(lx0 + 32, ly, &s.name, BLACK, 2);
    }
    cv.save_png(path)
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

/// Heatmaps of `D_ij = c_i - c_j` (the log decay, `<= 0`, on `j <= i`), shaded from
/// `clip` (dark, `D <= clip < 0`) to 0 (bright); the upper triangle is left white. The ACP
/// boundary is drawn in red: left of the staircase every block has `max D < delta` and is
/// skipped. `per_row` panels per row, `size` pixels square each.
pub fn decay_heatmaps(
    path: &Path,
    title: &str,
    panels: &[DecayPanel],
    clip: f64,
    per_row: usize,
    size: usize,
) -> Result<()> {
    if panels.is_empty() || per_row == 0 || size < 16 {
        return Err(Error::invalid(
            "decay heatmaps: need panels, per_row > 0, size >= 16",
        ));
    }
    if !(clip.is_finite() && clip < 0.0) {
        return Err(Error::invalid(
            "decay heatmaps: clip must be finite and < 0",
        ));
    }
    let rows = panels.len().div_ceil(per_row);
    let (pad, top, bar) = (40i64, 60i64, 90i64);
    let s = size as i64;
    let w = pad + per_row as i64 * (s + pad) + bar;
    let h = top + rows as i64 * (s + pad + 30) + 10;
    let mut cv = Canvas::new(w as usize, h as usize, WHITE);
    cv.text(pad, 15, title, BLACK, 2);
    for (pi, p) in panels.iter().enumerate() {
        let t = p.c.len();
        if t == 0 || p.block == 0 {
            return Err(Error::invalid("decay heatmaps: empty panel"));
        }
        let ox = pad + (pi % per_row) as i64 * (s + pad);
        let oy = top + (pi / per_row) as i64 * (s + pad + 30) + 22;
        cv.text(ox, oy - 20, &p.title, BLACK, 2);
        let cell = |k: i64| ((k as f64 + 0.5) * t as f64 / size as f64) as usize;
        for y in 0..s {
            let i = cell(y).min(t - 1);
            for x in 0..s {
                let j = cell(x).min(t - 1);
                if j <= i {
                    let d = p.c[i] - p.c[j];
                    cv.set(ox + x, oy + y, colormap(1.0 - d / clip));
                }
            }
        }
        let to_px = |tok: usize| (tok as f64 * size as f64 / t as f64).round() as i64;
        let mut prev_x: Option<i64> = None;
        for (qb, &sb) in p.start_blocks.iter().enumerate() {
            let y0 = to_px(qb * p.block);
            let y1 = to_px(((qb + 1) * p.block).min(t));
            let x = to_px((sb as usize * p.block).min(t));
            if let Some(px) = prev_x
                && px != x
            {
                cv.line(ox + px, oy + y0, ox + x, oy + y0, RED, 2);
            }
            cv.line(ox + x, oy + y0, ox + x, oy + y1, RED, 2);
            prev_x = Some(x);
        }
        cv.rect(ox - 1, oy - 1, s + 2, s + 2, BLACK);
    }
    // Colour bar: D from clip (bottom) to 0 (top).
    let bx = w - bar + 10;
    let (by, bh) = (top + 22, s.min(300));
    for y in 0..bh {
        let v = 1.0 - y as f64 / (bh - 1).max(1) as f64;
        cv.fill_rect(bx, by + y, 18, 1, colormap(v));
    }
    cv.rect(bx, by, 18, bh, BLACK);
    cv.text(bx + 22, by - 3, "0", BLACK, 2);
    cv.text(bx + 22, by + bh - 12, &format!("{clip:.0}"), BLACK, 2);
    cv.text(bx - 4, by + bh + 8, "D", BLACK, 2);
    cv.save_png(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colormap_ends_and_clamp() {
        assert_eq!(colormap(0.0), [68, 1, 84]);
        assert_eq!(colormap(1.0), [253, 231, 37]);
        assert_eq!(colormap(-3.0), colormap(0.0));
        assert_eq!(colormap(f64::NAN), colormap(0.0));
    }

    #[test]
    fn line_and_text_draw_pixels() {
        let mut c = Canvas::new(40, 20, WHITE);
        c.line(0, 0, 39, 19, BLACK, 1);
        assert_eq!(c.get(0, 0), Some(BLACK));
        assert_eq!(c.get(39, 19), Some(BLACK));
        let w = c.text(0, 10, "1", RED, 1);
        assert_eq!(w, 6);
        assert_eq!(c.get(2, 10), Some(RED)); // top of the "1" stem
        assert_eq!(c.get(100, 100), None);
    }

    #[test]
    fn png_round_trip() {
        let dir = std::env::temp_dir().join(format!("foxedge-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.png");
        let mut c = Canvas::new(7, 3, WHITE);
        c.set(6, 2, [1, 2, 3]);
        c.save_png(&p).unwrap();
        let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&p).unwrap()));
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (7, 3));
        assert_eq!(&buf[(2 * 7 + 6) * 3..][..3], &[1, 2, 3]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
