//! (detok: being written)
