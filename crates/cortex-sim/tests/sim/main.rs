//! End-to-end tests of the simulator: real HTTP and real ZeroMQ on loopback, one test binary
//! (the tokenizer is loaded once per process and shared by every worker).

mod api;
mod faults;
mod golden_sglang;
mod golden_vllm;
mod pd;
mod support;
mod timing;
