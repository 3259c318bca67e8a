//! (gguf: being written)
