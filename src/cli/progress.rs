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

/// The library's [`kvtrail::progress::Reporter`] as a progress bar.
#[derive(Default)]
pub struct BarReporter {
    bar: std::sync::Mutex<Option<ProgressBar>>,
}

impl kvtrail::progress::Reporter for BarReporter {
    fn start(&self, what: &str, total: u64) {
        if let Ok(mut b) = self.bar.lock() {
            if let Some(old) = b.take() {
                old.finish_and_clear();
            }
            *b = Some(bar(total, what));
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
