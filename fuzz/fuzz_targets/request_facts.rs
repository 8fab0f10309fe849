//! The request-facts parser on arbitrary bytes and on mutated valid bodies (the corpus seeds are
//! real chat, completion and `/generate` bodies): never panics, and what parses is consistent —
//! a token-id prompt's largest id is at most the body's `max_token_id`.

#![no_main]

use cortex_proxy::request::{Prompt, Route, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for route in [Route::ChatCompletions, Route::Completions, Route::Generate] {
        if let Ok(facts) = parse(route, data)
            && let Prompt::Tokens(ids) = &facts.prompt
            && let Some(&largest) = ids.iter().max()
        {
            assert!(facts.max_token_id.is_some_and(|m| m >= largest), "{facts:?}");
        }
    }
});
