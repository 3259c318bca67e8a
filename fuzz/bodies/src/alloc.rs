//! A counting global allocator, so targets can assert that a decoder's memory stays proportional to
//! its input: nothing sized by an untrusted length may be allocated before that length is checked
//! against the bytes actually present.
//!
//! The counters are process-wide; [`peak_during`] is meaningful while one thread allocates (libFuzzer
//! runs one input at a time; the corpus test runs the targets one after another on one thread).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as for `alloc`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Runs `f` and returns its result with the most bytes that were live at once during it, beyond those
/// live when it started.
pub fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    let peak = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (out, peak)
}

/// Panics unless `f` kept at most `per_byte * input_len + fixed` bytes live at once.
pub fn bounded<T>(what: &str, input_len: usize, per_byte: usize, fixed: usize, f: impl FnOnce() -> T) -> T {
    let (out, peak) = peak_during(f);
    let limit = input_len.saturating_mul(per_byte).saturating_add(fixed);
    assert!(
        peak <= limit,
        "{what}: {peak} bytes live at once for a {input_len}-byte input (limit {per_byte} per input byte + {fixed})"
    );
    out
}
