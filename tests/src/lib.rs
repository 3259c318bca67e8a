//! Helpers for tandem's end-to-end tests (being written).
