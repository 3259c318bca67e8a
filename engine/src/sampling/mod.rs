//! (sampling: being written)
