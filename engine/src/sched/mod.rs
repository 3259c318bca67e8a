//! (sched: being written)
