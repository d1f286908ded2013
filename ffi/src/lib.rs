//! The C ABI of foxedge (see issue: C ABI). Not yet implemented.
