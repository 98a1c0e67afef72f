//! Progress bars (indicatif), hidden when stderr is not a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `len` units, or a hidden one when stderr is not a terminal.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() || std::env::var_os("KVTRAIL_NO_PROGRESS").is_some() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} ({per_sec}, eta {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// Draws the library's progress phases as bars on stderr.
pub struct BarReporter {
    bar: std::sync::Mutex<Option<ProgressBar>>,
}

impl BarReporter {
    pub fn new() -> Self {
        BarReporter {
            bar: std::sync::Mutex::new(None),
        }
    }
}

impl kvtrail::replay::Reporter for BarReporter {
    fn phase(&self, name: &str, total: u64) {
        if let Ok(mut b) = self.bar.lock() {
            if let Some(old) = b.take() {
                old.finish_and_clear();
            }
            *b = Some(bar(total, name));
        }
    }
    fn advance(&self, n: u64) {
        if let Ok(b) = self.bar.lock()
            && let Some(b) = b.as_ref()
        {
            b.inc(n);
        }
    }
    fn finish(&self) {
        if let Ok(mut b) = self.bar.lock()
            && let Some(b) = b.take()
        {
            b.finish_and_clear();
        }
    }
}
