//! Placeholder replaced by the decision benchmark below.
#![allow(missing_docs)]
fn main() {}
