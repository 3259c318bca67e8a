//! (kv: being written)
