//! (kernels: being written)
