//! Any bytes as a PUBLISH_BATCH payload: no panic in the borrowed walker or the owned decoder,
//! and both agree on how many sub-frames a valid batch has.
#![no_main]
use aqueduct_proto::{BatchIter, Extensions, PublishBatch};
use bytes::Bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let walked = BatchIter::new(data).take_while(Result::is_ok).count();
    if let Ok(batch) = PublishBatch::from_parts(Extensions::default(), Bytes::copy_from_slice(data)) {
        assert_eq!(batch.len(), walked);
        assert!(batch.publishes().all(|p| p.is_ok()));
    }
});
