//! The `tandem` command line (being written).

fn main() {}
