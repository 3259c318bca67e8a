//! (weights: being written)
