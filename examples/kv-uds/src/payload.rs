//! Turning the host's iovecs into byte slices: gathered from on `send`, scattered into on delivery.
//!
//! This is where raw host memory becomes Rust slices, so every check that makes that sound lives
//! here: only host memory (`TANDEM_KV_MEM_HOST`), no NULL address under a non-empty piece, lengths
//! that fit in `isize` in total, and, for the writable slices we scatter into, no two pieces
//! overlapping (two `&mut` to one byte would be undefined behaviour even if the bytes agreed).

use std::io::{IoSlice, IoSliceMut};

use crate::abi::{self, TandemKvIov};
use crate::error::Failure;

/// Validates one piece and returns its length as `usize` (0 for an empty piece, whatever its address).
fn checked_len(iov: &TandemKvIov, index: usize) -> Result<usize, Failure> {
    if iov.mem_kind != abi::TANDEM_KV_MEM_HOST {
        return Err(Failure::unsupported(format!(
            "iov {index}: mem_kind {} is not TANDEM_KV_MEM_HOST; the uds backend moves host memory only",
            iov.mem_kind
        )));
    }
    if iov.len == 0 {
        return Ok(0);
    }
    if iov.addr.is_null() {
        return Err(Failure::invalid(format!(
            "iov {index}: NULL address with length {}",
            iov.len
        )));
    }
    usize::try_from(iov.len)
        .ok()
        .filter(|&len| isize::try_from(len).is_ok())
        .ok_or_else(|| {
            Failure::invalid(format!(
                "iov {index}: length {} does not fit in memory",
                iov.len
            ))
        })
}

/// Sums piece lengths, refusing a total that could not be one allocation.
fn checked_total(lens: &[usize]) -> Result<u64, Failure> {
    lens.iter()
        .try_fold(0usize, |total, &len| {
            total
                .checked_add(len)
                .filter(|&t| isize::try_from(t).is_ok())
        })
        .map(|total| total as u64)
        .ok_or_else(|| Failure::invalid("iov lengths overflow"))
}

/// The byte slices a `send` gathers its payload from, and the payload length.
///
/// # Safety
/// Every non-empty host piece must be readable for its length and not written by anyone for `'a`
/// (the header: "the payload memory may be reused once send returns", so it is stable during `send`).
pub(crate) unsafe fn gather<'a>(
    iovs: &'a [TandemKvIov],
) -> Result<(Vec<IoSlice<'a>>, u64), Failure> {
    let lens = iovs
        .iter()
        .enumerate()
        .map(|(i, iov)| checked_len(iov, i))
        .collect::<Result<Vec<_>, _>>()?;
    let total = checked_total(&lens)?;
    let slices = iovs
        .iter()
        .zip(&lens)
        .filter(|&(_, &len)| len > 0)
        .map(|(iov, &len)| {
            // SAFETY: host memory (checked), non-NULL, `len` fits in isize; readable and unchanged for
            // 'a by this function's contract.
            let bytes =
                unsafe { std::slice::from_raw_parts(iov.addr.cast::<u8>().cast_const(), len) };
            IoSlice::new(bytes)
        })
        .collect();
    Ok((slices, total))
}

/// The writable slices a delivered payload of `payload_len` bytes is scattered into.
///
/// Failures are host bugs (lengths that do not add up, overlapping pieces, NULL) or device memory;
/// the reader then drains the payload and reports the failure's status through `on_payload`.
///
/// # Safety
/// Every non-empty host piece must be writable for its length and touched by nobody else for `'a`
/// (the host's promise when it answers `TANDEM_KV_DELIVER`, until we call `on_payload`).
pub(crate) unsafe fn scatter<'a>(
    iovs: &'a [TandemKvIov],
    payload_len: u64,
) -> Result<Vec<IoSliceMut<'a>>, Failure> {
    let lens = iovs
        .iter()
        .enumerate()
        .map(|(i, iov)| checked_len(iov, i))
        .collect::<Result<Vec<_>, _>>()?;
    let total = checked_total(&lens)?;
    if total != payload_len {
        return Err(Failure::invalid(format!(
            "host bug: the delivered iovecs hold {total} bytes, the payload has {payload_len}"
        )));
    }
    let mut ranges: Vec<(usize, usize)> = iovs
        .iter()
        .zip(&lens)
        .filter(|&(_, &len)| len > 0)
        .map(|(iov, &len)| (iov.addr as usize, len))
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((start, len), (next, _)) = (pair[0], pair[1]);
        if start.checked_add(len).is_none_or(|end| end > next) {
            return Err(Failure::invalid("host bug: the delivered iovecs overlap"));
        }
    }
    Ok(iovs
        .iter()
        .zip(&lens)
        .filter(|&(_, &len)| len > 0)
        .map(|(iov, &len)| {
            // SAFETY: host memory (checked), non-NULL, `len` fits in isize, pieces pairwise disjoint
            // (checked above), writable and exclusively ours for 'a by this function's contract.
            let bytes = unsafe { std::slice::from_raw_parts_mut(iov.addr.cast::<u8>(), len) };
            IoSliceMut::new(bytes)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(buf: &mut [u8]) -> TandemKvIov {
        TandemKvIov {
            addr: buf.as_mut_ptr().cast(),
            len: buf.len() as u64,
            ..TandemKvIov::EMPTY
        }
    }

    #[test]
    fn gather_checks_kind_null_and_sums() {
        let (mut a, mut b) = ([1u8; 3], [2u8; 5]);
        let iovs = [iov(&mut a), TandemKvIov::EMPTY, iov(&mut b)];
        // SAFETY: the iovecs describe live local arrays nobody writes during the call.
        let (slices, total) = unsafe { gather(&iovs) }.unwrap();
        assert_eq!(total, 8);
        assert_eq!(slices.len(), 2);
        assert_eq!(&*slices[1], &[2u8; 5]);

        let device = [TandemKvIov {
            mem_kind: abi::TANDEM_KV_MEM_CUDA,
            ..iovs[0]
        }];
        // SAFETY: rejected before any memory is read.
        let failure = unsafe { gather(&device) }.unwrap_err();
        assert_eq!(failure.status(), abi::TANDEM_KV_ERR_UNSUPPORTED);
        let null = [TandemKvIov {
            len: 4,
            ..TandemKvIov::EMPTY
        }];
        // SAFETY: rejected before any memory is read.
        let failure = unsafe { gather(&null) }.unwrap_err();
        assert_eq!(failure.status(), abi::TANDEM_KV_ERR_INVALID);
        let huge = [TandemKvIov {
            len: u64::MAX,
            ..iovs[0]
        }];
        // SAFETY: rejected before any memory is read.
        let failure = unsafe { gather(&huge) }.unwrap_err();
        assert_eq!(failure.status(), abi::TANDEM_KV_ERR_INVALID);
    }

    #[test]
    fn scatter_checks_total_and_overlap() {
        let mut buf = [0u8; 16];
        let base = buf.as_mut_ptr();
        let piece = |offset: usize, len: u64| TandemKvIov {
            // SAFETY: offsets stay inside the 16-byte buffer.
            addr: unsafe { base.add(offset) }.cast(),
            len,
            ..TandemKvIov::EMPTY
        };
        let (disjoint, short, overlapping) = (
            [piece(0, 4), piece(4, 12)],
            [piece(0, 4)],
            [piece(4, 8), piece(0, 8)],
        );
        // SAFETY: two disjoint pieces of a live local buffer that nothing else touches meanwhile.
        let slices = unsafe { scatter(&disjoint, 16) }.unwrap();
        assert_eq!(slices.iter().map(|s| s.len()).collect::<Vec<_>>(), [4, 12]);
        drop(slices);
        // SAFETY: rejected before any slice is made.
        let short = unsafe { scatter(&short, 16) }.unwrap_err();
        assert!(
            short.message().contains("hold 4 bytes"),
            "{}",
            short.message()
        );
        // SAFETY: rejected before any slice is made.
        let overlap = unsafe { scatter(&overlapping, 16) }.unwrap_err();
        assert!(
            overlap.message().contains("overlap"),
            "{}",
            overlap.message()
        );
    }
}
