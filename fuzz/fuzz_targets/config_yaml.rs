//! The YAML config loader on arbitrary text: parsing and validation never panic; a file is
//! accepted or refused with a message.

#![no_main]

use cortex_gateway::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(cfg) = Config::parse(text) {
        // Relative paths resolve under a directory that does not exist: nothing is loaded.
        let _ = cfg.into_settings(std::path::Path::new("/nonexistent/cortex-fuzz"));
    }
});
