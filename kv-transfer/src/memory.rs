//! Registered block memory: for every layer, one contiguous array of `num_blocks` blocks of
//! `geometry.block_bytes()` each, in host or device memory. Connectors read sent blocks from it and
//! write received blocks into it in place: the hot path never copies a block through a staging buffer.
//!
//! Invariants:
//! - Every in-flight transfer holds a claim on its blocks: shared for a send (readers), exclusive for a
//!   receive (one writer). Claims are taken all-or-nothing and released exactly once, when the transfer
//!   ends however it ends (RAII [`Claim`]). [`KvMemory::claimed_blocks`] is 0 when nothing is in flight.
//! - The safe accessors ([`KvMemory::write_block`], [`KvMemory::read_block`]) take the same claims for the
//!   duration of the call, so safe code can never race a transfer.
//! - Memory registered with [`KvMemory::from_raw`] is also touched by its owner outside these claims; the
//!   owner promises (that is the `unsafe` contract) not to touch blocks while a transfer claims them, and
//!   to hold Rust references only to the blocks it touches (never one over a whole layer), so that a
//!   transfer's accesses to other blocks never alias a reference of the owner. tandem's CPU engine keeps
//!   its cache in cells it hands out block by block for exactly this reason.
//! - This type never makes a reference into block memory it does not own either: blocks move through
//!   raw pointers (its own copies) or iovecs (transports), one claimed block range at a time.

use std::alloc::Layout as AllocLayout;
use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use crate::error::{Error, Result};
use crate::geometry::Geometry;

/// Where block memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary host memory.
    Host,
    /// CUDA device memory of one device ordinal.
    Cuda {
        /// The device ordinal.
        device: i32,
    },
}

/// One contiguous piece of a payload: an address in memory of `kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Iov {
    /// Start address.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
    /// Host or device.
    pub kind: MemoryKind,
}

/// The one device allocation holding every layer of a device pool: what CUDA IPC exports (a
/// `cuMemAlloc` allocation; stream-ordered pool memory cannot be exported).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAllocation {
    /// Device address of the allocation's first byte.
    pub base: u64,
    /// Its size in bytes.
    pub bytes: usize,
}

const WRITER: i32 = -1;
const ALIGN: usize = 64;

/// A block pool registered for transfers. Shared (`Arc`) between the connector and the pool's owner.
pub struct KvMemory {
    geometry: Geometry,
    num_blocks: u32,
    kind: MemoryKind,
    /// Base address of each layer's block array.
    layers: Vec<usize>,
    /// Per block (across all layers): 0 free, n > 0 readers, -1 one writer.
    claims: Box<[AtomicI32]>,
    claimed: AtomicUsize,
    /// Keeps externally registered memory alive; `None` for memory this type allocated itself.
    _owner: Option<Box<dyn Any + Send + Sync>>,
    /// Device memory: the allocation every layer lies in.
    allocation: Option<DeviceAllocation>,
    owned: bool,
}

impl std::fmt::Debug for KvMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvMemory")
            .field("geometry", &self.geometry)
            .field("num_blocks", &self.num_blocks)
            .field("kind", &self.kind)
            .field("claimed_blocks", &self.claimed_blocks())
            .finish()
    }
}

impl KvMemory {
    /// Allocates zeroed host memory for `num_blocks` blocks of every layer.
    pub fn host(geometry: Geometry, num_blocks: u32) -> Result<Arc<KvMemory>> {
        let layer_bytes = Self::layer_bytes(&geometry, num_blocks)?;
        let mut layers = Vec::with_capacity(geometry.num_layers() as usize);
        for _ in 0..geometry.num_layers() {
            if layer_bytes == 0 {
                layers.push(ALIGN); // dangling but aligned, never dereferenced: no blocks
                continue;
            }
            let layout = AllocLayout::from_size_align(layer_bytes, ALIGN)
                .map_err(|e| Error::Invalid(format!("block pool of {layer_bytes} bytes per layer: {e}")))?;
            // SAFETY: layout has non-zero size (checked above).
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            if ptr.is_null() {
                // Free what we got so far before failing.
                for &base in &layers {
                    // SAFETY: every earlier base came from alloc_zeroed with this same layout.
                    unsafe { std::alloc::dealloc(base as *mut u8, layout) };
                }
                return Err(Error::Invalid(format!("cannot allocate {layer_bytes} bytes of host KV memory")));
            }
            layers.push(ptr as usize);
        }
        Ok(Arc::new(KvMemory {
            claims: (0..num_blocks).map(|_| AtomicI32::new(0)).collect(),
            claimed: AtomicUsize::new(0),
            geometry,
            num_blocks,
            kind: MemoryKind::Host,
            layers,
            _owner: None,
            allocation: None,
            owned: true,
        }))
    }

    /// Registers memory owned by someone else (an engine's KV cache, a CUDA allocation).
    ///
    /// # Safety
    /// For every layer `l`, `layer_bases[l]` must point to `num_blocks * geometry.block_bytes()` bytes of
    /// memory of `kind` that stay valid while the returned `KvMemory` lives (`owner` is kept alive with it
    /// for that purpose), and writable through them. While a transfer claims a block the caller must not
    /// write it, nor read it under a write claim (see [`KvMemory::claimed_blocks`]; in tandem the
    /// scheduler holds such blocks), and must hold no Rust reference covering it: a `&mut [T]` or `&[T]`
    /// over a whole layer is undefined behaviour as soon as a transfer touches any block of that layer,
    /// even a block the owner never uses. Hand out references block by block over interior-mutable
    /// storage (`UnsafeCell`) instead.
    pub unsafe fn from_raw(
        geometry: Geometry,
        num_blocks: u32,
        kind: MemoryKind,
        layer_bases: Vec<*mut u8>,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Arc<KvMemory>> {
        Self::layer_bytes(&geometry, num_blocks)?;
        if layer_bases.len() != geometry.num_layers() as usize {
            return Err(Error::Invalid(format!(
                "{} layer bases for {} layers",
                layer_bases.len(),
                geometry.num_layers()
            )));
        }
        if layer_bases.iter().any(|p| p.is_null()) {
            return Err(Error::Invalid("null layer base".into()));
        }
        Ok(Arc::new(KvMemory {
            claims: (0..num_blocks).map(|_| AtomicI32::new(0)).collect(),
            claimed: AtomicUsize::new(0),
            geometry,
            num_blocks,
            kind,
            layers: layer_bases.into_iter().map(|p| p as usize).collect(),
            _owner: Some(owner),
            allocation: None,
            owned: false,
        }))
    }

    /// Registers device memory of GPU `device` owned by someone else (a CUDA engine's pool): every layer
    /// lies inside `allocation`, which device backends export to their peers (CUDA IPC).
    ///
    /// # Safety
    /// As [`KvMemory::from_raw`], with device addresses: each `layer_bases[l]` points to
    /// `num_blocks * geometry.block_bytes()` bytes of device memory of `device` inside `allocation`,
    /// valid while the returned memory lives, and the owner does not touch claimed blocks.
    pub unsafe fn from_device(
        geometry: Geometry,
        num_blocks: u32,
        device: i32,
        allocation: DeviceAllocation,
        layer_bases: Vec<u64>,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Arc<KvMemory>> {
        let layer_bytes = Self::layer_bytes(&geometry, num_blocks)? as u64;
        let end = allocation.base.checked_add(allocation.bytes as u64);
        if let Some(l) = layer_bases.iter().position(|&b| b < allocation.base || end.is_none_or(|e| b.checked_add(layer_bytes).is_none_or(|le| le > e))) {
            return Err(Error::Invalid(format!("layer {l} lies outside the device allocation")));
        }
        let bases = layer_bases.iter().map(|&b| b as usize as *mut u8).collect();
        // SAFETY: forwarded from the caller (device addresses are never dereferenced on the host).
        let mut memory = unsafe { KvMemory::from_raw(geometry, num_blocks, MemoryKind::Cuda { device }, bases, owner)? };
        Arc::get_mut(&mut memory).expect("just created").allocation = Some(allocation);
        Ok(memory)
    }

    /// Device memory: the allocation every layer lies in.
    pub fn device_allocation(&self) -> Option<DeviceAllocation> {
        self.allocation
    }

    fn layer_bytes(geometry: &Geometry, num_blocks: u32) -> Result<usize> {
        (num_blocks as usize)
            .checked_mul(geometry.block_bytes())
            .filter(|&b| b <= isize::MAX as usize / 2)
            .ok_or_else(|| Error::Invalid(format!("{num_blocks} blocks do not fit in memory")))
    }

    /// The pool's geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Blocks per layer.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Host or device.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Blocks currently claimed by in-flight transfers (or by a safe accessor mid-call).
    pub fn claimed_blocks(&self) -> usize {
        self.claimed.load(Ordering::Acquire)
    }

    /// Address of one block of one layer; `layer` and `block` must be in range.
    pub(crate) fn block_addr(&self, layer: u32, block: u32) -> usize {
        debug_assert!(layer < self.geometry.num_layers() && block < self.num_blocks);
        self.layers[layer as usize] + block as usize * self.geometry.block_bytes()
    }

    /// The iovecs covering `blocks` of `layer`, in order, adjacent blocks merged.
    pub(crate) fn iovs(&self, layer: u32, blocks: &[u32]) -> Vec<Iov> {
        let bb = self.geometry.block_bytes();
        let mut out: Vec<Iov> = Vec::new();
        for &b in blocks {
            let addr = self.block_addr(layer, b);
            match out.last_mut() {
                Some(last) if last.addr + last.len == addr => last.len += bb,
                _ => out.push(Iov { addr, len: bb, kind: self.kind }),
            }
        }
        out
    }

    /// `iovs(layer, blocks)` made from `pattern`, the iovecs of the same blocks in layer `of`: each
    /// piece moved by the distance between the two layers' arrays. O(pieces) where `iovs` is
    /// O(blocks): a transfer sends the same blocks of every layer.
    pub(crate) fn iovs_moved(&self, pattern: &[Iov], of: u32, layer: u32) -> Vec<Iov> {
        let (from, to) = (self.layers[of as usize], self.layers[layer as usize]);
        pattern.iter().map(|iov| Iov { addr: iov.addr - from + to, ..*iov }).collect()
    }

    /// Whether `iovs` cover exactly `ids` of `layer`, in order (no allocation; O(blocks)).
    pub(crate) fn covers(&self, iovs: &[Iov], layer: u32, ids: &[u32]) -> bool {
        let mut ids = ids.iter();
        for iov in iovs {
            let Some((l, first, n)) = self.locate(iov) else { return false };
            if l != layer {
                return false;
            }
            for b in first..first + n {
                if ids.next() != Some(&b) {
                    return false;
                }
            }
        }
        ids.next().is_none()
    }

    /// Checks that `blocks` are in range and distinct.
    pub(crate) fn check_blocks(&self, blocks: &[u32]) -> Result<()> {
        let mut seen = vec![false; self.num_blocks as usize];
        for &b in blocks {
            let slot = seen.get_mut(b as usize).ok_or_else(|| {
                Error::Invalid(format!("block {b} out of range (pool has {} blocks)", self.num_blocks))
            })?;
            if std::mem::replace(slot, true) {
                return Err(Error::Invalid(format!("block {b} listed twice")));
            }
        }
        Ok(())
    }

    /// Claims `blocks` (validated: in range, distinct) for reading or writing, all or nothing.
    pub(crate) fn claim(self: &Arc<Self>, blocks: &[u32], write: bool) -> Result<Claim> {
        self.check_blocks(blocks)?;
        for (i, &b) in blocks.iter().enumerate() {
            let slot = &self.claims[b as usize];
            let ok = if write {
                slot.compare_exchange(0, WRITER, Ordering::AcqRel, Ordering::Acquire).is_ok()
            } else {
                slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| (c >= 0).then_some(c + 1)).is_ok()
            };
            if !ok {
                for &done in &blocks[..i] {
                    self.unclaim_one(done, write);
                }
                let what = if write { "written" } else { "read" };
                return Err(Error::BlocksBusy(format!(
                    "block {b} cannot be {what}: another transfer is using it"
                )));
            }
        }
        self.claimed.fetch_add(blocks.len(), Ordering::AcqRel);
        Ok(Claim { memory: Arc::clone(self), blocks: blocks.to_vec(), write, released: None })
    }

    fn unclaim_one(&self, block: u32, write: bool) {
        let slot = &self.claims[block as usize];
        if write {
            let prev = slot.swap(0, Ordering::AcqRel);
            debug_assert_eq!(prev, WRITER);
        } else {
            let prev = slot.fetch_sub(1, Ordering::AcqRel);
            debug_assert!(prev > 0);
        }
    }

    fn check_host_block(&self, layer: u32, block: u32, len: usize) -> Result<()> {
        if self.kind != MemoryKind::Host {
            return Err(Error::Unsupported { backend: "KvMemory".into(), what: "safe access to device memory".into() });
        }
        self.check_block(layer, block, len)
    }

    fn check_block(&self, layer: u32, block: u32, len: usize) -> Result<()> {
        if block >= self.num_blocks {
            return Err(Error::Invalid(format!("block {block} out of range (pool has {} blocks)", self.num_blocks)));
        }
        if layer >= self.geometry.num_layers() {
            return Err(Error::Invalid(format!("layer {layer} out of range")));
        }
        if len != self.geometry.block_bytes() {
            return Err(Error::Invalid(format!("buffer of {len} bytes for a {}-byte block", self.geometry.block_bytes())));
        }
        let _ = block;
        Ok(())
    }

    /// Base address of `layer`'s block array; `layer` must be in range.
    pub(crate) fn layer_base(&self, layer: u32) -> usize {
        self.layers[layer as usize]
    }

    /// Where an iovec of this memory lies: `(layer, first block, blocks)`; `None` unless it covers
    /// whole blocks of one layer.
    pub(crate) fn locate(&self, iov: &Iov) -> Option<(u32, u32, u32)> {
        let bb = self.geometry.block_bytes();
        let layer_bytes = self.num_blocks as usize * bb;
        if iov.kind != self.kind || bb == 0 || iov.len == 0 || !iov.len.is_multiple_of(bb) {
            return None;
        }
        let layer = self.layers.iter().position(|&base| iov.addr >= base && iov.addr + iov.len <= base + layer_bytes)?;
        let offset = iov.addr - self.layers[layer];
        if !offset.is_multiple_of(bb) {
            return None;
        }
        Some((layer as u32, (offset / bb) as u32, (iov.len / bb) as u32))
    }

    /// Block ids (with their layer) that `iovs` cover, in order; `None` unless they are whole blocks of
    /// one layer.
    pub(crate) fn blocks_of(&self, iovs: &[Iov]) -> Option<(u32, Vec<u32>)> {
        let mut layer = None;
        let mut ids = Vec::new();
        for iov in iovs {
            let (l, first, n) = self.locate(iov)?;
            if *layer.get_or_insert(l) != l {
                return None;
            }
            ids.extend(first..first + n);
        }
        Some((layer.unwrap_or(0), ids))
    }

    /// Copies `data` (exactly one block) into `block` of `layer`. Fails if a transfer claims the block.
    /// Device memory is written with a synchronous copy.
    pub fn write_block(self: &Arc<Self>, layer: u32, block: u32, data: &[u8]) -> Result<()> {
        if let MemoryKind::Cuda { device } = self.kind {
            self.check_block(layer, block, data.len())?;
            let _claim = self.claim(&[block], true)?;
            return crate::device::write(device, self.block_addr(layer, block) as u64, data);
        }
        self.check_host_block(layer, block, data.len())?;
        let _claim = self.claim(&[block], true)?;
        // SAFETY: host memory, block in range (claim checked it), we hold the exclusive claim so no transfer
        // touches it, and `data` is a separate borrow of exactly block_bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.block_addr(layer, block) as *mut u8, data.len());
        }
        Ok(())
    }

    /// Copies `block` of `layer` into `out` (exactly one block). Fails if a transfer writes the block.
    pub fn read_block(self: &Arc<Self>, layer: u32, block: u32, out: &mut [u8]) -> Result<()> {
        if let MemoryKind::Cuda { device } = self.kind {
            self.check_block(layer, block, out.len())?;
            let _claim = self.claim(&[block], false)?;
            return crate::device::read(device, self.block_addr(layer, block) as u64, out);
        }
        self.check_host_block(layer, block, out.len())?;
        let _claim = self.claim(&[block], false)?;
        // SAFETY: host memory, block in range, a shared claim excludes writers, `out` is a distinct buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(self.block_addr(layer, block) as *const u8, out.as_mut_ptr(), out.len());
        }
        Ok(())
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let bytes = self.num_blocks as usize * self.geometry.block_bytes();
        if bytes == 0 {
            return;
        }
        let layout = AllocLayout::from_size_align(bytes, ALIGN).expect("layout was valid at allocation");
        for &base in &self.layers {
            // SAFETY: allocated in `host` with exactly this layout; dropped once.
            unsafe { std::alloc::dealloc(base as *mut u8, layout) };
        }
    }
}

/// A transfer's hold on its blocks; released on drop, exactly once.
#[derive(Debug)]
pub(crate) struct Claim {
    memory: Arc<KvMemory>,
    blocks: Vec<u32>,
    write: bool,
    released: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Claim {
    /// A receiver that resolves once this claim is dropped (its blocks are free again).
    pub(crate) fn on_release(&mut self) -> tokio::sync::oneshot::Receiver<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.released = Some(tx);
        rx
    }
    pub(crate) fn blocks(&self) -> &[u32] {
        &self.blocks
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        for &b in &self.blocks {
            self.memory.unclaim_one(b, self.write);
        }
        self.memory.claimed.fetch_sub(self.blocks.len(), Ordering::AcqRel);
        if let Some(tx) = self.released.take() {
            let _ = tx.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::tests::small;
    use rand::{Rng, SeedableRng};

    #[test]
    fn write_then_read_round_trips_and_claims_are_released() {
        let m = KvMemory::host(small("m"), 5).unwrap();
        let bb = m.geometry().block_bytes();
        let data: Vec<u8> = (0..bb).map(|i| (i * 7 + 3) as u8).collect();
        m.write_block(2, 4, &data).unwrap();
        let mut out = vec![0u8; bb];
        m.read_block(2, 4, &mut out).unwrap();
        assert_eq!(out, data);
        m.read_block(1, 4, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0), "other layers untouched");
        assert_eq!(m.claimed_blocks(), 0);
        assert!(m.write_block(3, 0, &data).is_err(), "layer out of range");
        assert!(m.write_block(0, 5, &data).is_err(), "block out of range");
        assert!(m.write_block(0, 0, &data[1..]).is_err(), "short buffer");
    }

    #[test]
    fn moved_iovecs_are_those_of_the_other_layer_and_cover_exactly_its_blocks() {
        let m = KvMemory::host(small("m"), 16).unwrap();
        let blocks = [3, 4, 5, 9, 1, 2];
        let first = m.iovs(0, &blocks);
        for layer in 0..3 {
            let moved = m.iovs_moved(&first, 0, layer);
            assert_eq!(moved, m.iovs(layer, &blocks));
            assert!(m.covers(&moved, layer, &blocks));
            assert!(!m.covers(&moved, (layer + 1) % 3, &blocks), "another layer");
            assert!(!m.covers(&moved, layer, &blocks[..5]), "fewer blocks");
            assert!(!m.covers(&moved, layer, &[3, 4, 5, 9, 2, 1]), "another order");
        }
    }

    #[test]
    fn writers_exclude_everyone_readers_share() {
        let m = KvMemory::host(small("m"), 4).unwrap();
        let r1 = m.claim(&[0, 1], false).unwrap();
        let r2 = m.claim(&[1, 2], false).unwrap();
        assert_eq!(m.claimed_blocks(), 4);
        assert!(matches!(m.claim(&[2, 3], true), Err(Error::BlocksBusy(_))));
        assert_eq!(m.claimed_blocks(), 4, "a failed claim leaves nothing behind");
        drop(r2);
        let w = m.claim(&[2, 3], true).unwrap();
        assert!(m.claim(&[3], false).is_err());
        assert!(m.claim(&[0, 0], false).is_err(), "duplicates refused");
        drop((r1, w));
        assert_eq!(m.claimed_blocks(), 0);
    }

    /// Random claim/release sequences never leave a block both written and read, and always balance.
    #[test]
    fn random_claims_balance() {
        let m = KvMemory::host(small("m"), 16).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut held: Vec<Claim> = Vec::new();
        // Miri runs the interpreter over every step: a shorter walk there.
        let steps = if cfg!(miri) { 500 } else { 20_000 };
        for _ in 0..steps {
            if rng.random_bool(0.5) && !held.is_empty() {
                let i = rng.random_range(0..held.len());
                held.swap_remove(i);
            } else {
                let n = rng.random_range(0..4);
                let mut blocks: Vec<u32> = (0..n).map(|_| rng.random_range(0..16)).collect();
                blocks.sort_unstable();
                blocks.dedup();
                if let Ok(c) = m.claim(&blocks, rng.random_bool(0.3)) {
                    held.push(c);
                }
            }
            let mut readers = [0i32; 16];
            let mut writers = [0i32; 16];
            for c in &held {
                for &b in c.blocks() {
                    if c.write { writers[b as usize] += 1 } else { readers[b as usize] += 1 }
                }
            }
            for b in 0..16 {
                assert!(writers[b] <= 1 && (writers[b] == 0 || readers[b] == 0));
            }
            let total: usize = held.iter().map(|c| c.blocks().len()).sum();
            assert_eq!(m.claimed_blocks(), total);
        }
        held.clear();
        assert_eq!(m.claimed_blocks(), 0);
    }

    #[test]
    fn iovs_merge_adjacent_blocks() {
        let m = KvMemory::host(small("m"), 8).unwrap();
        let bb = m.geometry().block_bytes();
        let iovs = m.iovs(1, &[2, 3, 4, 7, 0]);
        assert_eq!(iovs.len(), 3);
        assert_eq!(iovs[0].len, 3 * bb);
        assert_eq!(iovs[0].addr, m.block_addr(1, 2));
        assert_eq!(iovs[1].addr, m.block_addr(1, 7));
        assert_eq!(iovs[2].addr, m.block_addr(1, 0));
    }
}
