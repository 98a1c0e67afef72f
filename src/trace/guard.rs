//! A panic guard around calls into the Parquet reader.
//!
//! The parquet crate asserts on some corrupt metadata (e.g. a negative
//! column offset in a damaged footer) instead of returning an error. Bad
//! input must never panic kvtrail, so every call into the reader goes
//! through [`guard`]: a panic inside becomes `Error::Parquet` for that file,
//! and the panic message is kept off stderr (the error says it instead).
//! Panics anywhere else are untouched: the process-wide hook installed here
//! forwards every panic that is not inside a guard to the previous hook.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

use crate::error::{Location, Result};
use crate::trace::parquet_error::parquet_error;

thread_local! {
    static GUARDED: Cell<bool> = const { Cell::new(false) };
}

static HOOK: Once = Once::new();

/// Runs `f`; a panic inside it becomes a Parquet error at `loc`.
pub(crate) fn guard<T>(loc: impl FnOnce() -> Location, f: impl FnOnce() -> Result<T>) -> Result<T> {
    HOOK.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(Cell::get) {
                prev(info);
            }
        }));
    });
    let was = GUARDED.with(|g| g.replace(true));
    let res = catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    match res {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown failure".into());
            Err(parquet_error(
                loc(),
                format!("corrupt file (the Parquet reader gave up: {msg})"),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_becomes_an_error_and_the_guard_is_reentrant() {
        let r: Result<u32> = guard(
            || Location::default().column("x"),
            || {
                let inner: Result<u32> = guard(Location::default, || Ok(1));
                assert_eq!(inner.unwrap(), 1);
                panic!("negative offset")
            },
        );
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("negative offset"), "{msg}");
        assert!(msg.contains("column `x`"), "{msg}");
        assert!(!GUARDED.with(Cell::get), "flag restored");
        assert_eq!(guard(Location::default, || Ok(5)).unwrap(), 5);
    }
}
