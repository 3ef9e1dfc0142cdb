//! PNG charts for benchmark results: [`line_plot`] (latency vs load, IOPS vs queue depth, …)
//! and [`bar_plot`] (kura next to its anchors).
//!
//! Drawn with plotters' bitmap backend; text uses DejaVu Sans compiled into the binary, so
//! plots render the same on a machine without fontconfig, FreeType or any font installed.

use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, Ranged, ValueFormatter};
use plotters::prelude::*;
use plotters::style::FontStyle;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use thiserror::Error;

pub const PLOT_WIDTH_PX: u32 = 1200;
pub const PLOT_HEIGHT_PX: u32 = 750;
const TITLE_FONT_PX: u32 = 30;
const LABEL_FONT_PX: u32 = 20;
const AXIS_DESC_FONT_PX: u32 = 22;
/// Linear axes get this fraction of their span as headroom on each side.
const AXIS_PAD_FRACTION: f64 = 0.05;
/// Log axes get this factor of headroom below and above.
const LOG_AXIS_PAD_FACTOR: f64 = 1.25;
const SERIES_COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

#[derive(Debug, Error)]
pub enum PlotError {
    #[error("nothing to plot: {0}")]
    NoData(&'static str),
    #[error("{axis} axis is logarithmic but has the value {value}, which is not positive")]
    NotPositiveOnLogAxis { axis: char, value: f64 },
    #[error("{axis} axis has the value {value}, which is not finite")]
    NotFinite { axis: char, value: f64 },
    #[error("cannot load the embedded font")]
    Font,
    #[error("cannot draw {path}: {reason}")]
    Draw { path: String, reason: String },
}

fn ensure_fonts() -> Result<(), PlotError> {
    static FONTS: OnceLock<bool> = OnceLock::new();
    let ok = *FONTS.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .is_ok()
            && plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold())
                .is_ok()
    });
    if ok { Ok(()) } else { Err(PlotError::Font) }
}

fn draw_err(path: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |reason| PlotError::Draw {
        path: path.display().to_string(),
        reason,
    }
}

/// Short tick labels: 0.5, 12, 1500, 2.5e6.
fn format_tick(v: &f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".to_owned()
    } else if !(1e-3..1e6).contains(&a) {
        format!("{v:.1e}")
    } else if a >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// Smallest and largest of `values`; `Err` for no values, a non-finite value, or a non-positive
/// one on a log axis.
fn extent(
    axis: char,
    values: impl Iterator<Item = f64>,
    log: bool,
) -> Result<(f64, f64), PlotError> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for value in values {
        if !value.is_finite() {
            return Err(PlotError::NotFinite { axis, value });
        }
        if log && value <= 0.0 {
            return Err(PlotError::NotPositiveOnLogAxis { axis, value });
        }
        lo = lo.min(value);
        hi = hi.max(value);
    }
    if lo > hi {
        return Err(PlotError::NoData("no points"));
    }
    Ok((lo, hi))
}

/// Axis range over `values`, with headroom on both sides.
fn axis_range(
    axis: char,
    values: impl Iterator<Item = f64>,
    log: bool,
) -> Result<Range<f64>, PlotError> {
    let (lo, hi) = extent(axis, values, log)?;
    if log {
        return Ok(lo / LOG_AXIS_PAD_FACTOR..hi * LOG_AXIS_PAD_FACTOR);
    }
    let pad = if hi > lo {
        (hi - lo) * AXIS_PAD_FRACTION
    } else {
        lo.abs().max(1.0) * AXIS_PAD_FRACTION
    };
    Ok(lo - pad..hi + pad)
}

/// Draws `series` (name, points) as lines with point markers into a PNG at `path`, with a
/// legend; `log_x`/`log_y` make that axis logarithmic (then all its values must be > 0).
/// Makes the directory a plot goes in (a bench's default path may be in one not made yet).
fn make_parent(path: &Path) -> Result<(), PlotError> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => std::fs::create_dir_all(dir).map_err(|e| PlotError::Draw { path: path.display().to_string(), reason: format!("cannot create {}: {e}", dir.display()) }),
        None => Ok(()),
    }
}

pub fn line_plot<S: AsRef<str>>(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(S, Vec<(f64, f64)>)],
    log_x: bool,
    log_y: bool,
) -> Result<(), PlotError> {
    ensure_fonts()?;
    make_parent(path)?;
    if series.iter().all(|(_, points)| points.is_empty()) {
        return Err(PlotError::NoData("every series is empty"));
    }
    let xs = axis_range(
        'x',
        series.iter().flat_map(|(_, p)| p.iter().map(|&(x, _)| x)),
        log_x,
    )?;
    let ys = axis_range(
        'y',
        series.iter().flat_map(|(_, p)| p.iter().map(|&(_, y)| y)),
        log_y,
    )?;
    let labels = Labels {
        title,
        x: x_label,
        y: y_label,
    };
    match (log_x, log_y) {
        (false, false) => draw_lines(path, &labels, series, xs, ys),
        (true, false) => draw_lines(path, &labels, series, xs.log_scale(), ys),
        (false, true) => draw_lines(path, &labels, series, xs, ys.log_scale()),
        (true, true) => draw_lines(path, &labels, series, xs.log_scale(), ys.log_scale()),
    }
}

struct Labels<'a> {
    title: &'a str,
    x: &'a str,
    y: &'a str,
}

fn draw_lines<S, X, Y>(
    path: &Path,
    labels: &Labels<'_>,
    series: &[(S, Vec<(f64, f64)>)],
    x: X,
    y: Y,
) -> Result<(), PlotError>
where
    S: AsRef<str>,
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let err = draw_err(path);
    let root = BitMapBackend::new(path, (PLOT_WIDTH_PX, PLOT_HEIGHT_PX)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            labels.title,
            ("sans-serif", TITLE_FONT_PX)
                .into_font()
                .style(FontStyle::Bold),
        )
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(90)
        .build_cartesian_2d(x, y)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc(labels.x)
        .y_desc(labels.y)
        .axis_desc_style(("sans-serif", AXIS_DESC_FONT_PX))
        .label_style(("sans-serif", LABEL_FONT_PX))
        .x_label_formatter(&format_tick)
        .y_label_formatter(&format_tick)
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = SERIES_COLORS[i % SERIES_COLORS.len()];
        let line = LineSeries::new(points.iter().copied(), color.stroke_width(3));
        chart
            .draw_series(line)
            .map_err(|e| err(e.to_string()))?
            .label(name.as_ref())
            .legend(move |(lx, ly)| {
                PathElement::new(vec![(lx, ly), (lx + 24, ly)], color.stroke_width(3))
            });
        let markers = points
            .iter()
            .map(move |&p| Circle::new(p, 4, color.filled()));
        chart.draw_series(markers).map_err(|e| err(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", LABEL_FONT_PX))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))
}

/// Draws one bar per (label, value) into a PNG at `path`, with each value printed on its bar.
pub fn bar_plot(
    path: &Path,
    title: &str,
    y_label: &str,
    bars: &[(String, f64)],
) -> Result<(), PlotError> {
    ensure_fonts()?;
    make_parent(path)?;
    if bars.is_empty() {
        return Err(PlotError::NoData("no bars"));
    }
    // Bars grow from zero; headroom beyond the longest bar for its value label.
    let (lo, hi) = extent('y', bars.iter().map(|(_, v)| *v).chain([0.0]), false)?;
    let headroom = if hi > lo { (hi - lo) * 0.1 } else { 1.0 };
    let ys = if lo < 0.0 { lo - headroom } else { 0.0 }..hi + headroom;
    let err = draw_err(path);
    let root = BitMapBackend::new(path, (PLOT_WIDTH_PX, PLOT_HEIGHT_PX)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            title,
            ("sans-serif", TITLE_FONT_PX)
                .into_font()
                .style(FontStyle::Bold),
        )
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(90)
        .build_cartesian_2d((0..bars.len() - 1).into_segmented(), ys)
        .map_err(|e| err(e.to_string()))?;
    let name_of = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
            bars.get(*i).map(|(n, _)| n.clone()).unwrap_or_default()
        }
        SegmentValue::Last => String::new(),
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(bars.len())
        .x_label_formatter(&name_of)
        .y_desc(y_label)
        .y_label_formatter(&format_tick)
        .axis_desc_style(("sans-serif", AXIS_DESC_FONT_PX))
        .label_style(("sans-serif", LABEL_FONT_PX))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    let rects = bars.iter().enumerate().map(|(i, (_, v))| {
        let color = SERIES_COLORS[i % SERIES_COLORS.len()];
        let mut bar = Rectangle::new(
            [
                (SegmentValue::Exact(i), 0.0),
                (SegmentValue::Exact(i + 1), *v),
            ],
            color.filled(),
        );
        bar.set_margin(0, 0, 15, 15);
        bar
    });
    chart.draw_series(rects).map_err(|e| err(e.to_string()))?;
    let value_style = TextStyle::from(("sans-serif", LABEL_FONT_PX).into_font())
        .pos(Pos::new(HPos::Center, VPos::Bottom));
    let values = bars.iter().enumerate().map(|(i, (_, v))| {
        Text::new(
            format_tick(v),
            (SegmentValue::CenterOf(i), *v),
            value_style.clone(),
        )
    });
    chart.draw_series(values).map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PNG of the plot size, and with more than a couple of colours (text and lines drawn).
    fn assert_png(path: &Path) {
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(
            &bytes[..8],
            b"\x89PNG\r\n\x1a\n",
            "{} is not a PNG",
            path.display()
        );
        // IHDR: width and height, big-endian, at offsets 16 and 20.
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((w, h), (PLOT_WIDTH_PX, PLOT_HEIGHT_PX));
    }

    /// Renders `text` alone and counts the dark pixels: zero would mean no glyphs were drawn.
    fn dark_pixels_of_text(text: &str) -> usize {
        ensure_fonts().unwrap();
        let (w, h) = (400_u32, 80_u32);
        let mut buf = vec![255_u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
            root.draw_text(
                text,
                &("sans-serif", 40).into_font().color(&BLACK),
                (10, 10),
            )
            .unwrap();
            root.present().unwrap();
        }
        buf.chunks(3)
            .filter(|px| px.iter().all(|&c| c < 128))
            .count()
    }

    #[test]
    fn text_renders_with_the_embedded_font() {
        assert!(dark_pixels_of_text("kura 4 KiB IOPS") > 500);
        assert_eq!(dark_pixels_of_text(""), 0);
    }

    #[test]
    fn line_plots_linear_and_log() {
        let dir = tempfile::tempdir().unwrap();
        let series = vec![
            (
                "kura ublk".to_owned(),
                (0..8)
                    .map(|i| (f64::from(1 << i), 20.0 + f64::from(i) * 15.0))
                    .collect(),
            ),
            (
                "fio on a file".to_owned(),
                (0..8)
                    .map(|i| (f64::from(1 << i), 10.0 + f64::from(i * i)))
                    .collect::<Vec<_>>(),
            ),
        ];
        for (log_x, log_y) in [(false, false), (true, false), (false, true), (true, true)] {
            let path = dir.path().join(format!("line-{log_x}-{log_y}.png"));
            line_plot(
                &path,
                "Latency vs queue depth",
                "queue depth",
                "p99 latency (µs)",
                &series,
                log_x,
                log_y,
            )
            .unwrap();
            assert_png(&path);
        }
        if let Ok(keep) = std::env::var("KURA_PLOT_SAMPLES") {
            line_plot(
                &Path::new(&keep).join("line.png"),
                "Latency vs queue depth",
                "queue depth",
                "p99 latency (µs)",
                &series,
                true,
                false,
            )
            .unwrap();
        }
    }

    #[test]
    fn bar_plot_draws() {
        let dir = tempfile::tempdir().unwrap();
        let bars = vec![
            ("memcached".to_owned(), 182_000.0),
            ("kura".to_owned(), 143_500.0),
            ("redis".to_owned(), 120_250.5),
        ];
        let path = dir.path().join("bars.png");
        bar_plot(&path, "GET/s, 4 KiB values", "requests per second", &bars).unwrap();
        assert_png(&path);
        if let Ok(keep) = std::env::var("KURA_PLOT_SAMPLES") {
            bar_plot(
                &Path::new(&keep).join("bars.png"),
                "GET/s, 4 KiB values",
                "requests per second",
                &bars,
            )
            .unwrap();
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.png");
        let empty: Vec<(&str, Vec<(f64, f64)>)> = vec![("a", vec![])];
        assert!(matches!(
            line_plot(&path, "t", "x", "y", &empty, false, false),
            Err(PlotError::NoData(_))
        ));
        let zero = vec![("a", vec![(0.0, 1.0), (1.0, 2.0)])];
        assert!(matches!(
            line_plot(&path, "t", "x", "y", &zero, true, false),
            Err(PlotError::NotPositiveOnLogAxis { axis: 'x', .. })
        ));
        let nan = vec![("a", vec![(1.0, f64::NAN)])];
        assert!(matches!(
            line_plot(&path, "t", "x", "y", &nan, false, false),
            Err(PlotError::NotFinite { .. })
        ));
        assert!(matches!(
            bar_plot(&path, "t", "y", &[]),
            Err(PlotError::NoData(_))
        ));
        // A single point still gets a usable axis.
        line_plot(
            &path,
            "t",
            "x",
            "y",
            &[("one", vec![(5.0, 5.0)])],
            false,
            false,
        )
        .unwrap();
        assert_png(&path);
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(format_tick(&0.0), "0");
        assert_eq!(format_tick(&12.0), "12");
        assert_eq!(format_tick(&0.5), "0.5");
        assert_eq!(format_tick(&1500.0), "1500");
        assert_eq!(format_tick(&2.5e6), "2.5e6");
    }
}
