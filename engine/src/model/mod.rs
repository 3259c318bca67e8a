//! (model: being written)
