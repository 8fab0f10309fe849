//! The workspace's own rules as ordinary tests: tidy, and golden vectors (including proof that a
//! corrupted vector is caught).

#![allow(clippy::unwrap_used, reason = "test-only helpers; a malformed fixture should fail loudly")]

use std::path::Path;

use xtask::{golden, tidy, workspace_root};

#[test]
fn tidy_passes() {
    let violations = tidy::run(&workspace_root()).unwrap();
    assert!(
        violations.is_empty(),
        "tidy violations:\n{}",
        violations.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn every_golden_vector_reproduces() {
    let report = golden::check(&workspace_root().join("golden")).unwrap();
    assert_eq!(report.failures().count(), 0, "{report}");
    // The counts the issue names, so a suite that silently checks nothing fails.
    let count = |name: &str| report.suite(name).map_or(0, |s| s.checked);
    assert!(count("sglang chains") >= 28 * 3 - 2 * 2, "{report}");
    assert!(count("sglang events") >= 14, "{report}");
    assert!(count("vllm hash_golden") >= 24 * 5, "{report}");
    assert_eq!(count("qwen3 tokenizer"), 46, "{report}");
    assert_eq!(count("chat templates"), 15, "{report}");
    // Every wire capture: a decode check where msgspec's untyped decode was recorded, and a
    // byte-for-byte re-encode check for every payload.
    assert_eq!(count("vllm wire"), 42, "{report}");
    assert_eq!(count("sglang wire"), 211, "{report}");
}

/// Copies `golden/` to a temporary directory, lets `corrupt` edit one file, and checks again.
fn check_corrupted(file: &str, corrupt: impl FnOnce(String) -> String) -> golden::Report {
    let src = workspace_root().join("golden");
    let dst =
        std::env::temp_dir().join(format!("cortex-golden-{}-{}", std::process::id(), file.replace('/', "_")));
    copy_dir(&src, &dst);
    let path = dst.join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let corrupted = corrupt(text.clone());
    assert_ne!(text, corrupted, "the corruption must change the file");
    std::fs::write(&path, corrupted).unwrap();
    let report = golden::check(&dst).unwrap();
    std::fs::remove_dir_all(&dst).unwrap();
    report
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), to).unwrap();
        }
    }
}

#[test]
fn a_corrupted_sglang_hash_fails() {
    // The brief's golden value -3488128144981237669, off by one.
    let report = check_corrupted("sglang/hash_vectors.json", |t| {
        t.replacen("-3488128144981237669", "-3488128144981237668", 1)
    });
    let failure = report.failures().next().expect("a corrupted vector must fail");
    assert!(failure.recipe.starts_with("sglang"), "{failure}");
    assert!(failure.expected.contains("-3488128144981237668"), "{failure}");
}

#[test]
fn a_corrupted_vllm_wire_value_fails() {
    let report = check_corrupted("vllm/hash_golden.json", |t| {
        t.replacen("1403909460543360175", "1403909460543360176", 1)
    });
    assert!(report.failures().any(|f| f.recipe == "vllm wire u64"), "{report}");
}

#[test]
fn a_corrupted_rendering_fails() {
    let report = check_corrupted("chat-templates/expected_transformers_qwen3.json", |t| {
        t.replacen("You are", "You were", 1)
    });
    assert!(report.failures().any(|f| f.recipe == "chat template"), "{report}");
}

#[test]
fn a_corrupted_wire_capture_fails() {
    // Block 0's medium in the first BlockPool frame, "GPU" -> "CPU": the bytes still re-encode, but
    // no longer decode to what msgspec recorded.
    let report = check_corrupted("vllm/blockpool_golden.json", |t| {
        t.replacen("a66d656469756da3475055", "a66d656469756da3435055", 1)
    });
    let failure =
        report.failures().find(|f| f.recipe == "vllm wire decode").expect("a corrupted capture must fail");
    assert!(failure.expected.contains("GPU") && failure.got.contains("CPU"), "{failure}");
    // SGLang 0.5.19's first batch published for DP rank 1 instead of the recorded rank 0.
    let report = check_corrupted("sglang/wire_legacy_0.5.19.json", |t| {
        t.replacen("9191b0416c6c426c6f636b73436c656172656400", "9191b0416c6c426c6f636b73436c656172656401", 1)
    });
    assert!(report.failures().any(|f| f.recipe == "sglang wire decode"), "{report}");
}
