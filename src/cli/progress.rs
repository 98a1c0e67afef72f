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

/// Units a reporter gathers before it moves its bar (a bar's `inc` takes
/// a lock and reads the clock; the replay reports every copy).
const BAR_STEP: u64 = 64 * 1024;

/// The library's [`kvtrail::progress::Reporter`] as a progress bar.
#[derive(Default)]
pub struct BarReporter {
    bar: std::sync::Mutex<Option<ProgressBar>>,
    /// Units reported and not yet shown.
    pending: std::sync::atomic::AtomicU64,
}

impl BarReporter {
    /// Moves the bar by the units gathered so far.
    fn flush(&self, b: &ProgressBar) {
        let n = self.pending.swap(0, std::sync::atomic::Ordering::Relaxed);
        if n > 0 {
            b.inc(n);
        }
    }
}

impl kvtrail::progress::Reporter for BarReporter {
    fn start(&self, what: &str, total: u64) {
        if let Ok(mut b) = self.bar.lock() {
            if let Some(old) = b.take() {
                old.finish_and_clear();
            }
            self.pending.store(0, std::sync::atomic::Ordering::Relaxed);
            *b = Some(bar(total, what));
        }
    }
    fn advance(&self, n: u64) {
        let held = self
            .pending
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed)
            .saturating_add(n);
        if held >= BAR_STEP
            && let Ok(b) = self.bar.lock()
            && let Some(b) = b.as_ref()
        {
            self.flush(b);
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
