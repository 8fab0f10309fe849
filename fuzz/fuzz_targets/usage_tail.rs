//! The reader that finds the usage in a worker's last bytes, on arbitrary upstream bytes (an SSE
//! stream's tail cut anywhere, or a JSON body): never panics.

#![no_main]

use cortex_proxy::upstream::find_usage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = find_usage(data, true);
    let _ = find_usage(data, false);
});
