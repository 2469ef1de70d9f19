#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    tierlimit_fuzz_targets::delta(data);
});
