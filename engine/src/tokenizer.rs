//! (tokenizer: being written)
