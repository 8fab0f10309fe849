//! The namespace of a store, built once per run of stores that share it.
//!
//! Key decision: a batch's stores almost always share block size and adapter, and building a
//! [`Namespace`] hashes the model name, so normalization keeps the last one built and reuses it
//! while the next store asks for the same (block size, adapter).

use cortex_hash::{Engine, Namespace};

/// The last namespace built for one engine and model.
#[derive(Debug)]
pub struct Namespaces<'m> {
    engine: Engine,
    model: &'m str,
    last: Option<(u32, Option<String>, Namespace)>,
}

impl<'m> Namespaces<'m> {
    /// A cache for the blocks `engine` publishes for `model`.
    #[must_use]
    pub fn new(engine: Engine, model: &'m str) -> Self {
        Namespaces { engine, model, last: None }
    }

    /// The namespace of `block_size`-token pages of adapter `lora` (`None`: the base model).
    #[inline]
    pub fn get(&mut self, block_size: u32, lora: Option<&str>) -> Namespace {
        if let Some((bs, l, ns)) = &self.last
            && *bs == block_size
            && l.as_deref() == lora
        {
            return *ns;
        }
        let ns = Namespace::new(self.engine, block_size, self.model, lora);
        self.last = Some((block_size, lora.map(str::to_owned), ns));
        ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_block_size_or_adapter_builds_a_new_namespace() {
        let mut c = Namespaces::new(Engine::Vllm, "m");
        let base = c.get(16, None);
        assert_eq!(base, Namespace::new(Engine::Vllm, 16, "m", None));
        assert_eq!(c.get(16, None), base);
        assert_eq!(c.get(16, Some("a")), Namespace::new(Engine::Vllm, 16, "m", Some("a")));
        assert_eq!(c.get(32, Some("a")), Namespace::new(Engine::Vllm, 32, "m", Some("a")));
        assert_eq!(c.get(16, None), base);
        assert_ne!(Namespaces::new(Engine::Sglang, "m").get(16, None), base);
    }
}
