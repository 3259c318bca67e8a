//! (engine: being written)
