//! Block storage that the engine and a KV transfer share: per layer one buffer of `num_blocks`
//! blocks of `block_elems` elements, every element an [`UnsafeCell`]. The CPU cache
//! ([`super::KvCache`], f32) and the CUDA engine's host mirror ([`super::HostKvMirror`], bf16 bits)
//! are built on it.
//!
//! Why cells: a transfer reads or writes blocks through the base pointers of
//! [`KvStore::base_ptrs`] on another thread while the engine works on other blocks of the same
//! layer. A plain `Vec<T>` per layer cannot allow that: any `&mut [T]` or `&[T]` the engine takes
//! over a whole layer (or even indexing through the `Vec`, which borrows all of it) claims every
//! element, and a transfer's access to any block under it is undefined behaviour. Here:
//! - nothing ever takes a `&mut` over a layer or over the store, and a `&` to cells asserts nothing
//!   about their contents, so writes by a transfer to some block never invalidate a reference the
//!   engine holds elsewhere;
//! - the engine reaches elements only a block (or a run of adjacent blocks) at a time:
//!   [`LayerRef::blocks`] (shared, from `&KvStore`) and [`LayerMut::blocks_mut`] (exclusive, from
//!   `&mut KvStore`), so the borrow checker keeps the engine's own references apart;
//! - the layers live in an `Arc` that transfers may hold ([`KvStore::keep_alive`]), so the base
//!   pointers stay valid for as long as anyone uses them; buffers never move or resize.
//!
//! Invariant (what users of the base pointers promise, see [`KvStore::base_ptrs`]): a transfer
//! writes a block only while the engine neither reads nor writes it, and reads a block only while
//! the engine does not write it. So at any time each block is either only read, or touched by one
//! party. In tandem the scheduler keeps this: a receiving request's blocks are the transfer's until
//! `kv_ready`, a finished prefill's blocks are only read until `release`.

use std::any::Any;
use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::sync::Arc;

/// One element. `repr(transparent)` over `UnsafeCell<T>`, so a layer of cells has the layout of a
/// layer of `T`s and a pointer to cells may write them.
#[repr(transparent)]
struct Cell<T>(UnsafeCell<T>);

// SAFETY: cells are read or written only through `KvStore`'s views (whose borrows keep the engine's
// own accesses apart) and through the raw pointers of `KvStore::base_ptrs`, whose users never touch a
// block the engine writes, nor write one it reads (module invariant): two threads never access one
// cell at once unless both only read. `T: Send` lets the values move between threads.
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for Cell<T> {}

/// The layers' cells, one boxed slice per layer, allocated once.
struct Layers<T>(Box<[Box<[Cell<T>]>]>);

/// Per-layer block buffers shared with transfers. The one engine-side handle (not `Clone`):
/// `&mut KvStore` is the engine's right to write.
pub(crate) struct KvStore<T> {
    layers: Arc<Layers<T>>,
    block_elems: usize,
    num_blocks: usize,
}

impl<T: Copy + Default + Send + Sync + 'static> KvStore<T> {
    /// `num_layers` layers of `num_blocks` blocks of `block_elems` elements, all `T::default()`
    /// (zero for the types used here: `vec!` asks the allocator for zeroed memory then, so pages
    /// of blocks never used are never touched).
    pub(crate) fn new(num_layers: usize, num_blocks: usize, block_elems: usize) -> KvStore<T> {
        let elems = num_blocks * block_elems;
        let layers = (0..num_layers)
            .map(|_| {
                let plain: Box<[T]> = vec![T::default(); elems].into_boxed_slice();
                let raw = Box::into_raw(plain) as *mut [Cell<T>];
                // SAFETY: `Cell<T>` is `repr(transparent)` over `UnsafeCell<T>`, which has the
                // size, alignment and bit validity of `T`: the allocation is a valid `[Cell<T>]`
                // of the same length, and is freed with the same layout.
                #[allow(unsafe_code)]
                unsafe {
                    Box::from_raw(raw)
                }
            })
            .collect();
        KvStore { layers: Arc::new(Layers(layers)), block_elems, num_blocks }
    }

    /// Layers in the store.
    pub(crate) fn num_layers(&self) -> usize {
        self.layers.0.len()
    }

    /// Blocks per layer.
    pub(crate) fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// One layer, read block by block. Panics when `layer` is out of range.
    pub(crate) fn layer(&self, layer: usize) -> LayerRef<'_, T> {
        LayerRef { cells: &self.layers.0[layer], block_elems: self.block_elems }
    }

    /// One layer, written block by block. Panics when `layer` is out of range.
    pub(crate) fn layer_mut(&mut self, layer: usize) -> LayerMut<'_, T> {
        LayerMut { cells: &self.layers.0[layer], block_elems: self.block_elems, _unique: PhantomData }
    }

    /// The base address of every layer's buffer, in layer order, each `num_blocks * block_elems`
    /// elements long; writable (the elements are cells). Valid while this store or a
    /// [`Self::keep_alive`] handle lives. Using them is the caller's `unsafe`, under the module
    /// invariant: never touch a block the engine writes meanwhile, never write one it reads.
    pub(crate) fn base_ptrs(&self) -> Vec<*mut u8> {
        self.layers.0.iter().map(|layer| UnsafeCell::raw_get(layer.as_ptr().cast::<UnsafeCell<T>>()).cast::<u8>()).collect()
    }

    /// A handle that keeps the buffers of [`Self::base_ptrs`] allocated.
    pub(crate) fn keep_alive(&self) -> Arc<dyn Any + Send + Sync> {
        Arc::clone(&self.layers) as Arc<dyn Any + Send + Sync>
    }
}

/// The cells of `count` blocks from `first` (panics when out of range), as a pointer to the
/// first element: carries the provenance of `cells`, and may write (they are cells).
fn run_ptr<T>(cells: &[Cell<T>], block_elems: usize, first: u32, count: usize) -> *mut T {
    let start = first as usize * block_elems;
    let run = &cells[start..start + count * block_elems];
    UnsafeCell::raw_get(run.as_ptr().cast::<UnsafeCell<T>>())
}

/// One layer of a [`KvStore`], read block by block. It borrows the store shared, so the engine
/// makes no `&mut` into it meanwhile.
pub(crate) struct LayerRef<'a, T> {
    cells: &'a [Cell<T>],
    block_elems: usize,
}

impl<T> Clone for LayerRef<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for LayerRef<'_, T> {}

impl<'a, T> LayerRef<'a, T> {
    /// `count` adjacent blocks from `first`, for as long as the store is borrowed. Panics when out
    /// of range.
    pub(crate) fn blocks(self, first: u32, count: usize) -> &'a [T] {
        let ptr = run_ptr(self.cells, self.block_elems, first, count);
        // SAFETY: `ptr` starts `count` in-bounds blocks (`run_ptr` indexed them). The store is
        // borrowed shared for 'a, so the engine makes no `&mut` to these elements meanwhile, and a
        // transfer never writes a block the engine reads (module invariant).
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts(ptr, count * self.block_elems)
        }
    }
}

/// One layer of a [`KvStore`], written block by block. It borrows the store exclusively, so the
/// engine holds no other reference into it meanwhile.
pub(crate) struct LayerMut<'a, T> {
    cells: &'a [Cell<T>],
    block_elems: usize,
    _unique: PhantomData<&'a mut KvStore<T>>,
}

impl<'a, T> LayerMut<'a, T> {
    /// `count` adjacent blocks from `first`, mutable, for as long as this view is borrowed. Panics
    /// when out of range.
    pub(crate) fn blocks_mut(&mut self, first: u32, count: usize) -> &mut [T] {
        let ptr = run_ptr(self.cells, self.block_elems, first, count);
        // SAFETY: `ptr` starts `count` in-bounds blocks. This view holds the store's exclusive
        // borrow and the slice borrows the view mutably, so no other engine reference to these
        // elements exists while it lives; a transfer never touches a block the engine writes
        // (module invariant).
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts_mut(ptr, count * self.block_elems)
        }
    }

    /// [`Self::blocks_mut`] for as long as the store is borrowed (consumes the view).
    pub(crate) fn into_blocks_mut(self, first: u32, count: usize) -> &'a mut [T] {
        let ptr = run_ptr(self.cells, self.block_elems, first, count);
        // SAFETY: as in `blocks_mut`; the view (the store's exclusive borrow for 'a) is consumed,
        // so the returned slice is the only engine reference into the store for 'a.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts_mut(ptr, count * self.block_elems)
        }
    }

    /// Block `src` to read and block `dst` to write, which must differ (panics otherwise or when
    /// out of range).
    pub(crate) fn src_dst(self, src: u32, dst: u32) -> (&'a [T], &'a mut [T]) {
        assert_ne!(src, dst, "copying a block onto itself");
        let (from, to) = (run_ptr(self.cells, self.block_elems, src, 1), run_ptr(self.cells, self.block_elems, dst, 1));
        // SAFETY: two different in-bounds blocks, so the slices do not overlap; the consumed
        // exclusive borrow and the module invariant exclude every other access to `dst` and every
        // write to `src` for 'a, as in `into_blocks_mut`.
        #[allow(unsafe_code)]
        unsafe {
            (std::slice::from_raw_parts(from, self.block_elems), std::slice::from_raw_parts_mut(to, self.block_elems))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    #[test]
    fn views_address_the_blocks_the_base_pointers_describe() {
        let mut s = KvStore::<u16>::new(3, 5, 6);
        let bases = s.base_ptrs();
        assert_eq!((bases.len(), s.num_layers(), s.num_blocks()), (3, 3, 5));
        for (l, base) in bases.iter().enumerate() {
            for b in 0..5u32 {
                let block = s.layer(l).blocks(b, 1);
                assert_eq!(block.as_ptr() as usize, *base as usize + b as usize * 6 * 2);
                assert!(block.iter().all(|&x| x == 0));
            }
        }
        s.layer_mut(1).blocks_mut(2, 2).fill(7);
        let layer = s.layer(1);
        assert!(layer.blocks(1, 1).iter().all(|&x| x == 0));
        assert!(layer.blocks(2, 2).iter().all(|&x| x == 7));
        assert!(layer.blocks(4, 1).iter().all(|&x| x == 0));
        let (src, dst) = s.layer_mut(1).src_dst(2, 0);
        dst.copy_from_slice(src);
        assert!(s.layer(1).blocks(0, 1).iter().all(|&x| x == 7));
        assert!(s.layer(0).blocks(0, 5).iter().all(|&x| x == 0));
    }

    #[test]
    #[should_panic]
    fn a_run_past_the_pool_panics() {
        let s = KvStore::<f32>::new(1, 4, 8);
        let _ = s.layer(0).blocks(3, 2);
    }

    #[test]
    fn the_buffers_outlive_the_store_while_a_transfer_holds_them() {
        let mut s = KvStore::<f32>::new(2, 4, 8);
        s.layer_mut(1).blocks_mut(3, 1).fill(2.5);
        let keep = s.keep_alive();
        let base = s.base_ptrs()[1];
        drop(s);
        // SAFETY: `keep` holds the layers, so layer 1's buffer is still allocated; no one else uses it.
        #[allow(unsafe_code)]
        let x = unsafe { base.cast::<f32>().add(3 * 8).read() };
        assert_eq!(x, 2.5);
        drop(keep);
    }

    /// A pointer handed to another thread, provenance and all (so that Miri checks every access
    /// through it against the engine's references, rather than trusting a pointer made from an
    /// integer).
    struct SendPtr(*mut u8);

    // SAFETY: the tests that send one keep to the module invariant when using it.
    #[allow(unsafe_code)]
    unsafe impl Send for SendPtr {}

    impl SendPtr {
        fn get(&self) -> *mut u8 {
            self.0
        }
    }

    /// What a node does: a transfer on another thread writes (decode side) and reads (prefill side)
    /// blocks of a layer through the base pointer while the engine, inside a kernel-like call, holds
    /// views of that layer and blocks of it. Under Miri this is the test that the cells make it
    /// defined. The same sequence over a plain `Vec<f32>` layer borrowed whole (what the engine did
    /// before) is undefined behaviour, and Miri says so: the transfer's write would invalidate the
    /// call's protected `&mut [f32]` (Stacked Borrows).
    #[test]
    fn a_transfer_touches_other_blocks_while_the_engine_holds_the_layer() {
        let mut s = KvStore::<f32>::new(2, 7, 16);
        s.layer_mut(0).blocks_mut(2, 1).fill(4.0);
        let base = SendPtr(s.base_ptrs()[0]);
        let bytes = 16 * 4;
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<f32>();
        let transfer = std::thread::spawn(move || {
            for () in go_rx {
                let p = base.get();
                // SAFETY: block 5 (written) and block 2 (read) of layer 0 are the transfer's: the
                // engine does not touch 5 and only reads 2 while the transfer runs.
                #[allow(unsafe_code)]
                let read = unsafe {
                    std::ptr::write_bytes(p.add(5 * bytes), 0x3f, bytes);
                    p.add(2 * bytes).cast::<f32>().read()
                };
                done_tx.send(read).unwrap();
            }
        });
        let transfer_runs = || {
            go_tx.send(()).unwrap();
            done_rx.recv().unwrap()
        };
        // The K/V write: the layer view and one block of it held across the transfer's access.
        fn engine_writes(layer: &mut LayerMut<'_, f32>, transfer_runs: impl Fn() -> f32) -> f32 {
            layer.blocks_mut(0, 1).fill(1.0);
            let b1 = layer.blocks_mut(1, 1);
            b1.fill(2.0);
            let read = transfer_runs();
            b1.fill(3.0);
            layer.blocks_mut(0, 1)[0] += 1.0;
            read
        }
        // Attention: blocks the engine reads (one of them also read by the transfer).
        fn engine_reads(layer: LayerRef<'_, f32>, transfer_runs: impl Fn() -> f32) -> f32 {
            let (b0, b2) = (layer.blocks(0, 1), layer.blocks(2, 1));
            let read = transfer_runs();
            b0[0] + b2[0] + read
        }
        assert_eq!(engine_writes(&mut s.layer_mut(0), transfer_runs), 4.0);
        assert_eq!(engine_reads(s.layer(0), transfer_runs), 2.0 + 4.0 + 4.0);
        drop(go_tx);
        transfer.join().unwrap();
        let layer = s.layer(0);
        assert!(layer.blocks(1, 1).iter().all(|&x| x == 3.0));
        assert!(layer.blocks(5, 1).iter().all(|&x| x.to_bits() == 0x3f3f_3f3f));
        assert_eq!(layer.blocks(0, 1)[..2], [2.0, 1.0]);
        assert!(layer.blocks(3, 2).iter().chain(layer.blocks(6, 1)).chain(s.layer(1).blocks(0, 7)).all(|&x| x == 0.0));
    }
}
